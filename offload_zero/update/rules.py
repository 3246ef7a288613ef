"""``update_timing``: when the optimizer update of a flat parameter runs, and the rules of
which timing works with what. Every check of a timing (the engine's config, the training CLI,
``offload="auto"``'s placement, the estimator) calls this module.

The timings (see DESIGN.md, "When updates run"):

- ``"step"``: the plain step, every update in :meth:`OffloadEngine.step`.
- ``"backward"``: each flat parameter is updated as soon as its gradient shard is final in
  backward (FSDP's "optimizer in backward"). Stage 2 or 3, no ``max_grad_norm``, one
  ``backward`` per ``step`` (no gradient accumulation). With a loss scale (fp16) only the
  flat parameters whose gradients overflowed are skipped, not the whole step.
- ``"next_forward"``: ``step()`` decides each update; it is applied just before the unit's
  parameters are next read. Stage 3.
- ``"auto"``: ``"next_forward"`` at stage 3 with the optimizer state on NVMe, ``"step"``
  otherwise (:func:`resolve`); the training CLI's ``auto`` prefers ``"backward"`` where it
  works (:func:`cli_timing`).

All timings give the same numbers. ``zero_grad()`` after a backward skips the batch except
under ``"backward"``, whose updates backward already applied (:func:`check_zero_grad`).
"""
from __future__ import annotations

from typing import Mapping, Optional

STEP = "step"
BACKWARD = "backward"
NEXT_FORWARD = "next_forward"
AUTO = "auto"
UPDATE_TIMINGS = (STEP, BACKWARD, NEXT_FORWARD, AUTO)

# the two switches update_timing replaced, with the timing each value meant
_OLD_SWITCHES = {"step_in_backward": {True: BACKWARD, False: STEP},
                 "step_in_forward": {True: NEXT_FORWARD, False: STEP, None: AUTO}}


def check_name(timing, name: str = "update_timing") -> str:
    """``timing`` itself when it is one of :data:`UPDATE_TIMINGS`; raises ValueError naming
    the value and the choices otherwise."""
    if not isinstance(timing, str) or timing not in UPDATE_TIMINGS:
        raise ValueError(f"{name}={timing!r} is not valid; choose one of {UPDATE_TIMINGS}")
    return timing


def refuse_old_switches(kwargs: Mapping[str, object]) -> None:
    """Raise TypeError if ``kwargs`` holds ``step_in_backward`` or ``step_in_forward`` (the
    switches ``update_timing`` replaced), naming the ``update_timing`` value to pass instead."""
    old = [k for k in _OLD_SWITCHES if k in kwargs]
    if not old:
        return
    uses = []
    for k in old:
        value = kwargs[k]
        timing = _OLD_SWITCHES[k].get(value if isinstance(value, bool) or value is None
                                      else bool(value))
        uses.append(f"{k}={value!r} -> update_timing={timing!r}")
    raise TypeError(f"{', '.join(old)} no longer exist{'s' if len(old) == 1 else ''}: one "
                    f"setting, update_timing, says when updates run ({'; '.join(uses)}); "
                    f"choose one of {UPDATE_TIMINGS}")


def default_timing(stage: int, offload_optimizer: Optional[str]) -> str:
    """``"auto"``'s choice: ``"next_forward"`` at stage 3 with the optimizer state on NVMe
    (``offload_optimizer="nvme"``), ``"step"`` otherwise; ``"auto"`` itself while the
    optimizer tier is not known yet (None: ``offload="auto"`` before its placement). There the
    plain step's NVMe reads and writes of the whole optimizer state (12 bytes per parameter
    each way) have no compute to hide behind; deferred to the next forward they overlap it. The
    numbers are the plain step's; the cost is host memory."""
    if offload_optimizer is None:
        return AUTO
    return NEXT_FORWARD if stage == 3 and offload_optimizer == "nvme" else STEP


def resolve(timing: str, stage: int, offload_optimizer: Optional[str]) -> str:
    """``timing`` with ``"auto"`` replaced by :func:`default_timing`; ValueError for a name
    not in :data:`UPDATE_TIMINGS`."""
    check_name(timing)
    return default_timing(stage, offload_optimizer) if timing == AUTO else timing


