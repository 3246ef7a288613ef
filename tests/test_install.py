"""``install.sh`` on a copy of the checkout, with stand-ins for the system: ``apt-get``,
``ldconfig`` and ``id`` on PATH, and PYTHON a wrapper that records every call and answers
``-m pip`` itself (nothing is installed or removed; other calls run this Python with the copy
importable, as an editable install of it would be)."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILT = sorted((REPO / "offload_zero").glob("_C*.so"))


def _script(path: Path, text: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + text)
    path.chmod(0o755)


def _checkout(tmp_path: Path, libaio: bool, apt_exit: int = 0) -> Path:
    """A copy of the checkout (extension built after its sources) and the stand-ins under
    ``tmp_path``; every call of apt-get and of PYTHON is appended to ``tmp_path/calls``."""
    copy = tmp_path / "checkout"
    copy.mkdir()
    for name in ("install.sh", "setup.py", "pyproject.toml"):
        shutil.copy2(REPO / name, copy / name)
    shutil.copytree(REPO / "csrc", copy / "csrc")
    shutil.copytree(REPO / "offload_zero", copy / "offload_zero",
                    ignore=shutil.ignore_patterns("__pycache__"))
    old = time.time() - 3600
    for source in [copy / "setup.py", *(copy / "csrc").iterdir()]:
        os.utime(source, (old, old))
    for built in (copy / "offload_zero").glob("_C*.so"):  # (built after them, whenever it was)
        os.utime(built, None)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    _script(bin_dir / "ldconfig", "echo '\tlibaio.so.1 (libc6,x86-64) => /lib/libaio.so.1'\n"
            if libaio else "true\n")
    _script(bin_dir / "id", "echo 0\n")
    _script(bin_dir / "apt-get", f'echo "apt-get $*" >> {calls}\n'
            f'echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process '
            f'4242 (apt-get)" >&2\nexit {apt_exit}\n')
    _script(bin_dir / "python", f'echo "python $*" >> {calls}\n'
            '[ "${1-}" = -m ] && [ "${2-}" = pip ] && exit 0\n'
            f'PYTHONPATH={copy} exec {sys.executable} "$@"\n')
    return copy


def _install(tmp_path: Path, copy: Path):
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
               PYTHON=str(tmp_path / "bin" / "python"))
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", str(copy / "install.sh")], env=env, capture_output=True,
                          text=True, timeout=120)


def _calls(tmp_path: Path):
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.skipif(not BUILT, reason="the C++ extension is not built in this checkout")
def test_a_second_run_skips_the_build_until_a_source_changes(tmp_path):
    copy = _checkout(tmp_path, libaio=True)
    proc = _install(tmp_path, copy)
    assert proc.returncode == 0, proc.stderr
    assert not [c for c in _calls(tmp_path) if c.startswith("python -m pip")], _calls(tmp_path)
    assert "is up to date" in proc.stdout
    os.utime(copy / "csrc" / "adam_scalar.cpp")  # (edited now: newer than the extension)
    proc = _install(tmp_path, copy)
    assert proc.returncode == 0, proc.stderr
    pips = [c for c in _calls(tmp_path) if c.startswith("python -m pip")]
    assert len(pips) == 1 and pips[0].endswith("-e .[train,test]"), pips


def test_apt_waits_for_the_dpkg_lock_and_its_error_is_shown(tmp_path):
    copy = _checkout(tmp_path, libaio=False, apt_exit=100)
    proc = _install(tmp_path, copy)
    assert proc.returncode != 0
    apts = [c for c in _calls(tmp_path) if c.startswith("apt-get")]
    assert apts and all("-o DPkg::Lock::Timeout=300" in c for c in apts), apts
    assert "Could not get lock /var/lib/dpkg/lock-frontend" in proc.stderr
    assert "could not install libaio1 and libaio-dev" in proc.stderr
    assert not [c for c in _calls(tmp_path) if c.startswith("python")]  # stopped there
