"""The mixture-of-experts decoder's run configuration: its model section and rules (the text data and sampling
sections are every language model's, models/language; optimizer, train and parallel are meshtrain.config's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from meshtrain.config import ConfigError, check_positive
from meshtrain.models.language import validate_text_training
from meshtrain.models.llama.config import LlamaModelSection, LlamaRunConfig, ffn_hidden
from meshtrain.models.llama.config import validate as validate_llama

Score = Literal["softmax", "sigmoid"]  # how a router turns its logits into each expert's score
ExpertMatmul = Literal["auto", "grouped", "loop"]  # experts.py: how the experts' matmuls run


@dataclass
class MoEModelSection(LlamaModelSection):  # the Llama-style decoder's keys, and the experts' (model.py MoEConfig)
    n_experts: int = 8  # routed experts in each MoE layer
    top_k: int = 2  # experts each token is sent to
    expert_hidden: int | None = None  # each expert's SwiGLU hidden width; null: model.ffn_hidden's
    n_shared_experts: int = 0  # experts every token passes through besides its top_k (DeepSeek's shared experts)
    moe_every: int = 1  # an MoE layer every this many layers (the others dense), counted after first_dense
    first_dense: int = 0  # the first this many layers keep a dense SwiGLU (DeepSeek-V3: 3)
    score: Annotated[str, Score] = "softmax"  # softmax over the experts (Mixtral, Qwen) or sigmoid each (DeepSeek-V3)
    norm_topk: bool = True  # the k chosen scores divided by their sum, so a token's gates add up to 1
    route_scale: float = 1.0  # the gates multiplied by this (DeepSeek-V3's routed scaling factor, 2.5)
    balance_coef: float = 0.01  # the auxiliary balance loss's weight in the gradient (router.py); 0: none
    bias_update_rate: float = 0.0  # γ of the auxiliary-loss-free balancing (router.py); 0: off
    capacity_factor: float | None = None  # null: dropless; else each expert takes at most this × its even share
    expert_matmul: Annotated[str, ExpertMatmul] = "auto"  # auto: one grouped GEMM on a GPU that has it, else a loop


@dataclass
class MoERunConfig(LlamaRunConfig):  # the Llama-style decoder's sections, with the experts' model section
    model: MoEModelSection = field(default_factory=MoEModelSection)


def validate(cfg: MoERunConfig) -> None:
    """The Llama-style decoder's rules, then the experts'; each error names the key and the fix."""
    validate_llama(cfg)
    m = cfg.model
    check_positive({"model.n_experts": m.n_experts, "model.top_k": m.top_k, "model.expert_hidden": m.expert_hidden,
                    "model.moe_every": m.moe_every})
    if m.n_experts < 2:
        raise ConfigError(f"model.n_experts={m.n_experts}: a mixture needs 2 experts or more (one expert is the llama "
                          "model's dense SwiGLU)")
    if m.top_k > m.n_experts:
        raise ConfigError(f"model.top_k={m.top_k} is more than model.n_experts={m.n_experts}: a token cannot be sent "
                          f"to more experts than there are; set model.top_k <= {m.n_experts}")
    for key, value in (("model.n_shared_experts", m.n_shared_experts), ("model.first_dense", m.first_dense),
                       ("model.balance_coef", m.balance_coef), ("model.bias_update_rate", m.bias_update_rate)):
        if value < 0:
            raise ConfigError(f"{key}={value} must be 0 or more")
    if m.route_scale <= 0:
        raise ConfigError(f"model.route_scale={m.route_scale} must be above 0 (1.0: the gates as the router gives them)")
    if m.capacity_factor is not None and m.capacity_factor <= 0:
        raise ConfigError(f"model.capacity_factor={m.capacity_factor} must be above 0 (1.0: each expert takes its "
                          "even share of the tokens; 1.25 leaves a quarter of slack), or null for dropless routing")
    if not moe_layers(m):
        raise ConfigError(f"model.first_dense={m.first_dense} with model.n_layer={m.n_layer} leaves no MoE layer: "
                          f"set model.first_dense below {m.n_layer} (or train the llama model)")
    if cfg.parallel.cp > 1 and m.capacity_factor is not None:
        raise ConfigError(f"model.capacity_factor={m.capacity_factor} with parallel.cp={cfg.parallel.cp}: the capacity "
                          "limits each expert per forward in token order, which a context-parallel rank, holding some "
                          "positions of each sequence, cannot see whole; set model.capacity_factor=null (dropless) or "
                          "parallel.cp=1")
    tp, hidden = cfg.parallel.tp, expert_hidden(m)
    if tp > 1 and hidden % tp:
        options = [h for h in (hidden - hidden % tp, hidden - hidden % tp + tp) if h > 0]
        raise ConfigError(f"model.expert_hidden={hidden} is not divisible by parallel.tp={tp}: tensor parallelism cuts "
                          f"every expert's hidden width into tp equal slices; set model.expert_hidden to a multiple of "
                          f"{tp} (e.g. {' or '.join(map(str, options))}) or a parallel.tp that divides {hidden}")
    validate_text_training(cfg)


def expert_hidden(m: MoEModelSection) -> int:
    """Each expert's SwiGLU hidden width: as set, or the dense layers' (model.ffn_hidden or Llama's rule)."""
    return m.expert_hidden or ffn_hidden(m)


def moe_layers(m: MoEModelSection) -> list[int]:
    """The layers (0-based) whose feed-forward is a mixture of experts: every moe_every-th after first_dense."""
    return [i for i in range(m.first_dense, m.n_layer) if (i - m.first_dense) % m.moe_every == 0]
