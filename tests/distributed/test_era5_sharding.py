"""Under torchrun, ERA5 batches are dealt over the dp ranks only: dp ranks read disjoint samples, and the
ranks of one replica (tp here) read the same ones, each sample exactly as one process reads it.

The file is both the pytest test and, run as a script under torchrun, the driver:
    python -m torch.distributed.run --nproc-per-node 4 test_era5_sharding.py DATA_DIR
4 ranks = dp 2 x tp 2 (dp_rank = rank // 2). Each rank loads 2 epochs with one worker process, gathers
what every rank read, and matches each sample against the whole dataset read by this process alone; it records
(meshtrain.runtime.results.record) whether every sample equals one process's exactly, and which samples each dp rank read.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

RANKS, TP, BATCH, LIMIT = 4, 2, 2, 11


def drive(root: Path) -> None:
    from meshtrain.data.era5 import ERA5Dataset
    from meshtrain.data.era5_batches import ERA5Batches
    from meshtrain.runtime.results import record
    from meshtrain.runtime.setup import distributed

    with distributed() as info:
        dp_rank, dp_size = info.rank // TP, info.world_size // TP
        ds = ERA5Dataset(root, "train", limit=LIMIT)
        reference_x = torch.stack([ds[i][0] for i in range(len(ds))])  # this process alone, no loader
        reference_y = torch.stack([ds[i][1] for i in range(len(ds))])
        stream = ERA5Batches(ds, batch_size=BATCH, dp_rank=dp_rank, dp_size=dp_size, seed=5, num_workers=1)
        per_rank = len(ds) // (dp_size * BATCH) * BATCH  # its share of the epoch's whole global batches
        orders, worst = [], 0.0
        for epoch in (0, 1):
            assert stream.step == epoch * stream.steps_per_epoch
            batches = [stream.next_batch() for _ in range(stream.steps_per_epoch)]
            xs, ys = (torch.cat(parts) for parts in zip(*batches, strict=True))
            assert xs.shape[0] == per_rank, (xs.shape, per_rank)
            gathered_x = [torch.empty_like(xs) for _ in range(info.world_size)]
            gathered_y = [torch.empty_like(ys) for _ in range(info.world_size)]
            dist.all_gather(gathered_x, xs)
            dist.all_gather(gathered_y, ys)
            read = []  # per rank: the dataset index of each sample it read, found by content
            for x_rank, y_rank in zip(gathered_x, gathered_y, strict=True):
                flat = x_rank.reshape(len(x_rank), -1)
                distance = torch.cdist(flat.double(), reference_x.reshape(len(ds), -1).double())
                indices = distance.argmin(1)
                worst = max(worst, float((x_rank - reference_x[indices]).abs().max()),
                            float((y_rank - reference_y[indices]).abs().max()))
                read.append(indices.tolist())
            for r in range(info.world_size):  # the tp ranks of one replica read the same batches
                assert read[r] == read[r - r % TP], (epoch, read)
            shares = [read[d * TP] for d in range(dp_size)]
            every = [i for share in shares for i in share]
            assert len(set(every)) == len(every) == dp_size * per_rank, (epoch, shares)  # disjoint across dp
            orders.append(shares)
            record(f"epoch {epoch}", dp_rank=dp_rank, read=read[info.rank], dp_shares=shares)
        assert orders[0] != orders[1], "each epoch reshuffles"
        stream.close()
        record("samples", equal=worst == 0.0, worst={"|loader - one process|": worst})


def test_dp_ranks_read_disjoint_samples_and_tp_ranks_the_same(tmp_path):
    from tests.conftest import assert_all_equal, run_driver

    from meshtrain.data.era5_synthetic import generate

    generate(tmp_path / "era5", years=[2016, 2017, 2018, 2019], samples_per_year=7, grid=(8, 16), seed=0)
    results = run_driver(__file__, RANKS, str(tmp_path / "era5"), timeout=120)
    assert_all_equal(results, ["samples"], RANKS, "every sample a rank read equals the one this process reads alone")
    for epoch in ("epoch 0", "epoch 1"):  # as the driver asserts: tp ranks of a replica read the same, dp ranks not
        reads = [results[rank][epoch]["read"] for rank in range(RANKS)]
        assert all(reads[rank] == reads[rank - rank % TP] for rank in range(RANKS)), (epoch, reads)
        every = [i for replica in reads[::TP] for i in replica]
        assert len(set(every)) == len(every) > 0, (epoch, reads)


if __name__ == "__main__":
    drive(Path(sys.argv[1]))
