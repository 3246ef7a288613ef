"""``CPUAdam``: the C++ host Adam/AdamW as a ``torch.optim.Optimizer``.

A drop-in for ``torch.optim.AdamW`` (``adamw_mode=True``) or ``torch.optim.Adam``
(``adamw_mode=False``) on CPU fp32 (or bf16) parameters: param groups, LR schedulers
(``group['lr']`` is read on every step) and ``state_dict``/``load_state_dict`` with torch's
state keys (``step``, ``exp_avg``, ``exp_avg_sq``) all work, so states move between this class
and torch's.
With ``state_dtype=torch.bfloat16`` the moments are kept in bf16 (stochastic rounding, see
:func:`offload_zero.optim.adam_step_`): 4 bytes per parameter less; with ``torch.uint8``, as
blockwise 8-bit codes (:mod:`offload_zero.optim.int8_moments`): 5.97 bytes per parameter less.
bf16 parameters are master weights of their own (2 bytes each instead of 4), updated in fp32
and stored with stochastic rounding.
"""
from __future__ import annotations

import math
from itertools import chain
from typing import Callable, Iterable, Optional, Tuple

import torch

from offload_zero.optim import int8_moments
from offload_zero.optim.kernel import adam_step_

__all__ = ["CPUAdam"]


def _describe(group_index: int, param_index: int, p: torch.Tensor) -> str:
    return (f"param_groups[{group_index}]['params'][{param_index}] (shape={tuple(p.shape)}, "
            f"dtype={p.dtype}, device={p.device})")


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW on CPU fp32 or bf16 parameters, one fused SIMD pass per parameter.

    Per element, with t the parameter's step count (Kingma & Ba 2015; Loshchilov & Hutter
    2019)::

        g = grad + weight_decay * p              (adamw_mode=False: Adam with L2)
        p = p * (1 - lr * weight_decay)          (adamw_mode=True: AdamW)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    (the bias-correction terms are 1 when ``bias_correction=False``). Results match
    ``torch.optim.AdamW``/``Adam`` with ``foreach=False`` to float rounding.

    Args:
        params: iterable of tensors or of param-group dicts, as for any torch optimizer. Each
            parameter must be a contiguous CPU float32 or bfloat16 tensor; its ``.grad`` may
            be float32, bfloat16 or float16 (any shape matching the parameter). A bfloat16
            parameter is its own master weight: updated in fp32 and stored with stochastic
            rounding, seeded as the moments (:func:`offload_zero.optim.adam_step_`; its
            random bits are independent of theirs); its moments keep ``state_dtype``.
        lr: learning rate, >= 0.
        betas: (beta1, beta2) in [0, 1).
        eps: denominator term, >= 0.
        weight_decay: >= 0; decoupled for ``adamw_mode=True``, an L2 term otherwise.
        adamw_mode: AdamW (True) or Adam (False).
        bias_correction: apply Adam's bias correction (True, as torch) or not.
        state_dtype: dtype of ``exp_avg``/``exp_avg_sq``: ``torch.float32`` (default, matches
            torch) or ``torch.bfloat16`` (half the moment memory; stored with stochastic
            rounding, seeded per parameter by its position in the groups, deterministic given
            the step). A per-group key like ``lr``. Moments loaded with another dtype (e.g.
            fp32 from a torch state dict, or bf16 ones that ``load_state_dict`` cast to the
            parameter's fp32) are converted on the next step. ``torch.uint8``: blockwise 8-bit
            moments, ``exp_avg``/``exp_avg_sq`` their uint8 codes beside fp32
            ``exp_avg_absmax``/``exp_avg_sq_absmax`` (one per 256 elements); fp32 moments
            loaded into such a group are encoded to nearest, and 8-bit ones decoded for an fp32
            or bf16 group.
        check_overflow: read every gradient for inf/nan before writing anything, so a bad
            gradient leaves the state untouched (True, the default: 4 more bytes per parameter
            of memory traffic). False skips that pass, as torch's fused AdamW does: a non-finite
            gradient then raises RuntimeError after the state was written. A per-group key.

    Parameters whose ``.grad`` is None are skipped. If a parameter's gradient holds an inf or
    nan, that parameter and its moments are left unchanged and its step count is not advanced;
    ``last_step_overflow`` is then True after :meth:`step`.

    Raises:
        ValueError: a hyperparameter is out of range, or a parameter is not a contiguous CPU
            float32 or bfloat16 tensor (the message names the group, index, shape, dtype and
            device).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True,
                 bias_correction: bool = True,
                 state_dtype: torch.dtype = torch.float32, check_overflow: bool = True) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        _check_state_dtype(state_dtype)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=bool(adamw_mode), bias_correction=bool(bias_correction),
                        state_dtype=state_dtype, check_overflow=bool(check_overflow))
        super().__init__(params, defaults)
        self.last_step_overflow = False
        for gi, group in enumerate(self.param_groups):
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            _check_state_dtype(group["state_dtype"])
            for pi, p in enumerate(group["params"]):
                _check_param(gi, pi, p)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, except that a bfloat16 parameter's moments (and 8-bit
        scales) keep their saved dtype and bits: torch casts every floating state tensor to
        its parameter's dtype, which would round fp32 moments and absmax to bfloat16."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            if p.dtype != torch.bfloat16 or saved_id not in state_dict["state"]:
                continue
            for key, value in state_dict["state"][saved_id].items():
                if key != "step" and isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Perform one optimization step over every parameter that has a gradient.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss; it
                runs with gradients enabled before the update.

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: a parameter or its gradient has the wrong device, dtype, layout or
                shape, or a group's hyperparameter is out of range.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        overflow = False
        seed = 0  # a parameter's position over all groups: its stochastic-rounding seed
        for gi, group in enumerate(self.param_groups):
            lr = float(group["lr"])
            beta1, beta2 = (float(b) for b in group["betas"])
            eps = float(group["eps"])
            weight_decay = float(group["weight_decay"])
            _check_hyper(lr, (beta1, beta2), eps, weight_decay)
            adamw = bool(group.get("adamw_mode", True))
            bias_correction = bool(group.get("bias_correction", True))
            state_dtype = group.get("state_dtype", self.defaults["state_dtype"])
            _check_state_dtype(state_dtype)
            check = bool(group.get("check_overflow", True))
            for pi, p in enumerate(group["params"]):
                seed += 1
                if p.grad is None:
                    continue
                _check_param(gi, pi, p)
                grad = p.grad
                if grad.is_sparse:
                    raise ValueError(f"{_describe(gi, pi, p)} has a sparse gradient; "
                                     "CPUAdam supports dense gradients only")
                if grad.shape != p.shape:
                    raise ValueError(f"{_describe(gi, pi, p)} has a gradient of shape "
                                     f"{tuple(grad.shape)}")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = torch.zeros_like(p, dtype=state_dtype,
                                                      memory_format=torch.contiguous_format)
                    if state_dtype == torch.uint8:
                        for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
                            state[key] = torch.zeros(int8_moments.blocks(p.numel()))
                _convert_moments(state, state_dtype)
                step = int(state["step"].item()) + 1
                absmax = ({"exp_avg_absmax": state["exp_avg_absmax"],
                           "exp_avg_sq_absmax": state["exp_avg_sq_absmax"]}
                          if state_dtype == torch.uint8 else {})
                skipped = adam_step_(
                    p, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], step=step,
                    lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                    adamw=adamw, bias_correction=bias_correction, sr_seed=seed,
                    check_overflow=check, **absmax)
                if skipped:
                    overflow = True
                else:
                    state["step"].fill_(float(step))
        self.last_step_overflow = overflow
        return loss


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"Invalid learning rate: lr={lr!r} (must be a finite float >= 0)")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas={betas!r}: must be a pair (beta1, beta2)")
    for i, beta in enumerate(betas):
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"Invalid beta at index {i}: {beta!r} (must be in [0, 1))")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"Invalid epsilon value: eps={eps!r} (must be a finite float >= 0)")
    if not isinstance(weight_decay, (int, float)) or not math.isfinite(weight_decay) \
            or weight_decay < 0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay!r} (must be >= 0)")


