"""How the Llama-style decoder is laid out: its structure as a pipeline cuts it, and its tensor-parallel plan (the
decoder plan every language model here shares, plus the SwiGLU's gate, column-parallel like its up projection).
Everything else is every language model's layout (parallel/lm_layout.py)."""

from __future__ import annotations

from functools import partial

from torch.distributed.tensor.parallel import ColwiseParallel

from meshtrain.models.llama import SPLIT
from meshtrain.parallel.lm_layout import build_language_model_layout
from meshtrain.parallel.tensor_parallel import apply_decoder_tensor_parallel

apply_tensor_parallel = partial(apply_decoder_tensor_parallel, block_extras={"mlp.c_gate": ColwiseParallel()})
build_llama_layout = partial(build_language_model_layout, split=SPLIT, tensor_parallel=apply_tensor_parallel)
