"""Loss scaling for float16 training (Micikevicius et al., 2018, "Mixed Precision Training", 3.2).

fp16 has 5 exponent bits: gradients below 2**-24 flush to zero. Multiplying the loss by a scale
S before backward moves the gradients up by S; the update divides them by S again (the C++
Adam's ``grad_scale``, fused into the same pass). A dynamic scale starts high, halves whenever a
gradient holds an inf or nan (that step is skipped: no weight or moment changes) and doubles
after ``growth_interval`` steps in a row without one, so it stays near the largest scale that
does not overflow. These are the defaults and semantics of ``torch.amp.GradScaler`` (DeepSpeed's
``fp16.loss_scale: 0`` is the same scheme with a window of 1000).
"""
from __future__ import annotations

import logging
import math
from typing import Dict

log = logging.getLogger("offload_zero")

__all__ = ["LossScaler", "finite_positive"]


def finite_positive(value) -> bool:
    """Whether ``value`` is a finite int or float > 0 (a bool is not a number here)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


class LossScaler:
    """The loss scale S and its dynamic schedule.

    Args:
        init_scale: the first S, a finite float > 0 (default 2**16).
        dynamic: halve S on overflow and double it after ``growth_interval`` good steps; a
            static scaler keeps ``init_scale`` (an overflowing step is still skipped).
        growth_interval: good steps in a row before S doubles, int >= 1 (default 2000).
        min_scale: S never goes below this, float > 0 and <= ``init_scale`` (default 1.0).
        max_scale: S never goes above this (default 2**24: fp32 keeps 24 bits of mantissa,
            and a scaled fp32 loss stays far from its range).

    Raises:
        ValueError: a value outside the ranges above, naming it.

    Attributes:
        scale: the current S (float, a power of two times ``init_scale``).
        overflows: steps skipped for an inf/nan gradient since construction.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, dynamic: bool = True,
                 growth_interval: int = 2000, min_scale: float = 1.0,
                 max_scale: float = 2.0 ** 24) -> None:
        for name, value in (("init_scale", init_scale), ("min_scale", min_scale),
                            ("max_scale", max_scale)):
            if not finite_positive(value):
                raise ValueError(f"{name}={value!r} is not valid; it must be a finite number > 0")
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(f"init_scale={init_scale!r} must lie in [min_scale={min_scale!r}, "
                             f"max_scale={max_scale!r}]")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval!r} is not valid; it must be an int >= 1")
        self.dynamic = bool(dynamic)
        self.growth_interval = growth_interval
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.scale = float(init_scale)
        self.overflows = 0
        self._good_steps = 0

    def update(self, overflow: bool) -> None:
        """Record one step: ``overflow`` (an inf/nan gradient on any rank: the step was skipped)
        halves a dynamic S, down to ``min_scale`` (an overflow there logs a warning: scaling
        cannot help); the ``growth_interval``-th good step in a row doubles it, up to
        ``max_scale``. Every rank must pass the same ``overflow``."""
        if overflow:
            self.overflows += 1
            self._good_steps = 0
            if self.dynamic and self.scale <= self.min_scale:
                log.warning("loss scale at its minimum %g and the gradients still overflow: the "
                            "step is skipped again (an inf/nan in the loss or the model itself? "
                            "a lower learning rate, or bf16?)", self.scale)
            if self.dynamic:
                self.scale = max(self.min_scale, self.scale * 0.5)
            return
        self._good_steps += 1
        if self.dynamic and self._good_steps >= self.growth_interval:
            self._good_steps = 0
            self.scale = min(self.max_scale, self.scale * 2.0)

    def state_dict(self) -> Dict[str, float]:
        """The scaler's state as plain numbers (for a training checkpoint)."""
        return {"scale": self.scale, "good_steps": self._good_steps, "overflows": self.overflows,
                "dynamic": self.dynamic}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        """Restore :meth:`state_dict`; nothing changes unless all of it is valid. A static
        scaler keeps its own scale (a setting, not state; a different saved one is logged).

        Raises:
            ValueError: a key is missing; the scale is not a finite number in
                [min_scale, max_scale]; good_steps or overflows is not an int >= 0; the state
                is of a dynamic scaler and this one is static, or the reverse (naming both).
        """
        missing = sorted({"scale", "good_steps", "overflows"} - set(state))
        if missing:
            raise ValueError(f"loss scaler state lacks {missing}; it has {sorted(state)}")
        scale = state["scale"]
        if not finite_positive(scale) or not self.min_scale <= scale <= self.max_scale:
            raise ValueError(f"loss scaler state has scale={scale!r}; it must be a finite number "
                             f"in [min_scale={self.min_scale:g}, max_scale={self.max_scale:g}]")
        for key in ("good_steps", "overflows"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"loss scaler state has {key}={value!r}; it must be an int >= 0")
        kind = {True: "dynamic", False: "static"}
        if "dynamic" in state and bool(state["dynamic"]) != self.dynamic:
            raise ValueError(f"the state is of a {kind[bool(state['dynamic'])]} loss scale but "
                             f"this scaler is {kind[self.dynamic]}")
        if self.dynamic:
            self.scale = float(scale)
        elif float(scale) != self.scale:
            log.warning("static loss scale: keeping %g (the loaded state had %g)", self.scale, scale)
        self._good_steps = state["good_steps"]
        self.overflows = state["overflows"]

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale:g}, overflows={self.overflows})"
