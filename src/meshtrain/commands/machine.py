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
import json
import subprocess
import sys

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


def _gib(n: int | None) -> str:
    return "—" if not n else f"{n / 2**30:.1f} GiB"


def tables(p: dict) -> list:
    """The profile `survey.collect` returns, as rich tables: the device, matmul peaks, the planner's rates by shape
    (CUDA), and one table per recorded set-up of collectives."""
    out = [_device_table(p), _peaks_table(p)]
    if "curves" in p:
        out.append(_rates_table(p))
    return out + _collectives_tables(p)


def _device_table(p: dict):
    import torch
    from rich.table import Table

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
    return head


def _peaks_table(p: dict):
    from rich.table import Table

    from meshtrain.machine.profile import format_flops

    peaks = Table(title="matmul peak per dtype (best of several timings; MFU uses the datasheet figure where "
                        "there is one; others' cores: what other processes used meanwhile)", title_justify="left")
    for column in ("dtype", "measured", "× fp32", "datasheet", "n", "spread", "measured at", "others' cores"):
        peaks.add_column(column, justify="left" if column in ("dtype", "measured at") else "right")
    fp32 = p["matmul"]["fp32"]["measured"]["flops"]
    for label, figures in p["matmul"].items():
        m = figures["measured"]
        peaks.add_row(label, format_flops(m["flops"]), f"{m['flops'] / fp32:.3g}",
                      format_flops(figures["datasheet"]) if figures["datasheet"] else "—", f"{m['n']}²",
                      f"{m['spread']:.0%}", m["measured"],
                      f"{m.get('others_cores', '?')}{' (busy)' if m.get('busy') else ''}")
    return peaks


def _rates_table(p: dict):
    from rich.table import Table

    from meshtrain.machine.profile import format_flops

    rates = Table(title=f"rates by shape for the planner (measured {p['curves']['measured']})", title_justify="left")
    for column in ("kernel", "dtype", "shapes", "lowest", "highest", "at"):
        rates.add_column(column, justify="left" if column in ("kernel", "dtype", "at") else "right")
    for kernel, what in (("gemm", "m × k × n"), ("sdpa", "T, head_dim, causal")):
        for label, rows in p["curves"][kernel].items():
            best = max(rows, key=lambda row: row[-1])
            rates.add_row(kernel, label, str(len(rows)), format_flops(min(row[-1] for row in rows)),
                          format_flops(best[-1]), f"{what} = {', '.join(map(str, best[:-1]))}")
    return rates


def _collectives_tables(p: dict) -> list:
    from rich.table import Table

    from meshtrain.runtime.collectives import human_bytes

    out = []
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
    # Imported here: the measuring modules, which `meshtrain machine --help` does without.
    import torch

    from meshtrain.machine.survey import collect
    from meshtrain.runtime.device import pick_device

    device = pick_device(0, args.device)
    if args.json:  # stdout is the JSON alone; log lines go to stderr
        configure_logging(stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ranks:
        _bench_collectives(args.ranks, args.max_bytes, quiet=args.json)
    p = collect(device, refresh=args.refresh)
    if args.json:
        print(json.dumps(p, indent=1, sort_keys=True))
    else:
        for table in tables(p):
            print_rich(table)
    return 0


def _bench_collectives(ranks: int, max_bytes: str, quiet: bool) -> None:
    """`collectives --bench --record` on `ranks` ranks under this machine's launcher: the profile gains their
    figures (its output on stderr when `quiet`, so that stdout stays the JSON alone)."""
    from meshtrain.runtime.launch import build_command

    argv = build_command(["python", "-m", "meshtrain", "collectives", "--bench", "--record",
                          "--max-bytes", max_bytes], nproc=ranks)
    log.info("collective bandwidth on %d ranks: %s", ranks, " ".join(argv))
    done = subprocess.run(argv, stdout=sys.stderr if quiet else None)
    if done.returncode:
        log.error("the collectives bench failed (exit %d); the profile below has no new collective figures",
                  done.returncode)
