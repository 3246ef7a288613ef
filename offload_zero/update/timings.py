"""The update timings at work: the plain step, updates in backward, and updates applied in
the next forward (``update_timing``; see :mod:`offload_zero.update.rules` for which works with
what, and [Note: update states] for each flat parameter's life between two steps).

:class:`UpdateTimings` is given what it works on (the optimizer-state store, the gradient
shards, the communicator, the scheduler, the read-ahead ring, the per-shard Adam call); it does
not know the engine. The scheduler's hooks call its methods (``grad_ready``, ``before_gather``,
...), and :meth:`OffloadEngine.step` calls :meth:`UpdateTimings.step`.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from offload_zero.config import EngineConfig
from offload_zero.memory.state_stores import NVMeStore
from offload_zero.partition.reduce_order import reduce_stage1
from offload_zero.update.adam import ShardAdam
from offload_zero.update.rules import BACKWARD, NEXT_FORWARD
from offload_zero.update.state import UpdateState, UpdateStates


class UpdateTimings:
    """When each trainable flat parameter's update runs, and the step that ends it.

    Args:
        cfg: the resolved :class:`EngineConfig` (``update_timing`` never ``"auto"``).
        store: the optimizer-state store; grads: the gradient shards; comm: the communicator.
        adam: the :class:`ShardAdam` call; states: the :class:`UpdateStates` owner.
        param_home: None, or the parameter shards' host/NVMe home.
        ring: None, or the NVMe read-ahead ring (a ``HostBufferPool``) of whole states.
        loss_scaler: None, or the fp16 :class:`LossScaler`.
        blocks, root: the units; trainable: the trainable flat parameters in unit order.
        after_blocks: the root's trainable flat parameters used after the blocks (LM head).
        forward_reads_params: whether forward reads block parameter shards from NVMe.

    Attributes set after construction: ``scheduler`` (the :class:`UnitScheduler`, whose hooks
    call this object), ``reduction`` (None, or the stage-2 :class:`OrderedReduction`),
    ``hypers`` (``f() -> tuple``: every parameter group's hyperparameters now), and
    ``grad_order`` (the reduction order, for stage 1's ``reduce_stage1``). Counters:
    ``skipped_steps``; ``last_grad_norm`` (None until a step clipped).
    """

    def __init__(self, cfg: EngineConfig, store, grads, comm, adam: ShardAdam,
                 states: UpdateStates, param_home, ring, loss_scaler, blocks, root, trainable,
                 after_blocks, forward_reads_params: bool):
        self.cfg, self.store, self.grads, self.comm = cfg, store, grads, comm
        self.adam, self.states, self.param_home, self.ring = adam, states, param_home, ring
        self.loss_scaler = loss_scaler
        self.blocks, self.root, self.trainable = blocks, root, trainable
        self.after_blocks, self.forward_reads_params = after_blocks, forward_reads_params
        self.in_backward = cfg.update_timing == BACKWARD
        self.in_next_forward = cfg.update_timing == NEXT_FORWARD
        self.world_size = comm.world_size
        self.scheduler = self.reduction = self.hypers = self.grad_order = None
        self.skipped_steps = 0
        self.last_grad_norm: Optional[float] = None
        self._pace = [0, 0]  # next_forward: [chunks streamed, chunks queued] (pace_streams)
        self._pending_step = (1.0, ())  # next_forward: (gradient factor, GroupHyper per group)

    # -- reads ahead (NVMe) ------------------------------------------------------------------
    def params_from_state(self) -> bool:
        """Whether parameter shards on NVMe are their master's bytes (a master of the compute
        dtype): with
        ``"backward"`` the whole state read ahead for an update then also serves the unit's
        gather in backward (one read of the parameters less per unit and step)."""
        home = self.param_home
        return getattr(home, "master_source", None) is not None

    def prefetch_state(self, unit) -> None:
        """``"backward"``: backward reached ``unit``: start reading its optimizer state (NVMe)
        so the update that follows its gradient does not wait for the disk. When parameter
        shards are their master's bytes, the state of the unit backward reaches next is read
        now too: its gather takes the parameters from that read instead of reading them
        separately."""
        self.pump()
        units = [unit]
        order = self.scheduler.order
        if self.params_from_state() and order:
            i = len(order) if unit.is_root else (order.index(unit) if unit in order else 0)
            units += order[i - 1:i] if i > 0 else []
        for u in units:
            for fp in u.flat_params:
                if fp.requires_grad and not self.states.done_in_backward(fp):
                    self.store.prefetch(fp)

    def read_ahead_in_forward(self, unit) -> None:
        """``"backward"``: a training forward started (``unit`` None) or reached block
        ``unit``: start reading into the read-ahead ring the whole state of the blocks that
        backward updates first (the last ones in forward order), as many as the ring holds, so
        the disk does those reads during forward instead of backward, and backward starts with
        them in memory.

        Without parameter reads in forward (parameter shards in memory) they all start at the
        forward's start, latest-in-forward first. When forward reads parameter shards from NVMe,
        each starts with the lead its parameter read would have had (``prefetch`` units ahead),
        so the parameter reads forward needs first are not queued behind them; with shards that
        are their master's bytes their gather then takes the parameters from this read (see
        :meth:`params_from_state`), one parameter read less. A read starts only when a ring
        buffer is free without waiting for the disk; one not started here is retried at the
        next unit, or started by backward (:meth:`prefetch_state`)."""
        order = self.scheduler.order
        if not order or self.ring is None:
            return
        at = -1 if unit is None else (order.index(unit) if unit in order else None)
        if at is None:
            return
        first = len(order) - min(self.ring.count, len(order))
        for j in reversed(range(first, len(order))):  # backward's order
            if self.forward_reads_params and j - self.cfg.prefetch > at:
                continue  # not yet: its parameter read would not have started yet either
            if not self._read_ahead(order[j].flat_params):
                return  # no free buffer: the rest keep backward's order, tried later

    def _read_ahead(self, fps: List, in_backward: bool = False) -> bool:
        """Start whole-state reads (NVMe) of the trainable flat parameters in ``fps`` not yet
        read ahead, in order, while a read-ahead buffer is free without waiting for the disk
        (``in_backward``: freed from the newest write-back done, see
        :meth:`NVMeStore.prefetch`). Returns False at the first one that could not start (the
        caller stops there)."""
        return all(self.store.prefetched(fp)
                   or self.store.prefetch(fp, wait=False, newest_first=in_backward)
                   for fp in fps if fp.requires_grad)

    def read_ahead_in_backward(self, unit) -> None:
        """``"next_forward"``: backward reached ``unit``. Start reading into the read-ahead
        ring the whole state of the first blocks in forward order (as many as the ring holds),
        whose updates the next forward applies first, each when backward is ``prefetch`` units
        (at least one) from it: its parameter read for backward would start then, and the
        gather takes the parameters from this read instead when shards on NVMe are their
        master's bytes (see :meth:`params_from_state`). The reads run while backward computes;
        the states are not written before those updates, so they stay current. A read starts
        only when a buffer is free without waiting for the disk."""
        order = self.scheduler.order
        if not order or self.ring is None:
            return
        i = len(order) if unit.is_root else (order.index(unit) if unit in order else None)
        if i is None:
            return
        for j in reversed(range(max(0, i - max(1, self.cfg.prefetch)), min(i, self.ring.count))):
            if not self._read_ahead(order[j].flat_params, in_backward=True):
                return

    # -- "backward" --------------------------------------------------------------------------
    def grad_ready(self, fp) -> None:
        """``"backward"``: ``fp``'s gradient is accumulated: reduce it to the shard and update
        ``fp`` now, or (NVMe state too large for the read-ahead ring) chunk by chunk from the
        hooks that follow, so its reads and writes overlap the rest of backward (see
        :meth:`pump`)."""
        self.grads.on_full_grad(fp)
        if self.states.done_in_backward(fp) or not self.grads.has_grad[fp]:
            return
        known_finite = False
        if self.world_size > 1:
            # the flags now, right after the reduction, in the same order on every rank: an
            # update streamed later must issue no collective of its own (its chunks advance
            # from hooks that differ per rank), and a flat parameter no rank used is not
            # updated (see [Note: reduction order])
            bad, unused = self.adam.grad_flags([fp])
            if fp in bad or fp in unused:
                # (inf/nan: skipped, an overflow of the step)
                self.states.move(fp, UpdateState.UNUSED if fp in unused
                                 else UpdateState.OVERFLOWED)
                self.grads.zero(only=[fp])
                return
            known_finite = True
        if isinstance(self.store, NVMeStore) and not self.store.prefetched(fp):
            skipped: set = set()
            # (the hyperparameters in force now, whatever changes them before it ends)
            update = self.adam.iter_updates([fp], self.unscale(), known_finite, skipped,
                                            self.hypers())

            def done(fp=fp, skipped=skipped):
                self.states.move(fp, UpdateState.OVERFLOWED if fp in skipped
                                 else UpdateState.APPLIED)
                self.grads.zero(only=[fp])  # (its gradient is used up)

            self.states.stream(fp, update, done)  # (until its last chunk, see pump)
            self.pump()
            return
        skipped = self.adam.update_all([fp], self.unscale(), known_finite, self.hypers())
        self.states.move(fp, UpdateState.OVERFLOWED if fp in skipped else UpdateState.APPLIED)
        # its gradient is used up: where one rank's shards adopt the gradients, its memory
        # serves the next one (see [Note: reused gradient memory])
        self.grads.zero(only=[fp])

    def unscale(self) -> float:
        """The factor that undoes the loss scale in the update: 1 / S (1.0 without scaling)."""
        return 1.0 if self.loss_scaler is None else 1.0 / self.loss_scaler.scale

    def pump(self, all_of_them: bool = False) -> None:
        """Advance the oldest streaming update (:attr:`UpdateStates.streams`) by one chunk, or
        every one to its end with ``all_of_them``. The updates go one after the other: they
        share the store's pipeline buffers. Each chunk's read was started one chunk earlier, so
        a call rarely waits for the disk."""
        streams = self.states.streams
        while streams:
            fp, gen, done = streams[0]
            try:
                next(gen)
                self._pace[0] += 1
                if not all_of_them:
                    return
            except StopIteration:
                streams.pop(0)
                done()
            except BaseException:
                streams.pop(0)
                self.states.stream_failed(fp)
                raise

    def finish_updates(self) -> None:
        """Finish every update started in backward and still streaming (``"backward"``), and
        apply those a step left for the next forward (``"next_forward"``): before the step, a
        forward or a read of the weights, so none sees half of one."""
        self.pump(all_of_them=True)
        self.apply_pending()

    # -- "next_forward" ----------------------------------------------------------------------
    def before_gather(self, unit) -> None:
        """``unit``'s parameters are about to be read (gathered or prefetched): apply its
        pending updates first, then start reading ahead the state of the units that follow.
        Their new shards on NVMe stay in their buffers for that gather (and only theirs, see
        :meth:`UpdateStates.follow_with_gather`: a shard kept for no gather would hold a buffer
        of the pool until its unit ran again; a backward's gather reads the shard's file).

        When a training forward gathers the root, the pending update of its part used after
        the blocks (the LM head; see ``after_blocks``) is not applied but started as a stream
        (:meth:`pump`): the blocks' gathers advance it (:meth:`pace_streams`), so its reads
        and writes run while the blocks compute, and the root gathers that part only when its
        first module runs (:meth:`finish_streaming`)."""
        states = self.states
        stream = []
        root_in_training = unit.is_root and self.scheduler.training_forward
        if root_in_training:
            stream = [fp for fp in unit.flat_params
                      if fp in self.after_blocks and states.is_pending(fp)
                      and not states.streaming(fp) and self.scheduler.may_gather_late(fp)]
        # the gather (late, for the streamed ones) follows these updates: their new shards stay
        # in their buffers for it; the unit's others were updated before an earlier gather
        updating = [fp for fp in unit.flat_params if states.is_pending(fp) or states.streaming(fp)]
        states.forget_gather_follows(fp for fp in unit.flat_params if fp not in updating)
        states.follow_with_gather(updating)
        if not root_in_training:
            for fp in unit.flat_params:  # gathered now, not late: its update ends first
                self.finish_streaming(fp)
            self.pace_streams(unit)
        fps = [fp for fp in unit.flat_params
               if states.is_pending(fp) and not states.streaming(fp) and fp not in stream]
        if fps:
            self._apply_pending(fps)
        coef, hypers = self._pending_step
        if stream:
            self._pace = [0, sum(self.store.chunks(fp) for fp in stream)]
        for fp in stream:  # (after the others: they may stream through the same buffers)
            def done(fp=fp):
                self._applied(fp)

            states.stream(fp, self.adam.iter_updates([fp], coef, True, set(), hypers), done)

    def pace_streams(self, unit) -> None:
        """Block ``unit`` is about to be gathered in forward: advance the streaming updates
        (:meth:`pump`) so that by the gather of the k-th of n blocks in forward order, k/n of
        their chunks are done. Their reads and writes then spread over the blocks' compute, the
        last chunk updated by the last block's gather, instead of taking the disk from the
        first blocks' reads and leaving it idle under the last ones. A unit outside the recorded
        order advances them by one chunk."""
        if not self.states.streams:
            return
        order = self.scheduler.order
        if unit not in order:
            self.pump()
            return
        target = -(-self._pace[1] * (order.index(unit) + 1) // len(order))
        while self.states.streams and self._pace[0] < target:
            self.pump()

    def streaming(self, fp) -> bool:
        """Whether ``fp``'s update is streaming (see :meth:`pump`): it has begun or is queued,
        and has not ended (the scheduler then gathers ``fp`` late)."""
        return self.states.streaming(fp)

    def finish_streaming(self, fp) -> None:
        """``fp`` is about to be gathered: end its streaming update (and any queued before it)."""
        while self.states.streaming(fp):
            self.pump()

    @torch.no_grad()
    def _apply_pending(self, fps: List) -> None:
        """Apply the pending updates of ``fps`` (``"next_forward"``) and zero their
        gradients; the write-backs stay in flight. The whole states of the next pending block
        updates are read ahead (as many as the read-ahead buffers hold), so their reads overlap
        the compute that runs before them."""
        coef, hypers = self._pending_step
        if self.states.streams and isinstance(self.store, NVMeStore) and not all(
                self.store.prefetched(fp) for fp in fps):
            # these stream through the pipeline buffers too: the streaming update ends first
            self.pump(all_of_them=True)
        self._read_ahead_pending([fp for fp in self.states.pending() if fp not in fps])
        for fp in fps:
            # one at a time, each forgotten only once applied: an error (an I/O error, a pool
            # exhausted) leaves the updates not yet made pending, with their gradients
            for _ in self.adam.iter_updates([fp], coef, True, set(), hypers,
                                            defer_write_back=self.may_defer_write_back(fp)):
                pass
            self._applied(fp)
        self._read_ahead_pending(self.states.pending())

    def _applied(self, fp) -> None:
        """``fp``'s pending update is made: forget it and its gradient. After the last one no
        more state is read before the next backward: the deferred write-backs start (see
        :meth:`may_defer_write_back`)."""
        self.states.move(fp, UpdateState.IDLE)
        self.grads.zero(only=[fp])
        if not self.states.pending() and isinstance(self.store, NVMeStore):
            self.store.start_deferred_writes()

    def may_defer_write_back(self, fp) -> bool:
        """Whether the write-back of ``fp``'s pending update (its state read ahead whole) can
        wait until the pending updates are all made (:meth:`_applied`; in a model with an LM
        head, until its streamed update ends as the head is gathered, so the head's compute
        hides them). The forward's disk time then goes to the reads it waits for. It can when
        the read-ahead buffers not held by such writes, this one's aside, can hold the state of
        every later pending update the ring takes, so no read ever waits on a deferred write:
        with a ring of three, the last three blocks' writes.
        Their buffers then also serve backward's gathers of those blocks
        (:meth:`NVMeStore.master_view`), one parameter read less each."""
        store, ring = self.store, self.ring
        if not isinstance(store, NVMeStore) or ring is None or not store.prefetched(fp) \
                or store.in_host(fp):
            return False
        later = sum(1 for f in self.states.pending() if f is not fp and not store.in_host(f)
                    and store.fits_ahead(f.shard_numel))
        return later <= ring.count - store.deferred_writes - 1

    def _read_ahead_pending(self, order: List) -> None:
        """Start whole-state reads of the first pending updates in ``order`` while a read-ahead
        buffer is free, without waiting for the disk (NVMe state only); a state larger than
        the buffers (an outsized root's) is left to the chunked stream of its update."""
        if self.ring is None:
            return
        self._read_ahead([fp for fp in order if self.store.fits_ahead(fp.shard_numel)])

    def apply_pending(self) -> None:
        """Apply every update that a step decided and ``"next_forward"`` left for the units'
        next gathers (no-op otherwise). Raises SwapIOError if an NVMe transfer fails."""
        self.states.forget_gather_follows()  # (no gather follows these updates)
        self.pump(all_of_them=True)  # (a streaming update: its flat parameter leaves pending)
        pending = self.states.pending()
        if pending:
            self._apply_pending(pending)

    # -- the step ------------------------------------------------------------------------------
    def step(self, hypers: tuple) -> None:
        """Update every trainable flat parameter with the parameter groups' ``hypers`` (or, with
        ``"next_forward"``, decide the updates), then zero the gradients and end the step: the
        plain step, the end of ``"backward"``'s, or ``"next_forward"``'s decision. Gradient
        clipping (``max_grad_norm``) and an fp16 overflow (outside ``"backward"``) skip the
        whole step on every rank."""
        cfg = self.cfg
        self.scheduler.reshard_all()  # a training forward without backward leaves the root gathered
        if self.reduction is not None:
            self.reduction.end_backward()  # (a backward whose end-of-backward callback did not run)
        self.finish_updates()  # ("next_forward": a step without a forward since the last)
        if cfg.stage == 1:
            reduce_stage1(self.grads, self.grad_order, self.comm)
        coef = self.unscale()  # the gradients carry the loss scale (1.0 without one)
        known_finite = False
        # (with "backward" most flat parameters were updated in backward already)
        with_grad = [fp for fp in self.trainable
                     if self.grads.has_grad[fp] and not self.states.done_in_backward(fp)]
        if cfg.max_grad_norm is not None:
            sq = self.comm.all_reduce_sum(self.grads.sum_of_squares().to(self.adam.device),
                                         what="grad norm").item()
            norm = math.sqrt(sq) * coef
            self.last_grad_norm = norm
            if not math.isfinite(norm):  # inf/nan somewhere on some rank: skip the whole step
                self.skip_step()
                return
            coef *= min(1.0, cfg.max_grad_norm / (norm + 1e-6))
            known_finite = True  # the kernel can skip its own inf/nan pass over the gradients
        elif self.loss_scaler is not None and not self.in_backward:
            # an overflow skips the whole step (not only the flat parameters that hold it), on
            # every rank; the updates then skip the kernel's own inf/nan pass
            if self.adam.nonfinite_on_any_rank(with_grad):
                self.skip_step()
                return
            known_finite = True
        if self.in_next_forward:
            self._decide(with_grad, coef, known_finite, hypers)
            return
        self._update_now(with_grad, coef, known_finite, hypers)

    def _update_now(self, with_grad: List, coef: float, known_finite: bool,
                    hypers: tuple) -> None:
        """The plain step's updates (and the end of ``"backward"``'s step): update
        ``with_grad``, count an overflow, drain every write-back, gather the new shards at
        stages 1-2."""
        try:
            skipped = self.adam.update_all(with_grad, coef, known_finite, hypers)
        finally:
            # every write-back done before the next forward reads parameters (a shard on
            # NVMe is read from its master's bytes): updates made in backward included
            try:
                self.store.release_prefetched()
            finally:
                self.store.drain()
                if self.param_home is not None:
                    self.param_home.drain()
        overflow = bool(skipped) or self.states.any_overflowed()
        if overflow:
            self.skipped_steps += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self.states.end_backward_updates()
        self.states.grads_pending = False
        if self.cfg.stage < 3:
            for fp in self.trainable:
                self.comm.all_gather_into(fp.full_values(), fp.sharded, what=fp.name)
        self.grads.zero()
        self.comm.end_step()

    def _decide(self, with_grad: List, coef: float, known_finite: bool, hypers: tuple) -> None:
        """End a ``"next_forward"`` step: decide now which flat parameters update (those with
        an inf/nan gradient on any rank are skipped, as in the plain step, and counted in
        ``skipped_steps``), with this gradient factor and the groups' ``hypers``; the updates
        themselves run before each unit's next gather (:meth:`_apply_pending`)."""
        skipped = set() if known_finite else self.adam.nonfinite_on_any_rank(with_grad)
        # in the order the next forward needs them: the root's first (gathered as forward
        # starts), then the blocks' in the recorded forward order
        units = [self.root] + (self.scheduler.order or self.blocks)
        ready = dict.fromkeys(fp for fp in with_grad if fp not in skipped)
        order = dict.fromkeys(fp for u in units for fp in u.flat_params if fp in ready)
        order.update(ready)  # (any the forward order does not hold, after it)
        self.states.decide(order)
        self._pending_step = (coef, hypers)
        if skipped:
            self.skipped_steps += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(bool(skipped))
        self.states.grads_pending = False
        self.grads.zero(keep=set(order))
        self.comm.end_step()
        self._read_ahead_pending(self.states.pending())

    def skip_step(self) -> None:
        """End a step that updates nothing (an inf/nan gradient on some rank): drop the
        gradients, count it in ``skipped_steps`` and halve a dynamic loss scale."""
        self.skipped_steps += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(True)
        self.grads.zero()
        self.comm.end_step()
        self.states.grads_pending = False

    def close(self) -> None:
        """Updates cut short by an error: end their I/O (each stream's generator closed)."""
        streams = self.states.streams
        while streams:
            streams.pop(0)[1].close()
