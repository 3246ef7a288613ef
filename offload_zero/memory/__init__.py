"""Host memory and the NVMe tier.

- ``aligned``: ``aligned_empty`` allocates 4096-byte aligned (optionally pinned) host tensors.
- ``swapper``: ``Swapper`` moves such tensors to and from files with async O_DIRECT I/O
  (Linux AIO through the ``libaio`` bindings, or a thread pool); failures raise ``SwapIOError``.
"""
from offload_zero.memory.aligned import ALIGNMENT, aligned_empty
from offload_zero.memory.swapper import SwapHandle, SwapIOError, Swapper

__all__ = ["ALIGNMENT", "aligned_empty", "Swapper", "SwapHandle", "SwapIOError"]
