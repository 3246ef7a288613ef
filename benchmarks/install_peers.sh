#!/usr/bin/env bash
# The peers the benchmarks compare against, pinned so every result row can be rerun:
# DeepSpeed 0.19.8 without its compiled ops (its CPU accelerator, DS_ACCELERATOR=cpu, and the
# ops it JIT-builds on first use). FSDP2 comes with torch. Run after ./install.sh.
set -euo pipefail
PY=${PYTHON:-python3}
DS_BUILD_OPS=0 "$PY" -m pip install -q --root-user-action=ignore "deepspeed==0.19.8"
DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} "$PY" -c "import deepspeed; print('deepspeed', deepspeed.__version__)"
