#!/usr/bin/env bash
# The floor tests (-m floor: FLOOR_TESTS in tests/conftest.py) on the oldest torch and torchvision
# that requirements.txt allows, in an environment of their own (.venv-floor): the tests whose
# outcome depends on torch's version, as they run the stages' distributed machinery.
set -euo pipefail
cd "$(dirname "$0")/.."
floor() { sed -n "s/^$1>=\([0-9.]*\)$/\1/p" requirements.txt; }
python3 -m venv .venv-floor
.venv-floor/bin/pip install -q "torch==$(floor torch).*" "torchvision==$(floor torchvision).*" pytest
.venv-floor/bin/python -c 'import torch; print("torch", torch.__version__)'
.venv-floor/bin/python -m pytest -m floor
