"""A Ctrl-C (KeyboardInterrupt) or SIGTERM (raised by the CLI's and the engine's handlers) lands
at whatever bytecode the main thread is running. Wherever it lands in a step, the caller must
see that interrupt and nothing else, and closing the engine must free everything and leave no
swap file behind. The tests below raise a KeyboardInterrupt at one point of a step in turn,
from a trace function (``sys.settrace``), at the start of a line of the package's code.

Points that a signal cannot reach are left out: the line event that Python's tracing reports at
the end of a ``with`` block comes before the block's ``__exit__`` is called, outside the
block's protection, while a signal handler runs only where the interpreter checks for pending
calls (function entry, calls, loop jumps), never between that point and the ``__exit__``.
"""
import faulthandler
import linecache
import logging
import os
import sys

import pytest
import torch

import offload_zero
from models import TinyLM, batches, lm_loss
from offload_zero import OffloadEngine

PACKAGE = os.path.dirname(offload_zero.__file__)
POINTS = 80  # interrupt points per mode, spread over the step's lines
MODES = {
    "none": dict(offload="none"),
    "cpu": dict(offload="cpu"),
    "nvme": dict(offload="nvme"),  # update_timing="next_forward": updates in the next forward
    "nvme-plain": dict(offload="nvme", update_timing="step"),
    "nvme-sib": dict(offload="nvme", update_timing="backward"),
}


class _Interrupter:
    """Counts the package's line events while armed (only lines that start with ``only``, if
    given); raises KeyboardInterrupt at the ``at``-th."""

    def __init__(self, at: int, only: str = ""):
        self.at, self.only, self.count, self.armed, self.where = at, only, 0, False, None

    def _local(self, frame, event, arg):
        if event == "line" and self.armed:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip()
            if not line.startswith("with ") and line.startswith(self.only):
                self.count += 1
                if self.count == self.at:
                    self.armed = False
                    self.where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
                    raise KeyboardInterrupt
        return self._local

    def __call__(self, frame, event, arg):
        return self._local if frame.f_code.co_filename.startswith(PACKAGE) else None


def _train(folder, kw, at: int, only: str = "") -> _Interrupter:
    """One step untraced, then zero_grad/forward/backward/step twice with ``at``'s interrupter
    armed, inside ``with OffloadEngine(...)``."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = TinyLM(n_blocks=3)
    data = batches(3)
    trap = _Interrupter(at, only)
    sys.settrace(trap)
    try:
        with OffloadEngine(model, lr=1e-2, **kw,
                           path=str(folder) if kw["offload"] == "nvme" else None) as eng:
            x, y = data[0]
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            trap.armed = True
            for x, y in data[1:]:
                eng.zero_grad()
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            trap.armed = False
    finally:
        sys.settrace(None)
    return trap


def _interrupted(folder, kw, at, caplog, only=""):
    """Run :func:`_train` interrupted at point ``at``; check what the caller and the disk see."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload_zero"):
        with pytest.raises(KeyboardInterrupt):
            _train(folder, kw, at, only)
    where = f"{kw}: interrupt at point {at}"
    assert "after KeyboardInterrupt raised" not in caplog.text, f"{where}: {caplog.text}"
    assert [p.name for p in folder.rglob("*")] == [], where
    assert torch.is_grad_enabled(), where


@pytest.mark.parametrize("mode", list(MODES))
def test_an_interrupt_anywhere_in_a_step_reaches_the_caller_and_close_frees_everything(
        mode, tmp_path, caplog):
    """At each of ``POINTS`` points spread over two steps: the ``with`` block raises that
    KeyboardInterrupt (not an error of the engine's cleanup, nothing swallowed, no hang),
    closing logs no error, no swap file is left, and grad mode is as it was."""
    kw = MODES[mode]
    total = _train(tmp_path / "count", kw, at=0).count
    assert total > POINTS
    # (the count varies by a few percent from run to run, with the polls of I/O in flight: the
    # points stay within 95% of it, so the last ones never fall past the end of a shorter run)
    span = total * 95 // 100
    faulthandler.dump_traceback_later(300, exit=True)  # a hang fails the run instead of stalling it
    try:
        for i in range(POINTS):
            at = 1 + (i * span) // POINTS + (7 * i) % max(1, span // POINTS)
            _interrupted(tmp_path / f"at{at}", kw, at, caplog)
    finally:
        faulthandler.cancel_dump_traceback_later()
        torch.set_grad_enabled(True)


