#!/usr/bin/env bash
# The GPU checks of a session lent one GPU, as one call: each part under its own time limit and all of them within
# DEADLINE_S (default 570 s) of the start, each part's output in OUT/<part>.log and its exit and seconds in
# OUT/summary.txt, so that what ran is kept when the time runs out.
#
#   WHEELS=.whl bash benchmarks/gpu_checks.sh OUT
#   PARTS="plan-validate features" ROWS="micro 24 × 2" bash benchmarks/gpu_checks.sh OUT     # some parts again
#
#   test-gpu        make test-gpu: meshtrain into the machine's python3 (offline), tests/gpu
#   plan-validate   meshtrain plan gpt preset=gpt2 --system this --validate 8 on a fresh data root and cache, as a
#                   new user runs it (the shipped corpus prepared, the GPU's rate tables and fixed costs measured)
#   features        benchmarks/gpt2_gpu_features.py: GPT-2 124M in the trainer, one iteration profiled
#
# docs/gpu.md holds the tables these printed, with the device and the date.
set -u
OUT=${1:-gpu-checks}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 MESHTRAIN_PROGRESS=0
started=$(date +%s)
deadline=$((started + ${DEADLINE_S:-570}))

part() {  # part NAME LIMIT_S COMMAND...: run it for at most LIMIT_S, never past the deadline
    local name=$1 limit=$2 begin rc
    shift 2
    case " ${PARTS:-test-gpu plan-validate features} " in *" $name "*) ;; *) return ;; esac
    begin=$(date +%s)
    limit=$((limit < deadline - begin ? limit : deadline - begin))
    if [ "$limit" -le 10 ]; then
        echo "$name: not run (deadline)" | tee -a "$OUT/summary.txt"
        return
    fi
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $(($(date +%s) - begin)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'; } >"$OUT/device.txt" 2>&1
# meshtrain into the machine's python3 for the parts after the tests, even when they are run alone
{ [ -z "${WHEELS:-}" ] || "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .; } >"$OUT/install.log" 2>&1
if command -v make >/dev/null; then
    part test-gpu 240 make test-gpu PYTHON="$PY" WHEELS="${WHEELS:-}"
else  # the Makefile's recipe, for an image without make
    part test-gpu 240 bash -c "set -e; [ -z '${WHEELS:-}' ] || $PY -m pip install -q --no-index --no-deps ${WHEELS:-.}/*.whl
        $PY -m pip install -q --no-index --no-deps --no-build-isolation -e .
        $PY -m pytest tests/gpu -m alone || alone=1; $PY -m pytest tests/gpu -m 'not alone' -n 8 --dist load --durations=10
        exit \${alone:-0}"
fi
scratch=$(mktemp -d)
part plan-validate 240 env MESHTRAIN_CACHE_DIR="$scratch/cache" "$PY" -m meshtrain plan gpt preset=gpt2 \
    train.grad_accum=8 data.root="$scratch/data" --system this --gpus-per-node 1 --validate 8 --steps 3
part features 300 "$PY" benchmarks/gpt2_gpu_features.py --profile --rows "${ROWS:-bf16+compile,micro 48 × 1}" \
    --iters 30
echo "all: $(($(date +%s) - started)) s" | tee -a "$OUT/summary.txt"
