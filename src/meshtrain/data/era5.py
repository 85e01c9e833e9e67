"""ERA5 weather fields for the ViT forecaster, read in NERSC's dl-at-scale-training layout.

A dataset root holds
    train/ valid/ test/        one HDF5 file per year, named so that the 4 characters before `.h5` are
                               the year (`2016.h5`), each with a dataset `fields` shaped [N, C, H, W]
    stats/global_means.npy     per-channel mean and standard deviation, shaped [1, C, 1, 1]
    stats/global_stds.npy      (NERSC's convention; computed over the train years)
    stats/channels.json        optional: the C channel names (NERSC's 20 are assumed when absent)

A sample is the pair (fields[t], fields[t + dt]) of one year's file, cropped to the top-left `crop`
rows x columns and normalised per channel: the model learns to step the weather forward by dt. Pairs
never straddle two files, so year y contributes N_y - dt samples, indexed year by year in time order;
`limit` keeps the first `limit` of them (NERSC's `short` config: 512 train / 128 valid).

Rows run from 90N to 90S, both poles included (ERA5's 721 rows at 0.25 deg, NERSC's 361 at 0.5 deg),
so the latitude of row i of a file with H_file rows is 90 - 180 i / (H_file - 1).

HDF5 handles do not survive fork: a handle opened in the parent and used by a DataLoader worker can
return wrong data. So the dataset opens its files lazily, in the process that reads, and remembers
which process that was; a copy made by fork or pickle opens its own. On file systems without working
locks (some Lustre mounts) set HDF5_USE_FILE_LOCKING=FALSE, as NERSC's scripts do.

data/era5_batches.py streams it to the training loop, sharded over the data-parallel ranks: `ERA5Batches`,
one dp rank's endless, resumable training stream over epochs, and `eval_batches`, an exact evaluation pass in
which every rank takes the same number of full batches and padding carries weight 0.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from meshtrain.data.text import DataError

SPLITS = ("train", "valid", "test")
# NERSC's FourCastNet set, in its channel order: 10 m wind, 2 m temperature, surface and mean-sea-level
# pressure, then winds, geopotential, temperature and relative humidity on pressure levels (hPa), and
# total column water vapour.
CHANNEL_NAMES = ("u10", "v10", "t2m", "sp", "msl", "t850", "u1000", "v1000", "z1000", "u850", "v850", "z850",
                 "u500", "v500", "z500", "t500", "z50", "r500", "r850", "tcwv")
DEFAULT_CROP = (360, 720)
MEANS_FILE = "stats/global_means.npy"
STDS_FILE = "stats/global_stds.npy"
CHANNELS_FILE = "stats/channels.json"


def how_to_fix(root: Path, sentence: bool = False) -> str:
    """The fix every error ends with; `sentence` capitalises it to open a sentence."""
    return (f"{'P' if sentence else 'p'}oint the dataset at a directory laid out as NERSC's ERA5 (train/ valid/ "
            f"test/ of YEAR.h5 files, stats/), or write a synthetic one with "
            f"`meshtrain prepare era5-synthetic --out {root}`")


def latitudes(rows: int) -> np.ndarray:
    """Latitude in degrees of each of `rows` rows spanning 90N to 90S, both poles included."""
    if rows < 2:
        return np.array([90.0])[:rows]
    return np.linspace(90.0, -90.0, rows)


def latitude_weights(lat) -> torch.Tensor:
    """cos(latitude) normalised to mean 1, [H]: weights for an RMSE in which every row counts by its area."""
    weights = torch.cos(torch.deg2rad(torch.as_tensor(lat, dtype=torch.float64)))
    return (weights / weights.mean()).to(torch.float32)


def denormalise(x, means, stds):
    """Fields back in physical units: x * std + mean per channel; x is [..., C, H, W] (tensor or array)."""
    if isinstance(x, torch.Tensor):
        means = torch.as_tensor(means, dtype=x.dtype, device=x.device).reshape(-1, 1, 1)
        stds = torch.as_tensor(stds, dtype=x.dtype, device=x.device).reshape(-1, 1, 1)
    else:
        means, stds = np.reshape(means, (-1, 1, 1)), np.reshape(stds, (-1, 1, 1))
    return x * stds + means


def _year_of(path: Path) -> int:
    stem = path.name[:-len(".h5")]
    if not stem[-4:].isdigit():
        raise DataError(f"{path}: ERA5 files are named by year, the 4 characters before .h5 being the year "
                        f"(e.g. 2016.h5); rename it or move it out of {path.parent}")
    return int(stem[-4:])


def _fields_shape(path: Path, root: Path) -> tuple[int, int, int, int]:
    try:
        with h5py.File(path, "r") as f:
            if "fields" not in f:
                raise DataError(f"{path} holds no dataset `fields` (it has: {', '.join(sorted(f)) or 'nothing'}); "
                                f"ERA5 files need `fields` shaped [N, C, H, W]: {how_to_fix(root)}")
            shape = f["fields"].shape
    except OSError as e:  # h5py's word for a file that is not HDF5, truncated, or unreadable
        raise DataError(f"{path} is not a readable HDF5 file ({e}): truncated or corrupt? "
                        f"Copy it again or regenerate it: {how_to_fix(root)}") from None
    if len(shape) != 4:
        raise DataError(f"{path}: `fields` has shape {list(shape)}, expected 4 dimensions [N, C, H, W]: "
                        f"{how_to_fix(root)}")
    return shape


def _load_stat(root: Path, name: str, num_channels: int) -> np.ndarray:
    path = root / name
    if not path.is_file():
        raise DataError(f"{path} not found: ERA5 data needs per-channel statistics, shaped [1, {num_channels}, 1, 1], "
                        f"in {root / 'stats'}: {how_to_fix(root)}")
    try:
        values = np.load(path)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not a readable .npy file ({e}): {how_to_fix(root)}") from None
    if values.size != num_channels or values.ndim not in (1, 4):
        raise DataError(f"{path} has shape {list(values.shape)} but the data files have {num_channels} channels: "
                        f"expected [1, {num_channels}, 1, 1]. The statistics belong to other data; "
                        f"recompute them or {how_to_fix(root)}")
    values = values.reshape(-1).astype(np.float64)
    if not np.all(np.isfinite(values)):
        raise DataError(f"{path} holds non-finite values: recompute the statistics or {how_to_fix(root)}")
    return values


def _channel_names(root: Path, num_channels: int) -> list[str]:
    path = root / CHANNELS_FILE
    if not path.is_file():
        if num_channels == len(CHANNEL_NAMES):
            return list(CHANNEL_NAMES)
        return [f"ch{i}" for i in range(num_channels)]
    try:
        names = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}): it should be a JSON list of the {num_channels} channel "
                        "names; fix or delete it") from None
    if not (isinstance(names, list) and len(names) == num_channels and all(isinstance(n, str) for n in names)):
        raise DataError(f"{path} should be a JSON list of {num_channels} channel names (the data files have "
                        f"{num_channels} channels); fix or delete it")
    return names


def _check_arguments(split: str, dt: int, limit: int | None, crop: tuple[int, int] | None) -> None:
    """ValueError for an ERA5Dataset argument that no data could make valid (checked before touching files)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if int(dt) != dt or dt < 1:
        raise ValueError(f"dt (the forecast step, in samples) must be an integer >= 1, got {dt}")
    if limit is not None and (int(limit) != limit or limit < 1):
        raise ValueError(f"limit must be a positive number of samples or None, got {limit}")
    if crop is not None and (len(crop) != 2 or any(int(c) != c or c < 1 for c in crop)):
        raise ValueError(f"crop must be (rows, columns) of positive integers or None, got {crop}")


