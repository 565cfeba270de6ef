#!/usr/bin/env bash
# relaunch on a GPU, in one call: on a bare machine with one NVIDIA GPU, torch, transformers and the usual stack but
# no network, no Ray and no pydantic, from the working tree plus the wheels benchmarks/gpu_wheels.sh puts in .whl/:
#   1. install the wheels into a temp dir (nothing outside it changes);
#   2. tests/gpu: FSDP2 on CUDA under nccl, DCP of CUDA tensors, the CUDA RNGs, pinned staging of background saves
#      and of the memory tier, generation on the GPU, CUDA IPC weight writes, and the default job on the one GPU
#      (rank, engine and spare sharing it) with a rank SIGKILLed, ending bit-identical to an uninterrupted run;
#   3. benchmarks/gpu.py at ~0.5B (fp32): step, save stall, memory staging, weight sync vs a device copy, and a rank
#      kill's loss beyond a steady step; its table, JSON and plot.
# A step that fails says why and the script goes on to the next. Everything it writes lands in $OUT (the device
# tool brings it back): summary.txt, tests.log, bench.log, gpu.json, gpu.png. It fits in 8 minutes on an H100.
# The device tool's call (docs/benchmarks.md, "On a GPU"):
#   command: bash benchmarks/gpu_check.sh    carry: [".whl"]    timeout_s: 560
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
SITE=${RELAUNCH_GPU_SITE:-/tmp/relaunch-site}
export PYTHONUNBUFFERED=1 TMPDIR=/tmp/relaunch-tmp RAY_TMPDIR=/tmp/relaunch-tmp
mkdir -p "$OUT" "$TMPDIR"
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }

# step NAME SECONDS CMD...: run CMD with a time limit, its output in $OUT/NAME.log, its outcome in summary.txt
step() {
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name"
  timeout --kill-after=10 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  summary "$name: exit $rc in $((SECONDS - start)) s$([ $rc = 124 ] && echo " (over its ${limit} s)")"
}

summary "relaunch gpu_check on $(hostname), $(date -u +%FT%TZ)"
summary "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
if ! ls .whl/ray-*.tar.xz >/dev/null 2>&1; then
  summary "no .whl/ray-*.tar.xz: run benchmarks/gpu_wheels.sh here first and carry .whl"
  exit 2
fi
rm -rf "$SITE" && mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl &&
  tar -xJf .whl/ray-*.tar.xz -C "$SITE" || { summary "installing the wheels failed"; exit 2; }
export PYTHONPATH="$SITE:$PWD"
summary "$(python3 -c 'import torch, ray, pydantic, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"| ray", ray.__version__, "| pydantic", pydantic.__version__, "| transformers", transformers.__version__)' 2>&1 | tail -1)"

# each step's time limit (seconds): GPU_CHECK_TESTS_SECS, GPU_CHECK_BENCH_SECS; PYTEST_ADDOPTS picks tests (-k ...)
step tests "${GPU_CHECK_TESTS_SECS:-200}" python3 -m pytest tests/gpu -n 0 -q -rA -p no:cacheprovider -o addopts="" -o log_level=WARNING --timeout 170
step bench "${GPU_CHECK_BENCH_SECS:-260}" python3 benchmarks/gpu.py --json "$OUT/gpu.json" --plot "$OUT/gpu.png"
summary "done in $SECONDS s"
