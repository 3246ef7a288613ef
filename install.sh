#!/usr/bin/env bash
# Installs offload-zero and everything it needs on a fresh Debian/Ubuntu machine:
# the system libaio (for the NVMe tier), torch (CPU build unless one is installed), and the
# package itself in editable mode with its train and test extras (builds the C++ kernels).
# Run again, it skips what is there: the package when it imports from this checkout with its
# extension built after the last change to csrc/ and setup.py (and the extras import).
# apt-get waits up to APT_LOCK_TIMEOUT_S seconds (default 300) for another apt or dpkg to
# release its lock, and its own output is shown if it fails.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd -P)
PY=${PYTHON:-python3}
APT_LOG=$(mktemp)
trap 'rm -f "$APT_LOG"' EXIT

apt_get() {  # apt-get, waiting for the dpkg lock; output kept in $APT_LOG
  apt-get -o DPkg::Lock::Timeout="${APT_LOCK_TIMEOUT_S:-300}" -y -q "$@" >"$APT_LOG" 2>&1
}

package_is_current() {  # exit 0 when `pip install -e .` would change nothing that matters here
  (cd / && "$PY" - "$ROOT" <<'EOF'
import glob, importlib.metadata, importlib.util, os, sys
root = sys.argv[1]
import offload_zero, offload_zero._C
importlib.metadata.distribution("offload-zero")  # installed, not only on sys.path
here = os.path.realpath(os.path.dirname(offload_zero.__file__))
built = os.path.getmtime(offload_zero._C.__file__)
sources = [os.path.join(root, "setup.py")] + glob.glob(os.path.join(root, "csrc", "*"))
sys.exit(here != os.path.realpath(os.path.join(root, "offload_zero"))
         or any(os.path.getmtime(s) > built for s in sources)
         or any(importlib.util.find_spec(m) is None
                for m in ("transformers", "tqdm", "matplotlib", "pytest")))
EOF
  ) >/dev/null 2>&1
}

if ! ldconfig -p 2>/dev/null | grep -q 'libaio\.so'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if ! { apt_get install libaio1 libaio-dev ||
           { apt_get update && apt_get install libaio1 libaio-dev; }; }; then
      cat "$APT_LOG" >&2
      echo "install.sh: apt-get could not install libaio1 and libaio-dev (its output is above)" >&2
      exit 1
    fi
  else
    echo "install.sh: the system libaio is missing; the NVMe tier will use its thread backend" >&2
    echo "            (as root: apt-get install -y libaio1 libaio-dev)" >&2
  fi
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q --root-user-action=ignore "torch==2.13.0"
fi
if package_is_current; then
  echo "install.sh: offload-zero is installed from $ROOT and its C++ extension is up to date"
else
  "$PY" -m pip install -q --root-user-action=ignore -e ".[train,test]"
fi
