"""Flat parameters: one contiguous, padded, sharded buffer per group of module parameters.

[Note: flat parameter layout]
A unit's parameters of one ``requires_grad`` value are laid end to end in one 1-D buffer of
``numel`` elements, padded to ``padded_numel = N * shard_numel`` where ``shard_numel`` is a
multiple of ``4096 / itemsize(compute dtype)``: every rank's shard starts on a 4096-byte
boundary in the compute dtype and in fp32 (O_DIRECT needs that for the NVMe tier). Rank r
owns elements ``[r * shard_numel, (r + 1) * shard_numel)``.

[Note: unsharded storage]
The gathered buffer ``full`` is a leaf tensor (``requires_grad`` for trainable groups) whose
storage holds 0 bytes when resharded and ``padded_numel`` elements when unsharded: memory
borrowed from the gather pool (see [Note: gather pool] in :mod:`offload_zero.memory.pool`), or
allocated by resizing the storage when there is no pool. Autograd saves views of ``full`` in
forward; because the storage object is the same, the saved views see the re-gathered values in
backward. Data is written through ``_full_alias``,
a tensor that shares the storage but not the version counter, so refilling it is invisible to
autograd's in-place checks. Module attributes point at views of ``full`` while the unit is
unsharded, and at zero-element placeholders that raise a clear error when used otherwise.

[Note: model parameters while wrapped]
Each original parameter name stays registered on its module (``module._parameters``) as a
model parameter (see :class:`ModelParam`; the model's own ``nn.Parameter`` object, its class
and ``.data`` changed) of the true shape, dtype (the compute dtype) and device, so
``model.parameters()``, ``.device``, ``num_parameters()`` and the state-dict machinery see
the model as it was. Where the gathered buffer is kept (stages 1 and 2, or one rank holding
its shards on the device) it is an alias of the parameter's piece of ``full``: reads see the
current values (a read from outside the engine first has an update ``"next_forward"`` left
pending applied: the flat parameter's ``read_hook``) and an in-place write under ``torch.no_grad()`` lands in ``full`` and bumps
the parameter's version counter (a write through a view bumps ``full``'s; the engine's own
writes go through ``_full_alias``, whose counter is another), which is how the engine finds
writes from outside (:mod:`offload_zero.exposure`). Otherwise it is a placeholder of one
element expanded to the shape: metadata reads work, an element-wise in-place write goes to
the engine, which applies it to the shards, ``detach()`` and ``.data`` are such placeholders
too, and any other use raises naming the parameter (see :class:`_ShardedParam`). While a unit runs, the gathered views sit in the module's
instance ``__dict__``, which attribute lookup reads before ``_parameters``; they are dropped
from there when the unit is resharded or the model's forward ends, so between steps
``module.weight`` is the registered model parameter again.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from offload_zero.config import Tier
from offload_zero.memory.accounting import StateKind, TierAccountant
from offload_zero.memory.pool import bind_storage, unbind_storage

ALIGN_BYTES = 4096


class ShardedState(enum.Enum):
    """Whether a flat parameter's gathered buffer holds storage."""

    SHARDED = "sharded"
    """Only this rank's shard exists; ``full`` has 0 bytes of storage."""
    UNSHARDED = "unsharded"
    """``full`` holds every rank's shard; module attributes are views into it."""


@dataclasses.dataclass
class ParamEntry:
    """One original ``nn.Parameter`` inside a flat parameter.

    ``refs`` lists every (module, attribute name, fully qualified name) that referred to it:
    a tied parameter has several refs and one slot in the flat buffer.
    """

    shape: torch.Size
    numel: int
    offset: int
    refs: List[Tuple[nn.Module, str, str]]

    @property
    def names(self) -> List[str]:
        """Every fully qualified name of this parameter in the model."""
        return [fqn for _, _, fqn in self.refs]


