"""How the mixture-of-experts decoder is laid out: every language model's layout (parallel/lm_layout.py) with the
Llama's structure. Data parallelism only for now (ddp, zero1, zero2, fsdp, zero3, hsdp): its ModelShape lists no
parallelism, so ParallelDims refuses tp, cp, pp and DeepSpeed before this runs. The experts' stacked weights
([E, ...], one parameter per projection) are where expert parallelism will shard dim 0."""

from __future__ import annotations

from functools import partial

from meshtrain.models.llama import SPLIT
from meshtrain.parallel.lm_layout import build_language_model_layout


def _no_tensor_parallel(part, tp_mesh, **_) -> None:
    raise NotImplementedError("the moe model has no tensor-parallel plan (ParallelDims.from_config refuses parallel.tp "
                              "> 1 for it)")


build_moe_layout = partial(build_language_model_layout, split=SPLIT, tensor_parallel=_no_tensor_parallel)
