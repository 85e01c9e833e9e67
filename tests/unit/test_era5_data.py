"""The ERA5 data layer: synthetic writer (layout, stats, idempotence, physics), reader (exact numbers vs numpy),
year boundaries, limit, dp sharding through DistributedSampler, lazy per-process h5 handles, and the errors."""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from meshtrain.commands import prepare as prepare_command
from meshtrain.data.era5 import (
    CHANNEL_NAMES,
    ERA5Dataset,
    denormalise,
    latitude_weights,
)
from meshtrain.data.era5_batches import ERA5Batches
from meshtrain.data.era5_synthetic import SyntheticAtmosphere, generate, split_years
from meshtrain.data.text import DataError

GRID = (90, 180)  # 2 deg: fine enough that neighbouring points correlate like real fields
SAMPLES = 6
FIX = "laid out as NERSC's ERA5 (train/ valid/ test/ of YEAR.h5 files, stats/), or write a synthetic one with " \
      "`meshtrain prepare era5-synthetic --out"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    prepare_command.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("era5") / "synthetic"
    generate(root, years=[2016, 2017, 2018], samples_per_year=SAMPLES, grid=GRID, seed=0)
    return root


def write_h5(path: Path, data: np.ndarray | None = None, name: str = "fields", **options) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        if data is not None:
            f.create_dataset(name, data=data, **options)


def write_stats(root: Path, means, stds) -> None:
    (root / "stats").mkdir(parents=True, exist_ok=True)
    np.save(root / "stats/global_means.npy", np.asarray(means).reshape(1, -1, 1, 1))
    np.save(root / "stats/global_stds.npy", np.asarray(stds).reshape(1, -1, 1, 1))


@pytest.fixture
def tiny(tmp_path) -> tuple[Path, dict[int, np.ndarray], np.ndarray, np.ndarray]:
    """Hand-made data: train/2016.h5 with 5 steps, train/2017.h5 with 4, 3 channels on a 5 x 7 grid."""
    rng = np.random.default_rng(7)
    root = tmp_path / "tiny"
    years = {2016: rng.normal(size=(5, 3, 5, 7)).astype(np.float32),
             2017: rng.normal(size=(4, 3, 5, 7)).astype(np.float32)}
    for year, data in years.items():
        write_h5(root / "train" / f"{year}.h5", data + np.float32(year - 2000))  # years apart in value
        years[year] = data + np.float32(year - 2000)
    means, stds = np.array([16.0, 15.5, 17.0]), np.array([1.5, 0.5, 2.0])
    write_stats(root, means, stds)
    (root / "stats/channels.json").write_text(json.dumps(["a", "b", "c"]))
    return root, years, means, stds


def expected(data: np.ndarray, t: int, means, stds, rows=None, columns=None, channels=None) -> np.ndarray:
    x = data[t][:, :rows, :columns] if channels is None else data[t][channels, :rows, :columns]
    picked = slice(None) if channels is None else channels
    return (x - np.float32(means)[picked, None, None]) / np.float32(stds)[picked, None, None]


# ----------------------------------------------------------------------------------------- the writer


def test_synthetic_layout_shapes_and_stats(synthetic):
    assert sorted(str(p.relative_to(synthetic)) for p in synthetic.rglob("*") if p.is_file()) == [
        "stats/channels.json", "stats/global_means.npy", "stats/global_stds.npy", "synthetic.json",
        "test/2018.h5", "train/2016.h5", "valid/2017.h5"]
    for split, year in (("train", 2016), ("valid", 2017), ("test", 2018)):
        with h5py.File(synthetic / split / f"{year}.h5", "r") as f:
            fields = f["fields"]
            assert fields.shape == (SAMPLES, 20, *GRID) and fields.dtype == np.float32
            assert fields.chunks == (1, 20, *GRID)
            if split == "train":
                train = fields[:].astype(np.float64)
    assert json.loads((synthetic / "stats/channels.json").read_text()) == list(CHANNEL_NAMES)
    means, stds = np.load(synthetic / "stats/global_means.npy"), np.load(synthetic / "stats/global_stds.npy")
    assert means.shape == stds.shape == (1, 20, 1, 1)
    np.testing.assert_allclose(means.ravel(), train.mean(axis=(0, 2, 3)), rtol=1e-9)  # train years only
    np.testing.assert_allclose(stds.ravel(), train.std(axis=(0, 2, 3)), rtol=1e-6)


