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

import math
from typing import Dict

__all__ = ["LossScaler"]


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
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
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
        halves a dynamic S, down to ``min_scale``; the ``growth_interval``-th good step in a row
        doubles it, up to ``max_scale``. Every rank must pass the same ``overflow``."""
        if overflow:
            self.overflows += 1
            self._good_steps = 0
            if self.dynamic:
                self.scale = max(self.min_scale, self.scale * 0.5)
            return
        self._good_steps += 1
        if self.dynamic and self._good_steps >= self.growth_interval:
            self._good_steps = 0
            self.scale = min(self.max_scale, self.scale * 2.0)

    def state_dict(self) -> Dict[str, float]:
        """The scaler's state as plain numbers (for a training checkpoint)."""
        return {"scale": self.scale, "good_steps": self._good_steps, "overflows": self.overflows}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        """Restore :meth:`state_dict`. Raises ValueError if a key is missing or the scale is not
        a finite number > 0."""
        missing = sorted({"scale", "good_steps", "overflows"} - set(state))
        if missing:
            raise ValueError(f"loss scaler state lacks {missing}; it has {sorted(state)}")
        scale = float(state["scale"])
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"loss scaler state has scale={state['scale']!r}; it must be a finite number > 0")
        self.scale = scale
        self._good_steps = int(state["good_steps"])
        self.overflows = int(state["overflows"])

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale:g}, overflows={self.overflows})"
