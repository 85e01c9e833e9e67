"""The models, one folder each (gpt/, llama/, vit/), each registered by the ModelSpec its __init__ builds with
`model_spec` (see meshtrain.registry), and what the language models share (language/). Model files hold no distributed
code; each folder's parallelize.py is where its model meets the mesh, through the parameter names, which are therefore
part of the interface.
"""

from __future__ import annotations

from pathlib import Path

from meshtrain.registry import ModelSpec


def model_spec(init_file: str, *, language_model: bool = False, **fields) -> ModelSpec:
    """The ModelSpec of the model in the folder of `init_file` (its __init__.py), whose presets are that folder's
    presets/; `fields` are the rest of ModelSpec's. A language model (language_model=True) is trained on a text that
    data=NAME names (data.name), takes the facts build_model needs from the text's meta.json, and can be sampled."""
    if language_model:
        fields = {"data_key": "data.name", "text": True, "data_facts": _text_data_facts, **fields}
    return ModelSpec(presets=Path(init_file).parent / "presets", **fields)


def _text_data_facts(cfg) -> dict:
    from meshtrain.models.language.workload import text_data_facts

    return text_data_facts(cfg)
