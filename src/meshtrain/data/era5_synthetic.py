"""Synthetic ERA5: weather-like fields in NERSC's layout, so the ViT forecaster runs without the 1 TB download.

The atmosphere here is a toy, but a consistent one, in physical units:
- a mean zonal wind per pressure level (mid-latitude westerly jets, easterly trades), and the mean
  geopotential that balances it geostrophically (falling towards the poles);
- a handful of planetary waves, each living in a latitude band and drifting east at a speed set by the
  band's wind, their amplitudes slowly pulsing; the same wave pattern at every level, stronger aloft;
- winds from the waves by geostrophy (u = -dz/dy / f, v = dz/dx / f, with f kept finite at the equator);
- temperatures falling poleward, their wave part from the 500-1000 hPa thickness (warm under ridges),
  2 m temperature and surface pressure lowered over a few smooth mountains;
- relative humidity high in poleward flow and in the tropics; water vapour from it by Clausius-Clapeyron;
- a little white noise.
So fields[t + dt] follows from fields[t] by a learnable rule (move each band's waves east), persistence
has a clear error, and every channel is smooth and correlated with its neighbours.

Time is absolute, sample k of year y lying at ((y - 2000) * samples_per_year + k) * dt_hours hours, so a
year's file depends only on the seed and the grid, and the valid year continues where training stopped.

Splits (years sorted): all but the last two train, the second to last is valid, the last is test; with
two years there is no test split. --train-years/--valid-years/--test-years choose them explicitly instead.
Statistics are computed over the train years only (as NERSC's).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from meshtrain.data.era5 import CHANNEL_NAMES, CHANNELS_FILE, MEANS_FILE, SPLITS, STDS_FILE
from meshtrain.data.text import DataError
from meshtrain.runtime.log import get_logger

log = get_logger("data")

FORMAT_VERSION = 1
MANIFEST = "synthetic.json"  # written last: its absence means "not (completely) written"
DEFAULT_YEARS = tuple(range(2011, 2019))  # 6 train years (378 pairs at 64 a year), 2017 valid, 2018 test
UNITS = {"u": "m/s", "v": "m/s", "t": "K", "z": "m2/s2", "r": "%", "sp": "Pa", "msl": "Pa", "tcwv": "kg/m2"}

EARTH_RADIUS = 6.371e6  # m
OMEGA = 7.292e-5  # Earth's rotation, rad/s
GRAVITY = 9.80665  # m/s2
R_DRY = 287.05  # gas constant of dry air, J/(kg K)
LEVELS = (1000, 850, 500, 50)  # hPa
WAVE_SCALE = {1000: 0.6, 850: 0.75, 500: 1.0, 50: 0.5}  # wave amplitude relative to 500 hPa
JET = {1000: 9.0, 850: 14.0, 500: 26.0}  # westerly jet speed, m/s
TRADES = {1000: 6.0, 850: 5.0, 500: 3.0}  # easterly trade wind speed, m/s
Z_EQUATOR = {1000: 1100.0, 850: 14800.0, 500: 57600.0, 50: 201500.0}  # geopotential at the equator, m2/s2
NOISE = {"u": 0.1, "v": 0.1, "t": 0.1, "z": 5.0, "sp": 10.0, "msl": 10.0, "r": 0.5, "tcwv": 0.1}


def _kind(name: str) -> str:
    return name if name in ("sp", "msl", "tcwv") else name[0]


def channel_units(names) -> list[str]:
    return [UNITS.get(_kind(n), "") for n in names]  # a real data set may name channels of its own


def _gauss(x, centre, width):
    return np.exp(-(((x - centre) / width) ** 2))


def mean_zonal_wind(lat: np.ndarray, level: int) -> np.ndarray:
    """Mean westerly wind (m/s) by latitude (degrees): jets near 45N/S, trades at the equator; 50 hPa: polar jets."""
    if level == 50:
        return 22.0 * (_gauss(lat, 62, 10) + _gauss(lat, -62, 10)) - 12.0 * _gauss(lat, 0, 20)
    return JET[level] * (_gauss(lat, 42, 12) + 0.9 * _gauss(lat, -47, 11)) - TRADES[level] * _gauss(lat, 0, 16)


def mean_geopotential(lat: np.ndarray, level: int) -> np.ndarray:
    """The geopotential (m2/s2) in geostrophic balance with mean_zonal_wind: dZ/dphi = -R f U."""
    fine = np.linspace(-90.0, 90.0, 3601)
    slope = -EARTH_RADIUS * 2 * OMEGA * np.sin(np.deg2rad(fine)) * mean_zonal_wind(fine, level)
    integral = np.concatenate([[0.0], np.cumsum((slope[1:] + slope[:-1]) / 2 * np.diff(np.deg2rad(fine)))])
    return Z_EQUATOR[level] + np.interp(lat, fine, integral - integral[1800])


class SyntheticAtmosphere:
    """The toy atmosphere of one seed on an H x W grid (rows 90N..90S with both poles, columns from 0E)."""

    def __init__(self, rows: int, columns: int, seed: int, num_waves: int = 10):
        rng = np.random.default_rng([seed, 0x5EA7])
        self.lat = np.linspace(90.0, -90.0, rows)
        self.lon = np.arange(columns) * (360.0 / columns)
        phi, lam = np.deg2rad(self.lat), np.deg2rad(self.lon)
        self.lam = lam
        sin_phi, cos_phi = np.sin(phi), np.cos(phi)
        # 1/f, except near the equator where it falls smoothly to 0 instead of blowing up
        self.inv_f = sin_phi / (2 * OMEGA * (sin_phi**2 + np.sin(np.deg2rad(12.0)) ** 2))

        # Each wave: envelope g(phi) = exp(-((phi - c) / w)^2) cos^2(phi), zero at the poles with its slope.
        self.waves = []
        for _ in range(num_waves):
            centre = np.deg2rad(rng.choice([-1.0, 1.0]) * rng.uniform(25, 70))
            width = np.deg2rad(rng.uniform(9, 15))
            bump = np.exp(-(((phi - centre) / width) ** 2))
            envelope = bump * cos_phi**2
            d_envelope = envelope * (-2 * (phi - centre) / width**2) - 2 * bump * cos_phi * sin_phi
            speed = 0.6 * mean_zonal_wind(np.rad2deg(centre), 500) + rng.uniform(-3, 3)  # m/s at the centre
            self.waves.append({
                "m": int(rng.integers(2, 8)),  # zonal wavenumber
                "phase": rng.uniform(0, 2 * np.pi),
                "omega": speed / (EARTH_RADIUS * np.cos(centre)) * 3600.0,  # rad of longitude per hour
                "amplitude": rng.uniform(800, 1800),  # m2/s2 at 500 hPa
                "period": rng.uniform(3, 10) * 24.0,  # hours, of the amplitude's pulsing
                "pulse_phase": rng.uniform(0, 2 * np.pi),
                "g": envelope, "dg": d_envelope, "g_over_cos": bump * cos_phi,
            })

        # A few smooth mountains (m), Gaussian in great-circle distance
        self.orography = np.zeros((rows, columns))
        for _ in range(5):
            c_lat, c_lon = np.deg2rad(rng.uniform(-50, 60)), rng.uniform(0, 2 * np.pi)
            cos_dist = (sin_phi[:, None] * np.sin(c_lat)
                        + cos_phi[:, None] * np.cos(c_lat) * np.cos(lam[None, :] - c_lon))
            dist = np.arccos(np.clip(cos_dist, -1, 1))
            self.orography += rng.uniform(800, 3500) * np.exp(-((dist / np.deg2rad(rng.uniform(8, 20))) ** 2))

        lat = self.lat[:, None]
        south = np.maximum(-np.sin(np.deg2rad(lat)), 0) ** 3  # Antarctica runs colder than the Arctic
        sin2 = np.sin(np.deg2rad(lat)) ** 2
        self.mean_t = {"t2m": 300 - 44 * sin2 - 8 * south, 850: 294 - 38 * sin2 - 5 * south, 500: 268 - 28 * sin2}
        self.mean_u = {level: mean_zonal_wind(lat, level) for level in LEVELS}
        self.mean_z = {level: mean_geopotential(lat, level) for level in LEVELS}
        self.tropics = _gauss(lat, 0, 15)
        self.poleward = np.tanh(lat / 8.0)  # +1 north, -1 south: v * poleward > 0 is flow towards the pole

    def waves_at(self, hours: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The 500 hPa wave geopotential and its geostrophic winds (u, v), each [H, W], at a time in hours."""
        z = np.zeros((len(self.lat), len(self.lon)))
        dz_dphi, dz_dlam_over_cos = np.zeros_like(z), np.zeros_like(z)
        for w in self.waves:
            amplitude = w["amplitude"] * (1 + 0.35 * np.sin(2 * np.pi * hours / w["period"] + w["pulse_phase"]))
            angle = w["m"] * (self.lam - w["omega"] * hours) + w["phase"]
            cos_a, sin_a = np.cos(angle), np.sin(angle)
            z += amplitude * np.outer(w["g"], cos_a)
            dz_dphi += amplitude * np.outer(w["dg"], cos_a)
            dz_dlam_over_cos += amplitude * np.outer(w["g_over_cos"], -w["m"] * sin_a)
        inv_f = self.inv_f[:, None] / EARTH_RADIUS
        return z, -inv_f * dz_dphi, inv_f * dz_dlam_over_cos

    def fields(self, hours: float, names, rng: np.random.Generator | None) -> np.ndarray:
        """All channels `names` at a time in hours, float32 [C, H, W], in physical units; no noise if rng is None."""
        wave_z, wave_u, wave_v = self.waves_at(hours)
        out = {}
        for level in LEVELS:
            scale = WAVE_SCALE[level]
            out[f"z{level}"] = self.mean_z[level] + scale * wave_z
            out[f"u{level}"] = self.mean_u[level] + scale * wave_u
            out[f"v{level}"] = scale * wave_v
        # Hypsometric: the 1000-500 hPa layer is warm where it is thick
        thickness_t = (WAVE_SCALE[500] - WAVE_SCALE[1000]) * wave_z / (R_DRY * np.log(1000 / 500))
        out["t2m"] = self.mean_t["t2m"] - 0.0065 * self.orography + thickness_t
        out["t850"] = self.mean_t[850] + 0.9 * thickness_t
        out["t500"] = self.mean_t[500] + 0.7 * thickness_t
        out["u10"], out["v10"] = 0.72 * out["u1000"], 0.72 * out["v1000"]
        out["msl"] = 1e5 + 1.2 * out["z1000"]  # 1000 hPa plus the air (1.2 kg/m3) between sea level and z1000
        column_t = out["t2m"] + 0.00325 * self.orography
        out["sp"] = out["msl"] * np.exp(-GRAVITY * self.orography / (R_DRY * column_t))
        out["r850"] = 100 / (1 + np.exp(-(0.4 + 0.12 * out["v850"] * self.poleward + 1.2 * self.tropics)))
        out["r500"] = 100 / (1 + np.exp(-(-0.3 + 0.08 * out["v500"] * self.poleward + 1.0 * self.tropics)))
        saturation = 611.2 * np.exp(17.67 * (out["t850"] - 273.15) / (out["t850"] - 29.65))  # Pa
        out["tcwv"] = 1.0 + 18.0 * out["r850"] / 100 * saturation / 611.2

        shape = (len(self.lat), len(self.lon))
        stack = np.empty((len(names), *shape), dtype=np.float32)
        for c, name in enumerate(names):
            noisy = out[name] if rng is None else out[name] + NOISE[_kind(name)] * rng.standard_normal(shape)
            if name in ("r500", "r850"):
                noisy = np.clip(noisy, 0, 100)
            elif name == "tcwv":
                noisy = np.maximum(noisy, 0)
            stack[c] = noisy
        return stack


