"""Loud errors for handing the engine's objects to Hugging Face accelerate's ``prepare()``.

The pattern that works: ``accelerator.prepare(loader)`` for the data loader only; the
:class:`~offload_zero.OffloadEngine` owns the model, the optimizer and gradient accumulation
(``engine(**batch)``, ``engine.backward(loss)``, ``engine.step()``). Preparing the wrapped model
would move or wrap its placeholders (DDP, autocast), preparing ``engine.optimizer`` would wrap
it in accelerate's own step-skipping and device moves, and ``accelerator.backward(loss)``
bypasses ``engine.backward`` (its loss scale and accumulation).

Nothing of accelerate is patched. [Note: accelerate's prepare]
- ``prepare_model`` and ``prepare_optimizer`` begin with ``if getattr(obj,
  "_is_accelerate_prepared", False):``. The wrapped model (an instance attribute) and
  ``EngineOptimizer`` (a class attribute) carry a :class:`RefusePrepare` there, whose truth test
  raises. No other code reads that name.
- ``prepare(engine)``: accelerate passes objects it does not know through unchanged, after
  testing them with ``isinstance`` against its DataLoader, Module, Optimizer and LRScheduler
  classes; a failed ``isinstance`` reads ``obj.__class__``. The engine's ``__class__`` is a
  property returning its type, as for any object, that raises instead when the caller is
  accelerate's ``prepare`` or one of its ``_prepare_*`` helpers (:func:`refuse_in_accelerate`;
  other accelerate calls, ``unwrap_model`` say, are left alone), as ``unittest.mock``
  answers ``isinstance`` through ``__class__``.
- ``accelerator.accumulate(model)`` reads nothing of the model in one process, so it cannot be
  refused without patching accelerate: with an engine, use ``gradient_accumulation_steps=N``
  and keep ``Accelerator(gradient_accumulation_steps=1)`` (the default).
"""
from __future__ import annotations

PATTERN = ("with accelerate, prepare only the data loader (loader = accelerator.prepare("
           "loader)): the OffloadEngine owns the model, the optimizer and gradient "
           "accumulation; in the loop call engine(**batch), engine.backward(loss) (not "
           "accelerator.backward) and engine.step(), with OffloadEngine(..., "
           "gradient_accumulation_steps=N) instead of accelerator.accumulate (README, "
           "\"accelerate and Trainer-style loops\")")


class RefusePrepare:
    """The value of ``_is_accelerate_prepared`` on what the engine owns: testing its truth (as
    accelerate's ``prepare_model`` / ``prepare_optimizer`` do first) raises ValueError naming
    ``what`` and the pattern that works (see [Note: accelerate's prepare])."""

    def __init__(self, what: str):
        self.what = what

    def __bool__(self):
        raise ValueError(f"accelerator.prepare({self.what}): {PATTERN}")

    def __repr__(self) -> str:
        return f"RefusePrepare({self.what!r})"


def refuse_in_accelerate(frame, what: str) -> None:
    """Raise ValueError naming ``what`` and the pattern that works if ``frame`` (the caller of
    an ``isinstance`` test on the engine) is ``Accelerator.prepare`` or one of its
    ``_prepare_*`` helpers."""
    if frame is None or frame.f_globals.get("__name__") != "accelerate.accelerator":
        return
    if frame.f_code.co_name.lstrip("_").startswith("prepare"):
        raise ValueError(f"accelerator.prepare({what}): {PATTERN}")
