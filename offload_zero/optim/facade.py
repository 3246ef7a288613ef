"""``engine.optimizer``: the engine's Adam as a ``torch.optim.Optimizer``, so that code written
for torch's optimizers (LR schedulers, Trainer-like loops) drives it unchanged.

The moments and master weights stay in the engine (device, host or NVMe); what this object holds
is the hyperparameters, one dict per parameter group, in torch's format: ``params`` (the
model's own parameter objects, taken before the engine wrapped it), ``lr``, ``betas``, ``eps``
and ``weight_decay``. Schedulers edit those dicts; the engine reads them at every update it
makes (see :class:`EngineOptimizer`).

[Note: parameter groups]
A flat parameter may hold parameters of several groups (a block's weights decayed, its biases
and norms not). Each rank's shard is cut into *segments*, runs of elements of one group
(:func:`shard_segments`); the update calls the Adam kernel once per segment with that group's
hyperparameters. Padding belongs to a neighbouring segment (its gradient and weights are zero,
so any group's update leaves it zero). The flat parameters, their memory and their step counts
are the same as without groups.
"""
from __future__ import annotations

import math
import weakref
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from offload_zero.accelerate_guard import RefusePrepare
from offload_zero.config import check_number

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


class GroupHyper(NamedTuple):
    """One parameter group's hyperparameters as the kernel takes them (Python floats)."""

    lr: float
    """Learning rate, >= 0."""
    betas: Tuple[float, float]
    """Adam's (beta1, beta2), each in [0, 1)."""
    eps: float
    """Term added to the denominator, >= 0."""
    weight_decay: float
    """Decoupled (AdamW) or L2 (Adam) weight decay, >= 0."""


def check_group(index: int, group: dict) -> GroupHyper:
    """``group``'s hyperparameters (``param_groups[index]``), checked: ``lr``, ``eps`` and
    ``weight_decay`` finite numbers >= 0 (0-d tensors and numpy numbers taken as floats),
    ``betas`` a pair each in [0, 1). Raises ValueError naming the group, the key and the value
    (a negative, nan or inf lr, say)."""
    where = f"param_groups[{index}]"
    missing = [k for k in HYPER_KEYS if k not in group]
    if missing:
        raise ValueError(f"{where} has no {missing[0]!r}; a group holds {list(HYPER_KEYS)}")
    lr = check_number(f"{where}['lr']", group["lr"], low=0.0)
    eps = check_number(f"{where}['eps']", group["eps"], low=0.0)
    wd = check_number(f"{where}['weight_decay']", group["weight_decay"], low=0.0)
    try:
        betas = tuple(group["betas"])
    except TypeError:
        betas = ()
    if len(betas) != 2:
        raise ValueError(f"{where}['betas']={group['betas']!r} must be a pair (beta1, beta2), "
                         "each in [0, 1)")
    betas = tuple(check_number(f"{where}['betas'][{i}]", b, 0.0, high=1.0)
                  for i, b in enumerate(betas))
    return GroupHyper(lr, betas, eps, wd)


def resolve_param_groups(model: nn.Module, param_groups: Optional[Sequence[dict]],
                         defaults: dict) -> Tuple[List[dict], Dict[int, int]]:
    """The engine's parameter groups for ``model`` (before the engine wraps it).

    ``param_groups``: None (one group of every trainable parameter) or a list (any iterable)
    of dicts in torch's format, each with ``params`` (parameters of ``model``) and any of
    ``lr``, ``betas``, ``eps``, ``weight_decay`` (else ``defaults``, the constructor's).
    Trainable parameters in no group go to a last group with ``defaults``. A parameter listed
    twice in one group (or a tied parameter under both its names) counts once.

    Returns ``(groups, group_of)``: the group dicts (``params`` a list of parameter objects,
    the hyperparameters checked by :func:`check_group`) and ``{id(parameter): group index}``.
    Raises ValueError for a group that is not a dict with ``params``, a parameter in two
    groups or not in ``model`` (each named: its qualified name, or its position and shape),
    or a bad hyperparameter.
    """
    names: Dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    if param_groups is None:
        param_groups = []
    elif isinstance(param_groups, (dict, torch.Tensor, str)) or not hasattr(param_groups,
                                                                             "__iter__"):
        raise ValueError(f"param_groups must be a list of dicts (torch's format), got "
                         f"{type(param_groups).__name__}")
    param_groups = list(param_groups)
    groups, group_of = [], {}
    for i, given in enumerate(param_groups):
        if not isinstance(given, dict) or "params" not in given:
            raise ValueError(f"param_groups[{i}] must be a dict with 'params', got {given!r:.80}")
        params = given["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        kept = []
        for j, p in enumerate(params):
            if not isinstance(p, torch.Tensor) or id(p) not in names:
                what = (f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor)
                        else repr(type(p).__name__))
                raise ValueError(f"param_groups[{i}]['params'][{j}] ({what}) is not a parameter "
                                 f"of the model (give the model's own parameters, taken before "
                                 f"it is wrapped)")
            owner = group_of.get(id(p))
            if owner is not None and owner != i:
                raise ValueError(f"parameter {names[id(p)]!r} is in param_groups[{owner}] and "
                                 f"param_groups[{i}]; a parameter belongs to one group")
            if owner is None:
                group_of[id(p)] = i
                kept.append(p)
        group = {**defaults, **{k: v for k, v in given.items() if k != "params"}, "params": kept}
        check_group(i, group)
        groups.append(group)
    rest = []
    for p in model.parameters():  # (each tied parameter once)
        if p.requires_grad and id(p) not in group_of:
            group_of[id(p)] = len(groups)
            rest.append(p)
    if rest or not groups:
        group = {**defaults, "params": rest}
        check_group(len(groups), group)
        groups.append(group)
    return groups, group_of