def check(timing: str, stage: int, gradient_accumulation_steps: int = 1,
          max_grad_norm: Optional[float] = None) -> None:
    """Raise ValueError if ``timing`` cannot run with these settings, naming the values and
    what works instead:

    - ``"backward"`` needs stage 2 or 3 (gradients reduced unit by unit in backward), no
      gradient accumulation (it updates in each backward) and no ``max_grad_norm`` (the norm
      needs every gradient before the first update);
    - ``"next_forward"`` needs stage 3 (units gathered before each forward).
    """
    check_name(timing)
    if timing == BACKWARD and stage < 2:
        raise ValueError(f"update_timing='backward' needs stage 2 or 3 (gradients reduced unit "
                         f"by unit in backward); got stage={stage}")
    if timing == BACKWARD and gradient_accumulation_steps > 1:
        raise ValueError(f"update_timing='backward' cannot accumulate gradients: "
                         f"gradient_accumulation_steps={gradient_accumulation_steps} needs N "
                         "backward calls per update, and update_timing='backward' updates in "
                         "each one; set update_timing='step' (update_timing='next_forward' "
                         "works)")
    if timing == BACKWARD and max_grad_norm is not None:
        raise ValueError(f"update_timing='backward' cannot clip: max_grad_norm={max_grad_norm!r} "
                         "needs every gradient before the first update; set max_grad_norm=None "
                         "or update_timing='step'")
    if timing == NEXT_FORWARD and stage != 3:
        raise ValueError(f"update_timing='next_forward' needs stage 3 (units gathered before "
                         f"each forward); got stage={stage}")


def check_zero_grad(timing: str, interrupted: bool) -> bool:
    """Whether ``zero_grad()`` after a backward, under ``timing``, drops the batch's gradients
    (True: ``"step"`` and ``"next_forward"``, whose updates wait for ``step()``) or must end the
    step instead (False: ``"backward"`` after a backward that a Ctrl-C or exit interrupted, its
    updates partly applied). Raises RuntimeError for ``"backward"`` after a backward that ran to
    its end: its updates are all applied, so the batch cannot be skipped; the message names
    ``step()`` and the timings that can skip batches."""
    check_name(timing)
    if timing != BACKWARD:
        return True
    if interrupted:
        return False
    raise RuntimeError(
        "zero_grad() after backward() with update_timing='backward': backward already applied "
        "this batch's updates, unit by unit, and they cannot be dropped; call step() to end "
        "the step, or build the engine with update_timing='step' (or 'next_forward' at stage "
        "3) to skip batches with zero_grad()")


def cli_timing(timing: str, stage: int, fp16: bool, grad_accum: int = 1,
               clips: bool = False) -> str:
    """The timing ``offload-zero train --update-timing`` gives the engine. ``"auto"`` is
    ``"backward"`` at stages 2-3 except with ``--dtype fp16`` (an overflow there would skip
    only the units whose gradients overflowed, not the whole step), ``--grad-accum`` above 1
    (it updates in each backward) or clipping (a DeepSpeed config's ``gradient_clipping``),
    and the engine's ``"auto"`` otherwise (:func:`default_timing`). Raises ValueError naming
    the flags for ``backward`` at stage 1 or with ``--grad-accum`` above 1 (gradients are
    reduced only in step() there, or must accumulate), and for ``next_forward`` below stage 3."""
    check_name(timing, "--update-timing")
    if timing == BACKWARD and stage < 2:
        raise ValueError(f"--update-timing backward needs --stage 2 or 3, got --stage {stage}")
    if timing == BACKWARD and grad_accum > 1:
        raise ValueError(f"--update-timing backward updates in each backward, so it cannot "
                         f"accumulate --grad-accum {grad_accum} micro-batches; give "
                         "--update-timing step or next_forward (or --grad-accum 1)")
    if timing == NEXT_FORWARD and stage != 3:
        raise ValueError(f"--update-timing next_forward needs --stage 3, got --stage {stage}")
    if timing == AUTO and stage >= 2 and not fp16 and grad_accum == 1 and not clips:
        return BACKWARD
    return timing


def keeps_tail_in_host(timing: str) -> bool:
    """Whether ``timing`` can keep the state updated last in backward and needed first in
    forward (the embeddings') in host memory (``tail_state_in_host``): the two timings whose
    state I/O overlaps compute."""
    return timing in (BACKWARD, NEXT_FORWARD)
