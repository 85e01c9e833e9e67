"""`meshtrain machine`: measure (once) and print what this machine can do.

    meshtrain machine                    the profile of this device at torch's thread count
    meshtrain machine --threads 1        ... at the threads one of several ranks gets
    meshtrain machine --refresh          measure again and keep the new figures
    meshtrain machine --ranks 4          also collective bandwidth on 4 ranks, through this machine's launcher
    meshtrain machine --json             the same as JSON, for scripts and cost models

On a CUDA GPU the profile also holds the planner's rate tables: GEMM FLOP/s by shape and attention (SDPA) by
sequence length (`meshtrain plan --system this` reads them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import torch

from meshtrain.machine import datasheet, profile
from meshtrain.machine.hardware import Hardware, describe
from meshtrain.machine.precision import auto_dtype
from meshtrain.runtime.log import configure_logging, get_logger, print_rich

log = get_logger("machine")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: $MESHTRAIN_DEVICE or auto)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads to measure with (default: torch's, i.e. every core; a rank of a job "
                             "gets cores / ranks per node)")
    parser.add_argument("--refresh", action="store_true", help="measure again and keep the new figures")
    parser.add_argument("--ranks", type=int, default=None,
                        help="also measure collective bandwidth on this many ranks (runs `collectives --bench "
                             "--record` under the launcher `meshtrain launch` would use here)")
    parser.add_argument("--max-bytes", default="64M", help="largest collective message with --ranks (default 64M)")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON instead of tables")


def dtypes_for(hw: Hardware) -> list[str]:
    """The matmul dtypes worth a figure on this device: tf32 only where fp32 can run on tensor cores."""
    labels = ["fp32", "tf32", "bf16", "fp16"] if hw.kind == "cuda" and hw.bf16 else ["fp32", "bf16", "fp16"]
    return labels if hw.kind != "mps" or hw.bf16 else ["fp32", "fp16"]


def collect(device: torch.device, refresh: bool = False) -> dict:
    """The profile of `device` at this process's thread count, measuring what the cache lacks."""
    hw = describe(device)
    entry = datasheet.match_device(hw.name) if hw.kind != "cpu" else None
    matmul = {}
    for label in dtypes_for(hw):
        peak = profile.datasheet_peak(device, label)
        matmul[label] = {"measured": profile.measured(device, label, refresh=refresh),
                         "datasheet": peak.flops if peak else None}
    auto = auto_dtype(hw)
    data = profile.read_cache()
    collectives = {key: value for key, value in data.get("collectives", {}).items()
                   if key.split("|")[1:3] == [hw.kind, hw.name]}
    p = {"key": profile.profile_key(hw, profile.threads_of(device)),
         "hardware": dataclasses.asdict(hw),
         "datasheet": entry.name if entry else None, "auto_dtype": {"dtype": auto.dtype, "reason": auto.reason},
         "matmul": matmul, "memory": profile.measured(device, "memory", refresh=refresh),
         "collectives": collectives, "cache": str(profile.cache_path())}
    if hw.kind == "cuda":
        p["curves"] = profile.curves(device, refresh=refresh)
    return p


def _gib(n: int | None) -> str:
    return "—" if not n else f"{n / 2**30:.1f} GiB"