def shard_segments(entry_groups: Sequence[Tuple[int, int, int]], shard_lo: int,
                   shard_numel: int) -> List[Tuple[int, int, int]]:
    """Cut one rank's shard into runs of one parameter group (see [Note: parameter groups]).

    ``entry_groups``: ``(offset, numel, group index)`` of each parameter in its flat parameter
    (elements, in layout order); ``shard_lo``: the first element of this rank's shard, which
    holds ``shard_numel`` elements. Returns ``[(lo, hi, group index)]`` in shard-local elements,
    covering ``[0, shard_numel)`` without gaps (padding joins the run before it, or the first
    run), neighbouring runs of one group merged.
    """
    runs: List[List[int]] = []
    for offset, numel, group in entry_groups:
        a = max(offset - shard_lo, 0)
        b = min(offset + numel - shard_lo, shard_numel)
        if a < b:
            runs.append([a, b, group])
    if not runs:  # padding only
        group = entry_groups[-1][2] if entry_groups else 0
        return [(0, shard_numel, group)]
    runs[0][0] = 0
    for run, nxt in zip(runs, runs[1:]):
        run[1] = nxt[0]
    runs[-1][1] = shard_numel
    merged: List[List[int]] = []
    for run in runs:
        if merged and merged[-1][2] == run[2]:
            merged[-1][1] = run[1]
        else:
            merged.append(run)
    return [tuple(run) for run in merged]


def json_group(group: dict) -> dict:
    """``group``'s values other than ``params`` that JSON can hold (numbers, strings, bools,
    None, lists of those; a 0-d tensor as its number), for a checkpoint: the hyperparameters
    and what schedulers add (``initial_lr``, ...)."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        value = _plain(value)
        if value is not _SKIP:
            out[key] = value
    return out


_SKIP = object()


def _plain(value):
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _SKIP
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    return _SKIP


STEPS_KEY = "offload_zero_adam_steps"
"""The key of :meth:`EngineOptimizer.state_dict` that records the engine's Adam step count."""


