"""The models, one folder each (gpt/, llama/, vit/), each registered by the ModelSpec its __init__ builds with
`model_spec` (see meshtrain.registry), and what the language models share (language/). Model files hold no distributed
code; each folder's parallelize.py is where its model meets the mesh, through the parameter names, which are therefore
part of the interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from meshtrain.registry import ModelSpec

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

# A language model made tiny for the planner's calibration (width 32, 2 heads, 16 tokens, batch 4): next to no
# arithmetic, so what a step costs is the layout's fixed costs.
LANGUAGE_MODEL_TINY = ("model.n_embd=32", "model.n_head=2", "model.block_size=16", "model.batch_size=4",
                       "model.dropout=0.0", "train.grad_accum=1", "parallel.microbatches=null")


def model_spec(init_file: str, *, language_model: bool = False, **fields) -> ModelSpec:
    """The ModelSpec of the model in the folder of `init_file` (its __init__.py), whose presets are that folder's
    presets/; `fields` are the rest of ModelSpec's. A language model (language_model=True) is trained on a text that
    data=NAME names (data.name), takes the facts build_model needs from the text's meta.json, can be sampled, and is
    calibrated tiny as LANGUAGE_MODEL_TINY says."""
    if language_model:
        fields = {"data_key": "data.name", "text": True, "data_facts": _text_data_facts, "tiny": LANGUAGE_MODEL_TINY,
                  **fields}
    return ModelSpec(presets=Path(init_file).parent / "presets", **fields)


def _text_data_facts(cfg: RunConfig) -> dict:
    from meshtrain.models.language.workload import text_data_facts

    return text_data_facts(cfg)
