"""offload-zero: ZeRO stage 1/2/3 data parallelism with CPU and NVMe offload for PyTorch.

Public entry points:

- :class:`offload_zero.engine.OffloadEngine` wraps any ``torch.nn.Module`` and trains it with
  its parameters partitioned into flat shards, gradients reduced to host fp32 shards, and fp32
  master weights and Adam moments on the tier the user picks (device, host RAM or NVMe files).
- :func:`offload_zero.from_deepspeed_config` builds an engine from a DeepSpeed JSON config.
- :class:`offload_zero.hf.OffloadTrainer` is a ``transformers.Trainer`` that trains through the
  engine (imported from :mod:`offload_zero.hf`, so that this package does not import transformers).
- :class:`offload_zero.optim.CPUAdam` is the C++ Adam/AdamW as a ``torch.optim.Optimizer``.
"""
from offload_zero.engine import OffloadEngine  # noqa: F401
from offload_zero.deepspeed_config import from_deepspeed_config  # noqa: F401
from offload_zero.optim import CPUAdam  # noqa: F401

__all__ = ["OffloadEngine", "CPUAdam", "from_deepspeed_config"]
__version__ = "0.1.0"