def test_synthetic_values_are_in_physical_units(synthetic):
    with h5py.File(synthetic / "train/2016.h5", "r") as f:
        x = dict(zip(CHANNEL_NAMES, np.moveaxis(f["fields"][:], 1, 0), strict=True))
    assert 220 < x["t2m"].min() and x["t2m"].max() < 315  # K
    assert x["t2m"][:, 45].mean() > x["t2m"][:, 5].mean() + 20  # warm equator, cold pole
    assert 45_000 < x["z500"].min() and x["z500"].max() < 62_000  # m2/s2: 500 hPa near 5.5 km
    assert x["z50"].min() > 190_000 and x["z1000"].max() < 4_000
    assert 96_000 < x["msl"].min() and x["msl"].max() < 106_000  # Pa
    assert x["sp"].min() > 50_000 and np.all(x["sp"] <= x["msl"] + 100)  # mountains lower sp
    assert x["r500"].min() >= 0 and x["r850"].max() <= 100
    assert x["tcwv"].min() >= 0 and x["tcwv"][:, 40:50].mean() > 3 * x["tcwv"][:, :10].mean()
    assert x["u500"][:, 20:30].mean() > 10  # the westerly jet near 45N
    for name in CHANNEL_NAMES:  # smooth: neighbours correlate along both axes
        a = x[name]
        assert np.corrcoef(a[:, :, :-1].ravel(), a[:, :, 1:].ravel())[0, 1] > 0.95, name
        assert np.corrcoef(a[:, :-1].ravel(), a[:, 1:].ravel())[0, 1] > 0.95, name


def test_synthetic_forecast_is_learnable(synthetic):
    """Persistence errs clearly; the known dynamics (waves moving east) predict t + dt down to the noise."""
    ds = ERA5Dataset(synthetic, "train", crop=None)
    atmosphere = SyntheticAtmosphere(*GRID, seed=0)
    persistence, oracle = [], []
    for t in range(len(ds)):
        x, y = (denormalise(v, ds.means, ds.stds)[0] for v in ds[t])  # u10 in m/s
        hours = ((2016 - 2000) * SAMPLES + t + 1) * 6.0
        clean = torch.from_numpy(atmosphere.fields(hours, ["u10"], None)[0])
        persistence.append(((y - x) ** 2).mean())
        oracle.append(((y - clean) ** 2).mean())
    persistence_rmse = float(torch.stack(persistence).mean().sqrt())
    oracle_rmse = float(torch.stack(oracle).mean().sqrt())
    print(f"u10 over 6 h: persistence RMSE {persistence_rmse:.3f} m/s, known dynamics {oracle_rmse:.3f} m/s")
    assert 0.2 < persistence_rmse < 2.0  # m/s over 6 hours
    assert oracle_rmse < 0.4 * persistence_rmse
    assert oracle_rmse == pytest.approx(0.1, rel=0.05)  # what is left is the 0.1 m/s noise