# ----------------------------------------------------------------------------------------------- writing


def split_years(years=None, train_years=None, valid_years=None, test_years=None) -> dict[str, list[int]]:
    """{split: years}: by the default rule from `years`, or exactly the explicit lists."""
    explicit = {"train": train_years, "valid": valid_years, "test": test_years}
    if any(v is not None for v in explicit.values()):
        if years is not None:
            raise DataError("give either --years (split by the rule) or --train-years/--valid-years/--test-years, "
                            "not both")
        if not train_years:
            raise DataError("--train-years is needed when the splits are chosen explicitly")
        splits = {name: sorted(set(v or ())) for name, v in explicit.items()}
        every = [y for v in splits.values() for y in v]
        if len(every) != len(set(every)):
            raise DataError(f"a year may belong to one split only, got {splits}")
    else:
        every = sorted(set(DEFAULT_YEARS if years is None else years))
        if len(every) < 2:
            raise DataError(f"synthetic ERA5 needs at least 2 years (one to train, one to validate), got {every}")
        if len(every) == 2:
            splits = {"train": every[:1], "valid": every[1:], "test": []}
        else:
            splits = {"train": every[:-2], "valid": every[-2:-1], "test": every[-1:]}
    bad = [y for v in splits.values() for y in v if not 0 <= y <= 9999]
    if bad:
        raise DataError(f"years must have at most 4 digits (file names are YEAR.h5), got {bad}")
    return splits


