#!/usr/bin/env bash
# The GPU path's check, for a machine with a CUDA build of torch and no vLLM (a GPU box
# that cannot reach a package index): the `gpu`-marked tests and the transfer benchmark.
#
#   scripts/gpu_check.sh [WHEELS]
#
# WHEELS: a folder of wheels for the project's other dependencies, made beforehand on a
# machine with an index, for the GPU machine's Python (here 3.11; change --python-version):
#
#   pip download -d wheels --only-binary=:all: --python-version 3.11 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#       lmdb zstandard xxhash numpy typer rich prometheus-client pytest
#
# Without WHEELS the dependencies must be installed already. The project itself is not
# installed: it runs from this checkout. Takes about 2 minutes; well under 8.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
"$py" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
if [ -n "${1:-}" ]; then
    "$py" -m pip install -q --no-index --find-links "$1" \
        lmdb zstandard xxhash numpy typer rich prometheus-client pytest
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
echo "gpu_check: tests marked gpu" >&2
"$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_path.py tests/test_connector_sides.py
echo "gpu_check: chunk save and load against the host-device copy" >&2
"$py" benchmarks/gpu_transfer.py --rounds 20