def tables(p: dict) -> list:
    from rich.table import Table

    from meshtrain.runtime.collectives import human_bytes

    hw, mem = p["hardware"], p["memory"]
    head = Table(title=f"machine profile: {hw['name']} ({hw['kind']})", title_justify="left", show_header=False)
    head.add_column(style="bold")
    head.add_column()
    threads = p["matmul"]["fp32"]["measured"]["threads"]
    head.add_row("device", f"{hw['kind']}: {hw['name']}; {hw['cores']} cores usable, measured with {threads} "
                           f"thread{'s' * (threads != 1)}; torch {torch.__version__}")
    isa = hw["isa"] + (f"; flags: {' '.join(hw['features'])}" if hw["features"] else "")
    head.add_row("instruction set", isa + (f"; capped by {', '.join(hw['caps'])}" if hw["caps"] else ""))
    head.add_row("bf16", f"{'native' if hw['bf16'] else 'emulated through fp32'}: {hw['why_bf16']}")
    head.add_row("train.dtype=auto", f"{p['auto_dtype']['dtype']} ({p['auto_dtype']['reason']})")
    head.add_row("memory", f"host {_gib(hw['host_memory_bytes'])}" +
                 (f", device {_gib(hw['device_memory_bytes'])}" if hw["device_memory_bytes"] else ""))
    head.add_row("memory bandwidth", f"{mem['gbs']:.4g} GB/s (copy of {mem['bytes'] >> 20} MiB, read + write, "
                                     f"spread {mem['spread']:.0%}, measured {mem['measured']})")
    if p["datasheet"]:
        head.add_row("datasheet", p["datasheet"])
    head.add_row("cache", p["cache"])

    peaks = Table(title="matmul peak per dtype (best of several timings; MFU uses the datasheet figure where "
                        "there is one; others' cores: what other processes used meanwhile)", title_justify="left")
    for column in ("dtype", "measured", "× fp32", "datasheet", "n", "spread", "measured at", "others' cores"):
        peaks.add_column(column, justify="left" if column in ("dtype", "measured at") else "right")
    fp32 = p["matmul"]["fp32"]["measured"]["flops"]
    for label, figures in p["matmul"].items():
        m = figures["measured"]
        peaks.add_row(label, profile.format_flops(m["flops"]), f"{m['flops'] / fp32:.3g}",
                      profile.format_flops(figures["datasheet"]) if figures["datasheet"] else "—", f"{m['n']}²",
                      f"{m['spread']:.0%}", m["measured"],
                      f"{m.get('others_cores', '?')}{' (busy)' if m.get('busy') else ''}")
    out = [head, peaks]
    if "curves" in p:
        rates = Table(title=f"rates by shape for the planner (measured {p['curves']['measured']})",
                      title_justify="left")
        for column in ("kernel", "dtype", "shapes", "lowest", "highest", "at"):
            rates.add_column(column, justify="left" if column in ("kernel", "dtype", "at") else "right")
        for kernel, what in (("gemm", "m × k × n"), ("sdpa", "T, head_dim, causal")):
            for label, rows in p["curves"][kernel].items():
                best = max(rows, key=lambda row: row[-1])
                rates.add_row(kernel, label, str(len(rows)), profile.format_flops(min(row[-1] for row in rows)),
                              profile.format_flops(best[-1]), f"{what} = {', '.join(map(str, best[:-1]))}")
        out.append(rates)
    for key, entry in p["collectives"].items():
        table = Table(title=f"collectives {key} (measured {entry['measured']})", title_justify="left")
        for column in ("op", "latency (us)", "peak busbw (GB/s)", "at size"):
            table.add_column(column, justify="left" if column == "op" else "right")
        for op, fig in entry["ops"].items():
            table.add_row(op, f"{fig['latency_s'] * 1e6:.1f}", f"{fig['peak_busbw_gbs']:.4g}",
                          human_bytes(fig["peak_at_bytes"]))
        out.append(table)
    return out


def run(args: argparse.Namespace) -> int:
    from meshtrain.runtime.device import pick_device

    device = pick_device(0, args.device)
    if args.json:  # stdout is the JSON alone; log lines go to stderr
        configure_logging(stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ranks:
        from meshtrain.runtime.launch import build_command

        argv = build_command(["python", "-m", "meshtrain", "collectives", "--bench", "--record",
                              "--max-bytes", args.max_bytes], nproc=args.ranks)
        log.info("collective bandwidth on %d ranks: %s", args.ranks, " ".join(argv))
        done = subprocess.run(argv, stdout=sys.stderr if args.json else None)
        if done.returncode:
            log.error("the collectives bench failed (exit %d); the profile below has no new collective figures",
                      done.returncode)
    p = collect(device, refresh=args.refresh)
    if args.json:
        print(json.dumps(p, indent=1, sort_keys=True))
    else:
        for table in tables(p):
            print_rich(table)
    return 0