class EngineOptimizer(torch.optim.Optimizer):
    """The engine's Adam/AdamW as a ``torch.optim.Optimizer`` (``engine.optimizer``).

    ``param_groups``: one dict per group, ``params`` (the model's own parameter objects, which
    stay registered on it while wrapped; the engine holds their fp32 values and gradients),
    ``lr``, ``betas``, ``eps``, ``weight_decay``; schedulers add their own keys (``initial_lr``).
    Edit them by hand or with any ``torch.optim.lr_scheduler`` scheduler (OneCycleLR's
    momentum cycling edits ``betas``) or transformers' schedules: the engine reads a group's
    values at every update it makes, so an edit takes effect from the next update.
    When that is: the plain step at :meth:`step`; with ``update_timing="next_forward"`` also at
    :meth:`step` (the updates it then applies in the next forward keep those values); with
    ``update_timing="backward"`` when backward produces each flat parameter's gradient (the values in
    force at :meth:`OffloadEngine.backward`, unless the group is changed while it runs).

    :meth:`step` is ``engine.step()`` (so a scheduler's count of optimizer steps holds, whichever
    of the two the loop calls), :meth:`zero_grad` is ``engine.zero_grad()``.
    :meth:`state_dict` / :meth:`load_state_dict` carry the groups' hyperparameters only
    (``state`` is empty): the moments and master weights are the engine's, saved by
    ``engine.save_checkpoint``, which records the groups' values too. So that a resume through
    them alone (torch's ``model.state_dict()`` + ``optimizer.state_dict()`` habit) cannot
    restart the moments silently, the dict records the engine's Adam step count
    (:data:`STEPS_KEY`) and a load into an engine at another count raises ValueError.

    The groups are fixed when the engine is built (``OffloadEngine(param_groups=...)``):
    :meth:`add_param_group` afterwards raises NotImplementedError.
    """

    # accelerator.prepare(engine.optimizer) raises (see [Note: accelerate's prepare])
    _is_accelerate_prepared = RefusePrepare("engine.optimizer")

    def __init__(self, engine, groups: List[dict], defaults: dict):
        """Built by the engine: ``groups`` from :func:`resolve_param_groups`, ``defaults`` the
        constructor's ``lr``, ``betas``, ``eps``, ``weight_decay``. Holds ``engine`` weakly."""
        self._engine_ref = weakref.ref(engine)  # (the engine holds this object)
        self._built = False
        super().__init__(groups, dict(defaults))
        self._built = True

    def _engine(self):
        engine = self._engine_ref()
        if engine is None:
            raise RuntimeError("the OffloadEngine of this optimizer is gone")
        return engine

    def add_param_group(self, param_group: dict) -> None:
        """torch's :meth:`~torch.optim.Optimizer.add_param_group`, while the engine builds this
        object; afterwards NotImplementedError (a flat parameter's layout is fixed when the
        engine is built: pass ``param_groups=`` to :class:`OffloadEngine` instead)."""
        if self._built:
            raise NotImplementedError("engine.optimizer's parameter groups are fixed when the "
                                      "engine is built: pass param_groups=[...] to OffloadEngine")
        super().add_param_group(param_group)

    def hypers(self) -> Tuple[GroupHyper, ...]:
        """Every group's hyperparameters now, checked (:func:`check_group`; ValueError naming a
        bad one)."""
        return tuple(check_group(i, g) for i, g in enumerate(self.param_groups))

    @torch.no_grad()
    def step(self, closure=None):
        """Run ``engine.step()`` (with gradient accumulation, an update only at the boundary:
        see ``gradient_accumulation_steps``). ``closure``, if given, is called first with
        gradients enabled (it runs forward and ``engine.backward``); its result is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine()._step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``engine.zero_grad(set_to_none)``: see :meth:`OffloadEngine.zero_grad`."""
        self._engine().zero_grad(set_to_none)

    def _adam_steps(self) -> int:
        """The engine's Adam step count: the most of its flat parameters' (0 before any)."""
        return max(self._engine().step_counts.values(), default=0)

    def state_dict(self) -> dict:
        """torch's :meth:`~torch.optim.Optimizer.state_dict`: ``state`` empty (the moments are
        the engine's: ``engine.save_checkpoint``), ``param_groups`` the groups' values, and
        :data:`STEPS_KEY`: the engine's Adam step count (an int), which
        :meth:`load_state_dict` checks."""
        out = super().state_dict()
        out[STEPS_KEY] = self._adam_steps()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's :meth:`~torch.optim.Optimizer.load_state_dict` (same number of groups, each
        with as many parameters), then the groups' values are checked: ValueError naming a bad
        one, the groups left as they were. The moments are not in it: see
        ``engine.load_checkpoint``. Raises ValueError, changing nothing, for a dict that holds
        per-parameter state (a torch optimizer's moments: this optimizer cannot take them), or
        one saved by an engine at another Adam step count than this one's (:data:`STEPS_KEY`:
        its moments are not in it, so a resume through it would restart them)."""
        if state_dict.get("state"):
            raise ValueError(
                f"this optimizer state_dict holds state for {len(state_dict['state'])} "
                "parameter(s) (a torch optimizer's moments?): engine.optimizer takes the "
                "groups' values only; the engine's Adam state is saved and restored by "
                "engine.save_checkpoint(dir) / engine.load_checkpoint(dir)")
        saved, now = state_dict.get(STEPS_KEY), self._adam_steps()
        if saved is not None and saved != now:
            raise ValueError(
                f"this optimizer state_dict was saved after {saved} Adam step(s) and holds the "
                f"groups' values only; this engine is at {now}: loading it would leave the "
                "moments and step counts where they are (a silent restart of Adam). Resume "
                "with engine.save_checkpoint(dir) / engine.load_checkpoint(dir), which restore "
                "the masters, moments, step counts and groups together, then load this dict")
        before = [{k: v for k, v in g.items()} for g in self.param_groups]
        super().load_state_dict(state_dict)
        try:
            self.hypers()
        except ValueError:
            for group, old in zip(self.param_groups, before):
                group.clear()
                group.update(old)
            raise
