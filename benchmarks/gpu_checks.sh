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
#   corpus          a generated 60 M-character corpus (jsonl + parquet), a 70,000-token BPE trained on its jsonl
#                   half, `prepare text` into uint32 shards with 16, 4 and 1 workers (timed on the idle cores; the
#                   shards compared), then GPT-2 124M on it in random and epoch order: the data wait
#   memory          GPT-2 124M eager (bf16 and fp32, loss in chunks, op and full activation checkpointing): the
#                   allocator's peaks that `meshtrain plan --trace` is held to
#   allocator       benchmarks/cuda_memory_items.py: cuBLAS's workspace and the allocator's rounding on a GPT-2 step
#   chunks          GPT-2 124M, each block compiled, the loss whole, in auto's chunks (1,280 tokens on a GPU) and in
#                   chunks of 1024 to 12288 tokens, a graph each: the chunk size a GPU's auto takes (docs/gpu.md, round 7)
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
    case " ${PARTS:-test-gpu plan-validate features prepare corpus memory allocator chunks} " in *" $name "*) ;; *) return ;; esac
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
corpus_part() {  # the corpus part's steps, in its own bash (timeout runs a program, not a function)
    set -e
    local c=$scratch/corpus
    "$PY" benchmarks/prepare_corpus.py --chars 60M --files 8 --generate-only "$c/raw"
    "$PY" - "$c" <<'EOF'
import gzip, json, pathlib, sys
folder = pathlib.Path(sys.argv[1])  # the jsonl half of the corpus as plain text, to train the tokenizer on
with open(folder / "slice.txt", "w") as out:
    for path in sorted((folder / "raw").glob("*.jsonl*")):
        out.writelines(json.loads(line)["text"] for line in (gzip.open if path.suffix == ".gz" else open)(path, "rt"))
EOF
    time "$PY" -m meshtrain prepare tokenizer "$c/slice.txt" --vocab-size 70000 --out "$c/tok70k.json"
    for workers in 16 4 1; do
        echo "prepare text with $workers worker(s):"
        time "$PY" -m meshtrain prepare text "$c/raw/*" --tokenizer "$c/tok70k.json" --shard-tokens 2000000 \
            --workers $workers --name "big$workers" --data-root "$c/data" 2>&1 | tail -1
    done
    for workers in 4 1; do diff -r "$c/data/big16" "$c/data/big$workers" -x manifest.json -x progress.json && \
        echo "shards of $workers worker(s) identical to 16's"; done
    "$PY" benchmarks/gpt2_gpu_features.py --rows "compile whole model,compile whole model + epoch order" \
        --iters 30 --set "data.root=$c/data" --set data.name=big16
}
export -f corpus_part
export scratch PY
part corpus 300 bash -c corpus_part
part memory 200 "$PY" benchmarks/gpt2_gpu_features.py --iters 10 --rows "compile whole model,bf16 eager,\
bf16 eager + loss in chunks (auto),bf16 eager + AC op,bf16 eager + AC full,fp32 eager"
part allocator 60 "$PY" benchmarks/cuda_memory_items.py
part chunks 280 "$PY" benchmarks/gpt2_gpu_features.py --iters 15 --rows "bf16+compile,loss in chunks (auto),\
loss in chunks 1024,loss in chunks 2048,loss in chunks 4096,loss in chunks 12288"
echo "all: $(($(date +%s) - started)) s" | tee -a "$OUT/summary.txt"
