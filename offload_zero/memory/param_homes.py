"""Where compute-dtype parameter shards live when they are not on the device
(``offload_param``): :class:`HostParamHome` (aligned, pinned host memory) and
:class:`NVMeParamHome` (NVMe files read ahead into a fixed pool, written back through a ring;
shards read from their master's bytes when the optimizer state is on NVMe too and the master
has the compute dtype).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from offload_zero.config import Tier
from offload_zero.memory.accounting import StateKind, TierAccountant
from offload_zero.memory.state_stores import NVMeStore
from offload_zero.memory.swapper import SwapHandle
from offload_zero.update.state import SHARD_IO_LEGAL, IOStages, ShardIO

class HostParamHome:
    """Parameter shards in aligned (pinned) host memory (``offload_param="cpu"``).

    The shard is copied to the device for each gather; the optimizer writes the new values
    straight into it.
    """

    tier = Tier.HOST

    def __init__(self, accountant: TierAccountant, host_alloc):
        self._acct, self._alloc = accountant, host_alloc
        self._held: Dict[object, int] = {}  # {fp: bytes of its host shard}

    def adopt(self, fp, device_shard: torch.Tensor) -> torch.Tensor:
        """Move ``fp``'s initial shard home; returns the tensor ``fp.sharded`` becomes."""
        host = self._alloc(device_shard.numel(), device_shard.dtype)
        host.copy_(device_shard)
        self._held[fp] = host.numel() * host.element_size()
        self._acct.add(Tier.HOST, StateKind.PARAMS, self._held[fp])
        return host

    def cache_report(self) -> dict:
        """The parameter shards held here (see [Note: host cache report] in
        :mod:`offload_zero.memory.host_cache`): ``{"host_param_flat_params",
        "host_frozen_flat_params"}`` (counts: all, frozen) and ``{"host_param_bytes",
        "host_frozen_bytes"}`` (their host bytes). Units: bytes."""
        frozen = [n for fp, n in self._held.items() if not fp.requires_grad]
        return {"host_param_flat_params": len(self._held),
                "host_param_bytes": sum(self._held.values()),
                "host_frozen_flat_params": len(frozen), "host_frozen_bytes": sum(frozen)}

    def fetch(self, fp) -> None:
        """Nothing to bring in: the shard is resident."""

    def shard_for_gather(self, fp) -> torch.Tensor:
        """The shard to all-gather from (host tensor)."""
        return fp.sharded

    def done_with(self, fp) -> None:
        """The gather no longer needs the host copy (it stays: it is the shard's home)."""

    def update_target(self, fp) -> torch.Tensor:
        """Host tensor the optimizer writes ``fp``'s new compute-dtype shard into."""
        return fp.sharded

    def commit(self, fp, target: torch.Tensor) -> None:
        """Persist what the optimizer wrote into ``update_target(fp)`` (resident: nothing)."""

    def discard(self, fp) -> None:
        """The update was skipped (overflow): nothing to persist."""

    def drain(self) -> None:
        """Wait for pending writes (none)."""

    def read(self, fp) -> torch.Tensor:
        """A CPU copy of ``fp``'s shard, shape (shard_numel,)."""
        return fp.sharded.clone()

    def release(self, fp) -> None:
        """Forget ``fp`` (engine close)."""
        nbytes = self._held.pop(fp, 0)
        if nbytes:
            self._acct.sub(Tier.HOST, StateKind.PARAMS, nbytes)

    def close(self) -> None:
        """Nothing beyond :meth:`release`."""


