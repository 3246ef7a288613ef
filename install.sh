#!/usr/bin/env bash
# Installs offload-zero and everything it needs on a fresh Debian/Ubuntu machine:
# the system libaio (for the NVMe tier), torch (CPU build unless one is installed), and the
# package itself in editable mode with its train and test extras (builds the C++ kernels).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if ! ldconfig -p 2>/dev/null | grep -q 'libaio\.so'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q libaio1 libaio-dev >/dev/null 2>&1 || {
      apt-get update -q >/dev/null && apt-get install -y -q libaio1 libaio-dev >/dev/null; }
  else
    echo "install.sh: the system libaio is missing; the NVMe tier will use its thread backend" >&2
    echo "            (as root: apt-get install -y libaio1 libaio-dev)" >&2
  fi
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q --root-user-action=ignore "torch==2.13.0"
fi
"$PY" -m pip install -q --root-user-action=ignore -e ".[train,test]"
