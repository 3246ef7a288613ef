"""The checks a load makes before anything in the engine changes: the metadata against the
engine (parameters, shapes, parameter groups, buffers, loss scaler), every rank file it needs
(tensors, dtypes, shapes, CRC-32s, save id), and the saved step counts."""
from __future__ import annotations

import copy
import logging
import math
import os
import zlib
from typing import Dict, List, Optional

from offload_zero.checkpoint.layout import (COMPUTE_DTYPES, META_NAME, TensorSpec,
                                            engine_layout, raw_bytes)

log = logging.getLogger("offload_zero")


def _mismatch(path: str, field: str, saved, mine) -> ValueError:
    return ValueError(f"{path!r}: {field} is {saved!r} in the checkpoint but {mine!r} in this "
                      "engine")


def check_matches(meta: dict, engine, path: str) -> None:
    """Raise ValueError naming the first field of ``meta`` that does not fit ``engine``."""
    mine = engine_layout(engine)
    if meta.get("dtype") not in COMPUTE_DTYPES:
        raise ValueError(f"{path!r}: dtype is {meta.get('dtype')!r}; a checkpoint's is one of "
                         f"{sorted(COMPUTE_DTYPES)}")
    world = meta.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"{path!r}: world_size is {world!r}; a checkpoint's is a positive "
                         "integer")
    same_world = world == mine["world_size"]
    saved_fps = meta.get("flat_params")
    if not isinstance(saved_fps, list) or not saved_fps:
        raise ValueError(f"{path!r}: flat_params is {saved_fps!r}; a checkpoint lists its flat "
                         "parameters")
    for saved in saved_fps:
        shard, numel = saved.get("shard_numel"), saved.get("numel")
        if not (isinstance(shard, int) and isinstance(numel, int) and shard * world >= numel >= 0):
            raise ValueError(f"{path!r}: flat parameter {saved.get('name')!r} shard_numel is "
                             f"{shard!r}: {world} shards of it cannot hold its {numel!r} "
                             "elements")
    where = saved_parameters(meta, path)
    count = len({saved[5] for saved in where.values()})
    params = [(e.names, list(e.shape), fp.requires_grad) for fp in engine.flat_params
            for e in fp.entries]
    found = set()
    for names, shape, trainable in params:
        saved = saved_parameter(where, names)
        if saved is None:
            raise ValueError(f"{path!r}: parameter {names[0]!r} of this engine is not in the "
                             f"checkpoint (it holds {count} parameters, this engine "
                             f"{len(params)})")
        found.add(saved[5])
        if saved[4] != shape:
            raise _mismatch(path, f"parameter {names[0]!r} shape", saved[4], shape)
        if saved_fps[saved[0]].get("requires_grad") != trainable:
            raise _mismatch(path, f"parameter {names[0]!r} requires_grad",
                            saved_fps[saved[0]].get("requires_grad"), trainable)
    _check_groups(meta, engine, path)
    extra = [saved[5] for saved in where.values() if saved[5] not in found]
    if extra:
        raise ValueError(f"{path!r}: parameter {extra[0]!r} of the checkpoint is not in this "
                         f"engine (it holds {count} parameters, this engine {len(params)})")
    if "buffers" in meta and meta["buffers"] != mine["buffers"]:
        raise _mismatch(path, "buffers (names)", meta["buffers"], mine["buffers"])
    if "buffers" not in meta and mine["buffers"]:
        log.warning("%s: saved without the model's buffers (an older checkpoint): %s keep their "
                    "current values", path, ", ".join(mine["buffers"][:5]))
    has_saved, has_mine = meta.get("loss_scaler") is not None, engine.loss_scaler is not None
    if has_saved != has_mine and meta["dtype"] == mine["dtype"]:
        state = {True: "present", False: "absent"}
        raise _mismatch(path, "loss_scaler", state[has_saved], state[has_mine])
    if has_saved != has_mine:
        log.warning("%s: saved in %s with%s a loss scaler, loaded in %s with%s one: the loss "
                    "scale is not restored", path, meta["dtype"], "" if has_saved else "out",
                    mine["dtype"], "" if has_mine else "out")
    elif has_saved:  # a bad scaler state must fail here, before the engine changes
        try:
            copy.deepcopy(engine.loss_scaler).load_state_dict(meta["loss_scaler"])
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path!r}: loss_scaler: {exc}") from None
    saved_opt = meta.get("optimizer") or {}
    cfg = engine.config
    if "param_groups" in meta:  # the groups' values are restored: only adamw stays this engine's
        mine_opt = {"adamw": cfg.adamw}
    else:
        mine_opt = {"betas": list(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
                    "adamw": cfg.adamw}
    changed = [f"{k} {saved_opt[k]!r} -> {v!r}" for k, v in mine_opt.items()
               if k in saved_opt and saved_opt[k] != v]
    if changed:
        log.warning("%s: the optimizer settings differ from the saved run's (%s); this engine's "
                    "are used", path, ", ".join(changed))


def _check_groups(meta: dict, engine, path: str) -> None:
    """Raise ValueError unless ``meta`` (a checkpoint's metadata) puts every trainable
    parameter in the parameter group ``engine`` puts it in (naming the first that differs) and
    holds valid values for as many groups. A checkpoint saved before parameter groups (no
    ``param_groups``) fits an engine of one group."""
    from offload_zero.optim.facade import check_group
    groups = meta.get("param_groups")
    mine = len(engine.optimizer.param_groups)
    if groups is None:
        if mine != 1:
            raise _mismatch(path, "the number of param_groups", 1, mine)
        return
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{path!r}: param_groups must be a list of objects, got {groups!r:.80}")
    if len(groups) != mine:
        raise _mismatch(path, "the number of param_groups", len(groups), mine)
    for i, group in enumerate(groups):
        try:
            check_group(i, group)
        except ValueError as exc:
            raise ValueError(f"{path!r}: {exc}") from None
    saved_group = {}
    for saved in meta["flat_params"]:
        for entry, group in zip(saved.get("parameters") or [], saved.get("groups") or []):
            for name in entry[0]:
                saved_group[name] = group
    for fp in engine.trainable:
        for e, group in zip(fp.entries, engine.entry_groups[fp]):
            theirs = next((saved_group[n] for n in e.names if n in saved_group), 0)
            if theirs != group:
                raise ValueError(f"{path!r}: parameter {e.names[0]!r} is in param_groups"
                                 f"[{theirs!r}] in the checkpoint but in param_groups[{group}] "
                                 "in this engine; load it into an engine with the same groups")


def saved_parameters(meta: dict, path: str = META_NAME) -> Dict[str, tuple]:
    """``{name: (saved flat parameter index, its name, its shard_numel, offset in it, shape,
    first name)}`` for every model parameter in ``meta``'s flat parameters, under each of its
    names (a tied parameter has several), offsets in elements, in layout order as
    :func:`offload_zero.partition.flat_param.build_entries` assigns them. Raises ValueError
    naming a malformed ``parameters`` entry."""
    out = {}
    for j, saved in enumerate(meta["flat_params"]):
        offset = 0
        for entry in saved.get("parameters") or []:
            ok = (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                  and entry[0] and all(isinstance(n, str) for n in entry[0])
                  and isinstance(entry[1], list)
                  and all(isinstance(d, int) and d >= 0 for d in entry[1]))
            if not ok:
                raise ValueError(f"{path!r}: flat parameter {saved.get('name')!r} has a "
                                 f"parameters entry {entry!r}; each is [[names], [shape]]")
            for name in entry[0]:
                out[name] = (j, saved["name"], saved["shard_numel"], offset, entry[1],
                             entry[0][0])
            offset += math.prod(entry[1])
        if offset > saved["numel"]:
            raise ValueError(f"{path!r}: flat parameter {saved.get('name')!r} lists parameters "
                             f"of {offset} elements in all, more than its numel "
                             f"{saved['numel']}")
    return out


def saved_parameter(where: Dict[str, tuple], names: List[str]) -> Optional[tuple]:
    """The saved parameter (from :func:`saved_parameters`) known by any of ``names`` (one
    parameter's names here: a tied one may list them in another order), or None."""
    return next((where[name] for name in names if name in where), None)


def verify_rank_file(path: str, specs: List[TensorSpec], rank: int, world_size: int,
                      save_id: Optional[str] = None) -> None:
    """Check that ``path`` is rank ``rank``'s complete, intact file of a save at
    ``world_size`` ranks: readable, written by that rank in the save ``save_id``
    (checkpoint.json's; a file must have the same, or none when it has none), exactly the tensors of ``specs`` with their
    dtypes and shapes, every CRC-32 right. Raises ValueError naming the file."""
    from safetensors import safe_open
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint file {path!r} is missing")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if (meta.get("rank"), meta.get("world_size")) != (str(rank), str(world_size)):
                raise ValueError(f"checkpoint file {path!r} was written by rank "
                                 f"{meta.get('rank')} of {meta.get('world_size')}, not rank "
                                 f"{rank} of {world_size}")
            if meta.get("save_id") != save_id:
                raise ValueError(f"checkpoint file {path!r} belongs to another save than its "
                                 f"{META_NAME} (save_id {meta.get('save_id')!r} there, "
                                 f"{save_id!r} in {META_NAME}): files of two checkpoints were "
                                 "mixed")
            expected = {name for name, _, _ in specs}
            keys = set(f.keys())
            if keys != expected:
                raise ValueError(f"checkpoint file {path!r}: tensors missing "
                                 f"{sorted(expected - keys)[:5]}, unexpected "
                                 f"{sorted(keys - expected)[:5]}")
            for name, dtype, shape in specs:
                t = f.get_tensor(name)
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise ValueError(f"checkpoint file {path!r}: {name} is {t.dtype} of shape "
                                     f"{tuple(t.shape)}, expected {dtype} of shape {shape}")
                crc = f"{zlib.crc32(raw_bytes(t)):08x}"
                if meta.get(f"crc32/{name}") != crc:
                    raise ValueError(f"checkpoint file {path!r} is corrupt: {name} has CRC-32 "
                                     f"{crc}, the file records {meta.get(f'crc32/{name}')}")
    except ValueError:
        raise
    except Exception as exc:  # safetensors' own errors: truncated, bad header
        raise ValueError(f"checkpoint file {path!r} cannot be read (truncated or corrupt): "
                         f"{exc}") from None


def saved_steps(f, segs: Dict[object, List[tuple]], path: str) -> Dict[object, int]:
    """Each trainable flat parameter's Adam step count, from the saved flat parameters its
    parameters come from (``segs``: :func:`offload_zero.checkpoint.load._segments`), in the
    open rank file ``f`` (every file holds them all). Raises ValueError if they differ: one
    flat parameter has one step count."""
    steps = {}
    for fp, parts in segs.items():
        if not fp.requires_grad:
            continue
        found = {name: int(f.get_tensor(f"{name}/step")) for _, _, name, _, _ in parts}
        if len(set(found.values())) > 1:
            names = {}
            for e, (_, _, name, _, _) in zip(fp.entries, parts):
                names.setdefault(name, []).append(e.names[0])
            told = "; ".join(f"{', '.join(ps[:3])}{', ...' if len(ps) > 3 else ''}: "
                             f"{found[name]} steps" for name, ps in names.items())
            raise ValueError(f"{path!r}: parameters that this engine keeps in one flat "
                             f"parameter ({fp.name!r}) have different Adam step counts in the "
                             f"checkpoint ({told}; the saving engine skipped a step "
                             "for some only, as it does for a flat parameter without a "
                             "gradient, or update_timing='backward' for one with an overflow); load it "
                             "into an engine that groups them as the saving one did (the same "
                             "unit_classes)")
        steps[fp] = next(iter(found.values()), 0)
    return steps
