"""Each data-parallel backend trains like one process on the whole batch, and shards what it says it does."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import REPO, clean_env, output

CHECK = str(Path(__file__).with_name("data_parallel_check.py"))
HOLDS = re.compile(r"(\w+) rank (\d+) holds params=(\d+)/(\d+) grads=(\d+)/(\d+) optimizer=(\d+)/(\d+)")

# backend, ranks, extra flags, which of params/grads/optimizer are sharded over how many ranks
CASES = [
    ("ddp", 2, [], {}),
    ("ddp", 4, [], {}),
    ("zero1", 2, [], {"optimizer": 2}),
    ("zero2", 2, [], {"params": 2, "grads": 2, "optimizer": 2}),
    ("fsdp", 2, [], {"params": 2, "grads": 2, "optimizer": 2}),
    ("zero3", 4, [], {"params": 4, "grads": 4, "optimizer": 4}),
    ("fsdp", 2, ["--cpu-offload"], {"params": 2, "grads": 2, "optimizer": 2}),
    ("hsdp", 4, [], {"params": 2, "grads": 2, "optimizer": 2}),  # 2 replicas x 2 shards
    ("fsdp", 2, ["--ac=full"], {"params": 2, "grads": 2, "optimizer": 2}),  # activation checkpointing composes
]


@pytest.mark.parametrize("backend,ranks,flags,sharded", CASES,
                         ids=[f"{c[0]}{''.join(c[2])}-{c[1]}ranks" for c in CASES])
def test_backend_equals_one_process_and_shards_as_promised(backend, ranks, flags, sharded):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", CHECK,
           backend, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=180)
    text = output(out)
    assert out.returncode == 0, text[-3000:]
    assert text.count("-> EQUAL") == ranks, "loss, gradients and parameters within 1e-5 of one process"
    held = {int(m[2]): dict(zip(("params", "grads", "optimizer"),
                                [(int(m[i]), int(m[i + 1])) for i in (3, 5, 7)], strict=True))
            for m in HOLDS.finditer(text)}
    assert sorted(held) == list(range(ranks))
    for kind in ("params", "grads", "optimizer"):
        whole = held[0][kind][1]
        mine = [held[r][kind][0] for r in range(ranks)]
        shards = sharded.get(kind, 1)
        if shards == 1:
            assert mine == [whole] * ranks, f"{kind} are replicated under {backend}"
        else:  # the shards of one replica partition the whole exactly, about 1/shards each
            for replica in range(ranks // shards):
                group = mine[replica * shards:(replica + 1) * shards]
                assert sum(group) == whole, f"{kind} shards of replica {replica} sum to the whole"
            assert max(mine) <= whole / shards * 1.05, f"each rank holds about 1/{shards} of the {kind}"
