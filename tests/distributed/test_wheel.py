"""meshtrain as users get it: an sdist and a wheel built from a clean copy of the repository, the wheel installed into
a fresh virtual environment without a network, and the installed `meshtrain` run from outside the repository."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from tests.conftest import REPO, clean_env, output

pytest.importorskip("build", reason="`build` is not installed: the dev extra carries it (make test installs it)")

CORPUS = "meshtrain/data/assets/tinyshakespeare.txt.gz"
BPE_RANKS = "meshtrain/data/assets/gpt2.tiktoken.gz"
GPU_CURVES = "meshtrain/plan/data/h100_curves.json"  # the planner's measured H100 rates (plan/machines.py)
MODELS = ("gpt", "llama", "vit")


@dataclass
class Built:
    checkout: Path  # the clean copy the packages were built from
    wheel: Path
    sdist: Path
    version: str  # the wheel's own Version: field


@dataclass
class Installed:
    venv: Path
    python: Path
    env: dict[str, str]
    cwd: Path  # outside the repository, so nothing is imported from the checkout by accident


def run(argv: list, *, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run argv, which must succeed; a failure shows the end of its output."""
    __tracebackhide__ = True
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{output(proc)[-4000:]}"
    return proc


def clean_checkout(to: Path) -> Path:
    """The files git knows, tracked or new but not ignored, copied to `to`: a build/ or *.egg-info left in the
    working tree by an earlier build must not leak into the packages."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():  # tracked files deleted in the working tree are still listed
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)
    return to


def package_files(checkout: Path) -> set[str]:
    """Every file of the package in the checkout, as the wheel names it (meshtrain/...)."""
    root = checkout / "src"
    return {p.relative_to(root).as_posix() for p in (root / "meshtrain").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def preset_names(checkout: Path, model: str) -> list[str]:
    return sorted(p.stem for p in (checkout / f"src/meshtrain/models/{model}/presets").glob("*.yaml"))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    checkout = clean_checkout(tmp_path_factory.mktemp("checkout"))
    dist = tmp_path_factory.mktemp("dist")
    # Neither --sdist nor --wheel: build makes the sdist, then the wheel from the unpacked sdist, as pip does with a
    # release, so a file the sdist forgets is missing from the wheel too. --no-isolation: the build runs offline,
    # with this environment's setuptools and wheel (the dev extra).
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, checkout], cwd=checkout, env=clean_env(),
        timeout=300)
    (wheel,), (sdist,) = dist.glob("meshtrain-*.whl"), dist.glob("meshtrain-*.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        fields = archive.read(f"meshtrain-{wheel.name.split('-')[1]}.dist-info/METADATA").decode()
    version = re.search(r"^Version: (\S+)$", fields, re.MULTILINE)[1]
    return Built(checkout, wheel, sdist, version)


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Installed:
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    env = {k: v for k, v in clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1").items()
           if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    run([venv / "bin" / "pip", "install", "--no-deps", "--no-index", built.wheel], env=env)
    # torch, numpy, omegaconf ... lent by this environment, appended to the fresh one's path once the wheel is in
    # (pip would otherwise see the editable meshtrain here as installed). Only the directory is lent: the .pth files
    # in it, among them the editable install's pointer to the checkout's src/, are not read from a lent directory.
    fresh_site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          env=env).stdout.strip())
    (fresh_site / "lent-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return Installed(venv, python, env, tmp_path_factory.mktemp("elsewhere"))


def test_the_wheel_ships_every_file_of_the_package(built):
    with zipfile.ZipFile(built.wheel) as archive:
        shipped = set(archive.namelist())
    # What prepare and the presets read at run time, named so that a moved or unlisted file fails here by name.
    presets = {model: preset_names(built.checkout, model) for model in MODELS}
    assert all(presets.values()), f"a model without presets: {presets}"
    data = {CORPUS, BPE_RANKS, GPU_CURVES} | {f"meshtrain/models/{model}/presets/{name}.yaml"
                                  for model, names in presets.items() for name in names}
    assert not data - shipped, f"data files missing from the wheel: {sorted(data - shipped)}"
    assert not package_files(built.checkout) - shipped, \
        f"files of the package missing from the wheel: {sorted(package_files(built.checkout) - shipped)}"


def test_the_sdist_holds_the_sources_and_the_project_documents(built):
    with tarfile.open(built.sdist) as archive:
        held = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    documents = {"README.md", "CHANGELOG.md", "pyproject.toml"} | {p.name for p in built.checkout.glob("LICEN[CS]E*")}
    assert not documents - held, f"missing from the sdist: {sorted(documents - held)}"
    sources = {f"src/{name}" for name in package_files(built.checkout)}
    assert not sources - held, f"package files missing from the sdist: {sorted(sources - held)}"


def test_the_version_is_written_once(built):
    import meshtrain

    # pyproject.toml reads it from meshtrain.__version__, which the wheel's metadata and name must carry.
    assert built.version == meshtrain.__version__
    assert built.wheel.name == f"meshtrain-{built.version}-py3-none-any.whl"


def test_the_fresh_environment_runs_the_wheel_not_the_checkout(installed, built):
    probe = ("import json, sysconfig, meshtrain; from meshtrain import config; from meshtrain.plan import machines; "
             "print(json.dumps({'file': meshtrain.__file__, 'site': sysconfig.get_paths()['purelib'], "
             f"'presets': {{m: config.presets(m) for m in {MODELS!r}}}, "
             "'curves': sorted(machines.shipped_curves()['gemm'])}))")
    found = json.loads(run([installed.python, "-c", probe], env=installed.env, cwd=installed.cwd).stdout)
    assert Path(found["file"]).is_relative_to(found["site"]), f"meshtrain imported from {found['file']}"
    # The presets are found beside the installed models, so `train ... preset=NAME` works from the wheel.
    assert found["presets"] == {model: preset_names(built.checkout, model) for model in MODELS}
    assert found["curves"] == ["bf16", "fp32", "tf32"]  # the planner's GPU curves, read from the installed package


def test_version_names_the_wheel_and_torch(installed, built):
    for argv in ([installed.venv / "bin" / "meshtrain", "--version"], [installed.python, "-m", "meshtrain", "--version"]):
        out = run(argv, env=installed.env, cwd=installed.cwd)
        assert out.stdout.strip() == f"meshtrain {built.version} (torch {metadata.version('torch')})"


def test_test_dist_passes_on_two_ranks(installed):
    # The torchrun that users type (`torchrun -m meshtrain test-dist`), run by the fresh interpreter: its ranks import
    # the installed meshtrain, and DDP over gloo must leave them with bit-identical parameters.
    out = run([installed.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "meshtrain",
               "test-dist", "--iters", "3"], env=installed.env, cwd=installed.cwd)
    text = output(out)
    assert re.search(r"│ world_size\s+│ 2\s", text), text[-3000:]
    assert "test-dist passed: 2 rank(s) on 1 node(s) hold bit-identical parameters after 3" in text, text[-3000:]
    assert len(re.findall(r"iter=\d+ loss=", text)) == 3, "rank 0 logs each iteration once"


@pytest.mark.parametrize("dataset, facts, train_tokens, val_tokens", [
    ("shakespeare_char", ["length of dataset in characters: 1,115,394", "vocab size: 65"], 1_003_854, 111_540),
    ("shakespeare", ["vocab size: 50,257"], 301_966, 36_059),  # the BPE ranks shipped beside the corpus
])
def test_prepare_reads_the_data_in_the_wheel(installed, tmp_path, dataset, facts, train_tokens, val_tokens):
    out = run([installed.venv / "bin" / "meshtrain", "prepare", dataset, "--data-root", tmp_path / "data"],
              env=installed.env, cwd=installed.cwd)
    text = output(out)
    for fact in [*facts, f"train has {train_tokens:,} tokens", f"val has {val_tokens:,} tokens"]:
        assert fact in text, text
    written = tmp_path / "data" / dataset
    # uint16 tokens: two bytes each.
    assert (written / "train.bin").stat().st_size == 2 * train_tokens
    assert (written / "val.bin").stat().st_size == 2 * val_tokens
    assert json.loads((written / "meta.json").read_text())["name"] == dataset
