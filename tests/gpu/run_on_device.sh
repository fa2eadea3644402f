#!/usr/bin/env bash
# Run the GPU tests on a machine with an NVIDIA GPU: make (or reuse) a venv with the `gpu` and `dev`
# extras, show the GPU, fail loudly if cupy cannot use it (so a run where every test skips cannot pass
# as green), run tests/gpu, and print a summary. Exits non-zero on any failure.
#
#   tests/gpu/run_on_device.sh [extra pytest args, e.g. -k nccl -x]
#
# Environment: SBPFLOW_GPU_VENV (default .venv-gpu; an existing venv is reused), PYTHON (default
# python3), PIP_ARGS (extra pip install args, e.g. "--no-index --find-links /wheels" on a machine without
# a package index), CUPY_CACHE_DIR (default .cupy-cache: compiled kernels are reused by later runs).
set -euo pipefail

cd "$(dirname "$0")/../.."
VENV="${SBPFLOW_GPU_VENV:-.venv-gpu}"
PYTHON="${PYTHON:-python3}"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$PWD/.cupy-cache}"
export CI="${CI:-1}"  # derandomized Hypothesis: a failure on the device reproduces

step() { printf '\n== %s ==\n' "$*"; }
fail() { printf '\nGPU TESTS: FAILED (%s)\n' "$*" >&2; exit 1; }

step "GPU"
nvidia-smi || fail "nvidia-smi failed: no NVIDIA driver or GPU on this machine"

step "venv $VENV"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV" || fail "could not create the venv with $PYTHON"
fi
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q ${PIP_ARGS:-} -e '.[gpu,dev]' || fail "pip install -e '.[gpu,dev]' failed"
"$VENV/bin/python" - <<'PY' || fail "cupy cannot use the GPU (see above)"
import cupy
from cupy.cuda import nccl

from sbpflow.device import array_module, gpu_count

array_module("cuda")  # raises with the reason if cupy cannot use a device
print(f"cupy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
      f"NCCL {nccl.get_version()}, {gpu_count()} GPU(s)")
PY

step "pytest tests/gpu"
set +e
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/gpu -rs "$@"
rc=$?
set -e

step "summary"
if [ "$rc" -eq 0 ]; then
    echo "GPU TESTS: PASSED"
else
    fail "pytest exited $rc"
fi
