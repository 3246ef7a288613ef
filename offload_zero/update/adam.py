"""The per-shard Adam/AdamW call: one flat parameter's shard updated chunk by chunk, each run
of one parameter group with that group's hyperparameters, the new compute-dtype shard written
in the same pass; and the inf/nan flags every rank agrees on first.

The maths is torch's single-tensor Adam/AdamW (Kingma & Ba, 2015; Loshchilov & Hutter, 2019):
``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
``p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``, with decoupled weight decay
``p *= 1 - lr wd`` (AdamW) or ``g += wd p`` (Adam), where ``g`` is the gradient times the
factor ``coef`` (1 / loss scale, times the clipping factor). Master weights on the host (or
streamed from NVMe) go through the C++ kernel (:func:`offload_zero.optim.kernel.adam_step_`),
those on an accelerator through torch ops (:func:`torch_adam_`).
"""
from __future__ import annotations

import math
import zlib
from typing import Dict, Iterator, List, Optional

import torch

from offload_zero.config import Tier
from offload_zero.update.state import UpdateStates


class ShardAdam:
    """Adam/AdamW on this rank's shards of the trainable flat parameters.

    Args:
        store: the optimizer-state store (:mod:`offload_zero.memory.state_stores`).
        grads: the :class:`offload_zero.partition.grads.GradientShards` (fp32 or bf16 shards,
            ``buf[fp]`` of ``shard_numel`` elements).
        comm: the :class:`offload_zero.comm.Comm` (inf/nan flags all-reduced over ranks).
        states: the :class:`UpdateStates` (each running update's target).
        step_count: ``{flat param: Adam steps taken}``, shared with checkpoints.
        segments: ``{flat param: [(lo, hi, group index)]}``, the shard's runs per parameter
            group (see [Note: parameter groups] in :mod:`offload_zero.optim.facade`).
        adamw: AdamW (decoupled weight decay) or Adam with L2.
        optimizer_tier: the tier of the master weights (:class:`Tier`).
        device: the engine's device.
        staging: None, or the host staging buffer (compute dtype, the largest shard) that new
            shards of an accelerator pass through when the master is on the host.
        used: None, or ``f(flat param) -> bool``: whether some rank's backward used it (stages
            1-2 with several ranks, see [Note: reduction order]).
    """

    def __init__(self, store, grads, comm, states: UpdateStates, step_count: Dict, segments: Dict,
                 adamw: bool, optimizer_tier: Tier, device: torch.device, staging=None,
                 used=None):
        self.store, self.grads, self.comm, self.states = store, grads, comm, states
        self.step_count, self.segments = step_count, segments
        self.adamw, self.optimizer_tier, self.device = adamw, optimizer_tier, device
        self.staging, self.used = staging, used
        self.rank, self.world_size = comm.rank, comm.world_size

    def grad_flags(self, fps: List) -> tuple:
        """``(nonfinite, unused)``: the flat parameters of ``fps`` whose gradient holds an inf
        or nan on any rank, and those no rank's backward used (their gradients are the zeros
        of [Note: reduction order]). One all-reduce of a float per flat parameter (4 bytes
        each), so that every rank skips the same ones (each rank sees only its own gradient
        shard): ``used + (N + 1) * nonfinite`` summed over the N ranks, exact in fp32 for
        any N below 4096. Collective: every rank calls it with the same ``fps`` in the same
        order."""
        if not fps:
            return set(), set()
        used = (lambda fp: True) if self.used is None else self.used
        base = self.world_size + 1
        flags = torch.tensor([float(used(fp)) + (0.0 if all_finite(self.grads.buf[fp]) else base)
                              for fp in fps], dtype=torch.float32, device=self.device)
        flags = [int(f) for f in self.comm.all_reduce_sum(flags, what="inf/nan flags").tolist()]
        return ({fp for fp, f in zip(fps, flags) if f >= base},
                {fp for fp, f in zip(fps, flags) if f % base == 0})

    def nonfinite_on_any_rank(self, fps: List) -> set:
        """The flat parameters of ``fps`` whose gradient holds an inf or nan on any rank (see
        :meth:`grad_flags`). Collective."""
        return self.grad_flags(fps)[0]

    def update_all(self, fps: List, coef: float, known_finite: bool, hypers: tuple) -> set:
        """Adam/AdamW on every flat parameter in ``fps`` (their gradients final) with the
        groups' ``hypers``; returns the set skipped for inf/nan gradients. State read ahead
        (:meth:`NVMeStore.prefetch`) is written back asynchronously; the step drains it."""
        skipped: set = set()
        for _ in self.iter_updates(fps, coef, known_finite, skipped, hypers):
            pass
        return skipped

    def iter_updates(self, fps: List, coef: float, known_finite: bool, skipped: set,
                     hypers: tuple, defer_write_back: bool = False) -> Iterator[None]:
        """:meth:`update_all` as a generator that yields after each chunk, with the groups'
        ``hypers`` (a :class:`GroupHyper` per group) throughout; flat parameters skipped for
        inf/nan gradients are added to ``skipped``. With several ranks, collective (see
        :meth:`grad_flags`). ``defer_write_back``: see :meth:`NVMeStore.iter_states`."""
        if not known_finite and self.world_size > 1:
            # every rank skips the same flat parameters, whichever rank's shard holds the inf/nan
            bad, unused = self.grad_flags(fps)
            skipped |= bad
            fps = [fp for fp in fps if fp not in bad and fp not in unused]
            known_finite = True
        try:
            # the store yields each flat parameter's state whole, or (NVMe) in chunks
            for fp, lo, hi, master, m, v in self.store.iter_states(
                    fps, defer_write_back=defer_write_back):
                whole = lo == 0 and hi == fp.shard_numel
                if lo == 0:
                    if not (known_finite or whole) and not all_finite(self.grads.buf[fp]):
                        skipped.add(fp)  # chunked: check before the first chunk is written
                    else:
                        if fp.home is not None:
                            # a read of the shard left unused (a backward cut short by an
                            # error) is stale once the update writes: drop it
                            fp.home.done_with(fp)
                        self.states.set_target(fp, self.update_target(fp))
                        # (counted once a target is found: an error there leaves the count)
                        self.step_count[fp] += 1
                if fp in skipped:
                    continue
                ok = self.update(fp, lo, hi, master, m, v, coef, hypers,
                                 check_overflow=whole and not known_finite)
                if not ok:
                    skipped.add(fp)
                if hi == fp.shard_numel:
                    self.finish(fp, ok)
                yield
        finally:
            for fp in fps:
                self.states.drop_target(fp)

    def update_target(self, fp) -> Optional[torch.Tensor]:
        """Where the kernel writes ``fp``'s new compute-dtype shard in the same pass as the
        update: the shard itself, a host buffer of its home, or the staging buffer; None when the
        master (of the compute dtype) is the shard."""
        if fp.home is not None:
            return fp.home.update_target(fp)
        if self.store.aliases(fp):
            return None  # the master is the shard: updated in place
        if self.optimizer_tier is Tier.DEVICE and self.device.type != "cpu":
            return None  # torch ops on the accelerator; copied from the master afterwards
        if fp.sharded.device.type == "cpu":
            return fp.sharded
        return self.staging[:fp.shard_numel]

    def update(self, fp, lo: int, hi: int, master, m, v, coef: float, hypers: tuple,
               check_overflow: bool) -> bool:
        """Adam/AdamW on elements [lo, hi) of ``fp``'s shard (``master``, ``m``, ``v``: 1-d
        views of that chunk; fp32 or bf16 master, fp32, bf16 or int8-coded moments), each run
        of one parameter group with that group's ``hypers`` (see [Note: parameter groups] in
        :mod:`offload_zero.optim.facade`); returns False on overflow (nothing then changed)."""
        grad = self.grads.buf[fp][lo:hi]
        runs = [(max(a, lo) - lo, min(b, hi) - lo, hypers[g])
                for a, b, g in self.segments[fp] if a < hi and b > lo]
        if len(runs) > 1 and check_overflow:
            # one check before any run is written: an inf/nan in a later run changes nothing
            if not all_finite(grad):
                self.step_count[fp] -= 1
                return False
            check_overflow = False
        if master.device.type == "cpu":
            out = self.states.target(fp)
            out = None if out is None else out[lo:hi]
            # (bf16 moments or master: rounding keyed by the element's place in the flat
            # parameter, the same however the update is cut into chunks and at any world size)
            base = self.rank * fp.shard_numel + lo  # (the chunk's place in the flat parameter)
            if m.dtype == torch.uint8:  # int8 moments: whole 256-element blocks, one call
                overflow = self._adam_cpu_int8(fp, lo, hi, master, grad, m, v, runs, coef, out,
                                               check_overflow, base)
            else:
                overflow = any([self._adam_cpu(fp, master[a:b], grad[a:b], m[a:b], v[a:b], hp,
                                               coef, None if out is None else out[a:b],
                                               check_overflow, key)
                                for r0, r1, hp in runs for a, b, key in sr_pieces(r0, r1, base)])
            if (not overflow and out is not None and fp.home is None
                    and out.data_ptr() != fp.sharded[lo:hi].data_ptr()):
                # staging buffer -> accelerator shard, chunk by chunk: the buffer is free again
                # before another update (interleaved with this one in backward) writes to it
                fp.sharded[lo:hi].copy_(out)
        else:
            overflow = any([torch_adam_(master[a:b], grad[a:b], m[a:b], v[a:b],
                                        self.step_count[fp], hp.lr, hp.betas, hp.eps,
                                        hp.weight_decay, self.adamw, coef) for a, b, hp in runs])
            if not overflow and master.data_ptr() != fp.sharded.data_ptr():
                fp.sharded[lo:hi].copy_(master)
        if overflow:
            self.step_count[fp] -= 1
        return not overflow

    def _adam_cpu(self, fp, master, grad, m, v, hp, coef: float, out, check_overflow: bool,
                  offset: int) -> bool:
        """The C++ Adam on one run of ``fp``'s shard (1-d views of equal length: fp32 or bf16
        master, fp32 or bf16 moments) with the group's ``hp``; ``offset``: the run's first
        element's index in the whole flat parameter (the stochastic rounding's position key);
        returns True on overflow (see :func:`offload_zero.optim.adam_step_`)."""
        from offload_zero.optim.kernel import adam_step_
        return adam_step_(master, grad, m, v, step=self.step_count[fp], lr=hp.lr,
                          betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
                          adamw=self.adamw, grad_scale=coef, out=out,
                          check_overflow=check_overflow, sr_seed=sr_seed(fp), sr_offset=offset)

    def _adam_cpu_int8(self, fp, lo: int, hi: int, master, grad, m, v, runs, coef: float, out,
                       check_overflow: bool, base: int) -> bool:
        """The C++ Adam on elements [lo, hi) of ``fp``'s shard with int8 moments (uint8 codes
        ``m``, ``v`` and the store's scales; ``lo`` a multiple of 256) and the runs of each
        parameter group (a block two groups share is updated as one: see
        :func:`offload_zero.optim.int8_moments.adam_step_runs_`); ``base``: element ``lo``'s
        place in the whole flat parameter. Returns True on overflow."""
        from offload_zero.optim.int8_moments import BLOCK_NUMEL, adam_step_runs_
        scales = self.store.scales(fp)[:, lo // BLOCK_NUMEL:-(-hi // BLOCK_NUMEL)]
        return adam_step_runs_(master, grad, m, v, scales[0], scales[1], runs,
                               step=self.step_count[fp], adamw=self.adamw,
                               grad_scale=coef, out=out, check_overflow=check_overflow,
                               sr_seed=sr_seed(fp), sr_offset=base)

    def finish(self, fp, ok: bool) -> None:
        """After the last chunk: write the new compute-dtype shard back to an NVMe home (an
        accelerator shard got each chunk from the staging buffer in :meth:`update`)."""
        target = self.states.drop_target(fp)
        if fp.home is not None:
            fp.home.commit(fp, target) if ok else fp.home.discard(fp)


def sr_pieces(a: int, b: int, base: int) -> List[tuple]:
    """Elements ``[a, b)`` of a chunk whose element 0 is element ``base`` of its flat
    parameter, as ``(lo, hi, sr_offset)`` calls of the kernel, whose stochastic rounding (bf16
    moments) counts from a multiple of 64: an unaligned start (a parameter group's boundary)
    gives a head of fewer than 64 elements keyed from the 64-element block holding it, and the
    rest is keyed by its own place. Group boundaries and the chunks' (multiples of 64) sit at
    fixed places in the flat parameter, so the rounding is the same however the update is
    chunked and at any world size."""
    g = base + a
    cut = min(b, a + (-g) % 64)
    pieces = [(a, cut, g - g % 64)] if cut > a else []
    if cut < b:
        pieces.append((cut, b, base + cut))
    return pieces


def sr_seed(fp) -> int:
    """The stochastic-rounding seed of ``fp``'s bf16 moments and master: a CRC-32 of its name,
    the same in every run and on every rank."""
    return zlib.crc32(fp.name.encode())


def all_finite(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """Whether every element of ``t`` is finite.

    One sum first (a memory-speed pass, ~20x faster than ``isfinite`` on a CPU): an inf or nan
    anywhere makes the sum inf or nan. Only finite values whose sum overflows give a non-finite
    sum with every element finite, so that case alone is checked element by element, in chunks
    of ``chunk`` elements so the temporary stays small.
    """
    if math.isfinite(float(t.sum())):
        return True
    for i in range(0, t.numel(), chunk):
        if not bool(torch.isfinite(t[i:i + chunk]).all()):
            return False
    return True


def torch_adam_(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, adamw,
                grad_scale) -> bool:
    """Adam/AdamW on accelerator tensors (1-d, equal lengths; fp32 ``param`` and moments,
    ``grad`` any float dtype) with torch's single-tensor semantics, in place; returns True on
    overflow (an inf/nan in ``grad * grad_scale``: nothing then changed)."""
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if not torch.isfinite(g).all():
        return True
    beta1, beta2 = betas
    if weight_decay:
        if adamw:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    return False
