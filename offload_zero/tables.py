"""The project's fixed name tables, one of each: tiers, compute dtypes and NVMe I/O backends.

Every module that lists an offload choice, a dtype name or an I/O backend imports it from here,
so a new entry is made in one place.
"""
from __future__ import annotations

import re
from typing import Dict, Optional

import torch

TIER_OF_OFFLOAD: Dict[str, str] = {"none": "device", "cpu": "host", "nvme": "nvme"}
"""An offload choice (``offload_optimizer`` / ``offload_param``) -> the tier it names."""
TIERS = tuple(TIER_OF_OFFLOAD.values())
"""Tier names, nearest the compute first: ``("device", "host", "nvme")``."""
OFFLOADS = tuple(TIER_OF_OFFLOAD)
"""Offload choices of one tier: ``("none", "cpu", "nvme")``."""

DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}
"""Compute dtypes by short name (the CLI's ``--dtype``)."""
DTYPE_LONG_NAMES: Dict[str, torch.dtype] = {str(dt).split(".")[1]: dt for dt in DTYPES.values()}
"""The same dtypes by torch's name (``"float32"``, ``"bfloat16"``, ``"float16"``: a
checkpoint's ``"dtype"``)."""
SHORT_NAME: Dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}
"""A compute dtype -> its short name."""

AIO_BACKENDS = ("auto", "libaio", "threads")
"""NVMe I/O backends: ``"auto"`` (libaio where it works, else threads), ``"libaio"``,
``"threads"``."""


def dtype_of(value) -> torch.dtype:
    """A compute dtype from a torch dtype, a short name (``"bf16"``) or torch's name
    (``"bfloat16"``), case-insensitive. Raises ValueError naming the value and the choices."""
    if isinstance(value, torch.dtype) and value in SHORT_NAME:
        return value
    if isinstance(value, str):
        key = value.lower()
        if key in DTYPES or key in DTYPE_LONG_NAMES:
            return DTYPES.get(key) or DTYPE_LONG_NAMES[key]
    raise ValueError(f"dtype={value!r} is not valid; choose one of {tuple(DTYPES)} "
                     f"or {tuple(SHORT_NAME)}")


def default_offload_param(offload: str, stage: int) -> str:
    """Where ``offload=`` alone puts parameter shards: NVMe for ``"nvme"`` at stage 3, else the
    device (``"none"``)."""
    return "nvme" if (offload == "nvme" and stage == 3) else "none"


# units of a size (the command line's, and max_shard_size as transformers reads it)
SIZE_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
              "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
SIZE_FORMS = "bytes (e.g. 500000000) or a number with B, KB, MB, GB, TB (powers of 1000) or " \
             "KiB, MiB, GiB, TiB (powers of 1024), e.g. 24GB, 64GiB, 1.5TB"


def parse_bytes(text: str, name: Optional[str] = None) -> int:
    """Bytes in a size such as ``"24GB"`` (24e9), ``"64GiB"`` (64 * 2**30), ``"1.5TB"`` or
    ``"0"``; units are case-insensitive, a bare number is whole bytes (a fraction of a unit
    rounds down; a bare fraction such as ``"0.5"``, likely a unit left out, is refused).

    Raises:
        ValueError: not one of those forms, or negative, naming ``name``, the value and the
            valid forms (``name`` None: the message starts at the value).
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or (unit and unit not in SIZE_UNITS):
        raise ValueError(f"{name + ' ' if name else ''}{text!r} is not a size; give {SIZE_FORMS}")
    if not unit and float(m.group(1)) != int(float(m.group(1))):
        raise ValueError(f"{name + ' ' if name else ''}{text!r} is not a size: a bare number is "
                         f"whole bytes (a unit left out?); give {SIZE_FORMS}")
    return int(float(m.group(1)) * SIZE_UNITS.get(unit or "B"))