class NVMeParamHome:
    """Parameter shards in NVMe files (``offload_param="nvme"``), read ahead into a fixed pool.

    ``fetch`` starts an asynchronous read of a shard into a pool buffer; ``shard_for_gather``
    waits for it; ``done_with`` returns the buffer right after the gather, so host memory holds
    parameter shards only for units in flight. After the update, ``commit`` writes the new shard
    back from the pool buffer the update wrote; nothing waits for the write until that buffer
    is needed (a pool with every buffer in use retires the oldest write), the shard is read
    again or updated again, or :meth:`drain`.

    Args:
        swapper: the rank's :class:`offload_zero.memory.swapper.Swapper`.
        pool: a :class:`offload_zero.memory.pool.HostBufferPool` of compute-dtype buffers, or a
            function ``fp -> pool`` (a small pool for an outsized root unit, say, so the main
            pool's buffers need not all be root-sized).
        accountant: NVMe ``PARAMS`` bytes are the files' sizes.
        master_is_param: the compute dtype is the master's (``master_dtype``: fp32, or bf16
            with ``master_dtype="bf16"``) and the optimizer state is on NVMe too: a trainable
            shard is then the same bytes as its master weights, so it is read
            from the master region of the optimizer's file (offset 0 of the file named
            ``fp.name``; see :class:`NVMeStore`) and never written by this home: the update
            writes it once, as the master. No second file, no second write per step.
        keep_after_update: ``f(fp) -> bool``: flat parameters whose new shard, written by the
            optimizer into a pool buffer, stays there as the read for their next gather, from
            step to step (the root unit, gathered first in forward, with a buffer of its own):
            one read of the shard per step less. None keeps nothing.
        gather_follows: ``f(fp) -> bool``: flat parameters whose gather follows the update
            being made (``update_timing="next_forward"``): the buffer the update writes the
            new shard into serves that gather, the write still in flight. None: no such.
        in_host: ``f(fp) -> bool``: flat parameters whose shard stays in host memory (see
            [Note: host cache]): trainable ones whose optimizer state does (``host_cache_bytes``,
            ``tail_state_in_host``), unless the shard is its master's bytes
            (``master_is_param``: it is then that host master), and frozen ones the host cache
            keeps. Such a shard is allocated by ``host_alloc``: the update writes it there,
            the gathers read it there, and it never reaches the disk. None: no such.
        host_alloc: ``f(numel, dtype) -> tensor``, the host allocator of those shards
            (required with ``in_host``).
        master_dtype: the master weights' dtype (float32 or bfloat16): with
            ``master_is_param``, the trainable shards of this dtype are the master's bytes.
        io_stages: the :class:`offload_zero.update.state.IOStages` of the parameter shards
            (:class:`ShardIO`: ``READING``, ``KEPT``, ``IN_UPDATE``, ``WRITING``, each with its
            pool buffer and handle; see [Note: update states]): the engine's
            (``UpdateStates.shard_io``); default: one of this home's own.

    Attributes:
        master_source: with ``master_is_param``, the :class:`NVMeStore` that owns the master's
            bytes (set by the engine before any ``adopt``). A shard whose master it holds in
            host memory (read ahead with the whole optimizer state, updated and not yet
            written back, or kept there; see :meth:`NVMeStore.holds_master`) is gathered from
            there, not read a second time, and a shard is read from the file only after the
            store's writes to it are done.
    """

    tier = Tier.NVME

    def __init__(self, swapper, pool, accountant: TierAccountant, master_is_param: bool = False,
                 keep_after_update=None, gather_follows=None,
                 io_stages: Optional[IOStages] = None, in_host=None, host_alloc=None,
                 master_dtype=torch.float32):
        if in_host is not None and host_alloc is None:
            raise ValueError("in_host needs host_alloc: the shards it keeps are host memory")
        self.swapper, self._acct = swapper, accountant
        self._in_host = in_host or (lambda fp: False)
        # the shards kept in host memory (their fp.sharded), homed as offload_param="cpu" homes
        # its shards; those flat parameters are in _resident
        self._host = HostParamHome(accountant, host_alloc) if in_host is not None else None
        self._resident: set = set()
        self._pool_for = pool if callable(pool) else (lambda fp: pool)
        self.io_stages = (io_stages if io_stages is not None
                          else IOStages(None, "parameter shard", SHARD_IO_LEGAL))
        self._sizes: Dict[object, int] = {}
        self.master_is_param = master_is_param
        self._master_dtype = master_dtype
        # a layout fact, not I/O state: the trainable shards that are their master's bytes
        # (read from the optimizer's file, never written by this home)
        self._in_master: set = set()
        self._keep = keep_after_update or (lambda fp: False)
        self._follows = gather_follows or (lambda fp: False)
        self.master_source: Optional[NVMeStore] = None

    def _wants(self, fp) -> bool:
        """Whether ``fp``'s new shard stays in the buffer its update writes, for the gather
        that follows the update or from step to step."""
        return self._follows(fp) or self._keep(fp)

    def _key(self, fp) -> str:
        return fp.name if fp in self._in_master else f"{fp.name}.param"

    def adopt(self, fp, device_shard: torch.Tensor):
        """Write ``fp``'s initial shard to its file (unless it is its master's bytes, which the
        optimizer's store writes); ``fp.sharded`` becomes None."""
        nbytes = device_shard.numel() * device_shard.element_size()
        if (self.master_is_param and fp.requires_grad
                and device_shard.dtype == self._master_dtype):
            self._in_master.add(fp)
            source = self.master_source
            # a master kept in host memory (NVMeStore.keep_in_host) holds the shard's bytes
            # there, accounted as host master weights: nothing of it is on NVMe
            self._sizes[fp] = 0 if source is not None and source.in_host(fp) else nbytes
            self._acct.add(Tier.NVME, StateKind.PARAMS, self._sizes[fp])
            return None
        if self._in_host(fp):
            self._resident.add(fp)
            return self._host.adopt(fp, device_shard)
        self._sizes[fp] = nbytes
        self._acct.add(Tier.NVME, StateKind.PARAMS, nbytes)
        self.swapper.allocate(self._key(fp), nbytes)
        pool = self._pool_for(fp)
        buf = pool.acquire()
        try:
            view = buf[:device_shard.numel()]
            view.copy_(device_shard)
            self.swapper.swap_out(self._key(fp), view).wait()
        finally:
            pool.release(buf)
        return None

    def cache_report(self) -> dict:
        """The parameter shards' split between host memory and NVMe (see [Note: host cache
        report] in :mod:`offload_zero.memory.host_cache`): those kept in host memory
        (:meth:`HostParamHome.cache_report`'s keys) and ``"nvme_param_flat_params"``,
        ``"nvme_param_bytes"``: the shards each gather reads from NVMe (a file of their own or
        their master's bytes), and their bytes. Units: bytes."""
        held = self._host.cache_report() if self._host is not None else {}
        read = [n for n in self._sizes.values() if n]
        return {"host_param_flat_params": 0, "host_param_bytes": 0,
                "host_frozen_flat_params": 0, "host_frozen_bytes": 0, **held,
                "nvme_param_flat_params": len(read), "nvme_param_bytes": sum(read)}

    def _from_store(self, fp) -> bool:
        source = self.master_source
        return source is not None and fp in self._in_master and source.holds_master(fp)

    def _holds_read(self, fp) -> bool:
        """Whether a pool buffer holds ``fp``'s shard for its next gather (``READING`` or
        ``KEPT``)."""
        return self.io_stages.stage(fp) in (ShardIO.READING, ShardIO.KEPT)

    def fetch(self, fp) -> None:
        """Start reading ``fp``'s shard into a pool buffer (``AT_REST`` -> ``READING``; no-op
        if already under way or kept, or if the optimizer's store is reading it with the whole
        state)."""
        if fp in self._resident or self._holds_read(fp) or self._from_store(fp):
            return
        if self.io_stages.stage(fp) is ShardIO.WRITING:
            if self._wants(fp):
                # the buffer being written holds the new shard: it is the read, at once (a
                # gather only reads it; the write's handle is waited for before the buffer
                # goes back to the pool, in done_with)
                io = self.io_stages
                io.move(fp, ShardIO.KEPT, handles=io.handles(fp))
                return
            self._retire(fp)
        if self.master_source is not None and fp in self._in_master:
            self.master_source.wait_writes(fp)
        buf = self._acquire(fp)
        view = buf[:fp.shard_numel]
        self.io_stages.move(fp, ShardIO.READING, buffer=buf,
                            handles=[self.swapper.swap_in(self._key(fp), view, urgent=True)])

    def shard_for_gather(self, fp) -> torch.Tensor:
        """Wait for ``fp``'s read (starting it if needed) and return the host shard."""
        if fp in self._resident:
            return self._host.shard_for_gather(fp)
        if not self._holds_read(fp) and self._from_store(fp):
            return self.master_source.master_view(fp)
        self.fetch(fp)
        if self.io_stages.stage(fp) is ShardIO.READING:  # (KEPT: the bytes are there)
            self.io_stages.handles(fp)[0].wait()
        return self.io_stages.buffer(fp)[:fp.shard_numel]

    def done_with(self, fp) -> None:
        """Return ``fp``'s read buffer to the pool (a gather used it, or an update is about to
        make it stale): ``READING`` or ``KEPT`` -> ``AT_REST``; nothing to do without one (a
        shard gathered from the store's read-ahead). A kept shard whose write is still in
        flight goes back to ``WRITING`` instead: its buffer returns to the pool when the write
        is retired (by a later acquire, update or drain), so the caller does not wait for it."""
        if fp in self._resident or not self._holds_read(fp):
            return
        io = self.io_stages
        buf, handles = io.buffer(fp), io.handles(fp)
        if io.stage(fp) is ShardIO.KEPT and not handles[0].done():
            io.move(fp, ShardIO.WRITING, handles=handles)
            return
        io.move(fp, ShardIO.AT_REST)
        handles[0].wait()
        self._pool_for(fp).release(buf)

    def update_target(self, fp) -> Optional[torch.Tensor]:
        """A pool buffer the optimizer writes ``fp``'s new shard into (``AT_REST`` ->
        ``IN_UPDATE``; see :meth:`commit`), or None when the shard is the master weights
        (updated in place by the optimizer). A write of ``fp``'s previous shard still in
        flight is retired first, and not kept: the update makes it stale. A shard kept in
        host memory (``in_host``) is its own target."""
        if fp in self._resident:
            return self._host.update_target(fp)
        if fp in self._in_master and not self._wants(fp):
            return None
        if self.io_stages.stage(fp) is ShardIO.WRITING:
            self._retire(fp, keep=False)
        buf = self._acquire(fp)
        self.io_stages.move(fp, ShardIO.IN_UPDATE, buffer=buf)
        return buf[:fp.shard_numel]

    def commit(self, fp, target: torch.Tensor) -> None:
        """Write the new shard in ``target`` back to ``fp``'s file, asynchronously
        (``IN_UPDATE`` -> ``WRITING``; nothing to do for a shard that is its master weights;
        ``KEPT`` for one whose gather follows, or a master's copy kept for it: the buffer
        serves that gather whenever the write completes; nothing for a shard kept in host
        memory, updated in place)."""
        if fp in self._resident or (fp in self._in_master and not self._wants(fp)):
            return
        if fp in self._in_master:  # its bytes are written as the master; keep the copy
            self.io_stages.move(fp, ShardIO.KEPT,
                                handles=[SwapHandle(self._key(fp), "kept", None, 0)])
            return
        handles = [self.swapper.swap_out(self._key(fp), target)]
        # a gather follows: the buffer is its read at once, the write in flight (no write-back
        # a full pool retires takes it from that gather: it would read the file instead)
        self.io_stages.move(fp, ShardIO.KEPT if self._follows(fp) else ShardIO.WRITING,
                            handles=handles)

    def discard(self, fp) -> None:
        """The update was skipped (overflow): return the target buffer unwritten
        (``IN_UPDATE`` -> ``AT_REST``)."""
        if self.io_stages.stage(fp) is not ShardIO.IN_UPDATE:
            return
        buf = self.io_stages.buffer(fp)
        self.io_stages.move(fp, ShardIO.AT_REST)
        self._pool_for(fp).release(buf)

    def _writes(self) -> list:
        """The flat parameters whose shard write is in flight (``WRITING``), oldest first."""
        return self.io_stages.in_stage(ShardIO.WRITING)

    def _acquire(self, fp) -> torch.Tensor:
        """A buffer of ``fp``'s pool. While every buffer is in flight, that pool's write-backs
        are retired (oldest first: a small pool, an outsized root's, may hold only writes just
        started), then its reads ahead that no gather has taken are dropped, oldest first: the
        prefetch follows the last forward's order, and a forward that skips a unit (a branch
        not taken, an expert without tokens) or runs them in another order leaves those reads
        waiting for a gather that may never come. A dropped one is read again if its unit
        runs (:meth:`fetch`); a kept shard's write goes on (:meth:`done_with`)."""
        pool = self._pool_for(fp)
        while pool.in_use == pool.count:
            writes = [w for w in self._writes() if self._pool_for(w) is pool]
            if writes:
                self._retire(writes[0])
                continue
            unread = [r for r in self.io_stages.in_stage(ShardIO.READING, ShardIO.KEPT)
                      if r is not fp and self._pool_for(r) is pool]
            if not unread:
                break
            self.done_with(unread[0])
        return pool.acquire()

    def _retire(self, fp, keep: bool = True) -> None:
        """Wait for ``fp``'s shard write: ``KEPT`` (its buffer holds the shard just written,
        for the next gather) if ``keep`` and ``keep_after_update`` says so, else
        ``AT_REST`` (its buffer back to the pool)."""
        io = self.io_stages
        buf, handles = io.buffer(fp), io.handles(fp)
        kept = False
        try:
            handles[0].wait()
            if keep and self._keep(fp):
                io.move(fp, ShardIO.KEPT, handles=handles)  # (the write's handle: done)
                kept = True
        finally:
            if not kept:
                io.move(fp, ShardIO.AT_REST)
                self._pool_for(fp).release(buf)

    def drain(self) -> None:
        """Wait for every write in flight and return their buffers (or keep them, see
        ``keep_after_update``)."""
        while self._writes():
            self._retire(self._writes()[0])

    def read(self, fp) -> torch.Tensor:
        """A CPU copy of ``fp``'s shard, read from its file (or its host copy)."""
        if fp in self._resident:
            return self._host.read(fp)
        shard = self.shard_for_gather(fp).clone()
        self.done_with(fp)
        return shard

    def release(self, fp) -> None:
        """Forget ``fp`` (engine close); its file goes with the swapper."""
        if fp in self._resident:
            self._resident.discard(fp)
            self._host.release(fp)
            return
        nbytes = self._sizes.pop(fp, 0)
        if nbytes:
            self._acct.sub(Tier.NVME, StateKind.PARAMS, nbytes)

    def close(self) -> None:
        """Finish reads and writes in flight."""
        try:
            for fp in self.io_stages.in_stage(ShardIO.READING, ShardIO.KEPT):
                try:
                    self.done_with(fp)  # (a kept shard's write in flight: WRITING)
                except Exception:
                    pass
        finally:
            self.drain()