class _FreedParam(torch.Tensor):
    """Zero-element placeholder for a parameter whose unit is resharded.

    Metadata (dtype, device, requires_grad) reads work; any computation raises ``RuntimeError``
    naming the parameter, instead of silently broadcasting garbage.
    """

    _ALLOWED = {"dtype", "device", "is_cuda", "is_cpu", "requires_grad", "is_floating_point",
                "__repr__", "__format__", "dim", "ndim", "size", "shape", "numel", "element_size",
                "is_complex", "layout", "__get__", "is_meta", "data_ptr", "type",
                "untyped_storage", "stride", "is_contiguous", "nbytes", "itemsize", "storage_offset"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "") or ""
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        if name in cls._ALLOWED or owner in cls._ALLOWED or name == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        return cls._compute(func, name, args, kwargs or {})

    @classmethod
    def _compute(cls, func, name: str, args, kwargs):
        """A computation (not a metadata read) on a placeholder: an error naming it."""
        freed = next((a for a in args if isinstance(a, _FreedParam)), None)
        label = getattr(freed, "_oz_label", "a parameter")
        raise RuntimeError(
            f"{label} is sharded: its unit is not gathered while {name or func} runs. Parameters "
            "are only available inside the forward of the unit that owns them; access a parameter "
            "of another unit only from modules that run inside that unit, or name the module "
            "classes with unit_classes= so both share one unit.")


class _LateParam(_FreedParam):
    """Placeholder for a parameter whose flat parameter is gathered late (see
    :class:`offload_zero.partition.schedule.UnitScheduler`'s ``gather_late``): it has the
    parameter's shape (a stride-0 view of one element), and the first computation that touches
    it gathers its flat parameter (``_oz_gather()``) and runs on the gathered view the module
    attribute then holds (``_oz_ref``: ``(module, attribute name)``)."""

    @classmethod
    def _compute(cls, func, name: str, args, kwargs):
        """Gather, then run ``func`` on the gathered views instead of the placeholders."""
        def real(x):
            if isinstance(x, _LateParam):
                x._oz_gather()
                module, attr = x._oz_ref
                return getattr(module, attr)
            return x

        return func(*(real(a) for a in args), **{k: real(v) for k, v in kwargs.items()})


class _SplitViews(torch.autograd.Function):
    """``torch.split(full, sizes)`` whose backward writes the flat gradient into memory from
    ``target()`` (reused from step to step, see [Note: reused gradient memory] in
    :mod:`offload_zero.partition.grads`) instead of a fresh allocation; pieces without a
    gradient (unused parameters, the padding) are zero-filled there. ``target()`` returning
    None falls back to a fresh tensor. Shapes: full (padded_numel,), pieces (size_i,)."""

    @staticmethod
    def forward(ctx, full, sizes, target):
        ctx.sizes, ctx.target = sizes, target
        ctx.set_materialize_grads(False)  # an unused piece's gradient stays None (no zeros)
        ctx.meta = (full.numel(), full.dtype, full.device)
        return tuple(torch.split(full, sizes))

    @staticmethod
    def backward(ctx, *grads):
        numel, dtype, device = ctx.meta
        if len(grads) == 1 and _whole(grads[0], numel, dtype):
            # One parameter, no padding: its gradient is the flat gradient as it is. Taken
            # without a copy, and no reused buffer is held for it between steps: an LM head's
            # or an embedding's would otherwise sit idle through forward and backward, beside
            # the activations, at the step's peak.
            return grads[0].reshape(-1), None, None
        # (a double backward records the graph through this gradient: no reused memory then)
        out = None if torch.is_grad_enabled() else ctx.target()
        if out is None:
            out = torch.empty(numel, dtype=dtype, device=device)
        if all(g is not None for g in grads):
            torch.cat([g.reshape(-1) for g in grads], out=out)
        else:
            for piece, g in zip(torch.split(out, ctx.sizes), grads):
                piece.zero_() if g is None else piece.copy_(g.reshape(-1))
        return out, None, None


def _whole(g: Optional[torch.Tensor], numel: int, dtype: torch.dtype) -> bool:
    """``g`` can serve as a flat gradient of ``numel`` elements of ``dtype`` as it is."""
    return g is not None and g.numel() == numel and g.dtype == dtype and g.is_contiguous()


_PENDING_GRAD_MESSAGE = (
    "{label}: its gradient lives in the OffloadEngine's gradient shards, not in .grad, so "
    "code reading .grad cannot see it. Clip with OffloadEngine(..., max_grad_norm=...), not "
    "torch.nn.utils.clip_grad_norm_ (the engine clips by the global norm over every rank; "
    "engine.last_grad_norm holds the norm of the last step); update with engine.step() or "
    "engine.optimizer (the engine's AdamW, which schedulers drive), not a torch.optim "
    "optimizer over model.parameters()")


class _PendingGrad(_FreedParam):
    """What a model parameter's ``.grad`` returns while the engine holds a gradient for it
    (after ``engine.backward``, before ``engine.step``): the parameter's shape, and any
    computation raises ``RuntimeError`` pointing to ``max_grad_norm=`` (so
    ``clip_grad_norm_(model.parameters(), x)`` fails instead of returning a norm of 0)."""

    @classmethod
    def _compute(cls, func, name: str, args, kwargs):
        from torch.utils._pytree import tree_leaves
        grad = next((a for a in tree_leaves((args, kwargs)) if isinstance(a, _PendingGrad)), None)
        raise RuntimeError(_PENDING_GRAD_MESSAGE.format(
            label=getattr(grad, "_oz_label", "a parameter")))


class ModelParam(nn.Parameter):
    """Base of the parameters a wrapped model holds (see [Note: model parameters while
    wrapped]); made by :meth:`FlatParam.expose`.

    ``.grad`` is None while the engine holds no gradient for the parameter, and a stand-in of
    the parameter's shape whose use raises ``RuntimeError`` (naming the parameter and
    ``max_grad_norm=``) while it does. Assigning None to it is accepted while it is None
    (torch's ``zero_grad`` between steps), and raises ``RuntimeError`` while the engine holds
    a gradient (one parameter's cannot be dropped alone: the wrapped model's ``zero_grad()``
    and ``engine.zero_grad()`` drop them all); assigning a tensor raises ``RuntimeError``.
    ``requires_grad`` reads as torch's; setting it to another value (``p.requires_grad =
    False``, ``requires_grad_(False)``) raises ``RuntimeError``: which parameters train is
    fixed when the engine is built. ``copy.deepcopy`` raises ``RuntimeError`` (the copy would
    not be the engine's), and so does pickling it (``torch.save(param)``).
    """

    _oz_flat = None     # the owning FlatParam
    _oz_label = "a parameter"

    @property
    def grad(self):
        """None, or while a backward's gradient waits in the engine's shards a zero-strided
        stand-in of the parameter's shape and dtype that raises RuntimeError when computed
        with (the values live in the gradient shards; see :class:`_PendingGrad`)."""
        fp = self._oz_flat
        if fp is None or not fp.grad_pending():
            return None
        t = torch.Tensor._make_subclass(
            _PendingGrad, torch.zeros((), dtype=self.dtype, device=self.device).expand(self.shape))
        t._oz_label = self._oz_label
        return t

    @grad.setter
    def grad(self, value):
        """Only None may be assigned, and only while the engine holds no gradient for the
        parameter (as ``zero_grad`` between steps does); RuntimeError otherwise."""
        if value is not None:
            raise RuntimeError(f"{self._oz_label}: its gradient lives in the OffloadEngine's "
                               "gradient shards; .grad cannot be assigned while wrapped")
        fp = self._oz_flat
        if fp is not None and fp.grad_pending():
            raise RuntimeError(
                f"{self._oz_label}: its gradient lives in the OffloadEngine's gradient shards, "
                "where one parameter's cannot be dropped alone (.grad = None would change "
                "nothing): call zero_grad() on the wrapped model itself, or engine.zero_grad(), "
                "to drop every gradient of the backward")

    @property
    def requires_grad(self):
        """torch's ``requires_grad``; setting another value raises RuntimeError (see the
        class docstring)."""
        return torch.Tensor.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value):
        self.requires_grad_(value)

    def requires_grad_(self, requires_grad: bool = True):
        """``self`` when ``requires_grad`` is the parameter's value already; RuntimeError
        otherwise (which parameters train is fixed when the engine is built)."""
        if bool(requires_grad) != self.requires_grad:
            raise RuntimeError(
                f"{self._oz_label}: requires_grad={bool(requires_grad)} after wrapping would "
                "not reach the OffloadEngine, which fixed which parameters train (their "
                "gradient and Adam state) when it was built: freeze or unfreeze before "
                "OffloadEngine(model, ...) (as for get_peft_model); peft's calls that switch "
                "adapters refuse while wrapped, and its disable_adapter() works (see "
                "docs/huggingface.md)")
        return self

    def __deepcopy__(self, memo):
        raise RuntimeError(f"{self._oz_label}: its values live in the OffloadEngine, so a "
                           "wrapped model cannot be deep-copied; copy the model before wrapping "
                           "it, or build one and load model.state_dict() into it")

    def __reduce_ex__(self, protocol):
        raise RuntimeError(f"{self._oz_label}: its values live in the OffloadEngine, so it "
                           "cannot be pickled (torch.save); save model.state_dict() instead")


