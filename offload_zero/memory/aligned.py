"""Host buffers whose first byte sits on a 4096-byte boundary.

O_DIRECT reads and writes (the NVMe tier, see ``swapper.py``) need the user buffer, the file
offset and the transfer length to be multiples of the logical block size of the device. 4096
bytes covers every device we target, so every host buffer that may cross the NVMe tier is
allocated here.

How: over-allocate a ``uint8`` tensor by ``ALIGNMENT - 1`` bytes, slice it at the first aligned
address and reinterpret the slice as the requested dtype. The slice is a view, so its storage
(the whole over-allocated block) stays alive as long as the returned tensor does.
"""
from __future__ import annotations

import torch

__all__ = ["ALIGNMENT", "aligned_empty", "is_aligned"]

ALIGNMENT = 4096
"""Bytes. Required alignment of buffer addresses, file offsets and lengths for O_DIRECT."""


def is_aligned(tensor: torch.Tensor, alignment: int = ALIGNMENT) -> bool:
    """Whether ``tensor`` can be handed to O_DIRECT as is.

    Args:
        tensor: any tensor.
        alignment: bytes, a power of two.

    Returns:
        True when the tensor is a contiguous CPU tensor, its ``data_ptr()`` is a multiple of
        ``alignment`` and its size in bytes is a multiple of ``alignment``.
    """
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.data_ptr() % alignment == 0
        and tensor.numel() * tensor.element_size() % alignment == 0
    )


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """Allocate an uninitialised 1-D CPU tensor whose data starts on a 4096-byte boundary.

    Args:
        numel: number of elements (>= 0). The result has exactly this many elements; its size
            in bytes is ``numel * itemsize`` and is *not* rounded up (round ``numel`` yourself
            when the buffer must also have an aligned length for O_DIRECT).
        dtype: any fixed-size torch dtype (float32, bfloat16, uint8, int64, ...).
        pin: when CUDA is available, allocate from page-locked (pinned) host memory so
            host<->device copies can run asynchronously. Without CUDA it is a no-op.

    Returns:
        A contiguous tensor of shape ``(numel,)`` and dtype ``dtype`` on the CPU with
        ``data_ptr() % ALIGNMENT == 0``. It is a view of a slightly larger ``uint8`` storage
        (at most ``ALIGNMENT - 1`` extra bytes) which it keeps alive.

    Raises:
        ValueError: ``numel`` is negative or not an int, or ``dtype`` is not a torch dtype.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"aligned_empty: numel must be an int >= 0, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"aligned_empty: dtype must be a torch.dtype, got {dtype!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    pin_memory = bool(pin) and torch.cuda.is_available()
    raw = torch.empty(nbytes + ALIGNMENT - 1, dtype=torch.uint8, pin_memory=pin_memory)
    offset = (-raw.data_ptr()) % ALIGNMENT
    # Allocators hand out at least 16-byte aligned blocks, so ``offset`` is a multiple of every
    # itemsize and ``view(dtype)`` below is legal.
    flat_bytes = raw[offset: offset + nbytes]
    out = flat_bytes.view(dtype)
    if out.data_ptr() % ALIGNMENT != 0:  # pragma: no cover - broken allocator invariant
        raise RuntimeError(
            f"aligned_empty: internal error, data_ptr {out.data_ptr():#x} not aligned "
            f"to {ALIGNMENT} after slicing at offset {offset}"
        )
    return out