def _stage_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.{os.getpid()}.tmp")


def _write_year(final: Path, atmosphere: SyntheticAtmosphere, names, year: int, seed: int,
                samples_per_year: int, dt_hours: float, moments: np.ndarray | None) -> None:
    """One year's file, written under a temp name then renamed; adds each channel's moments if given."""
    rows, columns = len(atmosphere.lat), len(atmosphere.lon)
    noise = np.random.default_rng([seed, year, 0x401])
    temp = _stage_path(final)
    try:
        with h5py.File(temp, "w") as f:
            fields = f.create_dataset("fields", shape=(samples_per_year, len(names), rows, columns), dtype="f4",
                                      chunks=(1, len(names), rows, columns))
            f.attrs.update(year=year, dt_hours=dt_hours, channels=list(names), synthetic=True)
            for k in range(samples_per_year):
                hours = ((year - 2000) * samples_per_year + k) * dt_hours
                sample = atmosphere.fields(hours, names, noise)
                fields[k] = sample
                if moments is not None:  # count, sum and sum of squares per channel, in float64
                    flat = sample.reshape(len(names), -1).astype(np.float64)
                    moments += np.stack([np.full(len(names), flat.shape[1]), flat.sum(1), (flat**2).sum(1)], 1)
        os.replace(temp, final)
    finally:
        temp.unlink(missing_ok=True)


