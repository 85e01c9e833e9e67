"""How the GPT is laid out: its structure as a pipeline cuts it (the token embedding and lm_head tied across the first
and last stages) and its tensor-parallel plan (the decoder plan every language model here shares, vocabulary-sharded
ends with the tie kept). Everything else is every language model's layout (parallel/lm_layout.py)."""

from __future__ import annotations

from functools import partial

from meshtrain.parallel.lm_layout import build_language_model_layout
from meshtrain.parallel.pipeline_schedules import StageSplit
from meshtrain.parallel.tensor_parallel import apply_decoder_tensor_parallel

# Split by pipeline stages, lm_head keeps its own copy of the tied embedding; a checkpoint from any layout has the
# embedding's optimizer state, which the copy's equals (see parallel.state_dict).
SPLIT = StageSplit(blocks="transformer.h", first=("transformer.wte", "transformer.wpe", "transformer.drop"),
                   last=("transformer.ln_f", "lm_head"), tied=("lm_head.weight", "transformer.wte.weight"))

apply_tensor_parallel = apply_decoder_tensor_parallel
build_gpt_layout = partial(build_language_model_layout, split=SPLIT, tensor_parallel=apply_tensor_parallel)
