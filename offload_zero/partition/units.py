"""Cutting a model into units and grouping each unit's parameters into flat parameters.

A *unit* is the granularity of gathering: by default each block of the model's largest
``nn.ModuleList`` (the transformer layers), plus one root unit for every parameter outside
them; ``unit_classes`` names module classes to use instead. A parameter referenced from several
modules (tied embeddings) is one entry in exactly one unit: the root unit if any reference lies
outside the blocks (the root is gathered for the whole forward), else the first block that uses
it, and the other units that use it list that unit in ``deps``.
"""
from __future__ import annotations

import enum
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from offload_zero.partition.flat_param import ALIGN_BYTES, FlatParam, ParamEntry


class UnitState(enum.Enum):
    """Gathering state of a unit (all its flat parameters move together)."""

    SHARDED = "sharded"
    """Parameters freed; only shards exist."""
    UNSHARDED = "unsharded"
    """Parameters gathered and visible to the unit's modules."""


class Unit:
    """A group of modules whose parameters are gathered and freed together.

    Attributes:
        index: position in construction order (root is last); name: module path ("" for root).
        module: the unit's module (the whole model for the root unit).
        flat_params: at most two :class:`FlatParam` (trainable, frozen).
        deps: other units owning parameters this unit's modules also use.
    """

    def __init__(self, index: int, name: str, module: nn.Module, is_root: bool):
        self.index, self.name, self.module, self.is_root = index, name, module, is_root
        self.flat_params: List[FlatParam] = []
        self.deps: List["Unit"] = []
        self.state = UnitState.SHARDED

    @property
    def label(self) -> str:
        """Human-readable name for messages."""
        return "root" if self.is_root else f"unit {self.index} ({self.name})"

    def __repr__(self):
        return f"Unit({self.label}, {self.state.value})"


def find_unit_modules(model: nn.Module, unit_classes: Sequence[type] = ()) -> List[Tuple[str, nn.Module]]:
    """Return ``[(qualified name, module)]`` of the block units, in module order.

    With ``unit_classes``: every outermost module that is an instance of one of them.
    Otherwise: the children of the ``nn.ModuleList`` holding the most parameter elements
    (ties broken by length). A model with no ``ModuleList`` has no block units (root only).
    """
    if unit_classes:
        found, taken = [], []
        for name, mod in model.named_modules():
            if mod is model or not isinstance(mod, tuple(unit_classes)):
                continue
            if any(name.startswith(t + ".") for t in taken):
                continue
            found.append((name, mod))
            taken.append(name)
        return found
    best, best_key = None, (0, 0)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            key = (sum(p.numel() for p in mod.parameters()), len(mod))
            if key > best_key:
                best, best_key = (name, mod), key
    if best is None:
        return []
    prefix = best[0]
    return [(f"{prefix}.{i}" if prefix else str(i), child) for i, child in enumerate(best[1])]


def group_parameters(model: nn.Module, block_names: List[str]
                     ) -> Tuple[List[List[Tuple[nn.Parameter, list]]], Dict[int, set]]:
    """Assign every distinct parameter to one unit.

    Returns ``(groups, users)``: ``groups[u]`` lists ``(param, refs)`` owned by unit ``u`` (block
    units first in ``block_names`` order, the root last), each ``refs`` a list of
    ``(module, attr, fqn)``; ``users[id(param)]`` is the set of unit indices referencing it.
    """
    root = len(block_names)

    def unit_of(mod_name: str) -> int:
        for i, b in enumerate(block_names):
            if mod_name == b or mod_name.startswith(b + "."):
                return i
        return root

    refs: Dict[int, list] = {}
    params: Dict[int, nn.Parameter] = {}
    users: Dict[int, set] = {}
    order: List[int] = []
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in list(mod._parameters.items()):
            if p is None:
                continue
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            key = id(p)
            if key not in refs:
                refs[key], params[key], users[key] = [], p, set()
                order.append(key)
            # every name: a module registered twice (self.c = self.a) gives its parameters two
            # names in state_dict(), and the same (module, attribute) twice
            refs[key].append((mod, attr, fqn))
            users[key].add(unit_of(mod_name))
    groups: List[list] = [[] for _ in range(root + 1)]
    for key in order:
        owner = root if root in users[key] else min(users[key])
        groups[owner].append((params[key], refs[key]))
    return groups, users