class _AliasParam(ModelParam):
    """A model parameter that aliases its piece of the kept gathered buffer: real values,
    readable and writable under ``torch.no_grad()``. A computation on it with autograd
    recording (a module that runs without its unit's hooks, a loss term on a weight) runs on
    a fresh view of ``full`` instead, so its gradient reaches the engine's flat gradient as a
    forward's does."""

    _oz_entry = None  # the ParamEntry it stands for

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        if owner == "data" or getattr(func, "__name__", "") not in _FreedParam._ALLOWED:
            cls._before_read(args)
        if owner == "data":
            return cls._data(func, args)
        kwargs = kwargs or {}
        if torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            from torch.utils._pytree import tree_map

            def live(x):
                if isinstance(x, _AliasParam) and x.requires_grad and x._oz_flat is not None:
                    return x._oz_flat.live_view(x._oz_entry)
                return x

            name = getattr(func, "__name__", "")
            if name not in _FreedParam._ALLOWED and name not in ("__get__", "__set__"):
                args, kwargs = tree_map(live, (tuple(args), kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @staticmethod
    def _before_read(args) -> None:
        """Run the ``read_hook`` of each flat parameter an argument aliases (once each): the
        engine applies an update it left pending (``update_timing="next_forward"``), so a read
        between steps sees the weights :meth:`OffloadEngine.step` made, not the ones before."""
        seen = []
        for a in args:
            fp = getattr(a, "_oz_flat", None) if isinstance(a, _AliasParam) else None
            if fp is not None and fp.read_hook is not None and fp not in seen:
                seen.append(fp)
                fp.read_hook()

    @classmethod
    def _data(cls, func, args):
        """``p.data`` is ``p.detach()``, which shares the version counter, so a write through
        it is seen (torch's own ``.data`` hides writes from it); ``p.data = t``: see
        :func:`_check_same_data`."""
        if func.__name__ == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].detach()
        _check_same_data(args[0], args[1])


def _check_same_data(param: ModelParam, new: torch.Tensor) -> None:
    """``param.data = new`` is accepted only when ``new`` is ``param`` or the same memory
    (``model.to()`` to where it already is); otherwise RuntimeError naming the parameter."""
    with torch._C.DisableTorchFunctionSubclass():
        if new is param or (new.data_ptr() == param.data_ptr() and new.shape == param.shape
                            and new.dtype == param.dtype and new.device == param.device):
            return
    raise _moved_error(param)


def _moved_error(param: ModelParam) -> RuntimeError:
    return RuntimeError(
        f"{param._oz_label}: its values live in the OffloadEngine; replacing .data (as "
        "model.to(), .half() or .float() do) would detach it from the engine. Move or cast "
        "the model before wrapping it (the engine's dtype= sets the compute dtype), or load "
        "new values with model.load_state_dict()")


def _to_is_noop(param: torch.Tensor, args, kwargs) -> bool:
    """Whether ``param.to(*args, **kwargs)`` asks for the device and dtype it has."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return ((device is None or torch.device(device) == param.device)
                and (dtype is None or dtype == param.dtype))


# in-place ops that act element by element (tensor arguments broadcast to the parameter's
# shape): a write of one of them to a sharded parameter is applied to each rank's part
ELEMENTWISE_WRITES = frozenset(
    "fill_ zero_ copy_ add_ sub_ mul_ div_ clamp_ clamp_min_ clamp_max_ neg_ abs_ sqrt_ exp_ "
    "log_ pow_ sign_ erfinv_ lerp_ addcmul_ addcdiv_ masked_fill_ nan_to_num_ round_ floor_ "
    "ceil_ trunc_ normal_ uniform_ bernoulli_ exponential_ log_normal_ cauchy_ "
    "geometric_".split())


class _ShardedParam(ModelParam):
    """A model parameter whose values exist only as shards (ZeRO stage 3): the true shape,
    dtype, device and ``requires_grad`` (one element expanded to any shape, 0-d included);
    ``detach()`` and ``.data`` give such a placeholder without autograd (for the state-dict
    machinery, whose values the engine fills in: a computation on it raises, as on the
    parameter). Two kinds of write go to the owning flat parameter's ``write_hook``
    (the engine applies them to this rank's part of the fp32 master weights and shard): an
    element-wise in-place method
    (:data:`ELEMENTWISE_WRITES`, on the parameter or its ``.data``, under ``torch.no_grad()``
    for a trainable one), and a ``torch.nn.init`` function (run on a full-shape fp32 CPU
    tensor of zeros, which it overwrites). Any other computation or write raises
    ``RuntimeError`` naming the parameter."""

    _ALLOWED = _FreedParam._ALLOWED | {"detach", "_has_compatible_shallow_copy_type"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "") or ""
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        if (owner == "data" and name == "__get__") or name == "detach":
            # (a placeholder too: a plain tensor of the expanded element would read as values;
            # the state-dict machinery keeps it until the engine's hook fills the values in)
            return args[0]._detached()
        if owner == "data" and name == "__set__":
            return _check_same_data(args[0], args[1])
        if name == "to" and _to_is_noop(args[0], args[1:], kwargs or {}):
            return args[0]  # (model.to(where it is): _apply then sets .data to it)
        if name in ("to", "half", "float", "double", "bfloat16", "cuda", "cpu", "type"):
            raise _moved_error(args[0])
        if name in cls._ALLOWED or owner in cls._ALLOWED or name == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        param = next((a for a in list(args) + [kwargs.get("tensor")]
                      if isinstance(a, _ShardedParam)), None)
        label = getattr(param, "_oz_label", "a parameter")
        init = getattr(func, "__module__", "") == "torch.nn.init"
        elementwise = bool(args) and args[0] is param and name in ELEMENTWISE_WRITES
        if param is not None and (init or elementwise):
            target = getattr(param, "_oz_target", None)
            if (not init and target is None and torch.is_grad_enabled()
                    and param.requires_grad):
                raise RuntimeError(f"{label}: a leaf Variable that requires grad is being used "
                                   "in an in-place operation (write under torch.no_grad())")
            hook = getattr(param._oz_flat, "write_hook", None)
            if hook is not None:
                hook(target if target is not None else param, param, func, args, kwargs, init)
                return param
        if name.endswith("_") and not name.endswith("__") or name == "__setitem__":
            raise RuntimeError(
                f"{label} is sharded over ranks or stored off the device (ZeRO stage 3): an "
                f"in-place write ({name}) outside forward cannot reach its shards (element-wise "
                f"ones do: {sorted(ELEMENTWISE_WRITES)}). Load new values with "
                "model.load_state_dict({name: value}, strict=False) instead")
        raise RuntimeError(
            f"{label} is sharded: its unit is not gathered while {name or func} runs. Run the "
            "wrapped model's forward, or read the weights with model.state_dict() / "
            "engine.full_state_dict(); update them with engine.step() (engine.optimizer), not a "
            "torch.optim optimizer over model.parameters()")

    def _detached(self) -> "_ShardedParam":
        """``p.data``: the same placeholder without autograd, whose writes go to ``p``."""
        with torch._C.DisableTorchFunctionSubclass():
            base = torch.Tensor.detach(self)
        d = torch.Tensor._make_subclass(_ShardedParam, base, False)
        d._oz_flat, d._oz_label = self._oz_flat, self._oz_label
        target = getattr(self, "_oz_target", None)
        d._oz_target = self if target is None else target
        return d

    def __repr__(self):
        return (f"ShardedParameter({self._oz_label}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, device={self.device}, requires_grad={self.requires_grad})")



def _placeholder(dtype, device, label: str) -> torch.Tensor:
    t = torch.Tensor._make_subclass(_FreedParam, torch.empty(0, dtype=dtype, device=device))
    t._oz_label = label
    return t


class FlatParam:
    """One flat parameter: its layout, this rank's shard, and the gathered buffer.

    Args:
        name: label used in messages and file names (e.g. ``"unit3.trainable"``).
        entries: the parameters it holds, in layout order (offsets already assigned).
        values: the original fp32/any-dtype tensors for ``entries`` (same order), copied in.
        requires_grad: whether the group is trainable.
        dtype: compute dtype of the shard and the gathered buffer.
        device: the accelerator.
        rank, world_size: this rank and the data-parallel world size N.
        keep_unsharded: True at stages 1 and 2 (parameters are never freed).
        accountant: records bytes of the shard and gathered buffer on the device tier.
        home: where the shard lives when not on the device (``HostParamHome`` /
            ``NVMeParamHome`` from :mod:`offload_zero.memory.param_homes`), or None for the device.

    Attributes:
        numel: real elements; shard_numel: elements per rank (aligned); padded_numel = N * shard_numel.
        grad_as_is: one parameter and no padding: autograd's gradient of that parameter is the
            flat gradient as it is (taken without a copy; no reused memory is lent for it).
        sharded: this rank's shard, shape (shard_numel,), compute dtype: on the device, in host
            memory (host home), or None (NVMe home: read into a pool buffer when gathered).
        full: the gathered buffer, shape (padded_numel,), 0 bytes while SHARDED.
        grad_target: ``f() -> Tensor | None`` giving the memory (shape (padded_numel,), compute
            dtype) that backward writes ``full``'s next gradient into, or None to allocate it
            each time (set by :class:`offload_zero.partition.grads.GradientShards`; see
            [Note: reused gradient memory] there).
    """

    def __init__(self, name: str, entries: List[ParamEntry], values: List[torch.Tensor],
                 requires_grad: bool, dtype: torch.dtype, device: torch.device, rank: int,
                 world_size: int, keep_unsharded: bool, accountant: TierAccountant, home=None):
        self.name = name
        self.entries = entries
        self.requires_grad = requires_grad
        self.dtype = dtype
        self.device = device
        self.rank, self.world_size = rank, world_size
        self.keep_unsharded = keep_unsharded
        self._acct = accountant
        self.home = home
        self.numel = sum(e.numel for e in entries)
        self.shard_numel = shard_numel_for(self.numel, world_size, dtype)
        self.padded_numel = self.shard_numel * world_size
        self.grad_as_is = len(entries) == 1 and self.padded_numel == self.numel
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self._bound = False  # full's storage borrows gather-pool memory
        # f() -> Tensor | None: memory the next gradient of ``full`` is written into, or None
        # to allocate it (see [Note: reused gradient memory] in partition/grads.py)
        self.grad_target = None
        # f() -> bool: whether the engine holds a gradient of this flat parameter (set by the
        # engine; read by the model parameters' ``.grad``)
        self.grad_pending = lambda: False
        self.exposed: List[ModelParam] = []  # one per entry (see expose())
        # f(param, source, func, args, kwargs, init): applies an element-wise in-place write
        # or an init function to a sharded model parameter (set by the engine; None: raise)
        self.write_hook = None
        # f(): called before a computation reads a model parameter that aliases this flat
        # parameter's values from outside the engine (see _AliasParam), or None
        self.read_hook = None

        self.full = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        self._full_alias = torch.empty(0, dtype=dtype, device=device).set_(
            self.full.untyped_storage(), 0, (self.padded_numel,), (1,))
        if requires_grad:
            self.full.requires_grad_(True)
        lo = rank * self.shard_numel
        with torch.no_grad():
            for e, v in zip(entries, values):
                self._full_alias[e.offset:e.offset + e.numel].copy_(v.reshape(-1))
        if keep_unsharded:
            # stage 1/2: the shard is a window of the persistent gathered buffer.
            self.sharded = self._full_alias[lo:lo + self.shard_numel]
            self.state = ShardedState.UNSHARDED
            self._acct.add(Tier.DEVICE, StateKind.PARAMS, self.padded_numel * self.itemsize)
        else:
            self.sharded = self._full_alias[lo:lo + self.shard_numel].clone()
            if home is None:
                self._acct.add(Tier.DEVICE, StateKind.PARAMS, self.shard_numel * self.itemsize)
            else:
                self.sharded = home.adopt(self, self.sharded)
            self.full.untyped_storage().resize_(0)
            self.state = ShardedState.SHARDED

    # -- state transitions (the only places ``state`` changes) ---------------------------------
    def to_unsharded(self, comm, memory: Optional[torch.Tensor] = None,
                     staging: Optional[torch.Tensor] = None) -> None:
        """SHARDED -> UNSHARDED: give ``full`` storage and all-gather every rank's shard into it.

        Args:
            comm: the data-parallel :class:`offload_zero.comm.Comm`.
            memory: uint8 device memory of ``padded_numel * itemsize`` bytes from the gather pool
                to bind ``full``'s storage to (see [Note: gather pool]); None allocates it.
            staging: a device buffer of at least ``shard_numel`` elements in the compute dtype
                that a host shard is copied into before a multi-rank all-gather (None allocates).
        """
        if self.state is ShardedState.UNSHARDED:
            return
        shard = self.sharded if self.home is None else self.home.shard_for_gather(self)
        nbytes = self.padded_numel * self.itemsize
        if memory is not None:
            bind_storage(self.full.untyped_storage(), memory[:nbytes])
            self._bound = True
        else:
            self.full.untyped_storage().resize_(nbytes)
            self._acct.add(Tier.DEVICE, StateKind.PARAMS, nbytes)
        if shard.device != self.device and self.world_size > 1:
            # a blocking copy: a host shard's buffer goes back to its pool right after
            if staging is not None and staging.numel() >= self.shard_numel:
                shard = staging[:self.shard_numel].copy_(shard)
            else:
                shard = shard.to(self.device)
        with torch.no_grad():
            comm.all_gather_into(self._full_alias, shard, what=self.name)
        if self.home is not None:
            self.home.done_with(self)
        self.state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        """UNSHARDED -> SHARDED: release ``full``'s storage (or its gather-pool memory) and
        point modules at placeholders. A no-op for flat parameters that are never freed
        (stages 1 and 2)."""
        if self.state is ShardedState.SHARDED or self.keep_unsharded:
            return
        self._drop_full()
        self.state = ShardedState.SHARDED
        self.set_placeholders()

    def _drop_full(self, keep_values: bool = False) -> None:
        if self._bound:
            unbind_storage(self.full.untyped_storage(), keep_values=keep_values)
            self._bound = False
        elif self.full.untyped_storage().nbytes():  # (0: a call cut short by an interrupt
            if not keep_values:                     # dropped it already)
                self.full.untyped_storage().resize_(0)
            self._acct.sub(Tier.DEVICE, StateKind.PARAMS, self.padded_numel * self.itemsize)

    # -- module attributes -------------------------------------------------------------------
    def set_views(self) -> None:
        """Point every module attribute at its view of ``full`` (must be UNSHARDED).

        Called before each forward so autograd records a fresh view per use.
        """
        if self.state is not ShardedState.UNSHARDED:
            raise RuntimeError(f"[rank {self.rank}] {self.name}: set_views while {self.state.value}")
        # Outside forward (inside backward, before an activation-checkpointing recomputation)
        # grad mode is off; the views must still track gradients when the caller's forward does.
        track = torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1
        # One split for all parameters: its backward writes every gradient into the flat
        # gradient in a single pass (a slice per parameter would zero-fill and add a full-size
        # tensor per parameter).
        sizes = [e.numel for e in self.entries]
        if self.padded_numel > self.numel:
            sizes.append(self.padded_numel - self.numel)
        with torch.set_grad_enabled(track):
            if self.grad_target is not None and track and self.full.requires_grad:
                pieces = _SplitViews.apply(self.full, sizes, self.grad_target)
            else:
                pieces = torch.split(self.full, sizes)
            for e, piece in zip(self.entries, pieces):
                view = piece.view(e.shape)
                for module, attr, _ in e.refs:
                    module.__dict__[attr] = view  # (read before _parameters: see the Note)

    def expose(self, originals: Optional[List[nn.Parameter]] = None) -> None:
        """Register a model parameter per entry under each of its names (see [Note: model
        parameters while wrapped]): an alias of its piece of ``full`` when ``full`` is kept,
        else a placeholder; then drop any views from the modules' ``__dict__``. Called once,
        when the engine is built.

        ``originals``: the model's own ``nn.Parameter`` objects, one per entry (in order): each
        becomes its entry's model parameter in place (its class and ``.data`` change), so
        references to it taken before wrapping see the engine's values and writes through
        them are seen; a parameter of another class (a subclass), or on another device (the
        meta device of an empty model), is replaced by a new one."""
        zero = torch.zeros((), dtype=self.dtype, device=self.device)  # (expands to any shape)
        base = self.full.detach()
        self.exposed = []
        for i, e in enumerate(self.entries):
            if self.keep_unsharded:
                data, cls = base[e.offset:e.offset + e.numel].view(e.shape), _AliasParam
            else:
                data, cls = zero.expand(e.shape), _ShardedParam
            p = None if originals is None else originals[i]
            if p is not None and type(p) is nn.Parameter and not p.is_meta:
                # (storage shared with full; p keeps its own version counter). A parameter of
                # an empty model (on the meta device) holds nothing to keep: a new one
                p.data = data
                p.__class__ = cls
            else:
                p = cls(data, requires_grad=self.requires_grad)
            p._oz_flat, p._oz_label = self, f"parameter {e.names[0]!r}"
            if cls is _AliasParam:
                p._oz_entry = e
            self.exposed.append(p)
            for module, attr, _ in e.refs:
                module._parameters[attr] = p
        self.hide_views()

    def live_view(self, entry: ParamEntry) -> torch.Tensor:
        """A view of ``entry``'s piece of ``full`` (must be UNSHARDED), shape ``entry.shape``,
        that autograd tracks into ``full``'s gradient."""
        if self.state is not ShardedState.UNSHARDED:
            raise RuntimeError(f"[rank {self.rank}] {self.name}: live_view while "
                               f"{self.state.value}")
        return self.full[entry.offset:entry.offset + entry.numel].view(entry.shape)

    def hide_views(self) -> None:
        """Drop the gathered views from the modules' ``__dict__``: attribute lookup finds the
        registered model parameters again (no-op before :meth:`expose`)."""
        if not self.exposed:
            return
        for e in self.entries:
            for module, attr, _ in e.refs:
                module.__dict__.pop(attr, None)

    def write_version(self) -> Tuple[int, ...]:
        """The version counters of ``full`` and of each model parameter: they move only when
        something outside the engine writes to the views or the model parameters (see [Note:
        model parameters while wrapped])."""
        return (self.full._version,) + tuple(p._version for p in self.exposed)

    def set_placeholders(self, gather=None) -> None:
        """Point every module attribute at a placeholder: the registered model parameters
        (:meth:`expose`), or before that a zero-element placeholder naming the parameter; with
        ``gather`` (``f()`` that gathers this flat parameter and sets its views), at a
        placeholder of the parameter's shape whose first computation calls it and then runs on
        the gathered view (see :class:`_LateParam`)."""
        if gather is None and self.exposed:
            self.hide_views()
            return
        for e in self.entries:
            for module, attr, fqn in e.refs:
                if gather is None:
                    t = _placeholder(self.dtype, self.device, f"parameter {fqn!r}")
                else:
                    one = torch.empty(1, dtype=self.dtype, device=self.device)
                    t = torch.Tensor._make_subclass(_LateParam, one.expand(e.shape))
                    t._oz_label, t._oz_gather, t._oz_ref = f"parameter {fqn!r}", gather, (module, attr)
                module.__dict__[attr] = t

    def full_values(self) -> torch.Tensor:
        """The gathered compute-dtype values (must be UNSHARDED), shape (padded_numel,), no grad."""
        return self._full_alias

    def release(self) -> None:
        """Drop every tensor this flat parameter holds (engine close).

        The storage is released by reference counting rather than resized to 0 bytes, so views
        still held elsewhere (a traceback's frames, say) stay readable instead of dangling.
        """
        if self.state is ShardedState.UNSHARDED and not self.keep_unsharded:
            self._drop_full(keep_values=True)  # views held elsewhere keep their values
        elif self.state is ShardedState.UNSHARDED:
            self._acct.sub(Tier.DEVICE, StateKind.PARAMS, self.padded_numel * self.itemsize)
        if self.home is not None:
            self.home.release(self)
        elif not self.keep_unsharded:
            self._acct.sub(Tier.DEVICE, StateKind.PARAMS, self.shard_numel * self.itemsize)
        for e in self.entries:  # the model is left without parameters (zero-element placeholders)
            for module, attr, _ in e.refs:
                module._parameters.pop(attr, None)
        for p in self.exposed:  # (references still held elsewhere: empty plain parameters)
            with torch._C.DisableTorchFunctionSubclass():
                p.data = torch.empty(0, dtype=self.dtype)
            p.__class__ = nn.Parameter
        self.exposed = []
        self.set_placeholders()
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.full = self._full_alias = self.sharded = empty
        self.state = ShardedState.SHARDED


def shard_numel_for(numel: int, world_size: int, dtype: torch.dtype) -> int:
    """Elements per rank of a flat parameter of ``numel`` elements (see [Note: flat parameter
    layout]): ``ceil(numel / N)`` rounded up to a multiple of ``4096 / itemsize``, at least one
    such block."""
    align = ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size()
    return max(1, math.ceil(numel / (world_size * align))) * align


def build_entries(params: List[Tuple[nn.Parameter, List[Tuple[nn.Module, str, str]]]]
                  ) -> List[ParamEntry]:
    """Assign offsets in order; returns one :class:`ParamEntry` per distinct parameter."""
    entries, offset = [], 0
    for p, refs in params:
        entries.append(ParamEntry(shape=p.shape, numel=p.numel(), offset=offset, refs=refs))
        offset += p.numel()
    return entries
