"""The tiny mixture of experts against a dense decoder of the same active parameters, on the same tokens, side by side.

    python benchmarks/moe_vs_dense.py                  # 4 ranks, 600 iterations each, char-level Shakespeare
    python benchmarks/moe_vs_dense.py --ranks 2 --iters 2000

Three runs of one length, one after the other on this machine, each on --ranks ranks with the same global batch:
  dense         `llama` shaped as the moe preset=cpu (4 layers, 64 wide, 4 heads over 2 key/value heads, block 64),
                its SwiGLU as wide as the MoE's active width averaged over the layers (--dense-hidden)
  moe ddp       `moe preset=cpu`: 8 experts of 128 hidden, top-2 + 1 shared, in layers 2-4; every rank holds all
  moe ep        the same model with parallel.ep=--ranks: each rank holds 8/ep experts, tokens move by all-to-all
Printed: parameters (total and active per token, non-embedding, as the start-up table counts them), median
tokens/s, the ratio to the dense run's, and the val loss at the end (the same tokens seen by all three).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from train_runs import prepared, run_train

# The moe preset=cpu's attention, data and optimizer (src/meshtrain/models/moe/presets/cpu.yaml), for the dense run.
SHAPE = ["model.n_layer=4", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=64", "model.block_size=64",
         "model.batch_size=12", "model.dropout=0.0", "data.name=shakespeare_char", "optimizer.lr=1.0e-3",
         "optimizer.min_lr=1.0e-4", "optimizer.beta2=0.99", "optimizer.warmup_iters=100"]
# Its active MLP width: the dense first layer's SwiGLU (192 = 8/3 × 64, rounded up to 64) and 3 MoE layers of
# (top-2 + 1 shared) × 128; the dense model spreads the same over its 4 layers: (192 + 3 × 384) / 4.
DENSE_HIDDEN = (192 + 3 * 384) // 4


def parameters(workload: str, overrides: list[str]) -> tuple[int, int]:
    """(total, active per token) non-embedding parameters of the model these overrides describe, built on meta."""
    import torch

    from meshtrain import config as config_mod
    from meshtrain import registry

    cfg = config_mod.load_config(overrides, workload)
    spec = registry.spec_of(cfg)
    with torch.device("meta"):
        model = spec.build_model(cfg, spec.data_facts(cfg))
    active = model.num_active_params() if hasattr(model, "num_active_params") else model.num_params()
    return model.num_params(), active


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iters", type=int, default=600)
    parser.add_argument("--dense-hidden", type=int, default=DENSE_HIDDEN)
    args = parser.parse_args()
    os.environ.setdefault("MESHTRAIN_DEVICE", "cpu")

    from rich.console import Console
    from rich.table import Table

    common = [f"train.max_iters={args.iters}", f"optimizer.lr_decay_iters={args.iters}", "train.eval_iters=20",
              f"train.eval_interval={args.iters}", "train.log_interval=10", "train.dtype=fp32"]
    runs = {"dense (llama)": ("llama", [*SHAPE, f"model.ffn_hidden={args.dense_hidden}"]),
            "moe, experts on every rank (ddp)": ("moe", ["preset=cpu"]),
            f"moe, experts over ep={args.ranks}": ("moe", ["preset=cpu", f"parallel.ep={args.ranks}"])}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_root = prepared(tmp)
        for name, (workload, overrides) in runs.items():
            run = run_train(workload, args.ranks, [*overrides, f"data.root={data_root}", *common])
            total, active = parameters(workload, [*overrides, f"data.root={data_root}"])
            rows.append((name, total, active, statistics.median(r["tps"] for r in run.steady(0.1)),
                         run.evals()[-1]["val_loss"], run.wall))

    dense_tps = rows[0][3]
    table = Table(title=f"{args.iters} iterations on {args.ranks} ranks ({os.cpu_count()} cores), fp32, the same "
                        "tokens", title_justify="left")
    for column in ("run", "params", "active/token", "tokens/s", "vs dense", "val loss", "wall s"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, total, active, tps, val, wall in rows:
        table.add_row(name, f"{total / 1e6:.3f}M", f"{active / 1e6:.3f}M", f"{tps:,.0f}", f"{tps / dense_tps:.2f}",
                      f"{val:.4f}", f"{wall:.1f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
