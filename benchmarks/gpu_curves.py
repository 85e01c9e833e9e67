"""Measure this GPU's GEMM and attention rate curves (machine/measure.py) and write them as JSON.

    python benchmarks/gpu_curves.py --out curves.json [--labels bf16,tf32,fp32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from meshtrain.machine.measure import gemm_curve, sdpa_curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--labels", default="bf16,tf32,fp32")
    args = parser.parse_args()
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "measured": time.strftime("%Y-%m-%d"), "gemm": {}, "sdpa": {}}
    for label in args.labels.split(","):
        started = time.perf_counter()
        result["gemm"][label] = gemm_curve(device, label)
        print(f"gemm {label}: {len(result['gemm'][label])} shapes in {time.perf_counter() - started:.0f} s, best "
              f"{max(p[3] for p in result['gemm'][label]) / 1e12:.1f} TFLOP/s", flush=True)
    for label in ("bf16",):
        started = time.perf_counter()
        result["sdpa"][label] = sdpa_curve(device, label)
        print(f"sdpa {label}: {len(result['sdpa'][label])} shapes in {time.perf_counter() - started:.0f} s, best "
              f"{max(p[3] for p in result['sdpa'][label]) / 1e12:.1f} TFLOP/s", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
