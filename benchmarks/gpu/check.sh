#!/usr/bin/env bash
# The GPU check: one prepared run on a lent GPU machine (one NVIDIA H200, 16 cores, no network),
# finishing in under 8 minutes. From the repository root:
#
#     OZ_COMMIT=<commit of the tree> benchmarks/gpu/check.sh
#
# Sections, each under its own `timeout` so one hang cannot eat the budget:
#   env      nvidia-smi, Python, torch and CUDA versions, the Python packages the engine uses
#   install  the C++ extension built from this tree without network
#            (python3 setup.py build_ext --inplace; PYTHONPATH=the tree)
#   tests    python3 -m pytest -q -rs tests/gpu
#   bench    benchmarks/bench_step.py --device cuda: torch, torch+io, offload cpu and nvme rows
#   bench16  the same in bf16: torch, offload nvme with fp32 masters, with bf16 moments and bf16
#            masters (6 bytes of state per parameter each way), and with half the state cached
#            and int8 moments (bench_step_gpu_bf16.txt)
#   ds       only if a DeepSpeed wheel lies under .whl/: installed offline, then bench_step's
#            DeepSpeed ZeRO-3 CPU-offload row beside ours (bench_step runs its ds-* rows with
#            --device cpu only); skipped with a message otherwise
#
# Everything printed goes to ${OUT:-/tmp}/gpu_check.log; the test and bench outputs also go to
# gpu_tests.txt and bench_step_gpu.txt there, each headed by the date, commit and command, ready
# to be copied into benchmarks/results/.
#
# Exit status: 0 when every section that ran passed; 1 when CUDA is not visible, the build
# failed or a test failed (or timed out); 3 when only the benchmarks failed.
#
# Settings (environment): OZ_COMMIT (the commit, when the tree has no .git); CHECK_BUDGET_S
# (seconds for the whole run, default 450); CHECK_SECTIONS (default "env install tests bench
# bench16 ds");
# BENCH_STEPS (default 5; the median is of steps 3..BENCH_STEPS); CHECK_ALLOW_NO_CUDA=1 (run
# without a GPU, to try the script itself: tests/gpu then skips and counts as passed).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

OUT_DIR=${OUT:-/tmp}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu_check.log
BUDGET_S=${CHECK_BUDGET_S:-450}
SECTIONS=${CHECK_SECTIONS:-"env install tests bench bench16 ds"}
BENCH_STEPS=${BENCH_STEPS:-5}
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/oz-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT  # (NVMe swap files of the benchmarks)

COMMIT=${OZ_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
FATAL=0      # CUDA missing, build or tests failed
BENCH_FAILED=0

wanted() { [[ " $SECTIONS " == *" $1 "* ]]; }

# section NAME LIMIT_S CMD...: run CMD under `timeout`, at most LIMIT_S and never past the budget
section() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - SECONDS - 5))
  if ((left < 20)); then
    echo "== $name: skipped, $left s of the ${BUDGET_S} s budget left"
    return 124
  fi
  ((limit > left)) && limit=$left
  echo
  echo "== $name (limit ${limit} s, at ${SECONDS} s of ${BUDGET_S} s)"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if ((rc == 124 || rc == 137)); then
    echo "== $name: TIMED OUT after ${limit} s"
  fi
  echo "== $name: exit $rc after ${SECONDS} s in all"
  return $rc
}

# bench_section NAME LIMIT_S FILE TITLE CMD...: `section` CMD, its output also into
# $OUT_DIR/FILE headed by TITLE, the commit, the date and the command; a failed run or row
# marks the benchmarks failed
bench_section() {
  local name=$1 limit=$2 file=$OUT_DIR/$3 title=$4
  shift 4
  {
    echo "# $title, commit $COMMIT, $DATE"
    echo "# command: $*"
  } >"$file"
  section "$name" "$limit" "$@" | tee -a "$file"
  local rc=${PIPESTATUS[0]}
  if ((rc != 0)) || grep -q ' failed: ' "$file"; then
    echo "== $name: FAILED (exit $rc, or a row failed)"
    BENCH_FAILED=1
  fi
}

