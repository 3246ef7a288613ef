"""Host-side optimizer: the C++ Adam/AdamW kernel and its ``torch.optim`` facade.

- :func:`adam_step_` — one Adam/AdamW step over flat CPU buffers (what the engine calls).
- :class:`CPUAdam` — the same kernel as a drop-in ``torch.optim.Optimizer``.
- :func:`selected_isa` — which instruction set the kernel runs (scalar, avx2, avx512).
- :func:`set_num_threads` / :func:`get_num_threads` — the kernel's default thread count.
- :class:`LossScaler` — the fp16 loss scale and its dynamic schedule (the engine's ``loss_scale=``).
- :class:`EngineOptimizer` — ``engine.optimizer``: the engine's parameter groups as a
  ``torch.optim.Optimizer``, for LR schedulers (:mod:`offload_zero.optim.facade`).
"""
from offload_zero.optim.cpu_adam import CPUAdam
from offload_zero.optim.facade import EngineOptimizer
from offload_zero.optim.kernel import (adam_step_, available_isas, get_num_threads,
                                       selected_isa, set_num_threads)
from offload_zero.optim.loss_scale import LossScaler

__all__ = ["CPUAdam", "adam_step_", "selected_isa", "available_isas", "set_num_threads",
           "get_num_threads", "LossScaler", "EngineOptimizer"]
