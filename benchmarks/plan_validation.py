"""`meshtrain plan`'s predictions against runs on this machine: GPT and ViT layouts side by side, in each dtype
asked for, the errors the planner promises (states exact, peak within 10%, step time MdAPE <= 15%, Spearman >= 0.8,
regret <= 5%) in one table per model and dtype, and a summary line each.

    python benchmarks/plan_validation.py                        # 12 GPT + 6 ViT layouts on 4 ranks, fp32 and auto
    python benchmarks/plan_validation.py --dtypes bf16 --gpt 6 --vit 0
    python benchmarks/plan_validation.py --ranks 8 --gpt 6 --vit 0

`auto` is what train.dtype=auto picks on this machine (bf16 where the CPU computes it at least as fast as fp32, else
fp32), as a user's run would. Each layout runs under torchrun (plan/measured/measure.py: the Trainer's own step; CPU
peaks counted from the tensors' own storages): on a CPU the layouts of each repeat in one job, on a GPU a job each.
The machine's fixed costs are calibrated first (plan/measured/calibrate.py, cached); nothing is fitted to the runs
scored here. The layout parallel.plan=auto would train is always among those run, so its regret is measured too. The
ViT needs `meshtrain prepare era5-synthetic`, the GPT `meshtrain prepare shakespeare_char`.
"""

from __future__ import annotations

import argparse

from meshtrain import config as config_mod
from meshtrain.commands import plan as plan_command
from meshtrain.plan import search
from meshtrain.plan.measured import fixed_costs, validate
from meshtrain.plan.measured.this_machine import this_machine
from meshtrain.runtime.log import configure_logging, print_rich

WORKLOADS = {  # model -> its overrides: the CPU presets, no dropout
    "gpt": ["preset=cpu", "model.dropout=0.0"],
    "vit": ["preset=tiny", "data.global_batch_size=16"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--gpt", type=int, default=12, help="GPT layouts to run")
    parser.add_argument("--vit", type=int, default=6, help="ViT layouts to run")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtypes", default="fp32,auto", help="comma-separated: fp32, bf16, auto")
    parser.add_argument("--recalibrate", action="store_true",
                        help="measure the fixed costs and the slowdown again, not the cached ones (as plan's)")
    args = parser.parse_args()
    configure_logging()
    summaries, recalibrated = [], set()
    for dtype in args.dtypes.split(","):
        resolved = plan_command._auto_dtype() if dtype == "auto" else dtype
        every = []
        for model, count in (("gpt", args.gpt), ("vit", args.vit)):
            if not count:
                continue
            overrides = [*WORKLOADS[model], f"train.dtype={resolved}"]
            cfg = config_mod.load_config(overrides, model)
            if args.recalibrate and (model, resolved) not in recalibrated:
                fixed_costs.forget(args.ranks, model, resolved)
                recalibrated.add((model, resolved))
            machine = lambda model=model: this_machine(args.ranks, model=model)  # noqa: E731
            ranked, _ = search.search(cfg, 1, args.ranks, machine())
            checks, auto = validate.validate_plan(model, overrides, cfg, ranked, count, 1, args.ranks, machine,
                                                  steps=args.steps)
            print_rich(plan_command.validation_table(checks, f"{model}, {resolved}: "))
            summaries.append(f"{model} {resolved}: {validate.summary(checks, auto)}")
            print(summaries[-1], flush=True)
            every += checks
        summaries.append(f"all {args.ranks}-rank layouts, {resolved}: {validate.summary(every)}")
        print(summaries[-1], flush=True)
    print("\n".join(summaries))


if __name__ == "__main__":
    main()
