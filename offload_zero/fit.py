""""Will it fit": each placement's bytes per tier, activations included, against the memory a
machine has; and the ``offload-zero estimate`` command with its budget flags.

[Note: fit verdict]
A placement (stage x offload) needs, per node: on each device its model states and engine
extras (:mod:`offload_zero.estimator`) plus one micro-batch's activations
(:mod:`offload_zero.activations`, [Note: activation arithmetic]); in host memory its host bytes
(all of the node's ranks); on NVMe its files (all of the node's ranks). It fits when every
tier's need is at most that tier's budget; otherwise it is short on each tier over budget by
``need - budget`` bytes. Where the device is the CPU (``--cpu-device``, or ``offload="auto"``
on a CPU-only machine) device and host are one memory and their sum is checked against the host
budget (tier ``device+host``). A tier without a budget (``None``) is not checked. Budgets are
taken exactly as given: no headroom is subtracted (``offload="auto"`` subtracts its own before
calling :func:`shortfall`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Dict, List, Optional

import torch

from offload_zero import estimator
from offload_zero.activations import ActivationBytes, DecoderShape, activation_bytes
from offload_zero.tables import SIZE_FORMS, TIERS, parse_bytes  # noqa: F401  (re-exported)

@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether one placement fits.

    Fields: stage, offload (the placement); need: ``{tier: bytes}`` per node (device: per
    device, or all of the node's ranks where device and host are one memory), activations
    included; activation_bytes: the activations in ``need["device"]``;
    short: ``{tier: bytes}`` over budget (empty: it fits); unchecked: tiers without a budget.
    """

    stage: int
    offload: str
    need: Dict[str, int]
    activation_bytes: int
    short: Dict[str, int]
    unchecked: tuple = ()

    @property
    def fits(self) -> bool:
        """True when no checked tier is over budget."""
        return not self.short

    def text(self, unit: float = 1e9, unit_name: str = "GB") -> str:
        """``"fits"`` or ``"short by 3.2 GB on device, 1.0 GB on host"`` (in ``unit`` bytes)."""
        if self.fits:
            return "fits"
        return "short by " + ", ".join(f"{b / unit:.1f} {unit_name} on {t}"
                                       for t, b in self.short.items())

    def to_dict(self) -> dict:
        """JSON-ready; bytes."""
        return {"stage": self.stage, "offload": self.offload, "fits": self.fits,
                "need": self.need, "activation_bytes": self.activation_bytes,
                "short": self.short, "unchecked": list(self.unchecked)}


def shortfall(need: Dict[str, int], budgets: Dict[str, Optional[int]]) -> Dict[str, int]:
    """Bytes over budget per tier, by [Note: fit verdict]: ``need`` and ``budgets`` map "device",
    "host", "nvme" to bytes (a budget ``None`` is not checked); ``budgets["shared"]`` True:
    device and host are one memory, checked together against ``budgets["host"]`` as
    ``"device+host"``. Returns ``{tier: bytes short}``, empty when it fits."""
    short = {}
    tiers = ["nvme"]
    if budgets.get("shared"):
        if budgets.get("host") is not None and need["device"] + need["host"] > budgets["host"]:
            short["device+host"] = need["device"] + need["host"] - budgets["host"]
    else:
        tiers = ["device", "host", "nvme"]
    for t in tiers:
        if budgets.get(t) is not None and need[t] > budgets[t]:
            short[t] = need[t] - budgets[t]
    return dict(sorted(short.items(), key=lambda kv: TIERS.index(kv[0].split("+")[0])))


def placement_need(placement: "estimator.Placement", activations: int,
                   per_node: bool = True) -> Dict[str, int]:
    """``{tier: bytes}`` a placement needs with ``activations`` bytes per device added to its
    device tier: per device / per node (``per_node``, the estimate's table) or per rank
    (``per_node=False``, what ``offload="auto"`` checks on one rank). This and
    :func:`shortfall` are what ``offload="auto"`` and the ``estimate`` command both use."""
    host = placement.host_bytes if per_node else placement.host_bytes_per_rank
    nvme = placement.nvme_bytes if per_node else placement.nvme_bytes_per_rank
    return {"device": placement.device_bytes + activations, "host": host, "nvme": nvme}


