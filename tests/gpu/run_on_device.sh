#!/usr/bin/env bash
# Everything the GPU machine checks, in one call, inside 8 minutes: show the GPU, fail loudly if cupy
# cannot use it (so a run where every test skips cannot pass as green), run tests/gpu, then
# bench/models/gpu_step.py (GPT-small, bf16 and fp32, against PyTorch on the same GPU). The machine is used as
# it is: its python3 (cupy, NCCL, torch, numpy, grpcio, protobuf, pytest, hypothesis; no Ray) and this
# checkout on PYTHONPATH, with no install step (tests/gpu/project_path.py maps client/, control_plane/ and
# actor_workers/ into the sbpflow namespace as an install would). Exits non-zero on any failure.
#
#   tests/gpu/run_on_device.sh [extra pytest args, e.g. -k nccl -x]
#
# Writes under $OUT (default .gpu-out/): gpu.log (everything printed), tests.xml (JUnit), gpu_step.json.
# Environment: PYTHON (default python3), CUPY_CACHE_DIR (default .cupy-cache: compiled kernels are
# reused by later runs), TESTS_S / BENCH_S (each stage's time limit, default 270 / 180 seconds).
set -uo pipefail

cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/.gpu-out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$PWD/.cupy-cache}"
export CI="${CI:-1}"  # derandomized Hypothesis: a failure on the device reproduces
failed=()

step() { printf '\n== %s (%s s in) ==\n' "$*" "$SECONDS"; }

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || failed+=("nvidia-smi")

step "cupy, NCCL and torch see it"
"$PY" - <<'PY' || { echo "GPU TESTS: FAILED (cupy cannot use the GPU, see above)"; exit 1; }
import tests.gpu.project_path  # noqa: F401  (the checkout as sbpflow, no install)
import cupy
import torch
from cupy.cuda import nccl

from sbpflow.device import array_module, gpu_count
from sbpflow.dtype import DType

array_module("cuda")  # raises with the reason if cupy cannot use a device
try:
    bf16 = str(cupy.ones(2, DType.bfloat16.to_numpy()).dtype)
except Exception as e:
    bf16 = f"no ({e!r})"
print(f"cupy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, NCCL {nccl.get_version()}, "
      f"{gpu_count()} GPU(s), cupy bfloat16: {bf16}; torch {torch.__version__}, cuda {torch.cuda.is_available()}")
PY

step "pytest tests/gpu"
timeout "${TESTS_S:-270}" "$PY" -m pytest -q -p tests.gpu.project_path -p no:cacheprovider tests/gpu -rs \
    --junitxml="$OUT/tests.xml" "$@" || failed+=("pytest tests/gpu (exit $?)")

step "bench/models/gpu_step.py"
timeout "${BENCH_S:-180}" "$PY" -c '
import runpy, sys
import tests.gpu.project_path  # noqa: F401
sys.argv = ["bench/models/gpu_step.py", "--json", sys.argv[1]]
runpy.run_path("bench/models/gpu_step.py", run_name="__main__")
' "$OUT/gpu_step.json" || failed+=("bench/models/gpu_step.py (exit $?)")

step "summary"
if [ "${#failed[@]}" -eq 0 ]; then
    echo "GPU TESTS: PASSED; bench figures in $OUT/gpu_step.json"
else
    printf 'GPU TESTS: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
