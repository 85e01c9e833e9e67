"""Activation checkpointing recomputes exactly what it drops, keeps fewer activations, and renames nothing; `op`
keeps what the planner counts."""

from dataclasses import replace

import pytest
import torch

from meshtrain import registry
from meshtrain.config import load_config
from meshtrain.models.gpt.model import GPT, GPTConfig
from meshtrain.models.llama.model import Llama, LlamaConfig
from meshtrain.parallel import checkpointing
from meshtrain.parallel.checkpointing import apply_activation_checkpointing
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import activations, machines, systems
from meshtrain.plan.measured.measure import TensorBytes
from meshtrain.plan.workload import ModelFacts

CONFIG = GPTConfig(block_size=16, vocab_size=65, n_layer=4, n_head=2, n_embd=32, dropout=0.1, bias=True)
LLAMA = LlamaConfig(block_size=16, vocab_size=65, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=80,
                    dropout=0.1)


def train_step(mode: str, config=CONFIG):
    torch.manual_seed(0)
    model = GPT(config) if isinstance(config, GPTConfig) else Llama(config)
    wrapped = apply_activation_checkpointing(model.transformer.h, mode, every=2)
    x = torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(1))
    saved = [0]

    def pack(t):
        saved[0] += t.numel()
        return t

    torch.manual_seed(5)  # the same dropout masks; recomputation must replay them
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, torch.roll(x, -1, 1))
    loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.item(), grads, saved[0], wrapped, list(model.state_dict())


@pytest.mark.parametrize("mode,wrapped", [("full", 4), ("selective", 2)])
def test_recomputation_is_exact_and_saves_memory(mode, wrapped):
    loss, grads, saved, n, keys = train_step(mode)
    base_loss, base_grads, base_saved, _, base_keys = train_step("none")
    assert n == wrapped
    assert loss == base_loss
    assert all(torch.equal(grads[k], base_grads[k]) for k in base_grads)
    assert keys == base_keys, "checkpoints keep their parameter names"
    assert saved < base_saved * (0.2 if mode == "full" else 0.7), "fewer activations are kept for backward"


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="choose one of none, full, selective, op"):
        apply_activation_checkpointing(GPT(CONFIG).transformer.h, "some")


@pytest.mark.parametrize("config", [CONFIG, LLAMA], ids=["gpt", "llama"])
def test_op_level_checkpointing_equals_none(config):
    """The same loss and gradients as without checkpointing, dropout included (its masks replayed)."""
    loss, grads, _, wrapped, keys = train_step("op", config)
    base_loss, base_grads, _, _, base_keys = train_step("none", config)
    assert wrapped == config.n_layer and keys == base_keys
    assert abs(loss - base_loss) <= 1e-5
    assert max((grads[k] - base_grads[k]).abs().max().item() for k in base_grads) <= 1e-5


def kept_by_forward(model: torch.nn.Module, mode: str, x: torch.Tensor) -> int:
    """Bytes of tensors a forward leaves alive for its backward beyond the output (measure.TensorBytes)."""
    apply_activation_checkpointing(model.transformer.h, mode, every=2)
    with TensorBytes() as counter:
        before = counter.alive
        logits, loss = model(x, torch.roll(x, -1, 1))
        kept = counter.alive - before - loss.untyped_storage().nbytes()
    return kept


def test_op_level_checkpointing_keeps_less_than_none_and_more_than_full():
    config = GPTConfig(block_size=16, vocab_size=65, n_layer=4, n_head=2, n_embd=32, dropout=0.0, bias=True)
    x = torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(1))
    kept = {}
    for mode in ("none", "op", "full"):
        torch.manual_seed(0)
        kept[mode] = kept_by_forward(GPT(config), mode, x)
    assert kept["full"] < kept["op"] < kept["none"], kept


FACTS = {"meta": {"vocab_size": 65}, "img_size": [32, 64], "channels": 3}


@pytest.mark.parametrize("name, overrides, layer", [
    ("gpt", ["preset=cpu", "model.n_head=4", "model.n_embd=64", "model.block_size=32"], 0),
    ("llama", ["preset=cpu", "model.n_kv_head=1", "model.ffn_hidden=160", "model.block_size=32"], 0),
    ("vit", ["preset=tiny", "model.mlp_ratio=2.0", "data.crop=[32,64]"], 0),
    ("moe", ["preset=cpu"], 0),  # a dense block
    ("moe", ["preset=cpu", "model.top_k=3"], 1),  # an MoE block: its experts' outputs per routed row (N·k, no ep)
])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_op_level_checkpointing_keeps_what_the_planner_counts(monkeypatch, name, overrides, layer, dtype):
    """activations.op_block_bytes against what one block keeps under `op` (fp32, and bf16 autocast on a CPU with
    fp32 weights and input): the tensors autograd saves outside the checkpoint (the block's input) and the outputs
    the checkpoint's cache keeps, each storage once, parameters not counted."""
    spec, cfg = registry.get(name), load_config([*overrides, f"train.dtype={dtype}"], name)
    torch.manual_seed(0)
    model = spec.build_model(cfg, FACTS)
    blocks = model.blocks if name == "vit" else model.transformer.h
    params = {p.untyped_storage().data_ptr() for p in blocks[str(layer)].parameters()}
    kept: dict[int, int] = {}
    op_policy = checkpointing.op_policy

    def note(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def counting_policy(ctx, op, *args, **kwargs):
        policy = op_policy(ctx, op, *args, **kwargs)
        if policy.name == "MUST_SAVE" and not ctx.is_recompute:
            outputs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)
            for t in outputs:
                if isinstance(t, torch.Tensor):
                    note(t)
        return policy

    monkeypatch.setattr(checkpointing, "op_policy", counting_policy)  # read when the blocks are wrapped
    apply_activation_checkpointing(blocks, "op")
    block, tokens = blocks[str(layer)], spec.shape(cfg).tokens
    kwargs = model.block_kwargs(torch.arange(tokens)) if hasattr(model, "block_kwargs") else {}
    x = torch.randn(2, tokens, next(block.parameters()).shape[-1], requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t), torch.autocast("cpu", torch.bfloat16,
                                                                                     enabled=dtype == "bf16"):
        block(x, **kwargs)
    facts = ModelFacts.of(cfg, FACTS)
    rows = 2 * tokens * facts.shape.moe.top_k if facts.shape.moe else 0
    machine = replace(machines.from_system(systems.get("polaris")), cpu=True)  # attention in fp32, as here
    assert sum(kept.values()) == activations.op_block_bytes(facts, cfg, ParallelDims.resolve(1), 2 * tokens, machine,
                                                            layer, rows)


def test_an_attention_kernel_that_draws_dropout_is_recomputed_not_kept():
    """A kept op is not run again, so one that draws from the generator would shift every later dropout's masks."""
    q = torch.zeros(1, 2, 4, 8)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert checkpointing.op_policy(None, flash, q, q, q, 0.0).name == "MUST_SAVE"
    assert checkpointing.op_policy(None, flash, q, q, q, dropout_p=0.1).name == "PREFER_RECOMPUTE"
    assert checkpointing.op_policy(None, torch.ops.aten.gelu.default, q).name == "PREFER_RECOMPUTE"