@pytest.mark.parametrize("mode", [m for m in MODES if m.startswith("nvme")])
def test_an_interrupt_between_freeing_a_unit_and_marking_it_free(mode, tmp_path, caplog):
    """Resharding a unit frees its memory, then marks it sharded. An interrupt between the two
    used to make the end of backward free it again, and the accounting's underflow error
    replaced the interrupt. Each such point of the two steps in turn (up to 12). (Modes whose
    parameters live in NVMe files: at world size 1 the others keep every unit gathered.)"""
    kw = MODES[mode]
    only = "self.state = ShardedState.SHARDED"
    total = _train(tmp_path / "count", kw, at=0, only=only).count
    assert total > 0
    for at in range(1, min(total, 12) + 1):
        _interrupted(tmp_path / f"at{at}", kw, at, caplog, only)


@pytest.mark.parametrize("block_raises", [True, False])
def test_an_error_in_one_part_of_close_still_closes_the_rest(block_raises, tmp_path, caplog,
                                                             monkeypatch):
    """close() closes every part even when one raises, and raises that error afterwards; when
    the ``with`` block itself raised (here a Ctrl-C), that is what leaves the block, and the
    error of the close is logged with it."""
    from offload_zero.partition.grads import GradientShards

    def broken(self):
        raise RuntimeError("grads release failed")
    monkeypatch.setattr(GradientShards, "release", broken)
    torch.manual_seed(0)
    (x, y), = batches(1)
    eng = OffloadEngine(TinyLM(n_blocks=3), offload="nvme", path=str(tmp_path), lr=1e-2)
    eng.backward(lm_loss(eng(x), y))
    eng.step()
    expected = KeyboardInterrupt if block_raises else RuntimeError
    with caplog.at_level(logging.WARNING, logger="offload_zero"):
        with pytest.raises(expected):
            with eng:
                if block_raises:
                    raise KeyboardInterrupt
    assert ("after KeyboardInterrupt raised RuntimeError: grads release failed" in caplog.text) \
        == block_raises
    assert [p.name for p in tmp_path.rglob("*")] == []
    assert all(pool._closed for pool in eng.pools.values()) and eng.pools
    assert all(fp.full.numel() == 0 and fp.sharded.numel() == 0 for fp in eng.flat_params)
    assert eng.swapper.closed


@pytest.mark.parametrize("mode", ["nvme", "nvme-sib"])
def test_a_second_ctrl_c_while_closing_still_removes_the_swap_files(mode, tmp_path, monkeypatch):
    """Users press Ctrl-C twice. The second one used to land while the swapper waited for its
    transfers in flight, before it deleted its files: they stayed, and the next run refused to
    overwrite them. Now the swapper holds SIGINT back until its files are gone, then raises it."""
    import signal
    torch.manual_seed(0)
    (x, y), = batches(1)
    eng = OffloadEngine(TinyLM(n_blocks=3), lr=1e-2, path=str(tmp_path), **MODES[mode])
    eng.backward(lm_loss(eng(x), y))
    eng.step()
    backend_type = type(eng.swapper._state.backend)
    backend_close = backend_type.close

    def close_with_a_second_ctrl_c(self):
        signal.raise_signal(signal.SIGINT)  # (its handler runs at the next bytecode)
        backend_close(self)
    monkeypatch.setattr(backend_type, "close", close_with_a_second_ctrl_c)
    assert list(tmp_path.rglob("*.swp"))
    with pytest.raises(KeyboardInterrupt):
        with eng:
            raise KeyboardInterrupt  # the first Ctrl-C
    assert [p.name for p in tmp_path.rglob("*")] == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_ending_an_interrupted_backward_does_not_replace_the_interrupt(
        tmp_path, caplog, monkeypatch):
    """A Ctrl-C inside backward makes the engine end the backward (free the units) before it
    re-raises; an error there used to replace the Ctrl-C. It is logged instead, and the
    engine still closes cleanly."""
    from offload_zero.partition.schedule import UnitScheduler
    torch.manual_seed(0)
    data = batches(2)
    eng = OffloadEngine(TinyLM(n_blocks=3), offload="nvme", path=str(tmp_path), lr=1e-2)
    x, y = data[0]
    eng.backward(lm_loss(eng(x), y))
    eng.step()
    end_backward = UnitScheduler.end_backward

    def failing(self):
        end_backward(self)
        raise RuntimeError("end of backward failed")
    monkeypatch.setattr(UnitScheduler, "end_backward", failing)
    x, y = data[1]
    loss = lm_loss(eng(x), y)
    loss.register_hook(lambda g: (_ for _ in ()).throw(KeyboardInterrupt))  # Ctrl-C in backward
    with caplog.at_level(logging.WARNING, logger="offload_zero"):
        with pytest.raises(KeyboardInterrupt):
            eng.backward(loss)
    assert ("ending the backward after KeyboardInterrupt raised RuntimeError: end of backward "
            "failed") in caplog.text
    eng.close()
    assert [p.name for p in tmp_path.rglob("*")] == []
