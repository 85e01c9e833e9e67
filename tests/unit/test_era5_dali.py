"""The DALI loader (data.loader=dali) hands out exactly ERA5Batches' batches: same shares, epochs and resume.
Runs where NVIDIA DALI is installed (the `dali` extra; on a CPU box its pipeline runs on the CPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from meshtrain.data.era5 import ERA5Dataset
from meshtrain.data.era5_batches import ERA5Batches
from meshtrain.data.era5_dali import ERA5DaliBatches, dali_available
from meshtrain.data.era5_synthetic import generate

pytestmark = pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI is not installed (pip install "
                                "'meshtrain[dali]'); the DALI loader is optional")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> ERA5Dataset:
    root = tmp_path_factory.mktemp("era5_dali")
    generate(root, years=[2015, 2016, 2017, 2018], samples_per_year=12, grid=(4, 8), channels=2, seed=0)
    return ERA5Dataset(root, "train")  # 2 years x 11 pairs = 22 samples


@pytest.fixture(autouse=True)
def no_pipeline_left():
    """Each test's DALI pipelines and their threads are gone before the next test: a later test that forks (a
    DataLoader's workers) must not inherit a lock one of them holds."""
    yield
    gc.collect()


def batches(stream, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [stream.next_batch() for _ in range(count)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dp_rank,dp_size,accum", [(0, 1, 1), (1, 2, 1), (1, 2, 2)])
def test_dali_batches_are_the_pytorch_loaders(dataset, workers, dp_rank, dp_size, accum):
    common = dict(batch_size=3, dp_rank=dp_rank, dp_size=dp_size, accum=accum, seed=5)
    reference = ERA5Batches(dataset, **common)
    dali = ERA5DaliBatches(dataset, num_workers=workers, **common)
    count = (2 * reference.steps_per_epoch + 1) * accum  # micro-batches, across two epoch boundaries
    for (x, y), (dx, dy) in zip(batches(reference, count), batches(dali, count), strict=True):
        assert torch.equal(x, dx) and torch.equal(y, dy)
    assert (dali.step, dali.micro) == (reference.step, reference.micro)
    dali.close()


def test_dali_resumes_at_the_saved_position(dataset):
    common = dict(batch_size=2, dp_rank=0, dp_size=2, seed=5)
    uninterrupted = ERA5DaliBatches(dataset, **common)
    want = batches(uninterrupted, 9)
    uninterrupted.close()
    resumed = ERA5DaliBatches(dataset, **common)
    resumed.seek(6)  # one epoch is 5 steps: 6 is mid-way through the second
    for (x, y), (wx, wy) in zip(batches(resumed, 3), want[6:], strict=True):
        assert torch.equal(x, wx) and torch.equal(y, wy)
    resumed.close()
