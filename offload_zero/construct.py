"""What ``OffloadEngine(...)`` does before and around the build of its parts: the checks of
its arguments, the config (``offload="auto"`` resolved to a placement), the parameter groups,
the communicator, and the build itself, guarded so that a failure releases what it allocated.

Nothing here holds the engine: :func:`resolve` returns what the engine stores, and
:func:`build_guarded` hands the built parts to a callable of the engine's own.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import torch.nn as nn

from offload_zero.build import EngineParts, build_parts
from offload_zero.comm import Comm, init_from_env
from offload_zero.config import EngineConfig, check_number, warn_user
from offload_zero.lifetime import WRAPPED, not_replacing, release
from offload_zero.memory.accounting import TierAccountant
from offload_zero.memory.aligned import aligned_empty
from offload_zero.update import rules
from offload_zero.update.state import UpdateStates

if TYPE_CHECKING:
    from offload_zero.optim.loss_scale import LossScaler
    from offload_zero.placement import PlacementChoice


@dataclasses.dataclass
class Resolved:
    """``OffloadEngine``'s arguments resolved, before anything is allocated.

    Fields: ``config`` (the :class:`EngineConfig`, ``offload="auto"`` replaced by the tiers
    and timing chosen), ``comm`` (the :class:`offload_zero.comm.Comm`), ``placement`` (None, or
    with ``offload="auto"`` the :class:`offload_zero.placement.PlacementChoice`), ``groups``
    and ``group_of`` (:func:`offload_zero.optim.facade.resolve_param_groups`'s result),
    ``defaults`` (the groups' default ``lr``, ``betas``, ``eps``, ``weight_decay``); and the
    bookkeeping the build starts from: ``acct`` (bytes per tier, empty), ``states`` (each flat
    parameter's update state), ``loss_scaler`` (``config.make_loss_scaler()``: None, or fp16's).
    """

    config: EngineConfig
    comm: Comm
    placement: Optional["PlacementChoice"]
    groups: List[dict]
    group_of: Dict[int, int]
    defaults: dict
    acct: TierAccountant
    states: UpdateStates
    loss_scaler: Optional["LossScaler"]


def check_arguments(model, kwargs: dict) -> None:
    """Check what ``OffloadEngine`` must refuse before its config is made: ``model``
    (:func:`check_model`) and ``kwargs``, the keywords beyond its named arguments (each must be
    an :class:`EngineConfig` field).

    Raises:
        ValueError: a bad ``model``; an unknown keyword (the valid ones listed).
        TypeError: ``step_in_backward``/``step_in_forward``, naming the ``update_timing`` to
            pass instead.
    """
    check_model(model)
    rules.refuse_old_switches(kwargs)  # (TypeError naming the update_timing to use)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        valid = sorted(fields | {'process_group', 'timeout_s', 'param_groups'})
        raise ValueError(f"OffloadEngine got unknown keyword argument(s) {unknown}; valid "
                         f"ones: {valid}")


def resolve(model: nn.Module, cfg: EngineConfig, process_group, timeout_s,
            param_groups) -> Resolved:
    """Resolve ``OffloadEngine``'s arguments (see the class's docstring) once
    :func:`check_arguments` passed and its config ``cfg`` is made (there, so that the config's
    warnings name the caller's line).

    ``timeout_s``: seconds, a finite number > 0. The process group is initialised from the
    environment (torchrun) if needed.

    Raises:
        ValueError: a bad parameter group (from ``resolve_param_groups``); a bad
            ``timeout_s``; with ``offload="auto"``, nothing fits.
    """
    from offload_zero.optim.facade import resolve_param_groups
    defaults = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    groups, group_of = resolve_param_groups(model, param_groups, defaults)
    timeout_s = check_number("timeout_s", timeout_s, low=0.0, low_inclusive=False)
    init_from_env(timeout_s, cfg.device)
    comm = Comm(process_group, device=cfg.device, check_collectives=cfg.check_collectives,
                timeout_s=timeout_s)
    placement = None
    if cfg.offload == "auto":
        placement, cfg = _auto_placement(model, cfg, comm)
    return Resolved(cfg, comm, placement, groups, group_of, defaults, TierAccountant(comm.rank),
                    UpdateStates(comm.rank), cfg.make_loss_scaler())


def check_model(model) -> None:
    """Raise ValueError unless ``model`` is an ``nn.Module`` that neither accelerate prepared
    nor another engine wraps (each message says what to do instead)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "_is_accelerate_prepared", None) is True:
        raise ValueError(f"model {type(model).__name__} was prepared by accelerate; wrap "
                         "the model itself (the engine places and shards it), and prepare "
                         "only the data loader")
    if getattr(model, WRAPPED, False):
        raise ValueError(f"model {type(model).__name__} is already wrapped by an "
                         "OffloadEngine: its parameters live in that engine (and go with "
                         "it on close()). Build the model afresh, or load the first "
                         "engine's full_state_dict() into a new one")


def _auto_placement(model: nn.Module, cfg: EngineConfig, comm: Comm):
    """``offload="auto"``: ``(the placement chosen, cfg with its tiers, update timing, moment
    format and host cache)`` (see :func:`offload_zero.placement.choose_placement`; ValueError when nothing
    fits)."""
    from offload_zero.placement import choose_placement
    choice = choose_placement(
        model, cfg.stage, comm.world_size, cfg.dtype, cfg.prefetch, cfg.unit_classes,
        cfg.device, cfg.path, cfg.max_device_bytes, cfg.max_host_bytes,
        update_timing=cfg.update_timing, tail_state_in_host=cfg.tail_state_in_host,
        leaf_modules=cfg.leaf_modules, workload=cfg.auto_workload, comm=comm,
        host_cache_bytes=cfg.host_cache_bytes, moment_dtype=cfg.moment_dtype,
        aio_backend=cfg.aio_backend, optimizer_prefetch=cfg.optimizer_prefetch,
        master_dtype=cfg.master_dtype)
    if cfg.host_cache_bytes not in (0, "auto") and choice.offload_optimizer != "nvme":
        warn_user(f"host_cache_bytes={cfg.host_cache_bytes} is not used: offload='auto' put the "
                  f"optimizer state on {choice.offload_optimizer!r}, not NVMe (set offload='nvme' "
                  "to keep part of it in host memory)")
    return choice, dataclasses.replace(
        cfg, offload_optimizer=choice.offload_optimizer, offload_param=choice.offload_param,
        update_timing=choice.update_timing, moment_dtype=choice.moment_dtype,
        host_cache_bytes=choice.host_cache_bytes)


def build_guarded(model: nn.Module, r: Resolved, load_from, init: Optional[str], strict: bool,
                  take: Callable[[EngineParts], None]) -> dict:
    """Build the engine's parts over ``model`` (:func:`offload_zero.build.build_parts`) with
    what :func:`resolve` returned (``r``), from its initial values (``load_from``, ``init``,
    ``strict``: see :func:`offload_zero.stream_load.initial_values`, checked before anything is
    allocated), then ``take(parts)``. An error in either releases every part built so far and is raised
    (an error in releasing is logged); the initial values' files are closed either way.
    Host buffers are aligned, and pinned with a CUDA device.

    Returns the load report, ``{"missing_keys": [...], "unexpected_keys": [...]}`` (empty
    lists without ``load_from``). Raises what ``initial_values``, the build or ``take`` raise.
    """
    from offload_zero.stream_load import initial_values
    cfg, acct = r.config, r.acct
    pin = cfg.device.type == "cuda"  # (host buffers: aligned, and pinned for a CUDA device)
    initial = initial_values(model, load_from, init, strict)
    load_report = {"missing_keys": list(getattr(initial, "missing_keys", [])),
                   "unexpected_keys": list(getattr(initial, "unexpected_keys", []))}
    parts = EngineParts()
    try:
        build_parts(parts, model, cfg, r.comm, acct,
                    lambda n, dt: aligned_empty(n, dt, pin=pin), initial, r.states, r.loss_scaler)
        take(parts)
    except BaseException as exc:
        with not_replacing(exc, r.comm.rank):
            release(acct, *releasable(parts))
        raise
    finally:
        if initial is not None:
            initial.close()
    return load_report


def releasable(parts: EngineParts) -> tuple:
    """What :func:`offload_zero.lifetime.release` closes of ``parts``, after the accountant:
    ``(store, param_home, swapper, pools, scheduler, grads, flat_params)`` (any may be None or
    empty)."""
    return (parts.store, parts.param_home, parts.swapper, parts.pools, parts.scheduler,
            parts.grads, parts.flat_params)
