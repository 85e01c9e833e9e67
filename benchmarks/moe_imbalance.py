"""How unevenly a mixture of experts' router loads the expert-parallel ranks: the rows the busiest rank of an ep group
would receive over the mean (what `meshtrain plan --expert-imbalance` assumes), measured on one process by routing
real batches through the model and summing its layers' tallies per ep slice of the experts.

    python benchmarks/moe_imbalance.py --data-root data                      # the cpu preset, untrained
    python benchmarks/moe_imbalance.py --data-root data --checkpoint outputs/runs/moe/ddp/.../checkpoints/...

Each draw gives every one of ep ranks its own batch (model.batch_size samples); the figure of a draw is the largest
busiest-over-mean of the MoE layers; the median and the largest of the draws are printed per ep.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import torch

from meshtrain import config as config_mod
from meshtrain import registry


def draw(model, data: np.ndarray, ep: int, batch: int, tokens: int, rng) -> float:
    """Busiest ep rank's rows over the mean, the largest over the MoE layers, for one batch per rank."""
    load = 0
    for _ in range(ep):
        starts = rng.integers(0, len(data) - tokens - 1, batch)
        x = torch.from_numpy(np.stack([data[s:s + tokens].astype(np.int64) for s in starts]))
        for moe in model.moe_layers():
            moe.tally.reset()
        with torch.no_grad():
            model(x)
        load = load + torch.stack([moe.tally.assigned for moe in model.moe_layers()])  # [layers, experts]
    per_rank = load.view(load.shape[0], ep, -1).sum(-1).float()  # the rows each ep rank's experts take
    return (per_rank.max(dim=1).values / per_rank.mean(dim=1)).max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", default=["preset=cpu"])
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--checkpoint", default=None, help="a model.pt from `meshtrain export` (default: untrained)")
    parser.add_argument("--draws", type=int, default=10)
    args = parser.parse_args()
    cfg = config_mod.load_config([*args.overrides, f"data.root={args.data_root}"], "moe")
    spec = registry.get("moe")
    torch.manual_seed(0)
    model = spec.build_model(cfg, spec.data_facts(cfg)).eval()
    if args.checkpoint:
        model.load_state_dict(torch.load(args.checkpoint, map_location="cpu", weights_only=True)["model"])
    data = np.memmap(Path(args.data_root) / cfg.data.name / "train.bin", dtype=np.uint16, mode="r")
    rng = np.random.default_rng(0)
    for ep in (e for e in (2, 4, 8, 16) if cfg.model.n_experts % e == 0):
        ratios = [draw(model, data, ep, cfg.model.batch_size, cfg.model.block_size, rng) for _ in range(args.draws)]
        print(f"ep {ep:>2}: busiest rank / mean, median {statistics.median(ratios):.3f}, largest {max(ratios):.3f} "
              f"({args.draws} draws of {cfg.model.batch_size} × {cfg.model.block_size} tokens a rank)")


if __name__ == "__main__":
    main()
