"""The memory check before a run (plan/measured/preflight.py): the planner's predicted peak against what a rank has,
one error with both figures and the settings that fit, and nothing said where the run fits."""

import re

import pytest
from tests.unit.test_api import one_process

from meshtrain.config import ConfigError, load_config
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan.cost import predict_peak
from meshtrain.plan.machines import Machine
from meshtrain.plan.measured import preflight
from meshtrain.plan.workload import ModelFacts

GIB = 2**30
# the seeds' hands-on run, with the GPT-2 vocabulary: planned without its data, from the tokenizer alone
# wordplay's seed run, whose whole [tokens, vocabulary] logits (train.loss_chunks=off) are most of its peak
SEED_RUN = ["train.backend=DDP", "data=shakespeare", "train.dtype=fp32", "model.batch_size=64",
            "model.block_size=1024", "data.root=/nonexistent", "train.loss_chunks=off"]


def test_a_run_that_cannot_fit_stops_with_both_figures_and_what_fits(monkeypatch):
    cfg = load_config(SEED_RUN)
    facts = ModelFacts.of(cfg)
    assert facts.head_features == 50257  # the vocabulary, from the GPT-2 tokenizer: data/shakespeare is not here
    machine = Machine("this", 1, 0.0, {}, 0.0, 0.0, 0.0, 0.0, 0.0, overlap=False, cpu=True)
    need = predict_peak(facts, cfg, ParallelDims.resolve(1), machine)
    assert need > 3 * 64 * 1024 * 50304 * 4  # the logits, what the loss keeps of them, and their gradient
    monkeypatch.setattr(preflight, "available_bytes", lambda device, ranks: 8 * GIB)
    with pytest.raises(ConfigError) as err:
        preflight.check_memory(cfg, one_process())
    message = str(err.value)
    said = re.match(r"out of memory ahead: ddp dp1 ac=none needs about ([\d.]+) GiB per rank at its peak "
                    r"\(`meshtrain plan`'s prediction, fp32\), but 90% of this host's available memory shared by "
                    r"1 rank\(s\) gives 7.20 GiB; these fit: ", message)
    assert said and need / GIB <= float(said.group(1)) < need / GIB + 8, message  # its tensors, and the runtime
    assert "model.batch_size=8 train.grad_accum=8" in message and message.endswith("train.memory_check=warn trains "
                                                                                  "anyway")
    for change in message.split("these fit: ")[1].split("; train.memory_check")[0].split("; "):
        fixed = load_config(SEED_RUN + change.split())
        assert predict_peak(ModelFacts.of(fixed), fixed, ParallelDims.resolve(1), machine) <= 7.2 * GIB, change

    warned = []
    monkeypatch.setattr(preflight.log, "warning", lambda fmt, *args: warned.append(fmt % args))
    preflight.check_memory(load_config(SEED_RUN + ["train.memory_check=warn"]), one_process())
    assert len(warned) == 1 and warned[0].startswith("out of memory ahead")
    monkeypatch.setattr(preflight, "available_bytes", lambda device, ranks: (need + 8 * GIB) / 0.9)
    preflight.check_memory(cfg, one_process())  # fits: nothing said
    assert len(warned) == 1


@pytest.mark.parametrize(("batch", "derived"), [(["data.global_batch_size=64"], True),
                                               (["data.global_batch_size=null", "data.batch_size=32"], False)],
                         ids=["global batch", "per-rank batch"])
def test_the_settings_that_fit_follow_how_the_batch_is_given(batch, derived):
    """The ViT's data.global_batch_size makes its micro-batch (global / (dp × grad_accum)): there a smaller micro-batch
    is more accumulation alone, as data.batch_size is not read. Each setting named fits, applied to the config."""
    overrides = ["preset=tiny", *batch]
    cfg = load_config(overrides, "vit")
    dims = ParallelDims.from_config(cfg, 2, 2)
    machine = Machine("this", 2, 0.0, {}, 0.0, 0.0, 0.0, 0.0, 0.0, overlap=False, cpu=True)
    need, message = preflight.shortfall(ModelFacts.of(cfg), cfg, dims, machine, 0.1 * GIB, "this box")
    changes = message.split("these fit: ")[1].split("; ")
    assert changes[0] == ("train.grad_accum=8" if derived else "data.batch_size=4 train.grad_accum=8")
    for change in changes:
        assert ("data.batch_size" in change) != derived, change
        fixed = load_config(overrides + change.split(), "vit")
        fixed_dims = ParallelDims.from_config(fixed, 2, 2)
        assert predict_peak(ModelFacts.of(fixed), fixed, fixed_dims, machine) <= 0.1 * GIB < need, change
