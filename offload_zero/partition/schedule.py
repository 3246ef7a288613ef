"""When units are gathered and freed: forward/backward hooks, prefetch and end-of-backward.

[Note: unit schedule]
forward, unit k:  pre-forward hook: unshard k (+ its deps), prefetch the next ``prefetch`` units in
                  the recorded order, point module attributes at the gathered views;
                  post-forward hook: reshard k (stage 3), hook k's outputs for backward.
backward, unit k: the first gradient reaching k's outputs unshards k (+ deps) and prefetches the
                  ``prefetch`` units that run before it in forward; once k's flat parameters'
                  gradients are accumulated they are reduced to shards and k is resharded (a
                  unit with frozen weights waits also for its inputs' gradients: until then
                  backward may still use those weights).
end of backward:  a callback queued on the autograd engine reshards whatever is still gathered.
next forward:     frees blocks an error left gathered (an error skips the post-forward hooks).
The root unit (everything outside the blocks) is gathered from the start of a training forward
to the end of its backward (an evaluation forward frees it at its end). Each of its flat
parameters gets fresh views when the first module using it runs: autograd runs ready nodes
newest first, so views made at the start of forward would hold back an LM head's gradient to the
end of backward. A root flat parameter that ``gather_late`` names when a training forward starts
(one whose pending update, ``update_timing="next_forward"``, runs while the blocks compute) is gathered only
then, into its part of the root's slot, after ``before_late_gather``. The forward order is
recorded on the first training forward and replayed for prefetch; it is re-recorded if a later
forward runs another order. A forward entered below the model (see [Note: forward entered below
the model] in :mod:`offload_zero.exposure`) runs the root's hooks at that module
(:meth:`UnitScheduler.begin_forward`).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import sys

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload_zero.lockstep import Phase
from offload_zero.partition.units import Unit, UnitState


class UnitScheduler:
    """Owns the hooks that gather and free units around their forward and backward.

    Args:
        blocks: block units, in construction order; root: the root unit.
        comm: the data-parallel :class:`offload_zero.comm.Comm`.
        prefetch: units gathered ahead of use (>= 0).
        reshard_after_forward: True at stage 3 (free parameters after each unit's forward).
        on_grad: ``f(flat_param)`` called once a flat parameter's gradient is accumulated.
        pool_for: ``f(unit) -> GatherPool | None``: where a unit's gathered parameters live
            (see [Note: gather pool]); None allocates them per gather.
        staging: device buffer a host shard is copied into before a multi-rank all-gather.
        on_unit_backward: ``f(unit)`` called when backward reaches a unit (after gathering it),
            or None.
        on_forward: ``f()`` called when a forward starts, before anything is gathered, or None.
        on_unit_forward: ``f(unit)`` called in a training forward (grad enabled, module in
            training mode; not a recomputation in backward) at its start, with ``unit=None``
            after ``on_forward`` and the root's gather, and when it reaches each block unit,
            after gathering it and before prefetching the units after it; or None.
        before_gather: ``f(unit)`` called before anything reads a sharded unit's parameters:
            its gather, or the start of its prefetch (an NVMe read); or None.
        gather_late: ``f(flat_param) -> bool``, asked for each root flat parameter after
            ``before_gather(root)`` in a training forward: True leaves it sharded until the
            first module using it runs (see the note above); or None (never).
        before_late_gather: ``f(flat_param)`` called just before such a late gather, or None.
        on_end_backward: ``f()`` called when a backward ends normally (from the autograd
            engine's end-of-backward callback, before the units are resharded), or None.
        on_forward_error: ``f(exception)`` called when the model's forward raises, or None.

    Attributes:
        live_peak: the most units gathered at once since construction.
    """

    def __init__(self, blocks: List[Unit], root: Unit, comm, prefetch: int,
                 reshard_after_forward: bool, on_grad: Callable,
                 pool_for: Optional[Callable] = None, staging: Optional[torch.Tensor] = None,
                 on_unit_backward: Optional[Callable] = None,
                 on_forward: Optional[Callable] = None,
                 on_unit_forward: Optional[Callable] = None,
                 before_gather: Optional[Callable] = None,
                 gather_late: Optional[Callable] = None,
                 before_late_gather: Optional[Callable] = None,
                 on_end_backward: Optional[Callable] = None,
                 on_forward_error: Optional[Callable] = None):
        self.blocks, self.root, self.comm = blocks, root, comm
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self._on_grad = on_grad
        self._pool_for = pool_for or (lambda unit: None)
        self._staging = staging
        self._on_unit_backward = on_unit_backward
        self._on_forward = on_forward
        self._on_unit_forward = on_unit_forward
        self._before_gather = before_gather
        self._gather_late = gather_late
        self._before_late_gather = before_late_gather
        self._on_end_backward = on_end_backward
        self._on_forward_error = on_forward_error
        self._forward_done = True
        self._late = {}                      # root flat param -> its part of the root's slot
        # root flat parameters a late gather can serve: used only by modules other than the
        # model itself (their first user's pre-forward hook gathers them)
        self._may_gather_late = {fp for fp in root.flat_params
                                 if all(m is not root.module for e in fp.entries for m, _, _ in e.refs)}
        self._training_forward = False
        self._slots = {}                     # unit -> (pool, slot id)
        self.live_peak = 0
        self.order: List[Unit] = []          # recorded forward order of block units
        self._recording: Optional[List[Unit]] = None
        self._in_backward = False
        # set by the engine around its own backward (see _refuse_plain_backward)
        self.in_engine_backward = False
        self._pending = {}                   # unit -> trainable flat params awaiting gradients
        self._handles = []
        self._inputs_pending = {}             # unit -> forwards whose input gradients are due
        self._open_container: Optional[Unit] = None  # a container unit gathered in forward
        for unit in blocks:
            # a container (a ModuleList of experts made a leaf unit) has no forward of its own:
            # its children's forwards gather it whole, and it stays gathered until forward
            # moves on to another unit, so every rank gathers it once whichever children run
            callers = [unit.module] if runs_itself(unit.module) else list(unit.module.children())
            for mod in callers:
                self._handles.append(mod.register_forward_pre_hook(
                    self._make_pre_forward(unit), with_kwargs=True))
                self._handles.append(mod.register_forward_hook(
                    self._make_post_forward(unit, keep=mod is not unit.module)))
        self._handles.append(root.module.register_forward_pre_hook(self._root_pre_forward))
        self._handles.append(root.module.register_forward_hook(self._root_post_forward))
        # (after the one above: it runs on success too, and finds the forward done then)
        self._handles.append(root.module.register_forward_hook(self._root_forward_failed,
                                                               always_call=True))
        self._fresh_views: set = set()       # root flat params given fresh views this forward
        for fp in root.flat_params:
            users = {id(m): m for e in fp.entries for m, _, _ in e.refs if m is not root.module}
            for module in users.values():
                self._handles.append(module.register_forward_pre_hook(self._make_fresh_views(fp)))
        for unit in blocks + [root]:
            for fp in unit.flat_params:
                if fp.requires_grad:
                    self._handles.append(fp.full.register_post_accumulate_grad_hook(
                        self._make_grad_hook(unit, fp)))

    # -- gathering ---------------------------------------------------------------------------
    @property
    def training_forward(self) -> bool:
        """Whether a training forward is running (grad enabled, model in training mode, not a
        recomputation in backward); set when the root's forward starts, before its gather."""
        return self._training_forward

    def may_gather_late(self, fp) -> bool:
        """Whether root flat parameter ``fp`` can be gathered late (see ``gather_late``): only
        modules other than the model itself use it, so its first user's hook can gather it."""
        return fp in self._may_gather_late

    def live_units(self) -> int:
        """Units whose parameters are gathered now (root included)."""
        return sum(u.state is UnitState.UNSHARDED for u in self.blocks + [self.root])

    def unshard(self, unit: Unit) -> None:
        """Gather ``unit``'s flat parameters (no-op if gathered)."""
        if unit.state is UnitState.UNSHARDED:
            return
        if self._before_gather is not None:
            self._before_gather(unit)
        pool = self._pool_for(unit)
        memory = None
        if pool is not None and unit.flat_params:
            slot, memory = pool.acquire()
            self._slots[unit] = (pool, slot)
        late = unit.is_root and self._training_forward and self._gather_late is not None
        offset = 0
        for fp in unit.flat_params:
            nbytes = fp.padded_numel * fp.itemsize
            part = None if memory is None else memory[offset:offset + nbytes]
            if late and fp in self._may_gather_late and self._gather_late(fp):
                self._late[fp] = part
                # (a forward that reads its weights before their modules run gathers it then)
                fp.set_placeholders(gather=lambda fp=fp: self._late_gather(fp))
            else:
                fp.to_unsharded(self.comm, memory=part, staging=self._staging)
            offset += nbytes
        unit.state = UnitState.UNSHARDED
        self.live_peak = max(self.live_peak, self.live_units())

    def _late_gather(self, fp) -> None:
        """Gather root flat parameter ``fp`` left sharded when the root was gathered (no-op
        once gathered) and point its modules at it: by its first user's pre-forward hook, or
        by the first computation on one of its placeholders."""
        if fp not in self._late:
            return
        if self._before_late_gather is not None:
            self._before_late_gather(fp)
        fp.to_unsharded(self.comm, memory=self._late[fp], staging=self._staging)
        del self._late[fp]
        fp.set_views()

    def reshard(self, unit: Unit) -> None:
        """Free ``unit``'s gathered parameters (stage 3 only; no-op otherwise or if sharded)."""
        if unit.state is UnitState.SHARDED or not self.reshard_after_forward:
            return
        for fp in unit.flat_params:
            fp.to_sharded()
        if unit.is_root:
            self._late.clear()
        if unit in self._slots:
            pool, slot = self._slots.pop(unit)
            pool.release(slot)
        unit.state = UnitState.SHARDED
        self.live_peak = max(self.live_peak, self.live_units())

    def reshard_all(self) -> None:
        """Free every gathered unit."""
        for u in self.blocks + [self.root]:
            self.reshard(u)

    def _activate(self, unit: Unit) -> None:
        for u in [unit] + unit.deps:
            self.unshard(u)
            for fp in u.flat_params:
                if fp not in self._late:  # (views once gathered, by its first user)
                    fp.set_views()

    def prefetch_unit(self, unit: Unit) -> None:
        """Get ``unit`` ready ahead of use: units whose shards live on NVMe start their
        asynchronous reads (gathered when they run, so the read overlaps this unit's compute);
        the others are gathered now."""
        if any(fp.home is not None and fp.home.tier.value == "nvme" for fp in unit.flat_params):
            if unit.state is UnitState.SHARDED:
                if self._before_gather is not None:
                    self._before_gather(unit)
                for fp in unit.flat_params:
                    fp.home.fetch(fp)
        else:
            self.unshard(unit)

    def _prefetch(self, unit: Unit, step: int) -> None:
        if not self.prefetch or unit not in self.order:
            return
        i = self.order.index(unit)
        for j in range(1, min(self.prefetch, len(self.order)) + 1):
            k = i + step * j
            if 0 <= k < len(self.order):
                self.prefetch_unit(self.order[k])

    # -- forward -----------------------------------------------------------------------------
    @property
    def forward_running(self) -> bool:
        """Whether a forward of the model (or of a module entered below it, see
        :meth:`begin_forward`) or a backward is under way."""
        return not self._forward_done or self._in_backward

    def begin_forward(self, module: nn.Module, args, inside: List[Unit] = ()) -> None:
        """Start a forward entered at ``module``, a module below the model whose forward runs
        while no forward of the model does (PEFT's ``generate`` calls the base model's forward,
        a script calls one layer): everything the model's own pre-forward hook does (the
        root gathered, the phase set, ``on_forward``), then ``inside``, the block units that
        hold ``module``, gathered (their own hooks sit on modules above it). Close it with
        :meth:`end_forward`, or on an error :meth:`forward_failed`."""
        self._root_pre_forward(module, args)
        for unit in inside:
            self._activate(unit)

    def end_forward(self, module: nn.Module, args, output) -> None:
        """End a forward that :meth:`begin_forward` started at ``module`` and that returned
        ``output``, as the model's own post-forward hook does (units resharded at stage 3, the
        root kept for backward in a training forward, pre-backward hooks on ``output``)."""
        self._root_post_forward(module, args, output)

    def forward_failed(self, module: nn.Module, args, output) -> None:
        """After a forward :meth:`begin_forward` started, whether it raised or not: when it
        raised (:meth:`end_forward` did not run), report the error (see [Note: lockstep])."""
        self._root_forward_failed(module, args, output)

    def _phase(self) -> Phase:
        if self._in_backward:
            return Phase.BACKWARD
        return Phase.FORWARD if torch.is_grad_enabled() else Phase.FORWARD_NO_GRAD

    def _root_forward_failed(self, module, args, output):
        """Runs after the model's forward whether it raised or not: when it raised (the
        post-forward hook did not run), report the error (see [Note: lockstep])."""
        if self._forward_done:
            return
        self._forward_done = True
        exc = sys.exc_info()[1]
        if exc is not None and self._on_forward_error is not None:
            self._on_forward_error(exc)

    def _root_pre_forward(self, module, args):
        self._forward_done = False
        self.comm.set_phase(self._phase())
        if self._on_forward is not None:
            self._on_forward()
        if not self._in_backward:
            # An error inside a forward skips the post-forward hooks: the blocks it had
            # gathered (and prefetched) are still gathered. Free them before this forward
            # needs their pool slots. (The root stays: a forward then another forward, then
            # backward on both, uses the root's views from the first.)
            for u in self.blocks:
                self.reshard(u)
        self._training_forward = (torch.is_grad_enabled() and module.training
                                  and not self._in_backward)
        if torch.is_grad_enabled() and module.training:
            self._recording = []
        self._fresh_views.clear()
        self._activate(self.root)
        if self._training_forward and self._on_unit_forward is not None:
            self._on_unit_forward(None)

    def _make_fresh_views(self, fp):
        def hook(module, args):
            self._late_gather(fp)
            if (fp in self._fresh_views or self._in_backward or not torch.is_grad_enabled()
                    or self.root.state is not UnitState.UNSHARDED):
                return
            self._fresh_views.add(fp)
            fp.set_views()
        return hook

    def _root_post_forward(self, module, args, output):
        self._forward_done = True
        self._close_container(None)
        self._training_forward = False
        if self._recording is not None:
            if self._recording != self.order:
                self.order = self._recording
            self._recording = None
        if self.reshard_after_forward:
            # A training forward keeps the root gathered for the backward that follows: it is
            # the first unit backward needs, its pool slot is its own, so keeping it costs no
            # memory and saves gathering it again (an NVMe read or a collective).
            keep_root = torch.is_grad_enabled() and module.training
            for u in self.blocks + ([] if keep_root else [self.root]):
                self.reshard(u)
        self._register_pre_backward(self.root, output)
        if not self._in_backward:
            self.comm.set_phase(Phase.IDLE)

    def _make_pre_forward(self, unit: Unit):
        has_frozen = any(not fp.requires_grad for fp in unit.flat_params)

        def hook(module, args, kwargs):
            if self._recording is not None and unit not in self._recording:
                self._recording.append(unit)
            self._close_container(unit)
            self._activate(unit)
            if self._in_backward:
                return None
            if (self._training_forward and torch.is_grad_enabled()
                    and self._on_unit_forward is not None):
                self._on_unit_forward(unit)
            self._prefetch(unit, +1)
            if has_frozen and self.reshard_after_forward and torch.is_grad_enabled():
                return self._signal_input_grads(unit, args, kwargs)
            return None
        return hook

    def _signal_input_grads(self, unit: Unit, args, kwargs):
        """Route ``unit``'s inputs that require grad through :class:`_InputGrads`, whose backward
        runs once their gradients are computed: the unit's frozen weights are needed until then
        (no gradient accumulation of theirs says when backward is done with them)."""
        leaves, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        self._inputs_pending[unit] = self._inputs_pending.get(unit, 0) + 1
        outs = _InputGrads.apply(lambda: self._input_grads_done(unit), *[leaves[i] for i in idx])
        for i, t in zip(idx, outs):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _input_grads_done(self, unit: Unit) -> None:
        self._inputs_pending[unit] -= 1
        self._maybe_reshard_after_backward(unit)

    def _make_post_forward(self, unit: Unit, keep: bool = False):
        def hook(module, args, output):
            if keep:  # one child of a container unit: the unit stays gathered for the others
                if not self._in_backward:
                    self._open_container = unit
            elif self.reshard_after_forward and not self._in_backward:
                self.reshard(unit)
            self._register_pre_backward(unit, output)
        return hook

    def _close_container(self, unit: Optional[Unit]) -> None:
        """Forward moved on to ``unit`` (None: the forward ended): reshard a container unit
        left gathered for its children, unless it is ``unit``."""
        open_unit = self._open_container
        if open_unit is not None and open_unit is not unit and not self._in_backward:
            self._open_container = None
            self.reshard(open_unit)

    # -- backward ----------------------------------------------------------------------------
    def _register_pre_backward(self, unit: Unit, output) -> None:
        if not torch.is_grad_enabled():
            return
        leaves, _ = tree_flatten(output)
        if hasattr(output, "values") and not leaves:  # ModelOutput-like dicts
            leaves = list(output.values())
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._make_pre_backward(unit))

    def _make_pre_backward(self, unit: Unit):
        def hook(grad):
            if not self._handles:  # hooks removed: the engine is closed
                raise RuntimeError("the OffloadEngine that ran this forward was closed before "
                                   "this backward; its parameters are gone: run backward "
                                   "before close()")
            self._refuse_plain_backward()
            if not self._in_backward:
                self._in_backward = True
                self.comm.set_phase(Phase.BACKWARD)
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._activate(unit)
            if self._on_unit_backward is not None:
                self._on_unit_backward(unit)
            if unit.is_root:
                if self.order and self.prefetch:
                    for u in reversed(self.order[-self.prefetch:]):
                        self.prefetch_unit(u)
            else:
                self._prefetch(unit, -1)
            return None
        return hook

    def _refuse_plain_backward(self) -> None:
        """Raise RuntimeError unless the engine's ``backward`` runs this backward: a plain
        ``loss.backward()`` would skip what it does around autograd."""
        if not self.in_engine_backward:
            raise RuntimeError(PLAIN_BACKWARD_MESSAGE)

    def _make_grad_hook(self, unit: Unit, fp):
        def hook(tensor):
            self._refuse_plain_backward()
            self._on_grad(fp)
            if unit.is_root or not self.reshard_after_forward:
                return
            self._pending.setdefault(unit, set()).add(fp)
            self._maybe_reshard_after_backward(unit)
        return hook

    def _maybe_reshard_after_backward(self, unit: Unit) -> None:
        """Reshard ``unit`` once backward is done with it: every trainable flat parameter's
        gradient accumulated and, with frozen weights, the gradients of its inputs computed."""
        trainable = sum(f.requires_grad for f in unit.flat_params)
        if len(self._pending.get(unit, ())) < trainable or self._inputs_pending.get(unit, 0) > 0:
            return
        self._pending.pop(unit, None)
        self._inputs_pending.pop(unit, None)
        self.reshard(unit)

    def _end_of_backward(self) -> None:
        if self._on_end_backward is not None:
            self._on_end_backward()
        self.end_backward()

    def end_backward(self) -> None:
        """Close a backward: forget what it was waiting for and, at stage 3, reshard every
        unit. Runs from a callback at the end of each backward; the engine also calls it when
        an error ends a backward early (the callback does not run then)."""
        self._in_backward = False
        self.comm.set_phase(Phase.IDLE)
        self._pending.clear()
        self._inputs_pending.clear()
        if self.reshard_after_forward:
            self.reshard_all()

    def remove_hooks(self) -> None:
        """Detach every hook from the model (engine close)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


PLAIN_BACKWARD_MESSAGE = (
    "a backward through a model wrapped by an OffloadEngine ran outside engine.backward(loss) "
    "(loss.backward(), torch.autograd.backward, accelerate's backward): it would skip what "
    "engine.backward does around autograd (the 1/N of gradient_accumulation_steps, the fp16 "
    "loss scale, the updates the last forward left pending, the ranks' lockstep), so its "
    "gradients would differ. Run the forward again and call engine.backward(loss)")


def runs_itself(module: nn.Module) -> bool:
    """Whether ``module`` has a forward of its own (a ``ModuleList`` or ``ModuleDict`` has
    none: only its children run)."""
    return type(module).forward is not nn.Module.forward


class _InputGrads(torch.autograd.Function):
    """Identity on a unit's inputs whose backward calls ``callback`` once their gradients are
    computed, i.e. once backward has passed through the whole unit."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads
