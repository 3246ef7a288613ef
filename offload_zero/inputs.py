"""Forward's inputs as ``engine(...)`` passes them to the model: tensors moved to the engine's
device, floating-point ones cast to the compute dtype (as FSDP's mixed precision casts forward
inputs); lists, tuples and dicts are walked, anything else passes unchanged."""
from __future__ import annotations

import torch


def to_device(obj, device: torch.device, dtype: torch.dtype):
    """``obj`` with every tensor in it (inside lists, tuples and dicts, at any depth) on
    ``device``, floating-point ones in ``dtype``; a tensor already there is returned as it is
    (no copy). Containers are rebuilt with their own type; other objects are returned
    unchanged."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.dtype != dtype:
            return obj.to(device=device, dtype=dtype)
        return obj.to(device) if obj.device != device else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device, dtype) for k, v in obj.items()}
    return obj
