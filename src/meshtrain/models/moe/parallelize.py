"""How the mixture-of-experts decoder is laid out: every language model's layout (parallel/lm_layout.py) with the
Llama's structure, under data parallelism (ddp, zero2, fsdp, zero3, hsdp; zero1 too without ep) and expert
parallelism (parallel.ep): each MoE layer's routed experts (the stacked [E, ...] weights) sharded over the ep ranks,
their forward dispatching the rows to the experts' owners and back (parallel/expert_parallel.py). Its ModelShape
lists ep alone, so ParallelDims refuses tp, cp, pp and DeepSpeed before this runs."""

from __future__ import annotations

from meshtrain.models.llama import SPLIT
from meshtrain.models.moe.model import MoE
from meshtrain.parallel.expert_parallel import apply_expert_parallel
from meshtrain.parallel.lm_layout import build_language_model_layout
from meshtrain.parallel.mesh import submesh


def _no_tensor_parallel(part, tp_mesh, **_) -> None:
    raise NotImplementedError("the moe model has no tensor-parallel plan (ParallelDims.from_config refuses parallel.tp "
                              "> 1 for it)")


def build_moe_layout(model, cfg, dims, mesh, device, rank):
    """The decoder's layout; with parallel.ep > 1 the experts are sharded first, on the plain model (as tensor
    parallelism is applied), so that data parallelism then wraps what they became."""
    if dims.ep > 1:
        ep_mesh = submesh(mesh, "ep")
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            apply_expert_parallel(moe.experts, ep_mesh)
    return build_language_model_layout(model, cfg, dims, mesh, device, rank, split=SPLIT,
                                       tensor_parallel=_no_tensor_parallel)