def split_by_gradient_order(model: nn.Module, members: List[Tuple[nn.Parameter, list]],
                            block_names: List[str]) -> List[List[Tuple[nn.Parameter, list]]]:
    """Split the root unit's ``members`` (``(param, refs)`` pairs from :func:`group_parameters`)
    by when backward finishes their gradients and forward first uses them: each part is updated
    when its gradient is final (``step_in_backward``) or just before its next use
    (``step_in_forward``), takes autograd's gradient without a copy where it is one parameter,
    and is skipped in a step that gives it no gradient (every mode).

    Returns ``[late]``, ``[early, late]`` or ``[rest, largest, late]``: the early part holds
    the parameters that only modules registered after the first block use (an LM head, a
    final norm: backward reaches them first, forward last); a parameter of more than half its
    elements and at least 1024 (the LM head's weight) goes alone in ``largest``, the others
    (the final norm's) in ``rest``. ``late`` holds the rest of the members (input embeddings,
    and any parameter also used before the blocks, such as an embedding tied to the LM head:
    its gradient is final only at the end of backward, and forward needs it first). Module
    registration order stands for execution order here; if a model runs its modules in another
    order, only the timing of the updates changes, never their result.
    Without blocks, or when either part is empty, the members stay one group.
    """
    if not block_names:
        return [members]
    position = {name: i for i, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
    first_block = min(position[b] for b in block_names)

    def after_blocks(refs) -> bool:
        # a parameter set on the model itself (module path "") counts as used before the blocks
        return all("." in fqn and position.get(fqn.rsplit(".", 1)[0], -1) > first_block
                   for _, _, fqn in refs)

    early = [(p, refs) for p, refs in members if after_blocks(refs)]
    late = [(p, refs) for p, refs in members if not after_blocks(refs)]
    if not (early and late):
        return [members]
    # a parameter holding most of the early part (an LM head's weight) goes alone: a flat
    # parameter of one parameter takes autograd's gradient as it is, with no gradient buffer
    # held for it (see [Note: reused gradient memory] in offload_zero.partition.grads)
    # (one under 1024 elements is padded in any dtype, its shard being 4096-byte aligned: its
    # gradient is copied anyway, and a part of its own would save nothing)
    largest = max(range(len(early)), key=lambda i: early[i][0].numel())
    rest = early[:largest] + early[largest + 1:]
    n = early[largest][0].numel()
    if not rest or n < ALIGN_BYTES // 4 or 2 * n <= sum(p.numel() for p, _ in early):
        return [early, late]
    return [rest, [early[largest]], late]


def host_tail_index(flat: Sequence[Tuple[bool, bool, int]],
                    setting: Optional[bool] = None) -> Optional[int]:
    """Which flat parameter keeps its optimizer state in host memory (``tail_state_in_host``,
    with ``step_in_backward`` or ``step_in_forward`` and the state on NVMe; the caller checks
    those).

    ``flat``: ``(is_root, trainable, shard_numel)`` per flat parameter, in construction order
    (shard_numel in elements). The candidate is the root's last trainable one: the part of its
    parameters :func:`split_by_gradient_order` finds final last in backward and needed first in
    forward (the embeddings).
    ``setting`` True takes it, False none, None takes it when its shard is at most a quarter
    of all trainable shards. Returns its index in ``flat``, or None.
    """
    tail = [i for i, (is_root, trainable, _) in enumerate(flat) if is_root and trainable]
    if setting is False or not tail:
        return None
    if setting is None and 4 * flat[tail[-1]][2] > sum(n for _, t, n in flat if t):
        return None
    return tail[-1]


def plan_flat_params(model: nn.Module, unit_classes: Sequence[type] = ()):
    """The flat parameters ``model`` is cut into, before anything is built (the engine builds
    them; the estimator counts them).

    Returns ``(block_modules, planned, users)``: ``block_modules`` from
    :func:`find_unit_modules`; ``planned`` lists ``(unit index, trainable, members)`` in
    construction order, one entry per unit and ``requires_grad`` value (the root unit's index
    is ``len(block_modules)``; its trainable members are split by
    :func:`split_by_gradient_order`); ``users`` as from :func:`group_parameters`.
    """
    block_mods = find_unit_modules(model, unit_classes)
    names = [n for n, _ in block_mods]
    groups, users = group_parameters(model, names)
    planned = []
    for index, group in enumerate(groups):
        for trainable in (True, False):
            members = [(p, refs) for p, refs in group if p.requires_grad == trainable]
            if not members:
                continue
            parts = [members]
            if index == len(names) and trainable:
                # the LM head's gradient is final at the start of backward, the embeddings'
                # at its end; forward needs the embeddings first, the LM head last: flat
                # parameters each updated when it is ready or needed (step_in_backward,
                # step_in_forward), each one parameter where it can be (no gradient copy),
                # and each skipped when it gets no gradient, in every mode alike
                parts = split_by_gradient_order(model, members, names)
            planned.extend((index, trainable, part) for part in parts)
    return block_mods, planned, users