def _check_state_dtype(state_dtype) -> None:
    if state_dtype not in (torch.float32, torch.bfloat16, torch.uint8):
        raise ValueError(f"Invalid state_dtype={state_dtype!r} (must be torch.float32, "
                         "torch.bfloat16 or torch.uint8)")


_SCALE_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")


def _convert_moments(state: dict, state_dtype: torch.dtype) -> None:
    """Bring a parameter's moments to ``state_dtype`` in place: 8-bit codes (with their
    absmax) are decoded for another dtype; fp32/bf16 moments are cast, or encoded to nearest
    for uint8 (:mod:`offload_zero.optim.int8_moments`)."""
    keys = ("exp_avg", "exp_avg_sq")
    coded = _SCALE_KEYS[0] in state  # (codes that load_state_dict cast to fp32 are exact)
    if coded:
        for key in keys:
            state[key] = state[key].to(torch.uint8)
    if coded and state_dtype != torch.uint8:
        for key, scale, signed in zip(keys, _SCALE_KEYS, (True, False)):
            state[key] = int8_moments.dequantize(state[key].contiguous(),
                                                 state.pop(scale).float().contiguous(),
                                                 signed=signed).view_as(state[key])
    if state_dtype == torch.uint8 and not coded:
        for key, scale, signed in zip(keys, _SCALE_KEYS, (True, False)):
            x = state[key].float().contiguous()
            codes = torch.empty(x.shape, dtype=torch.uint8)
            state[scale] = torch.empty(int8_moments.blocks(x.numel()))
            int8_moments.quantize_(x.view(-1), codes.view(-1), state[scale], signed=signed)
            state[key] = codes
    for key in keys + (_SCALE_KEYS if state_dtype == torch.uint8 else ()):
        want = torch.float32 if key in _SCALE_KEYS else state_dtype
        if state[key].dtype != want or not state[key].is_contiguous():
            state[key] = state[key].to(want).contiguous()


def _check_param(group_index: int, param_index: int, p: torch.Tensor) -> None:
    where = _describe(group_index, param_index, p)
    if p.device.type != "cpu":
        raise ValueError(f"{where}: CPUAdam needs CPU parameters")
    if p.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{where}: CPUAdam needs float32 or bfloat16 parameters")
    if p.layout != torch.strided or not p.is_contiguous():
        raise ValueError(f"{where}: CPUAdam needs contiguous dense parameters")