def placement_shortfall(placement: "estimator.Placement", budgets: Dict[str, Optional[int]],
                        activations: int = 0, per_node: bool = False):
    """``(need, short)`` of one placement: :func:`placement_need` (``activations`` bytes per
    device, e.g. ``activation_bytes(...).total``; per rank unless ``per_node``) checked by
    :func:`shortfall` against ``budgets`` (``{"device", "host", "nvme", "shared"}``, the dict
    :func:`offload_zero.placement.measure_budgets` returns). The one call ``offload="auto"``
    needs to count activations as ``offload-zero estimate`` does."""
    need = placement_need(placement, activations, per_node)
    return need, shortfall(need, budgets)


def verdicts(est: "estimator.MemoryEstimate", activations: ActivationBytes,
             budgets: Dict[str, Optional[int]]) -> List[Verdict]:
    """One :class:`Verdict` per row of ``est.table`` that the engine runs (stages 1-3),
    ``budgets`` as for :func:`shortfall` (device per device, host and NVMe per node)."""
    shared = bool(budgets.get("shared"))
    unchecked = tuple(t for t in TIERS if budgets.get(t) is None
                      and not (shared and t == "device" and budgets.get("host") is not None))
    out = []
    for p in est.table:
        if not p.engine_supported:
            continue
        need = placement_need(p, activations.total)
        if shared:  # every rank of the node is a process on the one memory
            need["device"] *= est.gpus_per_node
        out.append(Verdict(p.stage, p.offload, need, activations.total,
                           shortfall(need, budgets), unchecked))
    return out


def decoder_shape(model_or_params) -> DecoderShape:
    """The :class:`DecoderShape` of a checkpoint folder or preset (its config, read on the meta
    device), or the shape :func:`offload_zero.estimator.assumed_layout` assumes for a parameter
    count. Raises ValueError (bad input, as the estimator) or NotImplementedError (a config
    that is not a Llama-style decoder)."""
    if isinstance(model_or_params, str):
        model, _ = estimator.preset_or_checkpoint(model_or_params)
        return DecoderShape.from_config(model.config)
    layout = estimator.assumed_layout(estimator.param_count(model_or_params))
    layers = max(1, sum(1 for spec in layout if spec.unit != -1))
    return DecoderShape.assumed(layers, estimator.ASSUMED_ASPECT * layers, estimator.ASSUMED_VOCAB)


# -- command line: offload-zero estimate (the estimator's flags and these) ----------------------
DESCRIPTION = estimator.DESCRIPTION + """
will it fit: give the machine's memory and the micro-batch, and each placement (stage x
offload) gets a verdict, fits or short by X on a tier, with activations on the device counted by
the per-layer arithmetic of Korthikanti et al., 2022, for Llama-style Hugging Face decoders in
eager attention (docs/estimate.md):
  offload-zero estimate --model ./llama --gpu-memory 24GB --host-memory 64GB --nvme-free 500GB \\
      --batch-size 4 --seq-len 2048 --activation-checkpointing
"""

_BUDGET_FLAGS = (("gpu_memory", "--gpu-memory", "device"), ("host_memory", "--host-memory", "host"),
                 ("nvme_free", "--nvme-free", "nvme"))


