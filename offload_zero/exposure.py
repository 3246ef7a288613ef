"""The wrapped model's own API: its parameters, ``state_dict()``, ``load_state_dict()``, and
writes to its parameters from outside the engine.

The engine owns the weights (flat parameters; fp32 master weights in its store), but a script
keeps using the model object: Hugging Face's ``model.device``, ``num_parameters()``,
``generate()`` and ``save_pretrained()``, PEFT's adapter export, ``torch.no_grad()`` writes
that reset a layer. [Note: model parameters while wrapped] in
:mod:`offload_zero.partition.flat_param` describes the parameters the modules hold; this
module hooks the model so that:

- ``model.state_dict()`` returns every parameter as its full fp32 value, the same tensors as
  :meth:`OffloadEngine.full_state_dict` (collective over the data-parallel ranks);
- ``model.load_state_dict(sd, strict=...)`` writes parameters into the master weights, the
  moments left as they are, and into the compute-dtype shards on every tier, with torch's
  missing / unexpected key semantics and return value (collective at stages 1 and 2);
- an in-place write to a parameter outside forward reaches the master weights: at stages 1
  and 2 (or one rank holding its shards on the device) before the next forward, step or
  export reads them; where the parameter exists only as shards an element-wise write
  (``fill_``, ``copy_``, ``mul_``, ``normal_``, ...: ``flat_param.ELEMENTWISE_WRITES``) or a
  ``torch.nn.init`` function is applied at once to this rank's part of the fp32 master
  weights and shard, and any other write raises naming the parameter.

[Note: writes from outside]
The version counters of a kept gathered buffer ``full`` and of its model parameters move
only when something other than the engine writes to them (see the flat-parameter note).
The versions seen last are recorded per flat parameter; when they moved (checked as the
model's forward starts, and by the engine before a step, an export or a checkpoint) the
elements of this rank's shard whose compute-dtype value no longer equals the master weight
rounded to that dtype take the written value as their new fp32 master weight. Elements left
alone keep their full-precision master (a write to one layer does not round the others). A
write is thus seen at the compute dtype's precision: ``fill_(0.1)`` in bfloat16 trains from
bfloat16(0.1). With several ranks each rank takes its own shard from its own copy, so (as
with DDP) a script writes the same values on every rank.

[Note: forward entered below the model]
The engine gathers the root unit (everything outside the blocks) in the model's own
pre-forward hook. A forward can start lower down, with no forward of the model running: PEFT's
``PeftModel.generate`` calls the base model's ``generate``, which runs the base model's
forward; a script calls ``model.get_input_embeddings()(ids)`` or one layer's MLP. Every module
below the model that holds the engine's parameters or contains such a module therefore carries
a pre-forward hook (first): when no forward of the model (nor a backward) runs, its forward
starts one, as the model's own hooks do (writes from outside taken in, the root gathered, the
phase set, updates still pending for what is gathered applied), the block units enclosing
the module gathered too (their hooks sit above it); its post-forward hooks (last) end it the
same way. (With one rank and the shards on the device the shard is the parameter and nothing
needs a gather; with the shards on the host or NVMe the module would meet placeholders.)

Once the engine is closed (or collected) the model has no parameters left: the same hooks, and
state-dict and load-state-dict pre-hooks on the model and those modules, stay behind and raise
RuntimeError, so ``state_dict()`` (and PEFT's ``save_pretrained``) cannot return an empty
dict and save nothing. Keeping the weights on the model at close was not chosen: it would take
the whole model in host memory, which a model offloaded to NVMe does not fit.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Tuple

import torch
from torch.utils._pytree import tree_map

from offload_zero.partition.flat_param import FlatParam, ParamEntry
from offload_zero.peft_calls import PeftCalls
from offload_zero.update.rules import NEXT_FORWARD


def _refuse_copy(model) -> None:
    """Raise RuntimeError: a wrapped model cannot be pickled (``torch.save(model)``) or
    deep-copied; say what to do instead."""
    raise RuntimeError(
        f"{type(model).__name__}: a model wrapped by an OffloadEngine cannot be pickled "
        "(torch.save(model)) or deep-copied: its values live in the engine, and its hooks with "
        "them. Save model.state_dict() (or save_pretrained()) and load it into a model built "
        "anew, or copy the model before wrapping it")


class ModelExposure:
    """The hooks that keep a wrapped model's own API working; one per engine.

    Args:
        engine: the :class:`offload_zero.engine.OffloadEngine` (held weakly: the hooks on the
            model do nothing once it is gone or closed).

    Hooks installed on ``engine.module``: a forward pre-hook (first) that takes in writes
    from outside, a forward hook (last) that drops the gathered views from the modules so
    between forwards their attributes are the registered parameters, a state-dict post-hook
    and load-state-dict pre/post hooks; on the modules below it that use the engine's
    parameters, the hooks of [Note: forward entered below the model]. :meth:`remove` takes
    them off (engine close), but for those that raise once the engine is closed.
    """

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self._versions: Dict[FlatParam, Tuple[int, ...]] = {}  # (see FlatParam.write_version)
        self._exporting = False
        self._loaded_keys: List[str] = []
        model = engine.module
        for fp in engine.flat_params:
            if not fp.keep_unsharded:
                fp.write_hook = lambda *call, fp=fp: self.write_to_shards(fp, *call)
            elif fp.requires_grad and engine.config.update_timing == NEXT_FORWARD:
                # (only "next_forward" leaves updates pending: no hook on others' hot path)
                fp.read_hook = lambda fp=fp: self._before_read(fp)
        self._reading = False
        # (the weights are gone once the engine is: these stay after close() and raise)
        self._guards = [model.register_forward_pre_hook(self._refuse_closed, prepend=True),
                        model.register_state_dict_pre_hook(self._refuse_closed),
                        model.register_load_state_dict_pre_hook(self._refuse_closed)]
        self._entry = None  # the module a forward entered below the model started at
        self._inside: Dict[torch.nn.Module, List] = {}  # module -> block units holding it
        for unit in engine.blocks:
            for sub in unit.module.modules():
                if sub is not unit.module:
                    self._inside.setdefault(sub, []).append(unit)
        self._handles = []
        for sub in _entry_modules(engine):
            self._guards += [sub.register_forward_pre_hook(self._entry_pre, prepend=True),
                             sub.register_state_dict_pre_hook(self._refuse_closed),
                             sub.register_load_state_dict_pre_hook(self._refuse_closed)]
            self._handles += [sub.register_forward_hook(self._entry_post),
                              sub.register_forward_hook(self._entry_failed, always_call=True)]
        self._handles += [
            model.register_forward_pre_hook(self._before_forward, prepend=True),
            model.register_forward_hook(self._after_forward),
            model.register_state_dict_post_hook(
                lambda *args: self._fill_state_dict(*args)),  # (torch marks the hook object)
            model.register_load_state_dict_pre_hook(self._load_pre),
            model.register_load_state_dict_post_hook(self._load_post),
        ]
        # the model's zero_grad() drops the engine's gradients (torch's would set each .grad
        # to None, which cannot drop one parameter's part of a flat gradient: it raises)
        object.__setattr__(model, "zero_grad", self._zero_grad)
        # pickle and copy.deepcopy look __reduce_ex__ up on the instance: the model's hooks
        # (closures) made them fail with a bare AttributeError about a local object
        object.__setattr__(model, "__reduce_ex__", lambda protocol: _refuse_copy(model))
        # peft's adapter calls: refused before they change anything, disable_adapter() works
        self._peft = PeftCalls(model, self._settle)
        self.record_versions()

    def _settle(self) -> None:
        """Apply the updates the engine left pending, while it is open (see [Note: peft adapter
        calls] in :mod:`offload_zero.peft_calls`)."""
        eng = self._live()
        if eng is not None:
            eng.apply_pending_updates()

    def _before_read(self, fp) -> None:
        """A computation outside the engine reads a model parameter that aliases ``fp``'s
        values: an update ``update_timing="next_forward"`` left pending for it is applied first
        (every pending one, as for ``state_dict()``), so the read sees the weights the last
        step made. Nothing to do in a forward or backward (a unit's pending update is applied
        before its gather) or while the engine itself applies them."""
        eng = self._live()
        if eng is None or self._reading or not eng._states.is_pending(fp):
            return
        sched = eng.scheduler
        if sched.forward_running or sched.in_engine_backward:
            return
        self._reading = True
        try:
            eng.apply_pending_updates()
        finally:
            self._reading = False

    def _zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped model's ``zero_grad``: ``engine.zero_grad(set_to_none)`` (see
        :meth:`OffloadEngine.zero_grad`); nothing to drop once the engine is closed."""
        eng = self._live()
        if eng is not None:
            eng.zero_grad(set_to_none)

    def _live(self):
        eng = self._engine()
        return None if eng is None or eng._closed else eng

    def remove(self) -> None:
        """Take the hooks off the model (idempotent), but for those that make its forward,
        ``state_dict()`` and ``load_state_dict()`` raise once the engine is closed (see
        :meth:`_refuse_closed`); the model's ``save_pretrained`` and ``generate`` (Hugging
        Face's, peft's) then raise the same way (instance attributes set on the closed
        model)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._peft.remove()
        eng = self._engine()
        model = None if eng is None else eng.module
        for name in ("save_pretrained", "generate"):
            if callable(getattr(model, name, None)):
                # (Hugging Face's read model.dtype or model.device first, which a model without
                # parameters fails with StopIteration; peft's save writes its config first)
                object.__setattr__(model, name, lambda *args, **kwargs: self._refuse_closed(model))

    def _refuse_closed(self, module, *args) -> None:
        """Raise RuntimeError if the engine is closed or gone: its weights went with it, so
        the model has no parameters left, and its ``state_dict()`` would be empty (a silent
        empty save) and its forward would have nothing to compute with."""
        if self._live() is None:
            raise RuntimeError(
                f"{type(module).__name__}: its OffloadEngine is closed, and the weights went "
                "with it (the model has no parameters left). Take model.state_dict() or "
                "engine.full_state_dict(), or call save_pretrained(), before engine.close()")

    # -- a forward entered below the model ----------------------------------------------------
    def _entry_pre(self, module, args) -> None:
        """Pre-forward hook (first) on every module below the model that holds or contains
        the engine's parameters: when no forward of the model runs, this module's forward is
        where one starts (see [Note: forward entered below the model])."""
        self._refuse_closed(module)
        eng = self._engine()
        if self._entry is not None or eng.scheduler.forward_running:
            return
        self._entry = module
        self.take_outside_writes()
        eng.scheduler.begin_forward(module, args, self._inside.get(module, ()))

    def _entry_post(self, module, args, output) -> None:
        if self._entry is module and self._live() is not None:
            self._live().scheduler.end_forward(module, args, output)
            self._after_forward(module, args, output)

    def _entry_failed(self, module, args, output) -> None:
        """Runs last after this module's forward, whether it raised or not."""
        if self._entry is not module:
            return
        self._entry = None
        eng = self._live()
        if eng is not None:
            eng.scheduler.forward_failed(module, args, output)

    # -- writes from outside ---------------------------------------------------------------
    def record_versions(self) -> None:
        """Take every kept gathered buffer's current values as the engine's own (see [Note:
        writes from outside]); after the engine itself rewrote master weights and shards."""
        eng = self._live()
        if eng is not None:
            self._versions = {fp: fp.write_version() for fp in eng.flat_params
                              if fp.keep_unsharded}

    def take_outside_writes(self) -> List[FlatParam]:
        """Copy what was written into the model's parameters since the last check into the
        fp32 master weights (see [Note: writes from outside]); returns the flat parameters
        that had writes. Raises SwapIOError if an NVMe transfer fails."""
        eng = self._live()
        if eng is None:
            return []
        changed = [fp for fp, seen in self._versions.items() if fp.write_version() != seen]
        for fp in changed:
            if fp.requires_grad and not eng.store.aliases(fp):
                master, m, v = eng.store.read_all(fp)
                compute = fp.sharded.detach().cpu()
                moved = compute != master.to(fp.dtype)
                if bool(moved.any()):
                    master[moved] = compute[moved].float()
                    eng.store.write_all(fp, master, m, v)
            # (frozen parameters, and fp32 masters that are the shard: the write is in place)
            self._versions[fp] = fp.write_version()
        return changed

    def write_to_shards(self, fp: FlatParam, param, source, func, args, kwargs,
                        init: bool) -> None:
        """Apply the write ``func(*args, **kwargs)`` to ``param``, a parameter of ``fp`` that
        exists only as shards (``source``: the object standing for it in the call, ``param``
        or its ``.data``): to this rank's part of its fp32 master weights (or, frozen, its
        shard in fp32), then the compute-dtype shard is rewritten from it on its tier.

        An element-wise in-place method (``init`` False) runs on that part, tensor arguments
        broadcast to the parameter's shape and cut to the same part; a ``torch.nn.init``
        function (``init`` True) runs on a full-shape fp32 CPU tensor of zeros (it overwrites
        every element), whose part is then copied in. Local to this rank (no collective):
        with several ranks each rank's write sets its own part, so a script writes on every
        rank, as with DDP. Raises RuntimeError if the engine is closed, SwapIOError if an NVMe
        transfer fails."""
        eng = self._engine()
        if eng is None or eng._closed:
            raise RuntimeError(f"{param._oz_label}: its OffloadEngine is closed")
        e = next(e for e, p in zip(fp.entries, fp.exposed) if p is param)
        lo = eng.rank * fp.shard_numel
        a, b = max(lo, e.offset), min(lo + fp.shard_numel, e.offset + e.numel)
        eng.apply_pending_updates()
        if not eng.scheduler._in_backward:
            eng.scheduler.reshard_all()  # a gathered copy would be stale
        if a >= b:
            return  # (no element of it on this rank)
        shard, m, v = _read_shard(eng, fp)
        piece = shard[a - lo:b - lo]
        whole = torch.zeros(e.shape, dtype=torch.float32) if init else None

        def local(x):
            if x is source:
                return whole if init else piece
            if isinstance(x, torch.Tensor) and not init:
                x = x.detach().to("cpu")
                if x.numel() > 1:
                    return x.expand(e.shape).reshape(-1)[a - e.offset:b - e.offset]
            return x

        new_args, new_kwargs = tree_map(local, (tuple(args), dict(kwargs)))
        with torch._C.DisableTorchFunctionSubclass():
            func(*new_args, **new_kwargs)
        if init:
            piece.copy_(whole.reshape(-1)[a - e.offset:b - e.offset])
        _write_shard(eng, fp, shard, m, v)
        if eng.param_home is not None:
            eng.param_home.drain()

    def before_step(self) -> None:
        """At the start of a step: take in writes since the forward (see
        :meth:`take_outside_writes`) and drop views that backward left on the modules."""
        eng = self._live()
        if eng is None:
            return
        self.take_outside_writes()
        for fp in eng.flat_params:
            fp.hide_views()

    def _before_forward(self, module, args):
        if self._live() is not None:
            self.take_outside_writes()

    def _after_forward(self, module, args, output):
        eng = self._live()
        if eng is not None:
            for fp in eng.flat_params:
                fp.hide_views()

    # -- state_dict ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def exporting(self):
        """While :meth:`OffloadEngine.full_state_dict` reads the model's own ``state_dict()``
        for its buffers, the post-hook leaves it as it is (no recursion)."""
        self._exporting, before = True, self._exporting
        try:
            yield
        finally:
            self._exporting = before

    def _fill_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        eng = self._live()
        if eng is None or self._exporting:
            return
        full = eng.full_state_dict()
        for name, value in full.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = value

    # -- load_state_dict ----------------------------------------------------------------------
    def _load_pre(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                  unexpected_keys, error_msgs) -> None:
        eng = self._live()
        if eng is None:
            return
        values: Dict[FlatParam, List[Tuple[ParamEntry, torch.Tensor]]] = {}
        for fp in eng.flat_params:
            for e in fp.entries:
                present = [prefix + n for n in e.names if prefix + n in state_dict]
                if not present:
                    continue
                value = state_dict[present[-1]]  # (torch copies each name in turn: the last wins)
                if not isinstance(value, torch.Tensor) or value.shape != e.shape:
                    continue  # torch's own load reports it (the parameter has the true shape)
                for key in present:
                    del state_dict[key]
                self._loaded_keys += present
                values.setdefault(fp, []).append(
                    (e, value.detach().to("cpu", torch.float32).reshape(-1)))
        if values:
            load_parameters(eng, values)

    def _load_post(self, module, incompatible_keys) -> None:
        taken = set(self._loaded_keys)
        self._loaded_keys = []
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys
                                             if k not in taken]


def _entry_modules(engine) -> List[torch.nn.Module]:
    """The modules below ``engine.module`` whose forward can need the engine's parameters:
    those that hold one, and those that contain such a module."""
    users = {id(m) for fp in engine.flat_params for e in fp.entries for m, _, _ in e.refs}
    return [m for m in engine.module.modules()
            if m is not engine.module and any(id(s) in users for s in m.modules())]


def load_parameters(engine, values: Dict[FlatParam, List[Tuple[ParamEntry, torch.Tensor]]]
                    ) -> None:
    """Write new parameter values into ``engine``'s fp32 master weights (moments and step
    counts unchanged) and compute-dtype shards, on whatever tier they live, the way loading a
    checkpoint writes them.

    Args:
        engine: an open :class:`offload_zero.engine.OffloadEngine`.
        values: per flat parameter, ``(entry, value)`` pairs: ``value`` a flat fp32 CPU tensor
            of ``entry.numel`` elements. This rank writes the part of each that falls in its
            shard; with the gathered buffer kept (stages 1 and 2) the new shards are then
            all-gathered into it, so every rank must call this (collective).

    Raises SwapIOError if an NVMe transfer fails (file and offset named).
    """
    exposure = engine._exposure
    exposure.take_outside_writes()  # (a write to another parameter of the same flat one)
    engine.apply_pending_updates()
    if not engine.scheduler._in_backward:
        engine.scheduler.reshard_all()  # a gathered copy would be stale
    for fp, pieces in values.items():
        lo = engine.rank * fp.shard_numel
        hi = lo + fp.shard_numel
        shard, m, v = _read_shard(engine, fp)
        for e, value in pieces:
            a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
            if a < b:
                shard[a - lo:b - lo] = value[a - e.offset:b - e.offset]
        _write_shard(engine, fp, shard, m, v)
        if fp.keep_unsharded:
            engine.comm.all_gather_into(fp.full_values(), fp.sharded)
    if engine.param_home is not None:
        engine.param_home.drain()
    exposure.record_versions()


def _read_shard(engine, fp: FlatParam):
    """This rank's shard of ``fp`` in fp32 on the CPU (a copy): its master weights with the
    moments ``(shard, exp_avg, exp_avg_sq)``, or for a frozen one ``(shard, None, None)``."""
    if fp.requires_grad:
        return engine.store.read_all(fp)
    now = fp.home.read(fp) if fp.home is not None else fp.sharded.detach()
    return now.to("cpu", torch.float32, copy=True), None, None


def _write_shard(engine, fp: FlatParam, shard: torch.Tensor, m, v) -> None:
    """Make ``shard`` (fp32, (shard_numel,)) ``fp``'s master weights (moments ``m``, ``v``
    as read) and its compute-dtype shard, the way loading a checkpoint writes them."""
    from offload_zero.checkpoint.load import write_param_shard as _write_param_shard
    if fp.requires_grad:
        engine.store.write_all(fp, shard, m, v)
    _write_param_shard(fp, shard.to(fp.dtype))
