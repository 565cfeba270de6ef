#!/usr/bin/env bash
# What benchmarks/gpu_check.sh needs on a GPU machine that has torch, transformers and the rest of the usual
# stack but no network, no Ray and no pydantic (shared/../device's KINDS.md lists its packages): Python 3.12
# wheels for x86-64 in .whl/ (git-ignored through .git/info/exclude), Ray's packed as a tarball of the modules
# a job imports. Ray 2.60's wheel is 79 MB; less its Java jars and its libraries a job never imports (RLlib,
# Data, Serve, LLM, Tune, Train, the dashboard's web client) it packs to about 30 MB, inside a device call's
# 64 MiB. Run it here, then carry `.whl` (benchmarks/gpu_check.sh says how).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
mkdir -p .whl
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels=(ray=="$(version ray)" pydantic=="$(version pydantic)" pydantic-core=="$(version pydantic-core)"
        annotated-types typing-inspection jsonschema jsonschema-specifications referencing rpds-py)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${wheels[@]}"
ray_wheel=$(ls .whl/ray-*.whl)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && unzip -q "$OLDPWD/$ray_wheel" 'ray/*' -x 'ray/jars/*' 'ray/rllib/*' 'ray/data/*' 'ray/serve/*' \
   'ray/llm/*' 'ray/tune/*' 'ray/train/*' 'ray/dashboard/client/*')
tar -C "$tmp" -cJf ".whl/$(basename "$ray_wheel" .whl).tar.xz" ray
rm "$ray_wheel"
du -ch .whl/* | tail -1