def _size_arg(text: str) -> int:
    """argparse type of the budget flags: :func:`parse_bytes` (argparse names the flag)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``offload-zero estimate``: the estimator's, and the budgets and micro-batch of
    [Note: fit verdict]."""
    estimator.add_arguments(parser)
    fit = parser.add_argument_group("will it fit (activations included)")
    fit.add_argument("--gpu-memory", type=_size_arg, metavar="SIZE",
                     help="memory of each GPU, e.g. 24GB or 80GiB")
    fit.add_argument("--host-memory", type=_size_arg, metavar="SIZE",
                     help="host RAM per node, e.g. 64GB")
    fit.add_argument("--nvme-free", type=_size_arg, metavar="SIZE",
                     help="free space on the NVMe folder per node, e.g. 500GB")
    fit.add_argument("--batch-size", type=int, metavar="B", help="micro-batch per GPU (sequences)")
    fit.add_argument("--seq-len", type=int, metavar="T", help="tokens per sequence")
    fit.add_argument("--activation-checkpointing", action="store_true",
                     help="blocks recomputed in backward (the engine's activation_checkpointing)")


def run(args: argparse.Namespace):
    """Run ``offload-zero estimate``: the estimator's table (or JSON), then, with budgets, one
    verdict per placement. Returns the :class:`~offload_zero.estimator.MemoryEstimate`.

    Raises:
        ValueError: budgets without ``--batch-size`` and ``--seq-len`` (or one of the two
            without the other), ``--gpu-memory`` with ``--cpu-device``, or what the estimator
            raises.
    """
    budgets = {tier: getattr(args, dest) for dest, _, tier in _BUDGET_FLAGS}
    has_batch = (args.batch_size, args.seq_len) != (None, None)
    if all(b is None for b in budgets.values()) and not has_batch:
        return estimator.run(args)
    if None in (args.batch_size, args.seq_len):
        raise ValueError("--batch-size and --seq-len are both needed for the verdict (the "
                         f"activations); got --batch-size {args.batch_size} --seq-len "
                         f"{args.seq_len}")
    if args.cpu_device and budgets["device"] is not None:
        raise ValueError(f"--gpu-memory {budgets['device']} with --cpu-device: the device is "
                         "the host's memory; give --host-memory only")
    budgets["shared"] = args.cpu_device
    est = estimator.estimate_from_args(args)
    dtype = estimator.resolve_dtype(args.dtype)
    shape = decoder_shape(args.params if args.params is not None else args.model)
    acts = activation_bytes(shape, args.batch_size, args.seq_len, dtype,
                            args.activation_checkpointing)
    rows = verdicts(est, acts, budgets)
    if args.json:
        data = est.to_dict()
        data["fit"] = {"budgets": budgets, "batch_size": args.batch_size,
                       "seq_len": args.seq_len,
                       "activation_checkpointing": args.activation_checkpointing,
                       "activations": {**dataclasses.asdict(acts), "total": acts.total},
                       "verdicts": [v.to_dict() for v in rows]}
        print(json.dumps(data, indent=2))
    else:
        print(estimator.format_table(est, args.unit))
        print(format_verdicts(rows, acts, budgets, args, args.unit))
    return est


def format_verdicts(rows: List[Verdict], acts: ActivationBytes, budgets: dict, args,
                    unit: str = "GB") -> str:
    """The verdicts as text: a line of budgets and activations, then one line per placement."""
    scale = estimator._UNITS[unit]
    shown = ", ".join(f"{flag} {budgets[tier] / scale:.1f}" for _, flag, tier in _BUDGET_FLAGS
                      if budgets[tier] is not None)
    ckpt = "with" if args.activation_checkpointing else "without"
    lines = ["", f"will it fit ({unit}): {shown}; activations {acts.total / scale:.2f} per device "
                 f"(micro-batch {args.batch_size} x {args.seq_len} tokens, eager attention, "
                 f"{ckpt} activation checkpointing)",
             f"  {'stage':<6}{'offload':<8}{'device':>10}{'host':>10}{'NVMe':>10}  verdict"]
    for v in rows:
        lines.append(f"  {v.stage:<6}{v.offload:<8}{v.need['device'] / scale:>10.1f}"
                     f"{v.need['host'] / scale:>10.1f}{v.need['nvme'] / scale:>10.1f}  "
                     f"{v.text(scale, unit)}")
    if rows and rows[0].unchecked:
        lines.append(f"not checked (no budget given): {', '.join(rows[0].unchecked)}")
    return "\n".join(lines)
