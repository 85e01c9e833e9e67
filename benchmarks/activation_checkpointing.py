"""Activation checkpointing's four modes side by side: peak tensor bytes and step time of none, selective, full and op.

    python benchmarks/activation_checkpointing.py                     # the GPT cpu preset, one process
    python benchmarks/activation_checkpointing.py --rounds 5 model.batch_size=32

One process, the trainer's own step (plan/measured/measure.py's `measure`: warm-up steps, then one step's peak by
TensorBytes, the tensors' own bytes, and the median of --steps steps' times). The modes alternate round by round, so a
drift in the machine's speed falls on all of them alike; a mode's time is the median over rounds. Beside the measured
peak, the planner's (plan/cost.predict_peak) and its error.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import statistics
import tempfile
from dataclasses import replace

from train_runs import prepared

from meshtrain.machine.precision import choose
from meshtrain.parallel.checkpointing import MODES
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.plan import machines, systems
from meshtrain.plan.cost import predict_peak
from meshtrain.plan.measured import measure
from meshtrain.plan.workload import ModelFacts
from meshtrain.runtime.setup import distributed

ORDER = ("none", "selective", "full", "op")
assert set(ORDER) == set(MODES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="config overrides after preset=cpu (dotted key=value)")
    parser.add_argument("--data-root", help="where shakespeare_char is prepared (default: a temporary directory)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode and round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshtrain-ac-") as scratch:
        root = args.data_root or str(prepared(scratch))
        base = ["preset=cpu", f"data.root={root}", *args.overrides]
        # train.dtype=auto resolved as the trainer resolves it here, so that the planner prices the same run
        dtype = choose(measure.run_config("gpt", base, scratch).train.dtype, "cpu").dtype
        configs = {mode: measure.run_config("gpt", [*base, f"train.dtype={dtype}",
                                                    f"train.activation_checkpointing={mode}"], f"{scratch}/{mode}")
                   for mode in ORDER}
        peaks, times = {}, {mode: [] for mode in ORDER}
        logging.disable(logging.INFO)  # the set-up's table, the trainer's start-up lines, once per mode and round
        with contextlib.redirect_stdout(io.StringIO()), distributed() as info:
            for _ in range(args.rounds):
                for mode, cfg in configs.items():
                    found = measure.measure(cfg, info, warmup=2, steps=args.steps)
                    peaks[mode] = found["peak"]  # the same every round: the tensors of one step
                    times[mode].append(found["step_s"])
    print(f"GPT preset=cpu {' '.join(args.overrides)} train.dtype={dtype}, one process, {args.rounds} rounds of "
          f"{args.steps} steps per mode")
    _print_table(configs, peaks, {mode: statistics.median(t) for mode, t in times.items()})


def _print_table(configs: dict, peaks: dict[str, int], step_s: dict[str, float]) -> None:
    cpu = replace(machines.from_system(systems.get("polaris")), cpu=True)  # of a machine, the peak reads only this
    print("| mode | peak MB (measured) | peak MB (planner) | planner error | step ms | step vs none |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, cfg in configs.items():
        predicted = predict_peak(ModelFacts.of(cfg), cfg, ParallelDims.from_config(cfg, 1, 1), cpu)
        print(f"| {mode} | {peaks[mode] / 1e6:.2f} | {predicted / 1e6:.2f} | {predicted / peaks[mode] - 1:+.1%} | "
              f"{step_s[mode] * 1e3:.1f} | {step_s[mode] / step_s['none']:.2f}× |")


if __name__ == "__main__":
    main()