def _split_files(root: Path, split: str) -> tuple[Path, list[Path], list[tuple[int, int, int, int]]]:
    """(split directory, its year files in year order, each file's `fields` shape [N, C, H, W]).

    Every file must share one [C, H, W]: a sample is cut from one file, but batches mix years.
    """
    split_dir = root / split
    if not split_dir.is_dir():
        raise DataError(f"{split_dir} not found: the {split} split of ERA5 data is a directory of YEAR.h5 "
                        f"files. {how_to_fix(root, sentence=True)}")
    files = sorted(split_dir.glob("*.h5"), key=lambda p: (_year_of(p), p.name))
    if not files:
        raise DataError(f"{split_dir} holds no .h5 files: expected one per year (e.g. 2016.h5). "
                        f"{how_to_fix(root, sentence=True)}")
    shapes = [_fields_shape(path, root) for path in files]
    file_chw = {tuple(s[1:]) for s in shapes}
    if len(file_chw) > 1:
        listing = ", ".join(f"{p.name} {list(s)}" for p, s in zip(files, shapes, strict=True))
        raise DataError(f"the files of {split_dir} disagree in channels or grid ({listing}); "
                        "every year must have the same [C, H, W]")
    return split_dir, files, shapes


class ERA5Dataset(Dataset):
    """Pairs (fields[t], fields[t + dt]) of one split, normalised float32 tensors [C, H, W].

    Attributes the model code uses: `channel_names`, `means` and `stds` (float64 numpy [C], of the selected
    channels, in physical units), `lat` (degrees, [H], 90 down to -90), `img_size` (H, W), `num_channels`.
    `channels` picks channels by index or name, in the given order (default: all).
    """

    def __init__(self, root: str | Path, split: str, *, dt: int = 1, limit: int | None = None,
                 crop: tuple[int, int] | None = DEFAULT_CROP, channels: Sequence[int | str] | None = None):
        _check_arguments(split, dt, limit, crop)
        self.root, self.split, self.dt = Path(root), split, int(dt)
        split_dir, files, shapes = _split_files(self.root, split)
        file_channels, file_rows, file_columns = shapes[0][1:]
        self.files, self.years = files, [_year_of(p) for p in files]
        self._select_channels(channels, file_channels)

        rows, columns = file_rows, file_columns
        if crop is not None:  # the top-left corner, as NERSC crops to 360 x 720
            rows, columns = min(rows, crop[0]), min(columns, crop[1])
        self.img_size = (rows, columns)
        self.num_channels = len(self.channels)
        self.lat = latitudes(file_rows)[:rows]

        self._number_samples(split_dir, [s[0] for s in shapes], limit)
        self._handles: dict[int, h5py.Dataset] = {}
        self._files_open: list[h5py.File] = []
        self._inherited: list[list[h5py.File]] = []
        self._owner_pid: int | None = None

    def _select_channels(self, channels: Sequence[int | str] | None, file_channels: int) -> None:
        """Set the selected channels with their names and statistics, and how to read just them from a file."""
        all_names = _channel_names(self.root, file_channels)
        all_means = _load_stat(self.root, MEANS_FILE, file_channels)
        all_stds = _load_stat(self.root, STDS_FILE, file_channels)
        self.channels = self._resolve_channels(channels, all_names)
        # Only the selected channels must normalise: a constant channel the user leaves out is harmless.
        bad = [all_names[c] for c in self.channels if not all_stds[c] > 0]
        if bad:
            raise DataError(f"{self.root / STDS_FILE}: the standard deviation of {', '.join(bad)} is not positive, "
                            "so it cannot normalise; recompute the statistics (or drop those channels)")
        self.channel_names = [all_names[c] for c in self.channels]
        self.means, self.stds = all_means[self.channels], all_stds[self.channels]
        # float32 copies, shaped to broadcast over [C, H, W]: what __getitem__ normalises with
        self._means32 = self.means.astype(np.float32).reshape(-1, 1, 1)
        self._stds32 = self.stds.astype(np.float32).reshape(-1, 1, 1)
        # The channels as a slice when contiguous and increasing: h5py reads a slice far faster than a list.
        lo, hi = min(self.channels), max(self.channels) + 1
        self._channel_read = slice(lo, hi)
        self._channel_pick = None if self.channels == list(range(lo, hi)) else [c - lo for c in self.channels]

    def _number_samples(self, split_dir: Path, steps_per_file: list[int], limit: int | None) -> None:
        """Set the sample count and where each file's samples start in the numbering."""
        # Samples are numbered file by file: file f holds samples _starts[f] .. _starts[f + 1] - 1, its pairs
        # (t, t + dt) for t = 0 .. N_f - dt - 1; a file with no more than dt steps adds none.
        pairs_per_file = [max(steps - self.dt, 0) for steps in steps_per_file]
        self.samples_per_file = pairs_per_file
        self._starts = np.cumsum([0, *pairs_per_file])
        total = int(self._starts[-1])
        if total == 0:
            raise DataError(f"{split_dir}: no file has more than dt={self.dt} time steps "
                            f"(steps per file: {steps_per_file}), so there is no (t, t+dt) pair; "
                            "use a smaller dt or longer files")
        self.length = total if limit is None else min(total, int(limit))

    @staticmethod
    def _resolve_channels(channels, names: list[str]) -> list[int]:
        if channels is None:
            return list(range(len(names)))
        picked = []
        for c in channels:
            if isinstance(c, str):
                if c not in names:
                    raise ValueError(f"unknown channel {c!r}: the data has {', '.join(names)}")
                c = names.index(c)
            elif not 0 <= int(c) < len(names):
                raise ValueError(f"channel index {c} is out of range: the data has {len(names)} channels")
            picked.append(int(c))
        if not picked or len(set(picked)) != len(picked):
            raise ValueError(f"channels must be a non-empty list without repeats, got {list(channels)}")
        return picked

    def __len__(self) -> int:
        return self.length

    def locate(self, index: int) -> tuple[int, int]:
        """(file number, time index t) of sample `index`: its input is fields[t], its target fields[t + dt]."""
        if not -self.length <= index < self.length:
            raise IndexError(f"sample {index} is out of range for {self.length} samples")
        index %= self.length
        file_number = int(np.searchsorted(self._starts, index, side="right")) - 1
        return file_number, index - int(self._starts[file_number])

    def _fields(self, file_number: int) -> h5py.Dataset:
        pid = os.getpid()
        if self._owner_pid != pid:
            # Handles inherited through fork belong to the parent: never reuse them, and keep them referenced
            # so that no garbage collection closes (and unlocks) the file the parent still reads.
            self._inherited.append(self._files_open)
            self._handles, self._files_open, self._owner_pid = {}, [], pid
        if file_number not in self._handles:
            path = self.files[file_number]
            try:
                handle = h5py.File(path, "r")
            except OSError as e:
                raise DataError(f"{path} could not be opened for reading ({e}): was it moved or damaged "
                                f"after the dataset was built? {how_to_fix(self.root, sentence=True)}") from None
            self._files_open.append(handle)
            self._handles[file_number] = handle["fields"]
        return self._handles[file_number]

    def _read(self, fields: h5py.Dataset, t: int) -> np.ndarray:
        rows, columns = self.img_size
        x = fields[t, self._channel_read, :rows, :columns]
        if self._channel_pick is not None:
            x = x[self._channel_pick]
        return (x.astype(np.float32, copy=False) - self._means32) / self._stds32

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        file_number, t = self.locate(int(index))
        fields = self._fields(file_number)
        return torch.from_numpy(self._read(fields, t)), torch.from_numpy(self._read(fields, t + self.dt))

    def close(self) -> None:
        """Close this process's open files (they reopen on the next read)."""
        if self._owner_pid == os.getpid():
            for handle in self._files_open:
                handle.close()
        self._handles, self._files_open, self._owner_pid = {}, [], None

    def __getstate__(self) -> dict:
        # A pickled copy (spawned workers, multiprocessing) opens its own files.
        state = self.__dict__.copy()
        state.update(_handles={}, _files_open=[], _inherited=[], _owner_pid=None)
        return state
