#!/usr/bin/env bash
# Run bench/gpu.py on a lent GPU machine whose Python has torch but not this project's pure
# dependencies, and no network: they travel as wheels in .whl/ (ignored by git), fetched here with
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl trio outcome sniffio PyNaCl cffi pycparser pytest-trio
#
# The repository root is the `dtfm` package: a link named dtfm on PYTHONPATH imports it (the
# daemons that dtfm-swarm starts inherit the path). Every argument goes to bench/gpu.py;
# environment: OUT (where gpu.json, checks.log and daemons.log go), DTFM_GPU_PLANE_PROFILE.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(mktemp -d)
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
fi
ln -sfn "$PWD" "$site/dtfm"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, trio, nacl, msgpack, dtfm.train
print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec python3 bench/gpu.py "$@"
