"""How the GPT is laid out: its structure as a pipeline cuts it (the token embedding and lm_head tied across the first
and last stages) and its tensor-parallel plan (the decoder plan every language model here shares, vocabulary-sharded
ends with the tie kept). Everything else is every language model's layout (parallel/lm_layout.py)."""

from __future__ import annotations

from functools import partial

from meshtrain.models.gpt import SPLIT
from meshtrain.parallel.lm_layout import build_language_model_layout
from meshtrain.parallel.tensor_parallel import apply_decoder_tensor_parallel

apply_tensor_parallel = apply_decoder_tensor_parallel
build_gpt_layout = partial(build_language_model_layout, split=SPLIT, tensor_parallel=apply_tensor_parallel)