def test_synthetic_is_deterministic_and_idempotent(synthetic, tmp_path):
    stamps = {p: p.stat().st_mtime_ns for p in synthetic.rglob("*") if p.is_file()}
    generate(synthetic, years=[2016, 2017, 2018], samples_per_year=SAMPLES, grid=GRID, seed=0)
    assert {p: p.stat().st_mtime_ns for p in synthetic.rglob("*") if p.is_file()} == stamps  # nothing rewritten

    other = tmp_path / "other"
    generate(other, years=[2016, 2017], samples_per_year=SAMPLES, grid=GRID, seed=0)  # 2 years: train + valid
    assert sorted(p.name for p in other.iterdir()) == ["stats", "synthetic.json", "train", "valid"]
    with h5py.File(other / "train/2016.h5", "r") as a, h5py.File(synthetic / "train/2016.h5", "r") as b:
        assert np.array_equal(a["fields"][:], b["fields"][:])  # a year depends on seed and grid only
    generate(other, years=[2017, 2018, 2019], samples_per_year=SAMPLES, grid=GRID, seed=1)
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*.h5")) == [
        "test/2019.h5", "train/2017.h5", "valid/2018.h5"]  # the stale 2016/2017 files are gone
    with h5py.File(other / "train/2017.h5", "r") as a, h5py.File(synthetic / "valid/2017.h5", "r") as b:
        assert not np.allclose(a["fields"][:], b["fields"][:])  # another seed, another atmosphere
    assert list(other.rglob("*.tmp")) == []


def test_split_rule_and_explicit_years():
    assert split_years([2018, 2016, 2017, 2015]) == {"train": [2015, 2016], "valid": [2017], "test": [2018]}
    assert split_years([2016, 2017]) == {"train": [2016], "valid": [2017], "test": []}
    assert split_years(train_years=[2001, 2000], test_years=[2010]) == {"train": [2000, 2001], "valid": [],
                                                                        "test": [2010]}
    for bad in ({"years": [2016]}, {"years": [2016, 2017], "train_years": [2015]},
                {"train_years": [2016], "valid_years": [2016]}, {"valid_years": [2016]}, {"years": [12345, 1]}):
        with pytest.raises(DataError):
            split_years(**bad)


def test_prepare_command_line(tmp_path, synthetic):
    assert prepare_command.run(parse("era5-synthetic", "--data-root", str(tmp_path), "--years", "2016", "2017",
                                 "--samples-per-year", "3", "--grid", "8x16", "--channels", "4",
                                 "--dt-hours", "3")) == 0
    root = tmp_path / "era5_synthetic"  # DATA_ROOT/era5_synthetic without --out
    assert json.loads((root / "stats/channels.json").read_text()) == ["u10", "v10", "t2m", "sp"]
    assert ERA5Dataset(root, "valid")[0][0].shape == (4, 8, 16)
    assert json.loads((root / "synthetic.json").read_text())["dt_hours"] == 3.0
    out = tmp_path / "explicit"
    assert prepare_command.run(parse("era5-synthetic", "--out", str(out), "--train-years", "2000", "2001",
                                 "--valid-years", "2002", "--samples-per-year", "2", "--grid", "4x8")) == 0
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.h5")) == [
        "train/2000.h5", "train/2001.h5", "valid/2002.h5"]
    assert prepare_command.run(parse("era5-synthetic", "--out", str(out), "--tokenizer", "char")) == 2
    assert prepare_command.run(parse("shakespeare", "--years", "2016", "--data-root", str(tmp_path))) == 2
    assert prepare_command.run(parse("era5-synthetic", "--out", str(out), "--years", "2016")) == 1  # one year
    with pytest.raises(SystemExit):
        parse("era5-synthetic", "--grid", "90by180")
    foreign = tmp_path / "foreign"  # a directory of someone else's h5 files is never overwritten silently
    write_h5(foreign / "train" / "2016.h5", np.zeros((2, 1, 2, 2), np.float32))
    assert prepare_command.run(parse("era5-synthetic", "--out", str(foreign), "--grid", "4x8")) == 1
    assert h5py.File(foreign / "train/2016.h5", "r")["fields"].shape == (2, 1, 2, 2)


# ----------------------------------------------------------------------------------------- the reader


