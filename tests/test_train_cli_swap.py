"""The NVMe swap folder of ``offload-zero train``: a disk too small or filling up is one line,
SIGTERM and Ctrl-C remove the swap files (or name those left), and folders of killed runs are
named, not removed."""
import errno
import os
import shutil
import subprocess
import sys

import pytest

from offload_zero import cli, train
from train_cli_helpers import FAST, REPO, _files_under, _parse, unwritable_folder


def test_a_disk_too_small_for_the_nvme_files_is_one_line_before_training(tmp_path, capsys,
                                                                           monkeypatch):
    """Checked before anything is built: the bytes the NVMe files need on --path's file system
    (the estimator's count, this engine's files), what is free there, and what to do."""
    swap = tmp_path / "swap"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: usage._replace(free=1 << 20))  # 1 MiB free
    assert cli.main(["train", "--preset", "tiny", "--steps", "1", "--offload", "nvme",
                     "--path", str(swap), "--no-progress", *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"{str(swap)!r}" in err and "1.0 MiB free" in err
    assert "smaller model" in err and "--offload auto" in err and "another --path" in err
    assert not swap.exists()  # nothing was created


def test_a_swap_folder_that_cannot_be_written_is_named_not_reported_full():
    """A file system where no file can be created (/proc: 0 bytes free, and os.access passes
    for root) is reported as such, with the OS error and another --path to give, not as a
    disk too small ("0 B free: train a smaller model")."""
    ro = unwritable_folder()
    for path in (f"{ro}/swap", ro):
        with pytest.raises(ValueError) as info:
            train.check_disk_space(path, 1)
        msg = str(info.value)
        assert msg.startswith(f"--offload nvme: the swap folder --path {path!r} cannot be "
                              f"written (creating a file in {ro!r}: [Errno "), msg
        assert "give another --path" in msg and " free" not in msg, msg


def test_a_disk_that_fills_up_during_the_run_is_the_same_one_line(tmp_path, capsys,
                                                                  monkeypatch):
    """A disk that fills up after the check (another job writing there) ends the run with the
    same line, not a SwapIOError traceback naming one file's bytes."""
    from offload_zero.memory import swapper

    def full(fd, path, nbytes):
        raise swapper.SwapIOError(errno.ENOSPC, f"cannot reserve {nbytes} bytes for {path}: "
                                  "[Errno 28] No space left on device", path, 0, nbytes)
    monkeypatch.setattr(swapper, "_reserve", full)
    swap = tmp_path / "swap"
    assert cli.main(["train", "--preset", "tiny", "--steps", "1", "--offload", "nvme",
                     "--path", str(swap), "--no-progress", *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "no space left" in err and f"{str(swap)!r}" in err and " free" in err
    assert "--offload auto" in err


@pytest.mark.parametrize("signame,code,word", [("SIGTERM", 143, "terminated (SIGTERM)"),
                                               ("SIGINT", 130, "interrupted (Ctrl-C)")])
def test_sigterm_removes_swap_files(signame, code, word, tmp_path):
    """torchrun, Slurm and docker stop send SIGTERM, a user Ctrl-C: the run must unwind, clean
    up, and say so in one line."""
    import signal
    import time
    swap = tmp_path / "swap"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "offload_zero.cli", "train", "--preset", "tiny",
                             "--steps", "100000", "--offload", "nvme", "--path", str(swap), *FAST],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(swap.rglob("*.swp")):
        time.sleep(0.2)
    assert list(swap.rglob("*.swp")), "the run never created its swap files"
    time.sleep(1.0)
    proc.send_signal(getattr(signal, signame))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert f"{word}; swap files removed" in err and "Traceback" not in err
    assert _files_under(swap) == []


def test_swap_folders_of_killed_runs_are_named_not_removed(tmp_path, monkeypatch, caplog):
    """A SIGKILLed run leaves its default swap folder (nothing runs to remove it). The next
    NVMe run warns with the folder, its bytes and the command that removes it, and leaves it
    (and a live run's folder) alone."""
    import tempfile
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"offload-zero-swap-{gone.pid}-abc123"
    (stale / "rank0").mkdir(parents=True)
    (stale / "rank0" / "unit0.swp").write_bytes(b"\0" * 8192)
    live = tmp_path / f"offload-zero-swap-{os.getpid()}-live99"
    live.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with caplog.at_level("WARNING", logger="offload_zero.train"):
        train.run(_parse("--preset", "tiny", "--steps", 1, "--offload", "nvme", "--no-progress",
                         *FAST))
    warnings = [r.getMessage() for r in caplog.records if "left by killed runs" in r.getMessage()]
    assert warnings == [f"1 swap folder(s) left by killed runs hold 8.0 KiB; remove them with: "
                        f"rm -r {stale}"]
    assert (stale / "rank0" / "unit0.swp").is_file() and live.is_dir()
    ours = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("offload-zero-swap-"))
    assert ours == sorted([stale.name, live.name])  # this run's own folder is gone


def test_an_interrupted_run_that_left_swap_files_names_them(tmp_path, capsys, monkeypatch):
    """A clean-up cut short (a second Ctrl-C, say) that left swap files under --path used to
    end with 'swap files removed' all the same; the next run then refused to start. The last
    line now names what is left and says to remove it."""
    from offload_zero import cli, train
    left = tmp_path / "swap" / "rank0"
    left.mkdir(parents=True)

    runs = []

    def interrupted(args):
        if not runs:  # the first run leaves a file behind
            (left / "unit0.trainable.swp").write_bytes(b"")
        runs.append(args)
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "run", interrupted)
    assert cli.main(["train", "--path", str(tmp_path / "swap")]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "interrupted (Ctrl-C); 1 swap file(s) left under" in err and "removed" not in err
    assert "unit0.trainable.swp" in err and err.endswith("remove them")
    (left / "unit0.trainable.swp").unlink()
    assert cli.main(["train", "--path", str(tmp_path / "swap")]) == 130
    assert capsys.readouterr().err.strip().endswith("interrupted (Ctrl-C); swap files removed")


def test_an_interrupted_program_ignores_further_signals_while_it_exits(monkeypatch, capsys):
    """Run as the program (no argv) and interrupted, the CLI ignores a further Ctrl-C or
    SIGTERM on its way out: a second Ctrl-C landing in the interpreter's exit handlers printed
    a traceback after the last line (seen from torch's own). Called with argv, it changes no
    handler."""
    import signal
    from offload_zero import cli, train

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "run", interrupted)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert cli.main(["train"]) == 130
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    monkeypatch.setattr(sys, "argv", ["offload-zero", "train"])
    try:
        assert cli.main() == 130
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    assert capsys.readouterr().err.count("interrupted (Ctrl-C)") == 2
