"""Gradient shards: reduce each flat parameter's gradient to this rank's shard and keep it.

Stage 2/3: as soon as a flat parameter's gradient is accumulated in backward, it is
reduce-scattered (averaged over ranks), added into this rank's gradient shard, and the full
gradient is freed. Stage 1: the full gradient stays on the device until ``step()``, which
reduce-scatters it then (the same bytes as an all-reduce: Rajbhandari et al., 2019, sec. 7.2.1).

The shard buffer is fp32 in host memory when offloading (ZeRO-Offload keeps fp32 gradient
partitions on the CPU), else compute dtype on the device. Shapes: (shard_numel,). At stage 1
without offload there is no separate shard buffer: the full gradient is reduced in place and
this rank's window of it is the shard (the paper's 2Ψ of gradients, not 2Ψ + 2Ψ/N).

[Note: reused gradient memory]
On a CPU device (the host plays the accelerator) a flat parameter's gradient would be a fresh
allocation of ``padded_numel`` elements in every backward. Allocations that large are mapped
by the C library at malloc and unmapped at free, so every step faults their pages in again,
one fault per 4 KiB (the 149M-parameter bench model: 600 MB of gradients, 150k faults, about
a quarter of a second of kernel time a step; plain torch's per-parameter gradients are small
enough for malloc to recycle). At stages 2 and 3 the gradient of a flat parameter is consumed
as soon as it is accumulated, so its memory is lent instead (``FlatParam.grad_target``): the
backward of the parameters' views writes the flat gradient into a buffer from a free list of
buffers of its size (aligned host memory, huge pages where available) and autograd takes that
tensor as ``full.grad`` without a copy. The buffer returns to the free list once the gradient
is reduced into the shard, or, where one rank's shard adopts the gradient itself, once the
shard is zeroed after the update; a full :meth:`GradientShards.zero` also takes back any lent
buffer nothing holds any more (a gradient autograd added into another instead of taking it).
The free list keeps what was lent at once: with ``update_timing="backward"`` one buffer of each size
(each gradient is used up by its update in backward, and the engine zeroes it then, so blocks
of one size share one buffer, and so do sizes within ``NEAR_SIZE`` of each other, such as an
LM head and input embeddings with spare rows: :func:`size_classes`;
:func:`offload_zero.estimator.placement_bytes` counts the same), every flat parameter's
gradient for a plain
step at world size 1 (held until the step, as plain torch holds its ``.grad`` until
``zero_grad``), where one rank's host shards adopt the gradients; otherwise every size maps to
one class, the largest flat parameter's that borrows, so the gradients (each reduced at once)
take turns in one buffer: the gradient in flight of ZeRO's stages 2 and 3 (beside it, briefly,
a gradient taken as it is, below). Idle buffers count as host gradients where the shards adopt
them (their memory between steps); otherwise every buffer
counts as a device buffer, lent or not (the gradient in flight that
:mod:`offload_zero.estimator` adds on a CPU device). On CUDA the caching allocator already
recycles device memory, and nothing is lent.
A flat parameter of one parameter and no padding borrows nothing: autograd's gradient of that
parameter already is its flat gradient and is taken as it is (no copy). A buffer lent to it
would sit idle from its update to the next backward, beside the activations (an LM head's or
an embedding's: 131 MB each on the bench model, the step's peak RSS 0.12 GB higher), for the
faults of one fresh allocation a step, which plain torch pays for every parameter (it counts
as a device gradient while it is reduced; the estimator adds the largest such). This is why
:func:`offload_zero.partition.units.split_by_gradient_order` gives an LM head's weight a flat
parameter of its own, apart from the final norm.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional

import torch

from offload_zero.config import Tier
from offload_zero.memory.accounting import StateKind, TierAccountant
from offload_zero.partition.flat_param import FlatParam


NEAR_SIZE = 1.0625
"""Gradients whose sizes differ by at most this factor share lent buffers (with
``share_near_sizes``): an LM head and input embeddings with spare rows, say."""


def size_classes(sizes: List[int]) -> Dict[int, int]:
    """``{size: class size}`` for element counts ``sizes``: from the largest down, a size at
    least ``class size / NEAR_SIZE`` joins the current class, else starts its own. A buffer of
    the class size serves every gradient of the class (see [Note: reused gradient memory]);
    the estimator counts the same classes."""
    out: Dict[int, int] = {}
    top = None
    for n in sorted(set(sizes), reverse=True):
        if top is None or n * NEAR_SIZE < top:
            top = n
        out[n] = top
    return out


class GradientShards:
    """Per-flat-parameter gradient shards and their reduction.

    Args:
        flat_params: the trainable flat parameters.
        tier: ``Tier.HOST`` (fp32, aligned host memory) or ``Tier.DEVICE`` (compute dtype).
        comm: the :class:`offload_zero.comm.Comm` of the data-parallel group.
        stage: ZeRO stage (1 keeps full gradients until :meth:`reduce_all_full`).
        accountant: byte accounting.
        host_alloc: ``f(numel, dtype) -> Tensor`` for host buffers (aligned/pinned).
        host_dtype: dtype of host shard buffers (float32 default, or bfloat16).
        share_near_sizes: lend one buffer to gradients whose sizes are within
            :data:`NEAR_SIZE` of each other (see :func:`size_classes`); for gradients used up
            one after the other (``update_timing="backward"``).
    """

    def __init__(self, flat_params: List[FlatParam], tier: Tier, comm, stage: int,
                 accountant: TierAccountant, host_alloc, host_dtype: torch.dtype = torch.float32,
                 share_near_sizes: bool = False):
        self.comm, self.stage, self.tier, self._acct = comm, stage, tier, accountant
        self.buf: Dict[FlatParam, torch.Tensor] = {}
        self.has_grad: Dict[FlatParam, bool] = {}
        self._full_grad_held: Dict[FlatParam, int] = {}
        self._in_place = stage == 1 and tier is Tier.DEVICE
        # One rank whose "device" is the host itself: the reduced gradient already sits in host
        # memory in the right dtype, so the shard buffer adopts it instead of copying it.
        self._adopt = (tier is Tier.HOST and stage >= 2 and comm.world_size == 1 and
                       all(fp.device.type == "cpu" and fp.dtype == host_dtype for fp in flat_params))
        # One scratch shard, sized at start-up, receives every reduce-scatter (world size > 1).
        self.scratch = None
        if comm.world_size > 1 and flat_params:
            n = max(fp.shard_numel for fp in flat_params)
            fp0 = flat_params[0]
            self.scratch = torch.empty(n, dtype=fp0.dtype, device=fp0.device)
            accountant.add(Tier.DEVICE, StateKind.BUFFERS, n * self.scratch.element_size())
        for fp in flat_params:
            self.has_grad[fp] = False
            if self._in_place or self._adopt:
                continue
            if tier is Tier.HOST:
                b = host_alloc(fp.shard_numel, host_dtype)
            else:
                b = torch.empty(fp.shard_numel, dtype=fp.dtype, device=fp.device)
            self.buf[fp] = b
            accountant.add(tier, StateKind.GRADS, b.numel() * b.element_size())
        # [Note: reused gradient memory]
        self._alloc = host_alloc
        self._free: Dict[tuple, List[torch.Tensor]] = {}   # (numel, dtype) -> idle buffers
        self._lent: Dict[int, torch.Tensor] = {}           # data_ptr -> buffer lent out
        sizes = [fp.padded_numel for fp in flat_params]
        if not self._adopt:
            # each reduced at once: one buffer of the largest size that borrows serves all (a
            # gradient taken as it is borrows nothing, unless autograd made it non-contiguous)
            top = max((fp.padded_numel for fp in flat_params if not fp.grad_as_is), default=0)
            self._class_of = {n: max(n, top) for n in sizes}
        elif share_near_sizes:
            # (a gradient taken as it is borrows nothing: it joins no class)
            classes = size_classes([fp.padded_numel for fp in flat_params if not fp.grad_as_is])
            self._class_of = {n: classes.get(n, n) for n in sizes}
        else:
            self._class_of = {n: n for n in sizes}         # padded_numel -> buffer numel
        self._lends = stage >= 2 and all(fp.device.type == "cpu" for fp in flat_params)
        if self._lends:
            for fp in flat_params:
                fp.grad_target = functools.partial(self._lend, fp)

    # -- reused gradient memory ------------------------------------------------------------
    def _count(self, buf: torch.Tensor, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) ``buf``'s bytes in the accounting: idle buffers count
        as host gradients where the shards adopt the gradients (the shards' own memory between
        steps; a lent one counts as the shard it became); otherwise every buffer counts as a
        device buffer, lent or not (the gradient in flight of stages 2 and 3)."""
        tier, kind = (Tier.HOST, StateKind.GRADS) if self._adopt else (Tier.DEVICE, StateKind.BUFFERS)
        (self._acct.add if sign > 0 else self._acct.sub)(tier, kind, buf.numel() * buf.element_size())

    def _lend(self, fp: FlatParam) -> torch.Tensor:
        """Memory for ``fp``'s next full gradient, shape (padded_numel,), ``fp.dtype``: an idle
        buffer of its size class (:attr:`_class_of`) or a new one. Returns a tensor of its own
        (autograd takes it as the ``.grad`` only when nothing else holds that tensor)."""
        numel = self._class_of[fp.padded_numel]
        free = self._free.get((numel, fp.dtype))
        if free:
            buf = free.pop()
            if self._adopt:
                self._count(buf, -1)
        else:
            buf = self._alloc(numel, fp.dtype)
            if not self._adopt:
                self._count(buf, 1)
        self._lent[buf.data_ptr()] = buf
        return buf[:fp.padded_numel].detach()

    def _give_back(self, t: Optional[torch.Tensor]) -> None:
        """``t`` (a gradient) is done with: if its memory was lent, it is idle again."""
        buf = None if t is None else self._lent.pop(t.data_ptr(), None)
        if buf is not None:
            self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)
            if self._adopt:
                self._count(buf, 1)

    def _sweep(self) -> None:
        """Take back every lent buffer no shard holds (a full :meth:`zero`: no gradient is
        in use then but those the shards keep)."""
        held = {b.data_ptr() for b in self.buf.values()}
        for ptr in [p for p in self._lent if p not in held]:
            self._give_back(self._lent[ptr])

    def on_full_grad(self, fp: FlatParam) -> None:
        """Called when ``fp.full.grad`` has been accumulated in backward."""
        g = fp.full.grad
        if g is None:
            return
        nbytes = g.numel() * g.element_size()
        if self.stage == 1:
            if fp not in self._full_grad_held:  # the full gradient persists until step()
                self._full_grad_held[fp] = nbytes
                self._acct.add(Tier.DEVICE, StateKind.GRADS, nbytes)
            return
        # (lent memory counts as its buffer's where the shards do not adopt it)
        nbytes = 0 if not self._adopt and g.data_ptr() in self._lent else nbytes
        self._acct.add(Tier.DEVICE, StateKind.GRADS, nbytes)
        self._reduce_into_shard(fp, g)
        fp.full.grad = None
        self._acct.sub(Tier.DEVICE, StateKind.GRADS, nbytes)
        adopted = self.buf.get(fp)
        if adopted is None or adopted.data_ptr() != g.data_ptr():
            self._give_back(g)  # reduced into the shard: its memory is free again

    def reduce_all_full(self, flat_params: List[FlatParam]) -> None:
        """Stage 1: reduce-scatter every held full gradient into its shard.

        Without offload the reduction is in place and the shard is a window of the full
        gradient, which stays until :meth:`zero`; with offload the shard goes to the host
        buffer and the full gradient is freed now.
        """
        for fp in flat_params:
            g = fp.full.grad
            if g is None:
                continue
            if self._in_place:
                lo = fp.rank * fp.shard_numel
                window = g.detach()[lo:lo + fp.shard_numel]
                if self.comm.world_size > 1:
                    self.comm.reduce_scatter_avg(window, g.detach(),
                                                 scratch=self.scratch[:fp.shard_numel],
                                                 what=fp.name)
                self.buf[fp] = window
                self.has_grad[fp] = True
                continue
            self._reduce_into_shard(fp, g)
            fp.full.grad = None
            self._free_full(fp)

    def _free_full(self, fp: FlatParam) -> None:
        nbytes = self._full_grad_held.pop(fp, 0)
        if nbytes:
            self._acct.sub(Tier.DEVICE, StateKind.GRADS, nbytes)

    def _reduce_into_shard(self, fp: FlatParam, g: torch.Tensor) -> None:
        if self.comm.world_size == 1:
            shard = g.detach()
        else:
            shard = self.scratch[:fp.shard_numel]
            self.comm.reduce_scatter_avg(shard, g.detach(), what=fp.name)
        if self._adopt and not self.has_grad[fp]:
            self.buf[fp] = shard  # the caller drops its own reference to the full gradient
            self._acct.add(self.tier, StateKind.GRADS, shard.numel() * shard.element_size())
            self.has_grad[fp] = True
            return
        buf = self.buf[fp]
        if self.has_grad[fp]:
            buf.add_(shard.to(buf.device, buf.dtype))
        else:
            buf.copy_(shard)
            self.has_grad[fp] = True

    def forget(self, fp: FlatParam) -> None:
        """``fp`` has no gradient after all: the one reduced into its shard is every rank's
        zeros (no rank used it; see [Note: reduction order]). World size > 1 only, where no
        shard adopts a gradient."""
        self.has_grad[fp] = False

    def sum_of_squares(self) -> torch.Tensor:
        """Sum of squared gradient elements of this rank's shards, fp64 scalar on the host."""
        total = torch.zeros((), dtype=torch.float64)
        for fp, b in self.buf.items():
            if self.has_grad[fp]:
                total += b.double().pow(2).sum().cpu()
        return total

    def zero(self, only=None, keep=()) -> None:
        """Forget the accumulated gradients (the next backward overwrites the buffers): of
        every flat parameter, or of those in ``only``, except those in ``keep``."""
        for fp in (self.has_grad if only is None else only):
            if fp in keep:
                continue
            b = self.buf.pop(fp, None) if self._adopt and self.has_grad[fp] else None
            if b is not None:  # (None: a zero() cut short by an interrupt took it already)
                self._acct.sub(self.tier, StateKind.GRADS, b.numel() * b.element_size())
                self._give_back(b)
            self.has_grad[fp] = False
            if self._in_place or fp in self._full_grad_held:
                # (stage 1 holds the full gradient from backward to step; with offload it is
                # reduced only in the step, so a zero_grad() before it must drop it here)
                fp.full.grad = None
                if self._in_place:
                    self.buf.pop(fp, None)
                self._free_full(fp)
        if only is None:
            self._sweep()

    def release(self) -> None:
        """Free the buffers (engine close)."""
        if self._in_place or self._adopt:
            self.zero()
        if self.scratch is not None:
            self._acct.sub(Tier.DEVICE, StateKind.BUFFERS, self.scratch.numel() * self.scratch.element_size())
            self.scratch = None
        for fp, b in self.buf.items():
            self._acct.sub(self.tier, StateKind.GRADS, b.numel() * b.element_size())
        for fp in self.has_grad:
            fp.grad_target = None
        self.buf.clear()
        self._sweep()
        for b in [b for bufs in self._free.values() for b in bufs]:
            self._count(b, -1)
        self._free.clear()
