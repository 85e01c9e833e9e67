"""The ERA5 streams of the training loop: ERA5Batches (global batches down each epoch's permutation, the same
samples in every layout with one global batch, a start at any iteration without reading skipped samples, worker
processes) and eval_batches (equal
batch counts on every rank, every sample weighted exactly once). Samples are identified by their content."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from meshtrain.data.era5 import ERA5Dataset
from meshtrain.data.era5_batches import ERA5Batches, eval_batches
from meshtrain.data.era5_synthetic import generate
from meshtrain.data.text import DataError

SEED = 11


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Synthetic ERA5 whose train split holds 2 years x 13 pairs = 26 samples of 2 channels on a 4 x 8 grid."""
    out = tmp_path_factory.mktemp("era5_batches") / "synthetic"
    generate(out, years=[2015, 2016, 2017, 2018], samples_per_year=14, grid=(4, 8), channels=2, seed=0)
    return out


def train_set(root: Path, limit: int) -> ERA5Dataset:
    return ERA5Dataset(root, "train", limit=limit)


def index_by_content(ds: ERA5Dataset) -> dict[bytes, int]:
    lookup = {ds[i][0].numpy().tobytes(): i for i in range(len(ds))}
    assert len(lookup) == len(ds)  # every input field is distinct, so content names the sample
    return lookup


def sample_indices(ds: ERA5Dataset, lookup: dict[bytes, int], x: torch.Tensor, y: torch.Tensor) -> list[int]:
    """The dataset index of each row of a batch; checks x and y are exactly that sample's."""
    found = []
    for row_x, row_y in zip(x, y, strict=True):
        index = lookup[row_x.numpy().tobytes()]
        assert torch.equal(row_y, ds[index][1])
        found.append(index)
    return found


def permutation(n: int, epoch: int) -> list[int]:
    """Epoch `epoch`'s order of n samples, as DistributedSampler shuffles: randperm seeded by seed + epoch."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()


# ------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize(("dp_size", "accum", "steps"), [(2, 1, 3), (3, 1, 2), (2, 2, 1)])  # 23 // (dp × accum × 3)
def test_global_batches_run_down_each_epochs_permutation_and_ranks_take_slices(root, dp_size, accum, steps):
    ds, batch = train_set(root, 23), 3
    lookup = index_by_content(ds)
    streams = [ERA5Batches(ds, batch_size=batch, dp_rank=r, dp_size=dp_size, accum=accum, seed=SEED)
               for r in range(dp_size)]
    assert all(s.steps_per_epoch == steps for s in streams)
    global_batch = batch * dp_size * accum
    for epoch in (0, 1):
        order = permutation(len(ds), epoch)
        for step in range(steps):
            start = step * global_batch
            for rank, stream in enumerate(streams):
                assert (stream.step, stream.micro) == (epoch * steps + step, 0)
                for micro in range(accum):
                    x, y = stream.next_batch()
                    assert x.shape == y.shape == (batch, 2, 4, 8) and x.dtype == torch.float32
                    first = start + (micro * dp_size + rank) * batch  # micro-step a of rank r: rows (a·dp + r)·B on
                    assert sample_indices(ds, lookup, x, y) == order[first:first + batch]
            assert streams[0].global_ids(epoch * steps + step) == order[start:start + global_batch]
    assert permutation(len(ds), 0) != permutation(len(ds), 1)  # each epoch reshuffles


def test_every_layout_with_one_global_batch_reads_the_same_samples(root):
    ds = train_set(root, 23)
    lookup = index_by_content(ds)

    def read(dp_size, accum, steps=5):
        seen = {}
        for rank in range(dp_size):
            stream = ERA5Batches(ds, batch_size=12 // (dp_size * accum), dp_rank=rank, dp_size=dp_size, accum=accum,
                                 seed=SEED)
            for step in range(steps):  # 23 // 12: one global batch per epoch, so this crosses 4 epochs
                for _ in range(accum):
                    seen.setdefault(step, []).extend(sample_indices(ds, lookup, *stream.next_batch()))
        return {step: sorted(ids) for step, ids in seen.items()}

    reference = read(4, 1)
    assert all(len(ids) == 12 for ids in reference.values()) and reference[0] != reference[1]
    for dp_size, accum in [(2, 2), (1, 4), (2, 3), (3, 1)]:
        assert read(dp_size, accum) == reference, (dp_size, accum)


class CountingReads(Dataset):
    def __init__(self, dataset: Dataset):
        self.dataset, self.reads = dataset, []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        self.reads.append(int(index))
        return self.dataset[index]


def test_a_stream_started_at_an_iteration_reads_what_the_uninterrupted_one_did_there(root):
    ds, batch = train_set(root, 23), 3
    options = dict(batch_size=batch, dp_rank=1, dp_size=2, accum=1, seed=SEED)
    reference_stream = ERA5Batches(ds, **options)  # 3 steps per epoch
    rng_before = torch.get_rng_state()
    reference = [reference_stream.next_batch() for _ in range(11)]
    assert torch.equal(torch.get_rng_state(), rng_before)  # the stream never draws from the global RNG

    for k in (2, 3, 4, 7):  # mid-epoch 0, on the boundary, just past it, mid-epoch 2
        counted = CountingReads(ds)
        resumed = ERA5Batches(counted, **options)
        resumed.seek(k)
        for j in range(3):
            x, y = resumed.next_batch()
            assert torch.equal(x, reference[k + j][0]) and torch.equal(y, reference[k + j][1]), (k, j)
            # the skipped samples were never read: only this batch's were
            assert len(counted.reads) == (j + 1) * batch, (k, j, counted.reads)
        assert resumed.step == k + 3


def test_worker_processes_cross_epochs_resume_and_close(root):
    ds, options = train_set(root, 23), dict(batch_size=3, dp_rank=0, dp_size=2, seed=SEED)
    plain = ERA5Batches(ds, **options)
    reference = [plain.next_batch() for _ in range(7)]
    before = set(multiprocessing.active_children())
    stream = ERA5Batches(ds, num_workers=2, **options)
    for k in range(5):  # across the end of epoch 0 (3 steps): persistent workers, sampler reset
        assert all(torch.equal(a, b) for a, b in zip(stream.next_batch(), reference[k], strict=True)), k
    workers = [p for p in multiprocessing.active_children() if p not in before]
    assert len(workers) == 2 and all(p.is_alive() for p in workers)
    stream.seek(1)  # back to mid-epoch 0 while the workers hold batches of epoch 1
    for k in (1, 2, 3):
        assert all(torch.equal(a, b) for a, b in zip(stream.next_batch(), reference[k], strict=True)), k
    stream.close()
    assert not any(p.is_alive() for p in workers)
    x, y = stream.next_batch()  # used again, it starts fresh workers at its position
    assert torch.equal(x, reference[4][0]) and torch.equal(y, reference[4][1])
    stream.close()


def test_too_small_a_split_names_the_numbers(root):
    ds = train_set(root, 5)
    with pytest.raises(DataError) as error:
        ERA5Batches(ds, batch_size=2, dp_size=3)  # 5 // 3 // 2 = 0 steps
    message = str(error.value)
    for part in (f"the train split of {root}", "has 5 samples", "dp_size=3", "batch_size=2", "needs 6",
                 "Lower the batch"):
        assert part in message, message
    assert ERA5Batches(ds, batch_size=1, dp_size=3).steps_per_epoch == 1
    for bad in ({"batch_size": 0}, {"batch_size": 1, "dp_rank": 3, "dp_size": 3}):
        with pytest.raises(ValueError):
            ERA5Batches(ds, **bad)
    with pytest.raises(DataError, match="has no samples to evaluate on"):
        eval_batches([], batch_size=2)


# ----------------------------------------------------------------------------------------- evaluation


def evaluation(ds, batch, dp_size, num_workers=0) -> list[list[tuple[torch.Tensor, ...]]]:
    """Every rank's batches of one pass."""
    return [list(eval_batches(ds, batch_size=batch, dp_rank=r, dp_size=dp_size, num_workers=num_workers))
            for r in range(dp_size)]


