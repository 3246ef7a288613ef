"""Gradient accumulation's micro-step count: which ``step()`` calls update the weights, what
``backward()`` divides the loss by, what ``zero_grad()`` drops, and the checks before a
backward (the loss; with ``update_timing="backward"``, no gradients waiting).

With ``gradient_accumulation_steps=N`` (DeepSpeed's meaning) every N-th ``step()`` call
updates; the others only end a micro-batch and keep the gradients accumulated so far. Nothing
here knows the engine: :class:`Accumulation` is given the update states, the scheduler and the
parameter groups' check it works with.
"""
from __future__ import annotations

from typing import Callable

import torch

from offload_zero.update.rules import BACKWARD
from offload_zero.update.state import UpdateStates


class Accumulation:
    """The micro-step bookkeeping of one engine.

    Args:
        steps: ``gradient_accumulation_steps``, an int >= 1 (the config checked it).
        update_timing: the resolved ``update_timing`` (``"step"``, ``"backward"`` or
            ``"next_forward"``).
        states: the engine's :class:`offload_zero.update.state.UpdateStates`, whose
            ``grads_pending`` says whether a backward since the last step left gradients.
        scheduler: the :class:`offload_zero.partition.schedule.UnitScheduler` (a step that
            only ends a micro-batch reshards its units, as an update does).
        hypers: ``engine.optimizer.hypers``: every parameter group's values, checked
            (ValueError naming a bad one).

    Attributes:
        micro_steps: ``step()`` calls counted since the engine was built (an int >= 0; a
            ``zero_grad()`` that drops gradients takes back those of the unfinished window).
        micro_stepped: whether the last ``step()`` only ended a micro-batch, with no backward
            since.
    """

    def __init__(self, steps: int, update_timing: str, states: UpdateStates, scheduler,
                 hypers: Callable[[], tuple]):
        self.steps, self.update_timing = steps, update_timing
        self._states, self._scheduler, self._hypers = states, scheduler, hypers
        self.micro_steps = 0
        self.micro_stepped = False

    def is_boundary(self) -> bool:
        """Whether the next ``step()`` call updates the weights: every ``steps``-th call does
        (always True with ``steps`` 1)."""
        return (self.micro_steps + 1) % self.steps == 0

    def check_backward(self, loss) -> None:
        """Before a backward of ``loss``: raises ValueError unless it is a scalar tensor that
        requires grad. With ``update_timing="backward"`` also RuntimeError if gradients of an
        earlier backward wait for ``step()`` (the weights change during backward, so gradients
        cannot accumulate), and ValueError naming a parameter group's bad value (here, not
        inside backward's hooks)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("backward needs a scalar loss tensor that requires grad, got "
                             f"{_describe(loss)}")
        if self.update_timing != BACKWARD:
            return
        if self._states.grads_pending:
            raise RuntimeError("update_timing='backward' updates the weights during backward, "
                               "so gradients cannot accumulate over several backward calls: "
                               "call step() after each backward, or use update_timing='step' "
                               "(or 'next_forward')")
        self._hypers()

    def start_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """A backward of ``loss`` (a scalar tensor) begins: gradients are pending from now on.
        Returns the loss divided by ``steps`` when it is > 1 (so the micro-batches' gradients
        sum to their mean loss's), else ``loss`` itself."""
        self._states.grads_pending = True
        self.micro_stepped = False
        return loss / self.steps if self.steps > 1 else loss

    def nothing_to_drop(self) -> bool:
        """Whether ``zero_grad()`` has nothing to do: no backward since the last step, or the
        last ``step()`` only ended a micro-batch (``step(); zero_grad()`` accumulates)."""
        return not self._states.grads_pending or self.micro_stepped

    def dropped(self) -> None:
        """``zero_grad()`` dropped the gradients: the accumulation window starts again (the
        next ``steps`` calls of ``step()`` make the next update)."""
        self.micro_steps -= self.micro_steps % self.steps
        self._states.grads_pending = False

    def ends_micro_batch(self) -> bool:
        """At a ``step()`` call: True when it is no boundary, having counted it and resharded
        every unit (the root may be gathered); False at a boundary, where the caller updates
        and then calls :meth:`updated`."""
        if self.is_boundary():
            return False
        self._scheduler.reshard_all()
        self.micro_steps += 1
        self.micro_stepped = True
        return True

    def updated(self) -> None:
        """The update of a boundary ``step()`` call is done: count the call."""
        self.micro_steps += 1


def _describe(x) -> str:
    """``x`` in an error message: a tensor's shape and ``requires_grad``, else its type."""
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} (requires_grad={x.requires_grad})"
    return repr(type(x).__name__)