def test_reader_returns_normalised_pairs_within_a_year(tiny):
    root, years, means, stds = tiny
    ds = ERA5Dataset(root, "train", dt=2, crop=(4, 6))
    assert len(ds) == (5 - 2) + (4 - 2)  # pairs never straddle 2016 -> 2017
    assert [ds.locate(i) for i in range(len(ds))] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert ds.years == [2016, 2017] and ds.img_size == (4, 6) and ds.channel_names == ["a", "b", "c"]
    for i in range(len(ds)):
        file_number, t = ds.locate(i)
        data = years[ds.years[file_number]]
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.float32 and x.shape == (3, 4, 6)
        assert np.array_equal(x.numpy(), expected(data, t, means, stds, 4, 6))
        assert np.array_equal(y.numpy(), expected(data, t + 2, means, stds, 4, 6))
        raw = denormalise(x, ds.means, ds.stds).numpy()
        np.testing.assert_allclose(raw, data[t, :, :4, :6], rtol=1e-6)
    np.testing.assert_array_equal(ds.lat, [90.0, 45.0, 0.0, -45.0])  # 5 rows from pole to pole, cropped to 4
    assert ds.means.tolist() == means.tolist() and ds.stds.tolist() == stds.tolist()


def test_channels_crop_limit_and_weights(tiny):
    root, years, means, stds = tiny
    full = ERA5Dataset(root, "train")
    assert len(full) == 4 + 3 and full.img_size == (5, 7)  # crop (360, 720) leaves a small grid whole
    picked = ERA5Dataset(root, "train", channels=["c", 0])
    assert picked.channel_names == ["c", "a"] and picked.means.tolist() == [17.0, 16.0]
    assert np.array_equal(picked[5][1].numpy(), expected(years[2017], 2, means, stds, channels=[2, 0]))
    limited = ERA5Dataset(root, "train", limit=3)
    assert len(limited) == 3 and all(torch.equal(limited[i][0], full[i][0]) for i in range(3))
    with pytest.raises(IndexError):
        limited[3]
    assert len(ERA5Dataset(root, "train", limit=100)) == 7
    for bad in ({"dt": 0}, {"limit": 0}, {"crop": (0, 4)}, {"channels": ["zz"]}, {"channels": [0, 0]}):
        with pytest.raises(ValueError):
            ERA5Dataset(root, "train", **bad)
    weights = latitude_weights(np.linspace(90, -90, 5))
    assert float(weights.mean()) == pytest.approx(1.0) and float(weights[0]) == pytest.approx(0.0, abs=1e-7)


def test_dataset_reopens_files_after_pickle_and_in_workers(tiny):
    root, years, means, stds = tiny
    ds = ERA5Dataset(root, "train")
    assert ds._handles == {}  # __init__ read the shapes and closed the files
    first = ds[0][0].clone()
    assert list(ds._handles) == [0]  # opened on first read, in this process
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._handles == {} and torch.equal(copy[0][0], first)

    reference = torch.stack([ds[i][0] for i in range(len(ds))])
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2, timeout=60)  # a hung worker fails fast
    batches = torch.cat([x for x, _ in loader])  # forked workers, each opening its own handles
    assert torch.equal(batches, reference)
    assert torch.equal(ds[6][1], torch.from_numpy(expected(years[2017], 3, means, stds)))  # parent's still good
    ds.close()
    assert torch.equal(ds[0][0], first)


# ------------------------------------------------------------------------------------------ sharding


