"""`meshtrain plan`'s predictions against runs on this machine: GPT and ViT layouts side by side, the errors the
planner promises (states exact, peak within 15%, step time MdAPE <= 25%, Spearman >= 0.8), in one table.

    python benchmarks/plan_validation.py                        # 12 GPT + 6 ViT layouts on 4 ranks
    python benchmarks/plan_validation.py --ranks 8 --gpt 6 --vit 0

Each layout runs as its own torchrun job (plan/measured/measure.py: the Trainer's own step; CPU peaks from the profiler's
allocation events). The machine's fixed costs are calibrated first on a tiny GPT and a tiny ViT (plan/measured/calibrate.py), cached;
nothing is fitted to the runs scored here. The ViT needs `meshtrain prepare era5-synthetic`, the GPT
`meshtrain prepare shakespeare_char`.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from meshtrain import config as config_mod
from meshtrain.commands import plan as plan_command
from meshtrain.plan import search
from meshtrain.plan.cost import kinds_of, predict
from meshtrain.plan.measured import calibrate, validate
from meshtrain.plan.measured.this_machine import this_machine
from meshtrain.plan.workload import ModelFacts
from meshtrain.runtime.log import configure_logging, print_rich

WORKLOADS = {  # model -> its overrides: the CPU presets, fp32 (this box may have no bf16 units), no dropout
    "gpt": ["preset=cpu", "train.dtype=fp32", "model.dropout=0.0"],
    "vit": ["preset=tiny", "train.dtype=fp32", "data.global_batch_size=16"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--gpt", type=int, default=12, help="GPT layouts to run")
    parser.add_argument("--vit", type=int, default=6, help="ViT layouts to run")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    configure_logging()
    chosen = {}
    for model, count in (("gpt", args.gpt), ("vit", args.vit)):
        if count:
            cfg = config_mod.load_config(WORKLOADS[model], model)
            ranked, _ = search.search(cfg, 1, args.ranks, this_machine(args.ranks, model=model))
            chosen[model] = (cfg, plan_command.spread(ranked, count))
    for model, (cfg, layouts) in chosen.items():
        kinds = sorted({k for c in layouts for k in kinds_of(c.cfg, c.dims)})
        calibrate.calibrate(args.ranks, kinds, model, cfg.data.root)
    every = []
    for model, (cfg, layouts) in chosen.items():
        machine, facts = this_machine(args.ranks, model=model), ModelFacts.of(cfg)
        layouts = [replace(c, cost=predict(facts, c.cfg, c.dims, machine)) for c in layouts]
        checks = validate.run(model, WORKLOADS[model], layouts, args.ranks, steps=args.steps,
                              progress=lambda c: print(f"measured {c.candidate.label}", flush=True))
        print_rich(plan_command.validation_table(checks))
        print(f"{model}: {validate.summary(checks)}")
        every += checks
    print(f"all {args.ranks}-rank layouts: {validate.summary(every)}")


if __name__ == "__main__":
    main()
