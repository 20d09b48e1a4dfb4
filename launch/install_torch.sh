#!/usr/bin/env bash
# Install torch into a venv before the package (what `make setup` runs first):
#
#   launch/install_torch.sh .venv/bin/python 2.13.0
#
# - A GPU present (`nvidia-smi -L` lists one): torch from the default index (PyPI's Linux wheel is
#   the CUDA build).
# - No GPU: the CPU wheel, so nothing pulls a CUDA build and its ~20 nvidia packages (~3 GB). A
#   local wheel that pip can find without an index (pip's find-links, e.g. a CI image's wheel
#   folder) is taken first, with no network; else the public CPU index,
#   https://download.pytorch.org/whl/cpu (TORCH_CPU_INDEX overrides it).
# torch's own dependencies come with the package install that follows.
set -euo pipefail

PY="$1"
VERSION="$2"
CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "[setup] a GPU is present: torch==$VERSION from the default index (CUDA build)"
    exec "$PY" -m pip install -q "torch==$VERSION"
fi
if "$PY" -m pip install -q --no-index --no-deps "torch==$VERSION" 2>/dev/null; then
    echo "[setup] no GPU: torch==$VERSION from a local wheel (pip's find-links)"
    exit 0
fi
echo "[setup] no GPU: the CPU torch==$VERSION from $CPU_INDEX"
exec "$PY" -m pip install -q "torch==$VERSION" --index-url "$CPU_INDEX"
