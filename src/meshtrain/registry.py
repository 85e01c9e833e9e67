"""The models meshtrain can train, each described by one ModelSpec; nothing outside a model's folder names it.

    spec = registry.get("gpt")          # built in: gpt, vit, llama, moe; or an installed plugin; or "package.module:NAME"
    spec.run_config                     # the dataclass of a whole run (model, data, optimizer, train, parallel)
    spec.workload(cfg, info, dims)      # what the training loop drives: model, layout, batches, evaluation

A model lives in one folder (models/gpt/, models/vit/, or a package of your own) holding its model (no
distributed code), its parallelize plan, its workload, its config dataclass and presets, and its shape: the
numbers the layout rules and a cost model need. The folder's `__init__.py` builds a ModelSpec named SPEC.

A model of your own registers the same way, without editing meshtrain: either name it on the command line,
`meshtrain train mypackage.mymodel:SPEC preset=...`, or install a package that declares the entry point

    [project.entry-points."meshtrain.models"]
    mymodel = "mypackage.mymodel:SPEC"

and train it as `meshtrain train mymodel`. docs/models.md walks through one.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from meshtrain.errors import MeshtrainError

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig
    from meshtrain.nn.activation_counts import AutocastActivations

ENTRY_POINTS = "meshtrain.models"
BUILT_IN = {"gpt": "meshtrain.models.gpt:SPEC", "vit": "meshtrain.models.vit:SPEC", "llama": "meshtrain.models.llama:SPEC",
            "moe": "meshtrain.models.moe:SPEC"}


class RegistryError(MeshtrainError, ValueError):
    """No such model, or a plugin that does not give a ModelSpec; the message says which and what exists."""

    same_on_every_rank = True


@dataclass(frozen=True)
class ExpertShape:
    """The mixture-of-experts layers of a model, as the planner prices them (plan/experts.py): which layers, how
    tokens are routed, and what each layer saves for backward, split into what grows with this rank's tokens and what
    grows with the routed rows its experts receive (under expert parallelism a number that depends on the routing)."""

    layers: tuple[int, ...]  # the blocks (0-based) whose feed-forward is a mixture of experts
    top_k: int  # experts each token is sent to
    hidden: int  # each routed expert's hidden width
    module: str  # the module path suffix, in a block, of the stacked routed experts ([E, ...] parameters)
    capacity_factor: float | None = None  # None: dropless
    shared_hidden: int = 0  # the shared experts' hidden width (n_shared_experts × hidden); 0: none
    # Elements an MoE block saves for backward (fp32 eager, no dropout; tests/unit/test_registry.py checks both):
    saved_per_token: int = 0  # per token of this rank: attention, norms, router, gates, shared experts, indices
    saved_per_row: int = 0  # per routed row this rank's experts compute: its input and the SwiGLU's four hiddens
    saved_per_row_ep: int = 0  # more per row when the rows are exchanged (expert parallelism's index tensors)
    autocast_per_token: AutocastActivations | None = None  # per token under autocast, by dtype (int64 as 2 fp32)
    autocast_per_row: int = 0  # per routed row under autocast: all 16-bit (the experts' input and hidden tensors)
    # Of saved_per_token, the block's tensor-parallel half (attention and norms, cut over tp as a dense block's are,
    # plan/activations.py); of the rest, the MoE layer's, the shared experts' and (per row) the routed experts' four
    # hidden tensors are cut over tp (plan/experts.py), the rest is whole on every tp rank. 0 / None: all of it whole.
    attention_per_token: int = 0
    attention_autocast: AutocastActivations | None = None


@dataclass(frozen=True)
class ModelShape:
    """What the layout rules (parallel/mesh.check_layout) and a cost model need to know of a model, read from its
    config alone, before anything is built."""

    layers: int  # transformer blocks: what a pipeline splits
    width: int  # the residual stream's channels per token (embedding width)
    heads: int  # attention (query) heads: what tensor parallel and Ulysses split
    kv_heads: int  # key/value heads (fewer under grouped-query attention): tensor parallel splits them too
    mlp_hidden: int  # the MLP's hidden width: tensor parallel splits it
    tokens: int | None  # tokens per sample (sequence length, patches); None when only the data can tell
    causal: bool  # causal attention: ring context parallel then cuts the sequence into 2·cp zigzag chunks
    batch_size: int  # samples per data-parallel rank and micro-step, as configured (a pipeline splits it)
    dropout: float  # ring attention has no attention dropout
    # Elements one block saves for its backward, per token: fp32 eager, without dropout or activation checkpointing
    # (tested against what autograd keeps); a cost model scales it by tokens, dtype and the layout's sharding.
    activations_per_token: int | None = None
    autocast_activations: AutocastActivations | None = None  # the same under autocast, by dtype
    whole_output: bool = False  # its loss reads the whole output on every tp and cp rank (the ViT's whole field)
    # Replicated parameters added to the token stream as they are (the ViT's pos_embed: name -> its token dim): under
    # sequence parallel they meet a token-sharded stream, so their gradient arrives holding 1/tp of them
    token_sharded_grads: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    parallelisms: frozenset[str] = frozenset({"tp", "cp", "pp", "deepspeed"})  # which this model's plan supports
    # Routed experts per mixture-of-experts layer (models/moe); 0: a dense model
    experts: int = 0
    moe: ExpertShape | None = None  # what the planner needs of the mixture-of-experts layers (a model with experts)
    keys: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # field -> config key, for messages


@dataclass(frozen=True)
class ModelSpec:
    name: str  # `meshtrain train NAME`; runs go to outputs/runs/NAME/<backend>/
    summary: str  # one line for --help
    run_config: type  # a dataclass with model, data, optimizer, train and parallel sections
    presets: Path  # the folder of preset=NAME YAML files
    data_key: str  # what `data=VALUE` sets, e.g. "data.name"
    workload: Callable  # (cfg, info, dims) -> the workload the trainer drives (see train/trainer.py)
    shape: Callable  # (cfg) -> ModelShape
    validate: Callable | None = None  # (cfg) -> None: the model's own rules; raises config.ConfigError
    build_model: Callable | None = None  # (cfg, data_facts) -> nn.Module, for export and sample on one process
    # (model, cfg, dims, mesh, device, rank) -> its parallel.layout.Layout: what the workload's build_layout does, without
    # the workload's data (`plan --trace` lays the model out on a fake process group from the spec alone)
    build_layout: Callable | None = None
    # (cfg, dims, data_facts) -> (inputs, targets): one micro-batch of zeros shaped as the workload hands it to the
    # layout (`plan --trace` makes it of fake tensors); none: token windows [ModelShape.batch_size, tokens] (int64)
    micro_batch: Callable | None = None
    legend: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # its metrics' meanings
    text: bool = False  # a language model: `meshtrain sample` can generate from it
    # Where its blocks and ends are, by module path (parallel.pipeline_schedules.StageSplit): a pipeline cuts the model
    # there, and the planner counts what a stage holds from it.
    stage_split: object | None = None
    data_facts: Callable | None = None  # (cfg) -> what build_model takes from the data, without opening a stream
    # Overrides that make the model tiny (next to no arithmetic) for the planner's calibration of fixed costs
    # (plan/measured/calibrate.py sets the depth through ModelShape.keys["layers"], and the dtype); none: not
    # calibrated, its plan counts one block's dispatch instead
    tiny: tuple[str, ...] = ()
    source: str = ""  # where it was found (set by get)


_loaded: dict[str, ModelSpec] = {}


def names() -> list[str]:
    """Every model that `get` finds by name: the built-in ones, then installed plugins."""
    return [*BUILT_IN, *sorted(set(_entry_points()) - set(BUILT_IN))]


def get(name: str) -> ModelSpec:
    """The spec of a model: a built-in or installed name, or a "package.module:ATTRIBUTE" path."""
    if name in _loaded:
        return _loaded[name]
    target = BUILT_IN.get(name) or _entry_points().get(name) or (name if ":" in name else None)
    if target is None:
        raise RegistryError(f"unknown model {name!r}: choose one of {', '.join(names())}, or give your own as "
                            "package.module:SPEC (see docs/models.md)")
    module_name, _, attribute = target.partition(":")
    if target == name and "" not in sys.path and os.getcwd() not in sys.path:
        # `python -m meshtrain` finds a model in the working directory; the `meshtrain` script must find it too.
        sys.path.append(os.getcwd())
    try:
        spec = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise RegistryError(f"model {name!r}: cannot load {target}: {e}") from None
    if not isinstance(spec, ModelSpec):
        raise RegistryError(f"model {name!r}: {target} is a {type(spec).__name__}, not a meshtrain.registry.ModelSpec")
    _loaded[name] = _loaded[spec.name] = spec
    object.__setattr__(spec, "source", target)
    return spec


def spec_of(cfg: RunConfig) -> ModelSpec:
    """The spec whose run config `cfg` is: one loaded already, else a built-in or installed one (loaded now)."""
    for spec in itertools.chain(list(_loaded.values()), (get(name) for name in names())):
        if type(cfg) is spec.run_config:
            return spec
    raise RegistryError(f"a {type(cfg).__name__} is no registered model's run config")


@functools.cache  # reading every installed package's metadata takes ms, and the planner asks for each layout
def _entry_points() -> dict[str, str]:
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}
