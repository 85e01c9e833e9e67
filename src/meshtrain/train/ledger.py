"""The sample ledger (train.sample_ledger=true): which samples every iteration read, all ranks' together, one line
per iteration in the run's ledger.txt: `ITERATION ID ID ...` (a language model's ids are its windows' start
offsets in the split, or with data.order=epoch their numbers in the run's stream of windows; the ViT's the indices
of its samples in the split).

Rank 0 writes it: the data streams know every rank's samples of a global batch (data/text.py, data/era5_batches.py).
A resumed run first drops the lines of the iterations it will do again, so the file always reads as one run that
never stopped: "nothing skipped, nothing repeated" is then a comparison with another run's ledger (`read_ledger`).
"""

from __future__ import annotations

from pathlib import Path

LEDGER = "ledger.txt"


def read_ledger(path: Path) -> dict[int, list[int]]:
    """{iteration: its samples} of a ledger file."""
    lines = Path(path).read_text().splitlines()
    return {int(line.split()[0]): [int(i) for i in line.split()[1:]] for line in lines if line.strip()}


class SampleLedger:
    """Appends iterations to run_dir/ledger.txt from `start` on (the lines of later iterations, left by an attempt
    that died after the checkpoint it resumes from, are dropped first)."""

    def __init__(self, run_dir: Path, start: int):
        self.path = Path(run_dir) / LEDGER
        kept = [f"{i} {' '.join(map(str, ids))}\n" for i, ids in read_ledger(self.path).items()
                if i < start] if self.path.exists() else []
        self.file = self.path.open("w")
        self.file.writelines(kept)
        self.file.flush()

    def write(self, iteration: int, ids: list[int]) -> None:
        self.file.write(f"{iteration} {' '.join(map(str, ids))}\n")
        self.file.flush()  # a killed run leaves every iteration it finished

    def close(self) -> None:
        self.file.close()
