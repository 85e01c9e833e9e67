"""`meshtrain collectives --demo | --bench`: each collective at work on small tensors, checked against the analytic
answer, or its bandwidth per message size (runtime/collectives.py runs both); `--bench --record` keeps the figures
in the machine profile, where cost models read them."""

from __future__ import annotations

import argparse
import sys

# torch comes with these: only `meshtrain collectives` imports this module, and its options need the library's names.
import torch

from meshtrain.machine import profile
from meshtrain.runtime import collectives
from meshtrain.runtime.collectives import BENCH_OPS, DTYPES, OPTIONAL, parse_bytes
from meshtrain.runtime.log import get_logger
from meshtrain.runtime.setup import DistInfo, distributed

log = get_logger("collectives")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--demo", action="store_true", help="run every collective on small tensors, show and check it")
    mode.add_argument("--bench", action="store_true", help="sweep message sizes and report time, algbw and busbw")
    parser.add_argument("--ops", type=lambda s: [op.strip() for op in s.split(",") if op.strip()], default=None,
                        help=f"comma-separated collectives (default: all). bench: {', '.join(BENCH_OPS)}; demo: "
                             "the same plus scatter, gather, send_recv (all_reduce runs SUM, MIN, MAX and AVG)")
    parser.add_argument("--force-fallbacks", action="store_true",
                        help="use the hand-built AVG, reduce_scatter and all_to_all even where the backend has "
                             "them (demo: to check the fallbacks; bench: skips those ops)")
    bench = parser.add_argument_group("bench options")
    bench.add_argument("--min-bytes", type=parse_bytes, default=8, help="smallest message (default 8; 1K = 1024)")
    bench.add_argument("--max-bytes", type=parse_bytes, default=None,
                       help="largest message (default 256M, lowered so buffers fit comfortably: to the power of "
                            "two at most 1/16 of MemAvailable divided by the ranks on the node, or 1/16 of the "
                            "free GPU memory; the smallest over ranks)")
    bench.add_argument("--warmup", type=int, default=5, help="warm-up iterations per size (default 5)")
    bench.add_argument("--iters", type=int, default=20,
                       help="timed iterations per size (default 20; fewer for sizes that would exceed "
                            "--time-per-size, but at least 2)")
    bench.add_argument("--time-per-size", type=float, default=0.5,
                       help="seconds of warm-up, and again of timing, to aim for per size (default 0.5)")
    bench.add_argument("--dtype", choices=list(DTYPES), default="float32", help="element type (default float32)")
    bench.add_argument("--record", action="store_true",
                       help="store the figures in the machine profile (what `meshtrain machine --ranks N` runs), "
                            "where cost models read latency and bus bandwidth per message size")


def run(args: argparse.Namespace) -> int:
    known = set(BENCH_OPS) | ({"scatter", "gather", "send_recv"} if args.demo else set())
    unknown = sorted(set(args.ops or ()) - known)
    if unknown:  # refused before any process group: every rank sees the same arguments
        print(f"meshtrain collectives: unknown op(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}",
              file=sys.stderr)
        return 2
    with distributed(device=args.device, backend=args.backend, timeout=args.timeout) as info:
        native = collectives.native_support(info, args.force_fallbacks)
        missing = [name for name, ok in native.items() if not ok]
        log.info("%s on torch %s: %s", info.backend, torch.__version__,
                 f"hand-built fallback for {', '.join(missing)}" + (" (forced)" if args.force_fallbacks else "")
                 if missing else f"native {', '.join(OPTIONAL)}")
        if args.demo:
            return 0 if collectives.demo(info, args.ops, native) == 0 else 1
        return _bench(info, args, native)


def _bench(info: DistInfo, args: argparse.Namespace, native: dict[str, bool]) -> int:
    max_bytes = args.max_bytes if args.max_bytes is not None else collectives.fitting_max_bytes(info)
    if not 1 <= args.min_bytes <= max_bytes:  # max_bytes is agreed by all ranks, so all of them stop here alike
        log.error("--min-bytes %d must be at least 1 and at most --max-bytes %d", args.min_bytes, max_bytes)
        return 2
    options = collectives.BenchOptions(
        min_bytes=args.min_bytes, max_bytes=max_bytes, ops=None if args.ops is None else tuple(args.ops),
        warmup=args.warmup, iters=args.iters, time_per_size=args.time_per_size, dtype=args.dtype,
        force_fallbacks=args.force_fallbacks)
    points = collectives.bench(info, options, native)
    if args.record and info.is_main:
        _record(info, args.dtype, points)
    return 0


def _record(info: DistInfo, dtype: str, points: collectives.Points) -> None:
    """Keep the bench's points in the machine profile under this set-up's key (backend, device, ranks, nodes)."""
    key = profile.collectives_key(info.backend, info.torch_device, info.world_size, info.num_nodes)
    log.info("recorded in the machine profile %s as %s", profile.record_collectives(key, dtype, points), key)
