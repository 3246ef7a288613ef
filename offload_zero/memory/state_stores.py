"""Where master weights and Adam moments live, and how the step walks them.

Three stores share one interface. ``iter_states(flat_params)`` yields, for each flat parameter
in turn, ``(fp, lo, hi, master, exp_avg, exp_avg_sq)``: elements [lo, hi) of its shard as
tensors of shape (hi - lo,) that the caller updates in place; whatever the caller wrote is
persisted by the store. Resident stores yield each shard whole; the NVMe store in chunks of at
most ``chunk_numel`` elements, so its buffers do not grow with the largest unit.

The moments are ``moment_dtype`` (float32, bfloat16, or int8 codes with per-block scales that
every store keeps in memory: [Note: int8 moment scales] in
:mod:`offload_zero.memory.state_format`) in every store; the master is ``master_dtype``
(float32, or bfloat16: [Note: bf16 master weights] there).
Every store also copies a flat parameter's whole state out (``read_all``: exports, checkpoints)
and overwrites it (``write_all``: loading a checkpoint), the master as fp32 values.

- :class:`DeviceStore` (``offload="none"``): tensors on the accelerator.
- :class:`HostStore` (``offload="cpu"``): 4096-aligned (pinned when CUDA is present) host tensors.
- :class:`NVMeStore` (``offload="nvme"``): one file per flat parameter holding
  ``[master | exp_avg | exp_avg_sq]`` (fp32 or bf16 master, moments in fp32, bf16 or int8; see
  [Note: state layout] in :mod:`offload_zero.memory.state_format`), and a pipeline of
  three host buffer sets over chunks: while the caller updates chunk k, the read of chunk k+1 is
  in flight and the write of chunk k-1 drains (ZeRO-Infinity's overlap of NVMe I/O with the
  update). Its whole-state read-ahead ring (updates in backward or in the next forward) is
  :class:`offload_zero.memory.read_ahead.ReadAheadRing`.

Parameter shards off the device live in :mod:`offload_zero.memory.param_homes`.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch

from offload_zero.config import Tier
from offload_zero.memory.accounting import StateKind, TierAccountant
from offload_zero.memory.read_ahead import ReadAheadRing
from offload_zero.memory.state_format import StateFormat, decode_moments, encode_moments_
from offload_zero.update.state import STATE_IO_LEGAL, IOStages, StateIO

StateTuple = Tuple[object, int, int, torch.Tensor, torch.Tensor, torch.Tensor]


class _TensorStore:
    """Shared code of the stores that keep the three tensors resident (device or host)."""

    tier: Tier

    def __init__(self, accountant: TierAccountant, alloc, moment_dtype=torch.float32,
                 master_dtype=torch.float32):
        self._acct, self._alloc = accountant, alloc
        self.fmt = StateFormat(moment_dtype, master_dtype)
        self._state: Dict[object, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._held: Dict[object, Tuple[int, int]] = {}
        self._scales: Dict[object, torch.Tensor] = {}  # int8 moments' absmax (2, blocks)

    def add(self, fp, master_shard: torch.Tensor, alias: Optional[torch.Tensor] = None) -> None:
        """Register ``fp`` with initial master values ``master_shard`` ((shard_numel,), fp32;
        rounded to nearest for a bf16 master).

        ``alias``: an existing tensor of the master's dtype to use as the master (a compute
        dtype equal to it, on the same tier).
        """
        n = master_shard.numel()
        master = alias if alias is not None else self._alloc(n, self.fmt.master_dtype)
        if alias is None:
            master.copy_(master_shard)
        dt = self.fmt.moment_dtype
        m, v = self._alloc(n, dt), self._alloc(n, dt)
        m.zero_()
        v.zero_()
        self._state[fp] = (master, m, v)
        if self.fmt.blockwise:
            self._scales[fp] = self.fmt.new_scales(n, device=master.device)
        master_bytes = 0 if alias is not None else self.fmt.master_itemsize * n
        moment_bytes = self.fmt.resident_moment_bytes(n)
        self._held[fp] = (master_bytes, moment_bytes)
        self._acct.add(self.tier, StateKind.MASTER, master_bytes)
        self._acct.add(self.tier, StateKind.MOMENTS, moment_bytes)

    def iter_states(self, flat_params: List[object], defer_write_back: bool = False
                    ) -> Iterator[StateTuple]:
        """Yield ``(fp, 0, shard_numel, master, exp_avg, exp_avg_sq)`` for each flat parameter,
        in order: resident state comes whole (nothing to write back: ``defer_write_back`` has
        no effect)."""
        for fp in flat_params:
            master, m, v = self._state[fp]
            yield (fp, 0, master.numel(), master, m, v)

    def chunks(self, fp) -> int:
        """How many items :meth:`iter_states` yields for ``fp``: 1 (resident state comes
        whole)."""
        return 1

    def prefetch(self, fp) -> bool:
        """Resident state needs no read-ahead: always False (see :meth:`NVMeStore.prefetch`)."""
        return False

    def aliases(self, fp) -> bool:
        """Whether ``fp``'s master weights are its parameter shard itself (``alias`` in :meth:`add`)."""
        return self._held[fp][0] == 0

    def release_prefetched(self) -> None:
        """Nothing is read ahead for resident state (see :meth:`NVMeStore.release_prefetched`)."""

    def drain(self) -> None:
        """Resident state has no writes in flight (see :meth:`NVMeStore.drain`)."""

    def master_view(self, fp) -> torch.Tensor:
        """``fp``'s resident master weights themselves (not a copy; ``master_dtype``), shape
        (shard_numel,), on this store's device: updates change it in place."""
        return self._state[fp][0]

    def read_master(self, fp) -> torch.Tensor:
        """This rank's master shard of ``fp`` as fp32 values (a copy on the CPU), shape
        (shard_numel,)."""
        return self._state[fp][0].detach().to("cpu", torch.float32, copy=True)

    def scales(self, fp) -> torch.Tensor:
        """``fp``'s int8 moments' absmax, updated in place ([Note: int8 moment scales])."""
        return self._scales[fp]

    def read_all(self, fp) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU copies of (master, exp_avg, exp_avg_sq) for ``fp``: the master as fp32 values,
        int8 moments decoded."""
        master, m, v = self._state[fp]
        return self.read_master(fp), *decode_moments(self.fmt, m, v, self._scales.get(fp))

    def write_all(self, fp, master: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor) -> None:
        """Overwrite ``fp``'s (master, exp_avg, exp_avg_sq) in place with the given tensors of
        shape (shard_numel,) (fp32 master, rounded to nearest for a bf16 one; moments in the
        store's ``moment_dtype``), on any device (a checkpoint being loaded). Raises
        ValueError naming ``fp`` for a wrong shape or dtype."""
        _check_state_shapes(fp, self._state[fp][0].numel(), (master, exp_avg, exp_avg_sq),
                            self.fmt.exchange_dtype)
        if self.fmt.blockwise:  # (fp32 moments encoded to nearest)
            self._state[fp][0].copy_(master)
            encode_moments_(self.fmt, exp_avg, exp_avg_sq, *self._state[fp][1:], self._scales[fp])
            return
        for dst, src in zip(self._state[fp], (master, exp_avg, exp_avg_sq)):
            dst.copy_(src)

    def cache_report(self) -> dict:
        """The optimizer state's split between host memory and NVMe (see [Note: host cache
        report] in :mod:`offload_zero.memory.host_cache`): every state in host memory for a
        :class:`HostStore` (``"host_flat_params"``, a count, and ``"host_state_bytes"``: the
        master weights and moments allocated, a master aliased to the parameter shard none),
        nothing for a :class:`DeviceStore`; nothing on NVMe. Units: bytes."""
        held = self._held if self.tier is Tier.HOST else {}
        return {"host_flat_params": len(held), "nvme_flat_params": 0,
                "host_state_bytes": sum(mb + sb for mb, sb in held.values()),
                "nvme_state_bytes": 0}

    def close(self) -> None:
        """Release every tensor; idempotent."""
        for fp, (mb, sb) in self._held.items():
            self._acct.sub(self.tier, StateKind.MASTER, mb)
            self._acct.sub(self.tier, StateKind.MOMENTS, sb)
        self._held.clear()
        self._state.clear()
        self._scales.clear()


class DeviceStore(_TensorStore):
    """Master weights and moments on the accelerator (``offload="none"``)."""

    tier = Tier.DEVICE

    def __init__(self, accountant: TierAccountant, device: torch.device,
                 moment_dtype=torch.float32, master_dtype=torch.float32):
        super().__init__(accountant, lambda n, dt: torch.empty(n, dtype=dt, device=device),
                         moment_dtype, master_dtype)


class HostStore(_TensorStore):
    """Master weights and moments in aligned host memory (``offload="cpu"``)."""

    tier = Tier.HOST

    def __init__(self, accountant: TierAccountant, host_alloc, moment_dtype=torch.float32,
                 master_dtype=torch.float32):
        super().__init__(accountant, host_alloc, moment_dtype, master_dtype)


class NVMeStore(ReadAheadRing):
    """Master weights and moments in O_DIRECT files, streamed through three host buffer sets.

    Args:
        swapper: this rank's :class:`offload_zero.memory.swapper.Swapper` (closed by its owner).
        accountant: byte accounting (NVMe: file bytes; host: pipeline buffers).
        host_alloc: ``f(numel, dtype)`` returning 4096-aligned host tensors.
        max_shard_numel: the largest shard_numel of any flat parameter (sizes the buffers).
        chunk_numel: elements streamed per pipeline stage (multiple of 1024, of 2048 with bf16
            moments; default ``CHUNK_NUMEL``): buffers hold three states of
            ``min(max_shard_numel, chunk_numel)`` elements (12 bytes each with fp32 moments, 8
            with bf16; see :class:`offload_zero.memory.state_format.StateFormat`).
        master_is_param: the parameter shards (of the master's dtype) are read from the master
            region (file ``fp.name``, offset 0, ``w * shard_numel`` bytes; see
            :class:`NVMeParamHome`); the master's NVMe bytes are then accounted as parameters.
        moment_dtype: ``torch.float32`` (default), ``torch.bfloat16`` or ``torch.uint8``
            (int8 codes): the moments' dtype in the files and in every host buffer (see
            [Note: state layout]).
        master_dtype: ``torch.float32`` (default) or ``torch.bfloat16`` ([Note: bf16 master
            weights]): the master's dtype there.
        io_stages: the :class:`offload_zero.update.state.IOStages` of the optimizer state
            (:class:`StateIO`) that records where each flat parameter's state stands, with its
            buffer and handles: the engine's (``UpdateStates.state_io``); default: one of this
            store's own.

    Each flat parameter's state goes ``AT_REST`` (in its file) -> ``READ_AHEAD`` (whole, in a
    read-ahead buffer: :meth:`prefetch`) or straight -> ``IN_UPDATE`` (handed out by
    :meth:`iter_states`) -> ``WRITING`` or ``WRITE_DEFERRED`` -> ``AT_REST`` (see [Note:
    update states] in :mod:`offload_zero.update.state`); every move is checked there.

    A flat parameter whose name was given to :meth:`keep_in_host` before :meth:`add` keeps its
    state in host memory instead (a :class:`HostStore` inside this one: no file, no I/O): the
    ones whose I/O has the least compute to hide behind, as ``host_cache_bytes`` allows (see
    [Note: host cache] in :mod:`offload_zero.memory.host_cache`).

    Raises:
        offload_zero.memory.swapper.SwapIOError: an I/O failed; it names file and offset.
    """

    tier = Tier.NVME
    _DEPTH = 3  # buffer sets: read k+1 | update k | write k-1
    CHUNK_NUMEL = 1 << 22  # elements per chunk: 3 sets x 3 x 16 MiB of host buffers at most

    def __init__(self, swapper, accountant: TierAccountant, host_alloc, max_shard_numel: int,
                 chunk_numel: Optional[int] = None, master_is_param: bool = False,
                 moment_dtype=torch.float32, io_stages: Optional[IOStages] = None,
                 master_dtype=torch.float32):
        self._master_is_param = master_is_param
        self.fmt = StateFormat(moment_dtype, master_dtype)
        self.io_stages = (io_stages if io_stages is not None
                          else IOStages(None, "optimizer state", STATE_IO_LEGAL))
        self._init_read_ahead()
        chunk_numel = chunk_numel or self.CHUNK_NUMEL
        self._acct = accountant
        self.swapper = swapper
        multiple = self.fmt.chunk_multiple
        if chunk_numel % multiple:
            raise ValueError(f"chunk_numel={chunk_numel} must be a multiple of {multiple} "
                             f"elements with {self.fmt.moment_dtype} moments and "
                             f"{self.fmt.master_dtype} master weights")
        self._chunk = min(max_shard_numel, chunk_numel)
        self._bufs = [host_alloc(self.fmt.buffer_numel(self._chunk), torch.float32)
                      for _ in range(self._DEPTH)]
        self._buf_bytes = sum(b.numel() * 4 for b in self._bufs)
        self._acct.add(Tier.HOST, StateKind.BUFFERS, self._buf_bytes)
        # per buffer set: (fp, write handles, lo, hi) of the chunk write still in flight
        self._pending_write = [None] * self._DEPTH
        self._numel: Dict[object, int] = {}
        self._keys: Dict[object, str] = {}
        # int8 moments' absmax of the states in files, in host memory for the whole run
        self._scales: Dict[object, torch.Tensor] = {}
        # state kept in host memory
        self._host = HostStore(accountant, host_alloc, moment_dtype, master_dtype)
        self._host_names: set = set()
        self._moved = [0, 0]  # state bytes submitted: [read, written]
        self._closed = False

    def keep_in_host(self, name: str) -> None:
        """Keep the state of the flat parameter named ``name`` (added later) in host memory:
        ``w + 8`` bytes per element of its shard with fp32 moments, ``w + 4`` with bf16 (w the
        master's bytes, 4 or 2, left out when :meth:`add` gets an ``alias``), accounted as host
        master weights and moments."""
        self._host_names.add(name)

    def in_host(self, fp) -> bool:
        """Whether ``fp``'s state is kept in host memory (see :meth:`keep_in_host`); also
        true, by name, before it is added."""
        return getattr(fp, "name", None) in self._host_names

    def add(self, fp, master_shard: torch.Tensor, alias: Optional[torch.Tensor] = None) -> None:
        """Create ``fp``'s file and write the initial master to it (the moments' bytes, never
        written, read as zeros); for a
        flat parameter kept in host memory, allocate its state there instead (``alias``: a
        tensor of the master's dtype to use as its master, as in :meth:`HostStore.add`;
        ignored otherwise)."""
        if self.in_host(fp):
            self._host.add(fp, master_shard, alias=alias)
            return
        n = master_shard.numel()
        key = fp.name
        self.swapper.allocate(key, self.fmt.nbytes(n))
        self._numel[fp], self._keys[fp] = n, key
        self._acct.add(Tier.NVME, StateKind.MASTER, self._master_bytes(n))
        self._acct.add(Tier.NVME, StateKind.MOMENTS, self.fmt.moment_bytes(n))
        if self.fmt.blockwise:
            self._scales[fp] = self.fmt.new_scales(n)
            self._acct.add(Tier.HOST, StateKind.MOMENTS, self.fmt.scale_bytes(n))
        c = self._chunk
        # the moments' regions are left as allocated: a new file (fallocate'd or sparse)
        # reads as zeros, so their bytes are never written
        master_base = self.fmt.offsets(n)[0]
        for lo in range(0, n, c):
            hi = min(n, lo + c)
            self._views(0, hi - lo)[0].copy_(master_shard[lo:hi])
            view = self._views(0, hi - lo, padded=True)[0]  # (as _io transfers it)
            self._moved[True] += view.numel() * view.element_size()
            self.swapper.swap_out(key, view,
                                  offset_bytes=master_base + self.fmt.master_itemsize * lo).wait()

    def scales(self, fp) -> torch.Tensor:
        """``fp``'s int8 moments' absmax, in host memory ([Note: int8 moment scales])."""
        return self._host.scales(fp) if self.in_host(fp) else self._scales[fp]

    def aliases(self, fp) -> bool:
        """Whether ``fp``'s master weights are its parameter shard itself: only for state kept
        in host memory with an ``alias`` (master weights in files never are)."""
        return self.in_host(fp) and self._host.aliases(fp)

    def _master_bytes(self, n: int) -> int:
        # a parameter shard on NVMe of the master's dtype is read from the master region: its
        # bytes are counted once, as parameters (see NVMeParamHome's master_is_param)
        return 0 if self._master_is_param else self.fmt.master_itemsize * n

    def _views(self, slot: int, c: int, padded: bool = False):
        return self.fmt.views(self._bufs[slot], self._chunk, c, padded)

    def _io(self, fp, lo: int, hi: int, slot: int, write: bool, key=None, n=None, views=None):
        """Start the three transfers of elements [lo, hi) of (master, m, v) between the file
        and buffer set ``slot`` (or the three ``views``, padded as transferred: see
        [Note: state layout]); returns their handles."""
        key = key or self._keys[fp]
        n = n or self._numel[fp]
        op = self.swapper.swap_out if write else self.swapper.swap_in
        views = views if views is not None else self._views(slot, hi - lo, padded=True)
        self._moved[write] += sum(v.numel() * v.element_size() for v in views)
        return [op(key, view, offset_bytes=base + view.element_size() * lo)
                for base, view in zip(self.fmt.offsets(n), views)]

    def _writes_done(self, fp) -> bool:
        """Whether every write of ``fp``'s state still tracked (whole or chunk write-backs)
        has started and finished."""
        io = self.io_stages
        if io.stage(fp) is StateIO.WRITE_DEFERRED:
            return False
        if self._holds_whole_write(fp) and not all(h.done() for h in io.handles(fp)):
            return False
        return all(h.done() for w in self._pending_write if w is not None and w[0] is fp
                   for h in w[1])

    def _retire_chunk_write(self, slot: int) -> None:
        """Wait for buffer set ``slot``'s chunk write; a state whose stream has ended
        (``WRITING``) and whose last chunk write this was is ``AT_REST`` again (one whose
        stream still runs stays ``IN_UPDATE``)."""
        fp, handles, _, _ = self._pending_write[slot]
        self._pending_write[slot] = None
        try:
            for h in handles:
                h.wait()
        finally:
            if self.io_stages.stage(fp) is StateIO.WRITING:
                self._end_chunk_writes(fp)

    def _end_chunk_writes(self, fp) -> None:
        """``fp``'s stream ended (its last chunk queued, or cut short) or a chunk write of it
        was waited for: ``WRITING`` while a chunk write of it is in flight (in a buffer set),
        ``AT_REST`` once none is. Not for a state updated whole (its buffer's write-back)."""
        io = self.io_stages
        if io.stage(fp) not in (StateIO.IN_UPDATE, StateIO.WRITING) or io.buffer(fp) is not None:
            return
        if any(w is not None and w[0] is fp for w in self._pending_write):
            if io.stage(fp) is StateIO.IN_UPDATE:
                io.move(fp, StateIO.WRITING)
        else:
            io.move(fp, StateIO.AT_REST)

    def wait_writes(self, fp, lo: int = 0, hi: Optional[int] = None) -> None:
        """Wait for the writes of ``fp``'s state still in flight before its bytes are read
        again (by this store, or by another reader: an fp32 parameter shard is read from the
        master's bytes): every whole write-back, and the chunk write-backs of elements
        [lo, hi) (default: all). Raises SwapIOError if one failed (file and offset named)."""
        hi = self._numel.get(fp, 0) if hi is None else hi
        if self._holds_whole_write(fp):
            self._retire_whole_write(fp)
        for slot, w in enumerate(self._pending_write):
            if w is not None and w[0] is fp and w[2] < hi and lo < w[3]:
                self._retire_chunk_write(slot)

    def chunks(self, fp) -> int:
        """How many items :meth:`iter_states` yields for ``fp``: 1 for a state kept in host
        memory or read ahead whole, else its shard in chunks of the pipeline's buffers."""
        if self.prefetched(fp):
            return 1
        return -(-self._numel[fp] // self._chunk)

    def _chunks(self, fps):
        for fp in fps:
            n = self._numel[fp]
            for lo in range(0, n, self._chunk):
                yield fp, lo, min(n, lo + self._chunk)

    def _start_read(self, slot: int, item):
        if self._pending_write[slot] is not None:
            self._retire_chunk_write(slot)
        fp, lo, hi = item
        # a write of these bytes still in flight lands before the read: a whole write-back, or
        # a chunk's of an earlier stream (this stream's own writes are of other chunks)
        self.wait_writes(fp, lo, hi)
        return self._io(fp, lo, hi, slot, write=False)

    def iter_states(self, flat_params: List[object], defer_write_back: bool = False
                    ) -> Iterator[StateTuple]:
        """Yield each flat parameter's state chunk by chunk from a host buffer set; write it
        back after the caller is done with it, with the next read and the previous write in
        flight meanwhile. State kept in host memory comes first, whole, then state read ahead
        (:meth:`prefetch`), whole, its write-back started at once.

        ``defer_write_back``: the write-backs of the states read ahead are not started until
        :meth:`start_deferred_writes`, or until their buffer or bytes are needed (a read of
        that state, a buffer for a read-ahead that waits, :meth:`drain`), so the disk serves
        the reads the caller waits for first; each buffer stays taken meanwhile and serves
        the new master (:meth:`master_view`). No effect on state kept in host memory or
        streamed in chunks."""
        in_host = [f for f in flat_params if self.in_host(f)]
        yield from self._host.iter_states(in_host)
        flat_params = [f for f in flat_params if not self.in_host(f)]
        ahead = [f for f in flat_params if self.io_stages.stage(f) is StateIO.READ_AHEAD]
        for fp in ahead:
            yield from self._update_whole(fp, defer_write_back)
        streamed = [f for f in flat_params if f not in ahead]
        items = list(self._chunks(streamed))
        if not items:
            return
        for fp in streamed:
            if self.io_stages.stage(fp) is not StateIO.AT_REST:
                self.wait_writes(fp)  # its own earlier writes land before its chunks are read
            self.io_stages.move(fp, StateIO.IN_UPDATE)
        reads: Dict[int, list] = {}
        try:
            reads[0] = self._start_read(0, items[0])
            for i, (fp, lo, hi) in enumerate(items):
                slot = i % self._DEPTH
                if i + 1 < len(items):
                    reads[i + 1] = self._start_read((i + 1) % self._DEPTH, items[i + 1])
                for h in reads.pop(i):
                    h.wait()
                yield (fp, lo, hi, *self._views(slot, hi - lo))
                self._pending_write[slot] = (fp, self._io(fp, lo, hi, slot, write=True), lo, hi)
                if hi == self._numel[fp]:
                    self._end_chunk_writes(fp)  # WRITING (its writes: see wait_writes)
        finally:
            for fp in streamed:
                self._end_chunk_writes(fp)  # (a stream cut short)
            for hs in reads.values():
                for h in hs:
                    h.wait()
        # the last chunks' writes stay in flight: a later read of a buffer set waits for its
        # write first (_start_read), a read of the file for the writes to it (wait_writes),
        # and the step drains them

    def _update_whole(self, fp, defer_write_back: bool) -> Iterator[StateTuple]:
        """Yield ``fp``'s state read ahead whole (``READ_AHEAD`` -> ``IN_UPDATE``), then
        start its write-back (``WRITING``) or defer it (``WRITE_DEFERRED``); an update cut
        short returns its buffer to the ring (``AT_REST``)."""
        io = self.io_stages
        buf, handles = io.buffer(fp), io.handles(fp)
        n = self._numel[fp]
        io.move(fp, StateIO.IN_UPDATE)
        try:
            for h in handles:
                h.wait()
            yield (fp, 0, n, *self._whole_views(buf, n))
        except BaseException:
            io.move(fp, StateIO.AT_REST)
            self._ahead.release(buf)
            raise
        if defer_write_back:
            io.move(fp, StateIO.WRITE_DEFERRED)
            return
        try:
            writes = self._start_whole_write(fp, buf)
        except BaseException:
            # (its buffer stays out of the ring: a part of the write may be in flight)
            io.move(fp, StateIO.AT_REST)
            raise
        io.move(fp, StateIO.WRITING, handles=writes)

    def drain(self) -> None:
        """Wait for every write in flight, deferred ones started first (see
        :meth:`iter_states`); raises SwapIOError if one failed."""
        for slot, w in enumerate(self._pending_write):
            if w is not None:
                self._retire_chunk_write(slot)
        while self.whole_writes():
            self._retire_whole_write(self.whole_writes()[0])

    def read_all(self, fp) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU copies of (master, exp_avg, exp_avg_sq) for ``fp``, read from its file (or from
        host memory, see :meth:`keep_in_host`): the master as fp32 values, int8 moments
        decoded to fp32."""
        if self.in_host(fp):
            return self._host.read_all(fp)
        self.drain()
        n = self._numel[fp]
        md = self.fmt.moment_dtype
        out = tuple(torch.empty(n, dtype=dt) for dt in (self.fmt.master_dtype, md, md))
        for lo in range(0, n, self._chunk):
            hi = min(n, lo + self._chunk)
            for h in self._io(fp, lo, hi, 0, write=False):
                h.wait()
            for dst, src in zip(out, self._views(0, hi - lo)):
                dst[lo:hi].copy_(src)
        master = out[0].float()
        if self.fmt.blockwise:  # (decoded to fp32)
            return (master, *decode_moments(self.fmt, out[1], out[2], self._scales[fp]))
        return (master, out[1], out[2])

    def read_master(self, fp) -> torch.Tensor:
        """This rank's master shard of ``fp`` as fp32 values, read from its file (a CPU
        copy)."""
        return self.read_all(fp)[0]

    def write_all(self, fp, master: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor) -> None:
        """Write ``fp``'s (master, exp_avg, exp_avg_sq), CPU tensors of shape (shard_numel,)
        (fp32 master, rounded to nearest for a bf16 one; moments in ``moment_dtype``, fp32 for
        int8 ones: encoded to nearest),
        to its file chunk by chunk through the pipeline's first buffer set, and
        wait for every write (a checkpoint being loaded). Read-ahead of any state is dropped
        first: it would be stale. Raises ValueError naming ``fp`` for a wrong shape or dtype,
        SwapIOError if a write failed (file and offset named)."""
        if self.in_host(fp):
            return self._host.write_all(fp, master, exp_avg, exp_avg_sq)
        n = self._numel[fp]
        _check_state_shapes(fp, n, (master, exp_avg, exp_avg_sq), self.fmt.exchange_dtype)
        self.release_prefetched()
        self.drain()
        if self.fmt.blockwise:  # (fp32 moments encoded to nearest, then written as codes)
            codes = (torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8))
            encode_moments_(self.fmt, exp_avg, exp_avg_sq, *codes, self._scales[fp])
            exp_avg, exp_avg_sq = codes
        for lo in range(0, n, self._chunk):
            hi = min(n, lo + self._chunk)
            for dst, src in zip(self._views(0, hi - lo), (master, exp_avg, exp_avg_sq)):
                dst.copy_(src[lo:hi])
            for h in self._io(fp, lo, hi, 0, write=True):
                h.wait()

    def pool_report(self) -> dict:
        """The pipeline's fixed host buffers (sized at start-up, never grown), in the format of
        :meth:`offload_zero.memory.pool.HostBufferPool.report`."""
        per = self._bufs[0].numel() * 4 if self._bufs else 0
        return {"buffers": len(self._bufs), "buffer_bytes": per, "capacity_bytes": self._buf_bytes,
                "in_use": 0, "peak_in_use": self._DEPTH if self._bufs else 0}

    def cache_report(self) -> dict:
        """The optimizer state's split between host memory and NVMe (see [Note: host cache]
        and [Note: host cache report] in :mod:`offload_zero.memory.host_cache`):
        ``{"host_flat_params", "nvme_flat_params"}``
        (counts) and ``{"host_state_bytes", "nvme_state_bytes"}``: bytes of master weights and
        moments kept in host memory (:meth:`keep_in_host`), and bytes of the state files, which
        each step reads and writes once (every flat parameter updated). Units: bytes."""
        return {**self._host.cache_report(), "nvme_flat_params": len(self._numel),
                "nvme_state_bytes": sum(self.state_file_bytes(fp) for fp in self._numel)}

    def state_file_bytes(self, fp) -> int:
        """Bytes of ``fp``'s state file (``[master | exp_avg | exp_avg_sq]``, padding included:
        see [Note: state layout]), what one update reads and writes; 0 for a state kept in
        host memory."""
        n = self._numel.get(fp, 0)
        return self.fmt.nbytes(n) if n else 0

    @property
    def state_read_bytes(self) -> int:
        """Bytes of optimizer state (master weights, moments) this store has asked to read
        from its files since construction (counted as each read starts; a parameter shard
        read from a master's bytes by :class:`NVMeParamHome` is not counted here)."""
        return self._moved[False]

    @property
    def state_written_bytes(self) -> int:
        """Bytes of optimizer state this store has asked to write to its files since
        construction (the initial state included; counted as each write starts)."""
        return self._moved[True]

    @property
    def read_bytes(self) -> int:
        """Bytes read from NVMe since construction."""
        return self.swapper.bytes_read

    @property
    def written_bytes(self) -> int:
        """Bytes written to NVMe since construction."""
        return self.swapper.bytes_written

    def close(self) -> None:
        """Wait for I/O and release buffers; idempotent (the swapper's owner removes files)."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self.release_prefetched()
            finally:
                self.drain()
        finally:
            for fp, n in self._numel.items():
                self._acct.sub(Tier.NVME, StateKind.MASTER, self._master_bytes(n))
                self._acct.sub(Tier.NVME, StateKind.MOMENTS, self.fmt.moment_bytes(n))
                self._acct.sub(Tier.HOST, StateKind.MOMENTS, self.fmt.scale_bytes(n))
            self._numel.clear()
            self._scales.clear()
            self._host.close()
            self._acct.sub(Tier.HOST, StateKind.BUFFERS, self._buf_bytes)
            self._bufs = []


def _check_state_shapes(fp, numel: int, tensors, moment_dtype=torch.float32) -> None:
    """Raise ValueError unless the master is fp32 and the moments ``moment_dtype``, all of
    shape (numel,)."""
    for what, t, dt in zip(("master", "exp_avg", "exp_avg_sq"), tensors,
                           (torch.float32, moment_dtype, moment_dtype)):
        if t.dtype != dt or tuple(t.shape) != (numel,):
            raise ValueError(f"{getattr(fp, 'name', fp)}: {what} must be {dt} of shape "
                             f"({numel},), got {t.dtype} of shape {tuple(t.shape)}")


# -- where compute-dtype parameter shards live when they are not on the device ---------------------

