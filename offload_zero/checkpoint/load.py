"""Loading: every rank checks what it will read (:mod:`offload_zero.checkpoint.validate`), the
ranks agree, then each assembles its shards from the saved ones, resharded when the world
size or the grouping into flat parameters differs, and writes them into the engine's tiers."""
from __future__ import annotations

import os
from typing import Dict, Iterator, List

import torch

from offload_zero.checkpoint.agree import agree
from offload_zero.checkpoint.folder import folder_lock
from offload_zero.checkpoint.layout import (COMPUTE_DTYPES, META_NAME, STATE_KEYS,
                                            paths, persistent_buffers,
                                            rank_file_name, read_metadata_file,
                                            saved_moment_dtype, saved_specs, saves_param)
from offload_zero.checkpoint.validate import (check_matches, saved_parameter, saved_parameters,
                                              saved_steps, verify_rank_file)


def load_checkpoint(engine, folder) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` into ``engine``; returns the
    ``client_state`` saved with it (``{}`` if none).

    Collective. Restores every flat parameter's fp32 master weights, Adam moments and step
    count, the compute-dtype parameter shards (the saved ones, bit for bit, or derived from the
    fp32 master weights when the saving engine's compute dtype was another; at stages 1 and 2
    all-gathered into the full parameters), the values of ``engine.optimizer``'s parameter
    groups (every key but ``params``; a checkpoint without groups: ``engine.lr``),
    ``engine.skipped_steps`` and the loss scaler's state. The parameter groups must be the
    saving engine's: as many, each parameter in the same one (ValueError naming the first
    parameter that differs). The tiers may differ from the saving engine's (saved with
    ``offload="nvme"``, loaded with ``offload="cpu"``, say), and so may the world size and the
    ZeRO stage: a checkpoint of N ranks loads on M ranks, each rank reading the slices of the
    saved shards that make up its own (see :func:`_load_shards`). So may the grouping of the
    parameters into flat parameters (``unit_classes`` cuts units otherwise, say), as long as
    the parameters of one flat parameter here share one Adam step count there. So may the
    compute dtype (the master weights are fp32 in every one; a frozen parameter's shard is
    the saved one cast; a loss scaler on one side only is not restored, with a warning); the
    model's parameters (names, shapes, ``requires_grad``) may not change.

    Every rank first checks its whole file (structure, dtypes, shapes, CRC-32 of every tensor;
    when resharding, every saved file it reads from) and the ranks agree before anything in the engine changes, so a bad checkpoint leaves the
    engine as it was; each file is therefore read twice. An I/O error after that point (a
    failing NVMe write) leaves the engine partly loaded.

    Raises:
        ValueError: the metadata does not match this engine (a parameter missing
            on either side or with another shape or ``requires_grad``, a flat parameter's
            ``shard_numel`` too small for its ``numel``, ``loss_scaler`` present in one only
            at the same compute dtype, an unknown ``dtype``,
            parameters of one flat parameter here with different step counts there): the
            message names the field, the saved value and this engine's; ``folder`` or
            ``checkpoint.json`` missing or unreadable; a rank file missing, truncated,
            corrupt (checksum) or written by another rank (the message names the file; on
            every rank).
        RuntimeError: gradients of a ``backward()`` are waiting for ``step()``, or the engine
            is closed.
    """
    engine.settle_between_steps("load_checkpoint")
    final = paths(folder)[0]
    with folder_lock(final, exclusive=False, take=True):
        return _load(engine, final)


def _load(engine, final: str) -> dict:
    """:func:`load_checkpoint` once the folder is locked (shared)."""
    error = None
    try:  # every rank checks, then all agree: one that cannot read the folder stops them all
        meta = read_metadata_file(final)
        check_matches(meta, engine, os.path.join(final, META_NAME))
        saved_world = meta["world_size"]
        segments = _segments(meta, engine)
        sources = _source_ranks(segments, engine)
        specs = saved_specs(meta, engine)
        # every saved file is checked by some rank, also one this rank does not read (a rank
        # whose shards are padding only): a checkpoint with a file missing or damaged is refused
        mine = sorted(set(sources) | set(range(engine.rank, saved_world, engine.world_size)))
        for rank in mine:
            verify_rank_file(os.path.join(final, rank_file_name(rank)), specs, rank,
                              saved_world, meta.get("save_id"))
        from safetensors import safe_open
        with safe_open(os.path.join(final, rank_file_name(sources[0])), framework="pt") as f:
            steps = saved_steps(f, segments, os.path.join(final, META_NAME))
    except Exception as exc:
        error = exc
    agree(engine, error, f"load_checkpoint({final!r})", exc_type=ValueError)
    try:
        with torch.no_grad():
            _load_shards(final, engine, segments, sources, steps,
                         COMPUTE_DTYPES[meta["dtype"]])
        _restore_groups(engine, meta)
        engine.skipped_steps = meta["skipped_steps"]
        if meta["loss_scaler"] is not None and engine.loss_scaler is not None:
            engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    except Exception as exc:
        error = exc
    agree(engine, error, f"load_checkpoint({final!r})")
    with torch.no_grad():
        for fp in engine.flat_params:
            if fp.keep_unsharded:  # stages 1 and 2: every rank's new shard into the full values
                engine.comm.all_gather_into(fp.full_values(), fp.sharded, what=fp.name)
    return meta.get("client_state") or {}


def _restore_groups(engine, meta: dict) -> None:
    """Set ``engine.optimizer``'s groups to the values ``meta`` saved (checked by
    :func:`offload_zero.checkpoint.validate._check_groups`; every key but ``params``), or,
    for a checkpoint without ``param_groups``, the saved ``lr``."""
    groups = meta.get("param_groups")
    if groups is None:
        engine.set_lr(meta["lr"])
        return
    for group, saved in zip(engine.optimizer.param_groups, groups):
        for key, value in saved.items():
            if key != "params":
                group[key] = tuple(value) if key == "betas" else value


def _segments(meta: dict, engine) -> Dict[object, List[tuple]]:
    """Where each of ``engine``'s flat parameters lies in the saved ones, parameter by
    parameter: ``{fp: [(offset in fp, numel, saved flat parameter name, its shard_numel,
    offset in it)]}`` (elements). The checkpoint may group the parameters differently (other
    ``unit_classes`` on one side, say); checked by
    :func:`check_matches`."""
    where = saved_parameters(meta)
    out = {}
    for fp in engine.flat_params:
        segs = []
        for e in fp.entries:
            _, name, shard, offset, _, _ = saved_parameter(where, e.names)
            segs.append((e.offset, e.numel, name, shard, offset))
        out[fp] = segs
    return out


def _pieces(segs: List[tuple], lo: int, hi: int) -> Iterator[tuple]:
    """The saved slices that make up elements ``[lo, hi)`` of a flat parameter whose
    ``segs`` are from :func:`_segments`: ``(saved rank, saved flat parameter name, [a, b) in
    that rank's shard, [c, d) in the range)``. Elements no parameter holds (padding) are in no
    piece."""
    for offset, n, name, shard, saved_offset in segs:
        a, b = max(lo, offset), min(hi, offset + n)
        if a >= b:
            continue
        sa, sb = saved_offset + a - offset, saved_offset + b - offset
        for r in range(sa // shard, (sb - 1) // shard + 1):
            x, y = max(sa, r * shard), min(sb, (r + 1) * shard)
            yield r, name, (x - r * shard, y - r * shard), (x - sa + a - lo, y - sa + a - lo)


def _source_ranks(segments: Dict[object, List[tuple]], engine) -> List[int]:
    """The saving ranks whose files hold some element of this rank's shards (``segments``:
    :func:`_segments`): this rank alone at the same world size and grouping; else those whose
    shards overlap this rank's ranges (see :func:`_load_shards`); rank 0 alone if none does
    (the step counts and buffers are in every file)."""
    ranks = set()
    for fp, segs in segments.items():
        lo = engine.rank * fp.shard_numel
        ranks.update(r for r, _, _, _ in _pieces(segs, lo, lo + fp.shard_numel))
    return sorted(ranks) or [0]


def _load_shards(final: str, engine, segments: Dict[object, List[tuple]], sources: List[int],
                 steps: Dict[object, int], saved_dtype: torch.dtype) -> None:
    """Write this rank's shards of the checkpoint in ``final`` (verified) into the engine's
    store and parameter shards, at the saving world size or another (resharding), with the
    parameters grouped into flat parameters as the saving engine did or otherwise.

    Every flat parameter is a flat vector of ``numel`` elements cut into equal shards of
    ``shard_numel`` (the last padded with zeros): rank r of N holds elements
    ``[r * s, (r + 1) * s)``. Each parameter lies at an offset of one saved flat vector and
    one of this engine's (:func:`_segments`); this rank's shard is assembled from the slices of
    the saved shards that hold its range's parameters (``sources``' files; safetensors reads
    only those bytes): at the same world size and grouping that is its own file, whole. One
    flat parameter at a time (12 bytes per element of its shard in host memory, 8 with bf16
    moments, plus the shard); the padding is zeros, as in a fresh engine's (a zero weight with zero gradient and
    moments stays zero under Adam/AdamW). Buffers are the same in every file; ``steps`` are
    the step counts :func:`saved_steps` read (and checked) before anything changed.
    ``saved_dtype`` is the saving engine's compute dtype: where it is not this engine's, a
    trainable parameter shard is its master weights cast to this engine's dtype (rounded to
    nearest, as an update writes it) and a frozen one the saved shard cast."""
    from contextlib import ExitStack
    from safetensors import safe_open
    saved_moments = saved_moment_dtype(read_metadata_file(final))
    moments = engine.store.fmt.exchange_dtype
    with ExitStack() as stack:
        files = {r: stack.enter_context(safe_open(os.path.join(final, rank_file_name(r)),
                                                  framework="pt")) for r in sources}
        first = files[sources[0]]
        for fp in engine.flat_params:
            lo = engine.rank * fp.shard_numel
            pieces = list(_pieces(segments[fp], lo, lo + fp.shard_numel))

            def gather(key, dtype):
                out = torch.zeros(fp.shard_numel, dtype=dtype)
                for r, name, (a, b), (c, d) in pieces:
                    out[c:d] = files[r].get_slice(f"{name}/{key}")[a:b]
                return out

            master = None
            if fp.requires_grad:
                master = gather("master", torch.float32)
                # (moments saved in another dtype are converted: bf16 -> fp32 exactly)
                m, v = (gather(key, saved_moments).to(moments) for key in STATE_KEYS[1:])
                engine.store.write_all(fp, master, m, v)
                engine.step_counts[fp] = steps[fp]
            if fp.requires_grad and (saved_dtype != fp.dtype or not saves_param(fp)):
                values = master.to(fp.dtype)  # as an update writes it (fp32: the masters)
            else:
                values = gather("param", saved_dtype).to(fp.dtype)
            write_param_shard(fp, values)
        _load_buffers(first, engine)
    if engine.param_home is not None:
        engine.param_home.drain()


def write_param_shard(fp, values: torch.Tensor) -> None:
    """Make ``values`` (shape (shard_numel,), compute dtype) ``fp``'s parameter shard, the way
    an update writes it: into the shard itself, or through its home (host memory, or a pool
    buffer written back to its NVMe file; nothing when the shard is its master's bytes, which
    the store just wrote)."""
    if fp.home is None:
        fp.sharded.copy_(values)
        return
    fp.home.done_with(fp)  # a read of the old shard (kept or read ahead) is stale now
    target = fp.home.update_target(fp)
    if target is not None:
        target.copy_(values)
    fp.home.commit(fp, target)


def _load_buffers(f, engine) -> None:
    """Copy the persistent buffers saved in the open rank file ``f`` (if it has them: files
    written before buffers were saved do not) into the engine's module."""
    names = set(f.keys())
    for name, mod, attr in persistent_buffers(engine.module):
        if f"buffers/{name}" in names:
            mod._buffers[attr].copy_(f.get_tensor(f"buffers/{name}"))
