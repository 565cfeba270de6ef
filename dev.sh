#!/usr/bin/env bash
# The project's one set-up script. `./dev.sh demo` runs the default job on a local multi-node cluster and
# kills a node mid-run, `./dev.sh run [CONFIG] [KEY=VALUE ...]` runs a job, `./dev.sh test` runs the whole
# test suite, `./dev.sh relaunch ...` any CLI command. The first call creates .venv:
# torch first, pinned to the CPU build (2.13.0) unless a GPU is present, so nothing pulls CUDA wheels on a
# CPU machine; later calls reuse it and take a second.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${RELAUNCH_VENV:-.venv}
stamp="$VENV/.relaunch-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python3 -m venv "$VENV"
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q "torch>=2.6,<2.14"
  else
    "$VENV/bin/pip" install -q "torch==2.13.0"
  fi
  "$VENV/bin/pip" install -q -e ".[test]"
  touch "$stamp"
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