def _save_atomically(final: Path, write) -> None:
    temp = _stage_path(final)
    try:
        with open(temp, "wb") as f:
            write(f)
        os.replace(temp, final)
    finally:
        temp.unlink(missing_ok=True)


def _written_here(path: Path) -> bool:
    try:
        with h5py.File(path, "r") as f:
            return bool(f.attrs.get("synthetic", False))
    except OSError:
        return False


def _up_to_date(out: Path, manifest: dict, splits: dict[str, list[int]]) -> bool:
    try:
        if json.loads((out / MANIFEST).read_text(encoding="utf-8")) != manifest:
            return False
    except (OSError, ValueError):
        return False
    needed = [out / s / f"{y:04d}.h5" for s, ys in splits.items() for y in ys]
    needed += [out / MEANS_FILE, out / STDS_FILE, out / CHANNELS_FILE]
    return all(p.is_file() for p in needed)


def generate(out: str | Path, *, years=None, samples_per_year: int = 64, grid: tuple[int, int] = (90, 180),
             channels: int = len(CHANNEL_NAMES), seed: int = 0, dt_hours: float = 6.0, train_years=None,
             valid_years=None, test_years=None, force: bool = False) -> dict:
    """Write synthetic ERA5 to `out` (train/ valid/ test/ YEAR.h5, stats/, synthetic.json); return the manifest.

    Nothing is done when `out` already holds the same data (same manifest, all files present), unless
    `force`. Every file is written under a temp name and renamed; the manifest goes first and comes back
    last, so an interrupted run is redone in full by the next.
    """
    rows, columns = grid
    if rows < 2 or columns < 2:
        raise DataError(f"the grid needs at least 2 rows and 2 columns, got {rows}x{columns}")
    if not 1 <= channels <= len(CHANNEL_NAMES):
        raise DataError(f"channels must lie in 1..{len(CHANNEL_NAMES)} (the first N of {', '.join(CHANNEL_NAMES)}), "
                        f"got {channels}")
    if samples_per_year < 2:
        raise DataError(f"samples_per_year must be >= 2 (a sample pairs t with t + dt), got {samples_per_year}")
    if not dt_hours > 0:
        raise DataError(f"dt_hours must be positive, got {dt_hours}")
    splits = split_years(years, train_years, valid_years, test_years)
    names = list(CHANNEL_NAMES[:channels])
    out = Path(out)
    manifest = {"format_version": FORMAT_VERSION, "seed": seed, "splits": splits, "samples_per_year": samples_per_year,
                "grid": [rows, columns], "channels": names, "units": channel_units(names), "dt_hours": dt_hours}
    if not force and _up_to_date(out, manifest, splits):
        log.info("%s is up to date (%s): nothing to do", out, ", ".join(f"{s} {v}" for s, v in splits.items() if v))
        return manifest
    existing = [p for s in SPLITS for p in (out / s).glob("*.h5")]
    foreign = [p for p in existing if not _written_here(p)]
    if foreign and not force:
        raise DataError(f"{out} holds .h5 files that are not synthetic ERA5 (e.g. {foreign[0]}): choose another "
                        "--out, or pass --force to delete them and write synthetic data there")

    atmosphere = SyntheticAtmosphere(rows, columns, seed)
    (out / MANIFEST).unlink(missing_ok=True)
    (out / "stats").mkdir(parents=True, exist_ok=True)
    moments = np.zeros((channels, 3))
    written = set()
    for split in ("train", "valid", "test"):  # train first: its moments make the statistics
        for year in splits[split]:
            (out / split).mkdir(exist_ok=True)
            final = out / split / f"{year:04d}.h5"
            log.info("writing %s (%d samples of %d x %d x %d)", final, samples_per_year, channels, rows, columns)
            _write_year(final, atmosphere, names, year, seed, samples_per_year, dt_hours,
                        moments if split == "train" else None)
            written.add(final)
    for stale in set(existing) - written:  # years of an earlier run that this layout no longer has
        stale.unlink()
    count, total, squares = moments.T
    means = total / count
    stds = np.sqrt(np.maximum(squares / count - means**2, 0.0))
    for name, values in ((MEANS_FILE, means), (STDS_FILE, stds)):
        _save_atomically(out / name, lambda f, v=values: np.save(f, v.reshape(1, -1, 1, 1)))
    _save_atomically(out / CHANNELS_FILE, lambda f: f.write((json.dumps(names) + "\n").encode()))
    _save_atomically(out / MANIFEST, lambda f: f.write((json.dumps(manifest, indent=1) + "\n").encode()))
    log.info("wrote %s: %s; statistics from the train years in %s", out,
             ", ".join(f"{s} {v}" for s, v in splits.items() if v), out / "stats")
    return manifest