@pytest.mark.parametrize("dp_size", [2, 4])
def test_ranks_get_disjoint_shares_that_cover_the_data(synthetic, dp_size):
    ds = ERA5Dataset(synthetic, "valid")  # 5 samples: divides by neither 2 nor 4
    n = len(ds)
    shares = [list(ERA5Batches(ds, batch_size=1, dp_rank=r, dp_size=dp_size, seed=3).sampler) for r in range(dp_size)]
    every = [i for share in shares for i in share]
    # each rank n // dp_size samples, none twice; the n % dp_size left over wait for another epoch
    assert all(len(s) == n // dp_size for s in shares) and len(set(every)) == len(every) == n - n % dp_size


def test_epochs_reshuffle_reproducibly_and_batches_match(synthetic):
    ds = ERA5Dataset(synthetic, "train", limit=5)
    streams = [ERA5Batches(ds, batch_size=2, dp_rank=r, dp_size=2, seed=3) for r in range(2)]

    def orders(epoch):
        for stream in streams:
            stream.sampler.start = epoch * stream.steps_per_epoch  # the epoch's first global batch
        return [list(stream.sampler) for stream in streams]

    epoch0, epoch1 = orders(0), orders(1)
    assert epoch0 != epoch1 and orders(1) == epoch1 and orders(0) == epoch0
    assert set(epoch1[0]).isdisjoint(epoch1[1])
    stream = ERA5Batches(ds, batch_size=2, dp_rank=1, dp_size=2, seed=3)
    stream.next_batch()  # 2 samples per rank: epoch 0 is one full batch
    x, y = stream.next_batch()
    for row, index in enumerate(epoch1[1]):
        assert torch.equal(x[row], ds[index][0]) and torch.equal(y[row], ds[index][1])
    with pytest.raises(ValueError):
        ERA5Batches(ds, batch_size=2, dp_rank=2, dp_size=2)


# ------------------------------------------------------------------------------------------- errors


def broken(root: Path, case: str) -> None:
    good = np.zeros((3, 2, 4, 4), np.float32)
    write_stats(root, [0.0, 0.0], [1.0, 1.0])
    if case == "no split":
        return
    (root / "train").mkdir()
    if case == "no files":
        return
    if case == "corrupt":
        (root / "train/2016.h5").write_bytes(b"not hdf5 at all" * 100)
    elif case == "truncated":
        write_h5(root / "train/2016.h5", np.ones((64, 2, 32, 32), np.float32))
        data = (root / "train/2016.h5").read_bytes()
        (root / "train/2016.h5").write_bytes(data[: len(data) // 2])
    elif case == "no fields":
        write_h5(root / "train/2016.h5", good, name="data")
    elif case == "ndim":
        write_h5(root / "train/2016.h5", good[0])
    elif case == "stats channels":
        write_h5(root / "train/2016.h5", np.zeros((3, 3, 4, 4), np.float32))
    elif case == "no stats":
        write_h5(root / "train/2016.h5", good)
        (root / "stats/global_stds.npy").unlink()
    elif case == "grids differ":
        write_h5(root / "train/2016.h5", good)
        write_h5(root / "train/2017.h5", good[:, :, :3])
    elif case == "file name":
        write_h5(root / "train/latest.h5", good)
    elif case == "too short":
        write_h5(root / "train/2016.h5", good[:1])


ERRORS = {
    "no split": ("train not found", FIX),
    "no files": ("holds no .h5 files", FIX),
    "corrupt": ("2016.h5 is not a readable HDF5 file", "truncated or corrupt", FIX),
    "truncated": ("2016.h5 is not a readable HDF5 file", "truncated file", FIX),
    "no fields": ("2016.h5 holds no dataset `fields` (it has: data)", FIX),
    "ndim": ("`fields` has shape [2, 4, 4], expected 4 dimensions [N, C, H, W]", FIX),
    "stats channels": ("global_means.npy has shape [1, 2, 1, 1] but the data files have 3 channels", FIX),
    "no stats": ("global_stds.npy not found", FIX),
    "grids differ": ("disagree in channels or grid (2016.h5 [3, 2, 4, 4], 2017.h5 [3, 2, 3, 4])",),
    "file name": ("latest.h5: ERA5 files are named by year",),
    "too short": ("no file has more than dt=1 time steps",),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_data_is_named_with_the_fix(tmp_path, case):
    root = tmp_path / "bad"
    broken(root, case)
    with pytest.raises(DataError) as error:
        ERA5Dataset(root, "train")
    message = str(error.value)
    for part in ERRORS[case]:
        assert part in message, message
    assert str(root) in message


def test_file_removed_after_construction_is_named(tiny):
    root = tiny[0]
    ds = ERA5Dataset(root, "train")
    shutil.move(root / "train/2017.h5", root / "moved.h5")
    assert ds[0][0].shape == (3, 5, 7)
    with pytest.raises(DataError, match="2017.h5 could not be opened"):
        ds[5]
