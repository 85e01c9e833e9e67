"""Bytes that cross between nodes, per layout: 2 nodes × 2 ranks in network namespaces (tests/netns.py; needs root),
a small GPT, the veth counters read as rank 0 logs iterations 4 and 14.

    python benchmarks/cross_node_bytes.py

Prints per layout the bytes per iteration that left a node, and that figure over the model's parameter bytes. The
order string decides what crosses: with tp named first, a node holds whole tensor-parallel groups and only data
parallelism's (or the pipeline's) traffic crosses.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import clean_env, prepare_data  # noqa: E402
from tests.netns import Cluster, why_not  # noqa: E402

GPT = ["model.n_layer=2", "model.n_head=4", "model.n_embd=64", "model.block_size=64", "model.dropout=0.0",
       "model.batch_size=16", "train.eval_iters=1", "train.dtype=fp32", "train.log_interval=1",
       "train.max_iters=14", "train.eval_interval=1000", "train.save_checkpoints=false"]
LAYOUTS = {
    "ddp dp4": ["train.backend=ddp"],
    "fsdp dp4": ["train.backend=fsdp"],
    "hsdp 2×2 (shards in a node)": ["train.backend=hsdp", "parallel.dp_replicate=2"],
    "fsdp dp2 × tp2, tp in a node": ["train.backend=fsdp", "parallel.tp=2", "parallel.order=tp-cp-dp-pp"],
    "tp2 × pp2, tp in a node": ["parallel.tp=2", "parallel.pp=2", "parallel.order=tp-cp-dp-pp"],
    "tp2 × pp2, tp across nodes": ["parallel.tp=2", "parallel.pp=2", "parallel.order=pp-cp-dp-tp"],
}


def measure(cluster: Cluster, name: str, layout: list[str], data_root: Path, out_dir: Path) -> float:
    """Bytes per iteration crossing between the nodes."""
    args = ["train", "gpt", *GPT, *layout, f"data.root={data_root}", f"train.out_dir={out_dir}"]
    jobs = [cluster.torchrun(node, re.sub(r"\W", "", name), args, clean_env(MESHTRAIN_TIMEOUT="120"), REPO)
            for node in (0, 1)]
    text, sent = cluster.sent_at_steps(jobs[0], {4, 14})
    jobs[1].communicate()
    if any(job.returncode for job in jobs) or len(sent) < 2:
        raise SystemExit(f"{name}: the job failed\n{text[-3000:]}")
    return (sent[14] - sent[4]) / 10


def parameter_bytes(data_root: Path) -> int:
    from meshtrain.config import load_config
    from meshtrain.plan.workload import ModelFacts

    return ModelFacts.of(load_config([*GPT, f"data.root={data_root}"], "gpt")).num_params * 4


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    reason = why_not()
    if reason:
        raise SystemExit(f"cannot make nodes here: {reason}")
    with tempfile.TemporaryDirectory() as tmp, Cluster(2) as cluster:
        data_root = prepare_data(Path(tmp) / "data")
        param_bytes = parameter_bytes(data_root)
        print(f"the model: {param_bytes / 1024:.1f} KiB of fp32 parameters")
        print(f"{'layout (2 nodes × 2 ranks)':<32} {'KiB/iteration across':>21} {'× parameter bytes':>18}")
        for name, layout in LAYOUTS.items():
            per_iteration = measure(cluster, name, layout, data_root, Path(tmp) / "out")
            print(f"{name:<32} {per_iteration / 1024:>21.1f} {per_iteration / param_bytes:>18.2f}", flush=True)


if __name__ == "__main__":
    main()
