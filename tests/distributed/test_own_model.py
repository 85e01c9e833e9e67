"""A model of one's own, as docs/models.md writes it, trains through `meshtrain train package.module:SPEC` on one
process and on two ranks under fsdp × tp, and its run samples: the page's code is run, so it cannot rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import REPO, clean_env, output, prepare_data, torchrun

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


def test_the_documented_model_trains_and_samples(package):
    env = clean_env(PYTHONPATH=f"{package}{':' + str(REPO / 'src')}")
    common = ["train", "mypackage.tiny:SPEC", "preset=cpu", f"data.root={package / 'data'}"]
    one = subprocess.run([sys.executable, "-m", "meshtrain", *common, f"train.out_dir={package / 'one'}"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert one.returncode == 0, output(one)[-3000:]
    evals = [float(v) for v in re.findall(r"val_loss=([0-9.]+)", output(one))]
    assert len(evals) == 3 and evals[-1] < evals[0] - 0.5, evals
    run_dir = (package / "one" / "tiny" / "ddp" / "latest").resolve()
    sample = subprocess.run([sys.executable, "-m", "meshtrain", "sample", "--run", str(run_dir), "--prompt", "ROMEO:",
                             "--max-new-tokens", "10"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert sample.returncode == 0 and sample.stdout.startswith("ROMEO:"), output(sample)

    two = torchrun(2, *common, f"train.out_dir={package / 'two'}", "train.backend=fsdp", "parallel.tp=2",
                   "train.max_iters=10", timeout=300, env=env)
    assert two.returncode == 0, output(two)[-3000:]
    assert re.search(r"layout: fsdp over 2 rank\(s\) \([^)]*tp=2", output(two)), output(two)[-3000:]