@pytest.mark.parametrize(("limit", "dp_size", "batch"), [(23, 2, 4), (23, 3, 2), (5, 3, 4), (24, 2, 3)])
def test_eval_ranks_take_equal_batches_and_weigh_every_sample_once(root, limit, dp_size, batch):
    ds = train_set(root, limit)
    lookup = index_by_content(ds)
    num_batches = -(-limit // (dp_size * batch))
    passes = evaluation(ds, batch, dp_size)
    assert [len(eval_batches(ds, batch_size=batch, dp_rank=r, dp_size=dp_size)) for r in range(dp_size)] \
        == [len(p) for p in passes] == [num_batches] * dp_size
    total = dict.fromkeys(range(limit), 0.0)
    weighted_sum, weight_sum = 0.0, 0.0
    for rank, batches in enumerate(passes):
        real = []
        for x, y, weight in batches:
            assert x.shape == (batch, 2, 4, 8) and weight.shape == (batch,) and weight.dtype == torch.float32
            for index, w in zip(sample_indices(ds, lookup, x, y), weight.tolist(), strict=True):
                assert w in (0.0, 1.0)
                total[index] += w
                if w:
                    real.append(index)
            weighted_sum += float((weight.double() * x.double().mean(dim=(1, 2, 3))).sum())
            weight_sum += float(weight.sum())
        assert real == list(range(rank, limit, dp_size))  # dealt in order, no shuffle
    assert total == dict.fromkeys(range(limit), 1.0)
    padding = sum(int((w == 0).sum()) for batches in passes for _, _, w in batches)
    assert padding == num_batches * batch * dp_size - limit
    exact_mean = sum(float(ds[i][0].double().mean()) for i in range(limit)) / limit
    assert weight_sum == limit and weighted_sum / weight_sum == pytest.approx(exact_mean, rel=1e-12, abs=1e-12)
    again = evaluation(ds, batch, dp_size)  # a second evaluation sees the same batches
    assert all(torch.equal(a, b) for p, q in zip(passes, again, strict=True)
               for s, t in zip(p, q, strict=True) for a, b in zip(s, t, strict=True))


def test_eval_with_worker_processes_matches(root):
    ds = train_set(root, 23)
    with_workers, alone = evaluation(ds, 2, 3, num_workers=2), evaluation(ds, 2, 3)
    assert [len(p) for p in with_workers] == [4, 4, 4]  # ceil(23 / 6)
    assert all(torch.equal(a, b) for p, q in zip(with_workers, alone, strict=True)
               for s, t in zip(p, q, strict=True) for a, b in zip(s, t, strict=True))
