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


AUTO_LEAF_SUFFIX = "SparseMoeBlock"
"""Module classes whose names end so (transformers' Mixtral, Qwen2-MoE, Qwen3-MoE, ... sparse
MoE blocks) are leaf modules without being named in ``leaf_modules``."""


def find_leaf_modules(model: nn.Module, leaf_modules: Sequence[object] = ()) -> List[str]:
    """Qualified names of the outermost leaf modules of ``model``, in module order: instances of
    the classes in ``leaf_modules``, modules named there, and sparse MoE blocks (see
    :data:`AUTO_LEAF_SUFFIX`). The model itself is never a leaf (it is the root unit).

    Raises:
        ValueError: a name in ``leaf_modules`` that no module of ``model`` has (naming a few
            that exist).
    """
    classes = tuple(c for c in leaf_modules if isinstance(c, type))
    names = {n for n in leaf_modules if isinstance(n, str)}
    modules = dict(model.named_modules())
    missing = sorted(n for n in names if n not in modules or n == "")
    if missing:
        some = [n for n in modules if n][:6]
        raise ValueError(f"leaf_modules names {missing}, which are not modules of "
                         f"{type(model).__name__}; qualified module names look like {some}")
    found: List[str] = []
    for name, mod in modules.items():
        if mod is model or _inside(name, found):
            continue
        if (name in names or (classes and isinstance(mod, classes))
                or type(mod).__name__.endswith(AUTO_LEAF_SUFFIX)):
            found.append(name)
    return found


def _inside(name: str, prefixes: Sequence[str]) -> bool:
    """Whether module ``name`` lies strictly inside one of the modules ``prefixes``."""
    return any(name.startswith(p + ".") for p in prefixes)


def find_unit_modules(model: nn.Module, unit_classes: Sequence[type] = (),
                      leaf_modules: Sequence[object] = ()) -> List[Tuple[str, nn.Module]]:
    """Return ``[(qualified name, module)]`` of the block units, in module order.

    With ``unit_classes``: every outermost module that is an instance of one of them.
    Otherwise: the children of the ``nn.ModuleList`` holding the most parameter elements
    (ties broken by length). A model with no ``ModuleList`` has no block units (root only).
    Leaf modules (:func:`find_leaf_modules`) are never cut: no unit lies inside one, and a
    leaf that no unit holds is a unit of its own.
    """
    leaves = find_leaf_modules(model, leaf_modules)
    if unit_classes:
        found, taken = [], []
        for name, mod in model.named_modules():
            if mod is model or not isinstance(mod, tuple(unit_classes)):
                continue
            if _inside(name, taken) or _inside(name, leaves):
                continue
            found.append((name, mod))
            taken.append(name)
    else:
        best, best_key = None, (0, 0)
        for name, mod in model.named_modules():
            if (isinstance(mod, nn.ModuleList) and len(mod) > 0 and name not in leaves
                    and not _inside(name, leaves)):
                key = (sum(p.numel() for p in mod.parameters()), len(mod))
                if key > best_key:
                    best, best_key = (name, mod), key
        found = [] if best is None else [
            (f"{best[0]}.{i}" if best[0] else str(i), child) for i, child in enumerate(best[1])]
    taken = [n for n, _ in found]
    modules = dict(model.named_modules())
    extra = [(n, modules[n]) for n in leaves if n not in taken and not _inside(n, taken)]
    if not extra:
        return found
    order = {n: i for i, n in enumerate(modules)}
    return sorted(found + extra, key=lambda item: order[item[0]])


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
    when its gradient is final (``update_timing="backward"``) or just before its next use
    (``update_timing="next_forward"``), takes autograd's gradient without a copy where it is one parameter,
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
    with ``update_timing="backward"`` or ``update_timing="next_forward"`` and the state on NVMe; the caller checks
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


def plan_flat_params(model: nn.Module, unit_classes: Sequence[type] = (),
                     leaf_modules: Sequence[object] = ()):
    """The flat parameters ``model`` is cut into, before anything is built (the engine builds
    them; the estimator counts them).

    Returns ``(block_modules, planned, users)``: ``block_modules`` from
    :func:`find_unit_modules` (with ``unit_classes`` and ``leaf_modules``); ``planned`` lists ``(unit index, trainable, members)`` in
    construction order, one entry per unit and ``requires_grad`` value (the root unit's index
    is ``len(block_modules)``; its trainable members are split by
    :func:`split_by_gradient_order`); ``users`` as from :func:`group_parameters`.
    """
    block_mods = find_unit_modules(model, unit_classes, leaf_modules)
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
                # parameters each updated when it is ready or needed (update_timing "backward",
                # "next_forward"), each one parameter where it can be (no gradient copy),
                # and each skipped when it gets no gradient, in every mode alike
                parts = split_by_gradient_order(model, members, names)
            planned.extend((index, trainable, part) for part in parts)
    return block_mods, planned, users
