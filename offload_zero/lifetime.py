"""The engine's process lifetime: releasing its resources (also from its finalizer), SIGTERM
as a clean exit, and clean-ups that must not replace the exception in flight.

Nothing here holds the engine: the finalizer (``weakref.finalize``) keeps only the parts it
releases, so the engine itself can be collected.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading

log = logging.getLogger("offload_zero")

WRAPPED = "_offload_zero_wrapped"  # set on a model an engine has taken the parameters of


def exit_on_sigterm() -> None:
    """Make SIGTERM (torchrun stopping the other workers, Slurm, ``docker stop``) end the
    process as ``sys.exit(143)`` instead of at once, so ``with`` blocks, ``close()`` and the
    engines' finalizers run and the swap files go (tens of GB on a disk that the next run
    would otherwise refuse). Only where SIGTERM still has its default action, from the main
    thread, once per process: a handler of the program's own is left as it is."""
    try:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
            signal.signal(signal.SIGTERM, _sigterm_exit)
    except (ValueError, OSError):  # (no signals here: an embedded interpreter, say)
        pass


def _sigterm_exit(signum, frame):
    raise SystemExit(128 + signum)


def collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the ranks fell out of step (another rank failed, or they were at
    different collectives): no further collective can be run then."""
    from offload_zero.lockstep import CollectiveMismatch, PeerFailure
    return isinstance(exc, (CollectiveMismatch, PeerFailure))


@contextlib.contextmanager
def not_replacing(exc: BaseException, rank: int, doing: str = "releasing the engine"):
    """A clean-up run while ``exc`` (a Ctrl-C, a SIGTERM, the caller's own error) propagates:
    an error of the clean-up is logged as a warning instead of raised, so ``exc`` is what the
    caller sees."""
    try:
        yield
    except Exception as cleanup_exc:  # noqa: BLE001 - the exception in flight goes first
        log.warning("[rank %d] %s after %s raised %s: %s", rank, doing, type(exc).__name__,
                    type(cleanup_exc).__name__, cleanup_exc)


def close_engine(comm, exposure, updates, finalizer) -> None:
    """``engine.close()``'s work, in order: the model's hooks go (``exposure.remove()``), updates
    cut short by an error end their I/O (``updates.close()``), then ``finalizer()`` releases
    the parts (:func:`release`), even if the first two raised. Each error is recorded for the
    other ranks (``comm.reporting()``) and raised; the finalizer's replaces an earlier one."""
    try:
        with comm.reporting():
            exposure.remove()
            updates.close()
    finally:
        with comm.reporting():
            finalizer()


def release(acct, store, param_home, swapper, pools, scheduler, grads, flat_params) -> None:
    """Close the engine's resources; swap files go first: they must not outlive the process.

    Any of them may be None (a constructor that failed half-way). Every part is closed even if
    an earlier one raises (an interrupt can leave any bookkeeping half updated); the first
    error is raised once all have run."""
    acct.closing()
    parts = [part.close for part in (store, param_home) if part is not None]
    if swapper is not None:
        parts.append(swapper.close)
    if scheduler is not None:
        parts.append(scheduler.remove_hooks)
    if grads is not None:
        parts.append(grads.release)
    parts += [fp.release for fp in flat_params] + [pool.close for pool in pools.values()]
    first = None
    for close in parts:
        try:
            close()
        except BaseException as exc:  # noqa: BLE001 - the rest must still be closed
            first = first or exc
    if first is not None:
        raise first
