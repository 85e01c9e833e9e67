"""A model of one's own, as docs/models.md writes it, trains by path with the page's own command lines (`meshtrain
train mypackage.tiny:SPEC` in the package's folder, nothing installed; torchrun on four ranks under fsdp × tp), and
its run samples: the page's code and commands are run, so they cannot rot."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tests import preloaded
from tests.conftest import REPO, clean_env, forked_cmd, output, prepare_data
from tests.distributed.test_docs_run import FORKED_TORCHRUN
from tests.unit.test_docs_links import command_lines

PRESET = """model: {n_layer: 2, n_head: 2, n_embd: 32, block_size: 32, batch_size: 4}
optimizer: {lr: 1.0e-3, min_lr: 1.0e-4, beta2: 0.99, warmup_iters: 5}
train: {max_iters: 30, eval_interval: 15, eval_iters: 4, log_interval: 5, dtype: fp32, sample_tokens: 8}
"""


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """mypackage/tiny.py from the page's code block, with a preset beside it."""
    root = tmp_path_factory.mktemp("own")
    code = re.search(r"```python\n(.*?)```", (REPO / "docs" / "models.md").read_text(), re.S).group(1)
    (root / "mypackage" / "presets").mkdir(parents=True)
    (root / "mypackage" / "__init__.py").write_text("")
    (root / "mypackage" / "tiny.py").write_text(code)
    (root / "mypackage" / "presets" / "cpu.yaml").write_text(PRESET)
    prepare_data(root / "data")
    return root


def page_commands() -> list[str]:
    """The page's command lines that train the package by path (its bash block), in page order."""
    return [line for line in command_lines((REPO / "docs" / "models.md").read_text()) if "mypackage.tiny:SPEC" in line]


def run_as_written(line: str, package: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`line` as a shell in the package's folder runs it (the venv's commands first on PATH, nothing on
    PYTHONPATH: the working directory is what finds the package), with `overrides` after the page's own. A torchrun
    line's ranks are forked (tests/forked_ranks.py: torch's own agent; each rank's sys.path[0] the working
    directory, as `python -m` sets it), not four fresh interpreters importing torch."""
    bin_dir = str(Path(sys.executable).parent)
    env = clean_env(PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)
    extra = [f"data.root={package / 'data'}", *overrides]
    if ranks := FORKED_TORCHRUN.match(line):  # as test_docs_run forks a documented torchrun line
        return preloaded.run(forked_cmd(int(ranks.group(1)), *shlex.split(line[ranks.end():]), *extra), env=env,
                             cwd=package, timeout=300)
    return subprocess.run([*shlex.split(line), *extra], capture_output=True, text=True, env=env, cwd=package,
                          timeout=300)


def test_the_documented_model_trains_and_samples(package):
    one_process, four_ranks = page_commands()
    assert one_process.startswith("meshtrain train ") and four_ranks.startswith("torchrun --nproc-per-node 4 ")
    one = run_as_written(one_process, package, f"train.out_dir={package / 'one'}", "train.max_iters=30")
    assert one.returncode == 0, output(one)[-3000:]
    evals = [float(v) for v in re.findall(r"val_loss=([0-9.]+)", output(one))]
    assert len(evals) == 3 and evals[-1] < evals[0] - 0.5, evals
    run_dir = (package / "one" / "tiny" / "ddp" / "latest").resolve()
    sample = preloaded.run([sys.executable, "-m", "meshtrain", "sample", "--run", str(run_dir), "--prompt", "ROMEO:",
                            "--max-new-tokens", "10"], env=clean_env(), cwd=package, timeout=120)
    assert sample.returncode == 0 and sample.stdout.startswith("ROMEO:"), output(sample)

    four = run_as_written(four_ranks, package, f"train.out_dir={package / 'four'}", "train.max_iters=10")
    assert four.returncode == 0, output(four)[-3000:]
    assert re.search(r"layout: fsdp over 4 rank\(s\) \([^)]*tp=2", output(four)), output(four)[-3000:]
