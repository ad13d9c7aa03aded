#!/usr/bin/env bash
# One prepared GPU check for cdmlfs_torch, in a single go:
#   1. the CUDA tests (tests/test_torch_cuda.py: values, stream ordering, record_stream, copies overlapping
#      compute, ArchiveImageFolder end to end) plus the prefetcher's CPU tests;
#   2. the GPU benchmark (scripts/bench_torch.py --gpu): ResNet-50 training steps fed straight from a ZIP;
#      data stall (target <= 5% of step time) and, from a torch.profiler trace, the share of host-to-device
#      copy time that ran while compute kernels ran.
# Without CUDA every GPU part skips cleanly and the script exits 0.
#
# What it assumes:
#   - a checkout of this repository (the script finds its root itself), Linux, an NVIDIA GPU and driver;
#   - a Python >= 3.10: $PYTHON (default python3); if it runs inside a venv, that venv is used. Else a venv is made at $VENV (default
#     ${TMPDIR:-/tmp}/cdmlfs-gpu-venv; an existing one, the checkout's .venv say, is used as it is) with
#     --system-site-packages, so a CUDA build of torch/torchvision already installed for that Python is
#     reused as it is (the version is printed; 2.14.1 / 0.29.1 is what the project pins);
#   - otherwise torch==2.14.1 and torchvision==0.29.1 are installed by pip. With no network, point
#     WHEELS at a folder of wheels: pip then runs with --no-index --find-links "$WHEELS". That folder must
#     also hold whatever of cdmlfs's needs the machine lacks (cachetools, zstandard, mfusepy, tqdm,
#     pillow, numpy, pytest);
#   - FUSE is not needed: the GPU part reads the ZIP through the Python API. If installing cdmlfs in
#     editable mode fails (its optional C accelerator needs a compiler and libdeflate headers), the
#     checkout is used through PYTHONPATH instead.
# Environment: PYTHON, VENV, WHEELS, IMAGES (synthetic JPEGs, default 10000, so the timed steps stay in one epoch), STEPS (measured training
# steps, default 100), BATCH (default 64), OUT (where logs and JSON go, default ${TMPDIR:-/tmp}/cdmlfs-gpu-check).
# Exit status: 0 when the tests pass and the benchmark meets its target, 1 otherwise, 2 on a setup failure.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
# A Python that runs inside a venv already (GPU images ship torch that way) is used with its own venv:
# a venv made from it with --system-site-packages would see the base interpreter's packages, not torch.
if [ -z "${VENV:-}" ] && "$PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
  VENV=$("$PYTHON" -c 'import sys; print(sys.prefix)')
fi
VENV=${VENV:-${TMPDIR:-/tmp}/cdmlfs-gpu-venv}
IMAGES=${IMAGES:-10000}
STEPS=${STEPS:-100}
BATCH=${BATCH:-64}
OUT=${OUT:-${TMPDIR:-/tmp}/cdmlfs-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

say() { printf '\n== %s\n' "$*"; }

PIP_ARGS=(-q --disable-pip-version-check)
if [ -n "${WHEELS:-}" ]; then PIP_ARGS+=(--no-index --find-links "$WHEELS"); fi

say "python environment"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv --system-site-packages "$VENV" || { echo "cannot create $VENV with $PYTHON"; exit 2; }
fi
PY=$(cd "$VENV" && pwd)/bin/python
if ! "$PY" -c "import torch, torchvision" 2>/dev/null; then
  "$PY" -m pip install "${PIP_ARGS[@]}" torch==2.14.1 torchvision==0.29.1 || { echo "torch install failed"; exit 2; }
fi
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"cachetools": "cachetools", "zstandard": "zstandard", "mfusepy": "mfusepy", "tqdm": "tqdm",
        "PIL": "pillow", "numpy": "numpy", "pytest": "pytest"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "installing: $missing"
  # shellcheck disable=SC2086
  "$PY" -m pip install "${PIP_ARGS[@]}" $missing || { echo "could not install: $missing"; exit 2; }
fi
installed_here=$(cd / && "$PY" -c "import os, cdmlfs; print(os.path.dirname(os.path.dirname(cdmlfs.__file__)))" \
  2>/dev/null || true)
if [ "$installed_here" != "$ROOT" ] &&
   ! "$PY" -m pip install "${PIP_ARGS[@]}" --no-deps --no-build-isolation -e . >"$OUT/pip-install.log" 2>&1; then
  echo "editable install failed (see $OUT/pip-install.log); using the checkout through PYTHONPATH"
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
"$PY" - <<'EOF' || exit 2
import torch, torchvision, cdmlfs, cdmlfs_torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), torchvision {torchvision.__version__}")
print(f"cdmlfs from {cdmlfs.__file__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
else:
    print("no CUDA device: the GPU parts will skip")
EOF

status=0
say "tests: CUDA prefetcher (and its CPU path)"
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_torch_cuda.py tests/test_torch_prefetch.py \
  2>&1 | tee "$OUT/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

say "benchmark: ResNet-50 fed from a ZIP (data stall, copy/compute overlap)"
"$PY" scripts/bench_torch.py --no-cpu --gpu --images "$IMAGES" --gpu-steps "$STEPS" --gpu-batch "$BATCH" \
  --workdir "${TMPDIR:-/tmp}/cdmlfs-gpu-bench" --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

say "result: $([ $status -eq 0 ] && echo PASS || echo FAIL) (logs and JSON in $OUT)"
exit $status
