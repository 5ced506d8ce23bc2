#!/usr/bin/env bash
# The default suite again, on the oldest torch and torchvision that requirements.txt allows, in an
# environment of their own (.venv-floor): what the README says must hold there too.
set -euo pipefail
cd "$(dirname "$0")/.."
floor() { sed -n "s/^$1>=\([0-9.]*\)$/\1/p" requirements.txt; }
python3 -m venv .venv-floor
.venv-floor/bin/pip install -q "torch==$(floor torch).*" "torchvision==$(floor torchvision).*" pytest
.venv-floor/bin/python -c 'import torch; print("torch", torch.__version__)'
.venv-floor/bin/python -m pytest