main() {
echo "offload-zero GPU check: commit $COMMIT, $DATE, budget ${BUDGET_S} s, sections: $SECTIONS"
echo "log: $LOG"

# -- env ---------------------------------------------------------------------------------------
if wanted env; then
  section env 30 bash -c '
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    else
      echo "nvidia-smi: not found"
    fi
    echo "cpus: $(nproc)  memory: $(free -g 2>/dev/null | awk "/^Mem:/ {print \$2}") GiB"
    df -h "${TMPDIR:-/tmp}" | tail -1
    '"$PY"' - <<"EOF"
import importlib, platform, sys
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device 0:", torch.cuda.get_device_name(0))
print("storage rebinding (gather pool):", hasattr(torch.UntypedStorage, "_swap_data_ptr_"))
for name in ("numpy", "psutil", "safetensors", "libaio", "transformers", "pytest", "pybind11",
             "setuptools", "deepspeed"):
    try:
        mod = importlib.import_module(name)
        print(f"  {name:<13}", getattr(mod, "__version__", "present"))
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"  {name:<13} not importable ({type(exc).__name__}: {exc})")
EOF
  '
fi

if [ "${CHECK_ALLOW_NO_CUDA:-0}" != 1 ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "== CUDA is not available to torch here: tests/gpu would only skip; stopping (exit 1)"
  exit 1
fi

# -- install -----------------------------------------------------------------------------------
if wanted install; then
  if section install 150 "$PY" setup.py -q build_ext --inplace \
      && "$PY" -c "import offload_zero._C as c; import offload_zero; print('offload_zero', offload_zero.__version__, 'from', offload_zero.__file__, 'kernels:', c.__file__)"; then
    :
  else
    echo "== install: the extension did not build or import; tests and benchmarks cannot run"
    FATAL=1
  fi
fi

# -- tests/gpu ---------------------------------------------------------------------------------
if wanted tests && ((FATAL == 0)); then
  {
    echo "# tests/gpu, commit $COMMIT, $DATE"
    echo "# command: $PY -m pytest -q -rs tests/gpu"
  } >"$OUT_DIR/gpu_tests.txt"
  section tests 180 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu \
    | tee -a "$OUT_DIR/gpu_tests.txt"
  rc=${PIPESTATUS[0]}
  ((rc != 0)) && { echo "== tests: FAILED (exit $rc)"; FATAL=1; }
fi

# -- bench_step on the GPU ---------------------------------------------------------------------
if wanted bench && ((FATAL == 0)); then
  mkdir -p "$WORK/nvme"
  bench_section bench 200 bench_step_gpu.txt "bench_step on the GPU" \
    "$PY" benchmarks/bench_step.py --device cuda --steps "$BENCH_STEPS" --skip 2 \
    --batch 8 --seq 512 --timeout 100 --path "$WORK/nvme" \
    --configs torch,torch+io,ours-cpu,ours-nvme,ours-nvme+sib
fi

# -- bench_step on the GPU in bf16: fewer state bytes per step --------------------------------
if wanted bench16 && ((FATAL == 0)); then
  mkdir -p "$WORK/nvme16"
  bench_section bench16 150 bench_step_gpu_bf16.txt "bench_step on the GPU in bf16" \
    "$PY" benchmarks/bench_step.py --device cuda --dtype bf16 --steps "$BENCH_STEPS" --skip 2 \
    --batch 8 --seq 512 --timeout 100 --path "$WORK/nvme16" \
    --configs torch,ours-nvme+sib,ours-nvme+bf16m+bf16w+sib,ours-nvme+cache+int8m+bf16w+sib
fi

# -- optional: DeepSpeed ZeRO-3 offload beside ours --------------------------------------------
if wanted ds; then
  shopt -s nullglob
  wheels=(.whl/deepspeed-*.whl)
  shopt -u nullglob
  if ((${#wheels[@]} == 0)); then
    echo
    echo "== ds: skipped, no DeepSpeed wheel under .whl/ (put deepspeed-*.whl and its dependencies' wheels there)"
  elif ((FATAL != 0)); then
    echo "== ds: skipped, an earlier section failed"
  else
    section ds-install 60 "$PY" -m pip install -q --no-index --find-links .whl "${wheels[0]}" \
      || echo "== ds-install: pip could not install ${wheels[0]} offline (its dependencies' wheels may be missing)"
    bench_section ds 150 bench_step_ds.txt \
      "bench_step with DeepSpeed ZeRO-3 CPU offload (the CPU as device)" \
      "$PY" benchmarks/bench_step.py --device cpu --steps 4 --skip 2 --batch 2 --seq 256 \
      --timeout 120 --path "$WORK/nvme" --configs torch,ours-cpu,ds-cpu
  fi
fi

echo
echo "== done after ${SECONDS} s: commit $COMMIT, $DATE; log $LOG"
if ((FATAL != 0)); then
  echo "== result: FAILED (CUDA, build or tests)"
  exit 1
fi
if ((BENCH_FAILED != 0)); then
  echo "== result: tests passed, benchmarks failed"
  exit 3
fi
echo "== result: passed"
exit 0
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
