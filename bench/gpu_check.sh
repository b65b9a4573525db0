#!/usr/bin/env bash
# The CUDA device check (bench/gpu_check.py; docs/benchmarks.md, "CUDA device check") on a GPU machine
# without network: installs the wheels carried in .whl/ (platformdirs; bitsandbytes 0.50.2 cut down to
# its CPU and CUDA 13.x libraries) into /tmp/site, puts them and this checkout on PYTHONPATH, and runs
# the check with its reports in $OUT (else bench/results/). Arguments go to the script
# (--budget-s, --cases, --list). Carry: .whl (git-ignored through .git/info/exclude). The report names
# the commit in MEMGUARD_COMMIT when set (the device copy's .git can be older than the tree it got):
#   MEMGUARD_COMMIT=<git rev-parse --short HEAD here> bash bench/gpu_check.sh --budget-s 500
cd "$(dirname "$0")/.." || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD; python3 bench/gpu_check.py --out "${OUT:-bench/results}" "$@"
