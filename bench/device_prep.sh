#!/usr/bin/env bash
# Run here, before a GPU machine's first call: puts beside the checkout what
# bench/device_check.sh needs there and the device machine lacks (see the device tool's
# README and KINDS.md: Python 3.12, no network, no cffi, pycparser or gguf; only the repo
# travels, not ../shared):
#   .whl/         cp312 wheels of cffi, pycparser and gguf (the versions pinned below)
#   shared/data/  the real Qwen3.6-35B-A3B config and the chat template (make_bench_model.py
#                 and the tests read ROOT/shared/data when ../shared is absent)
# Both are listed in .git/info/exclude (never committed) and must be named in the call's carry:
#   run(command="bash bench/device_check.sh", carry=[".whl", "shared"], timeout_s=540)
# Usage: bash bench/device_prep.sh [SHARED_DIR]   (default: ../shared beside the checkout)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
shared="$(cd "${1:-$root/../shared}" 2>/dev/null && pwd)" || { echo "device_prep: ${1:-../shared} not found" >&2; exit 1; }
[ -d "$shared/data" ] || { echo "device_prep: $shared/data not found" >&2; exit 1; }
[ "$shared" != "$root/shared" ] || { echo "device_prep: $shared is the copy this script makes" >&2; exit 1; }
cd "$root"
mkdir -p .git/info
for p in /.whl/ /shared/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl cffi==2.0.0 pycparser==3.0 gguf==0.19.0
rm -rf shared && mkdir -p shared/data/templates
cp "$shared/data/qwen3.6-35b-a3b.json" shared/data/
cp "$shared"/data/templates/*.jinja shared/data/templates/
ls -l .whl
du -sh .whl shared
git status --short --ignored .whl shared
