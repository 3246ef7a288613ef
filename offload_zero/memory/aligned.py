"""Host buffers whose first byte sits on a 4096-byte boundary.

O_DIRECT reads and writes (the NVMe tier, see ``swapper.py``) need the user buffer, the file
offset and the transfer length to be multiples of the logical block size of the device. 4096
bytes covers every device we target, so every host buffer that may cross the NVMe tier is
allocated here.

How: over-allocate a ``uint8`` tensor by ``ALIGNMENT - 1`` bytes, slice it at the first aligned
address and reinterpret the slice as the requested dtype. The slice is a view, so its storage
(the whole over-allocated block) stays alive as long as the returned tensor does.

[Note: pinning and the locked-memory limit]
Pinned (page-locked) host memory cannot be swapped out, and a process may lock at most its
``RLIMIT_MEMLOCK`` soft limit unless it holds ``CAP_IPC_LOCK`` (containers often run with a
64 KiB or 8 MiB limit and without the capability), although NVIDIA's driver usually pins
without charging it. ``aligned_empty(pin=True)`` checks the request against the limit first:
the bytes this process currently holds pinned through ``aligned_empty`` (``pinned_bytes()``:
counted when a pinned block is allocated, released when its storage is freed) plus the new
block against a finite soft limit. Over it, it warns (``RuntimeWarning`` naming the limit and
the bytes wanted) and still tries; when the pinned allocation fails it warns and returns an
unpinned aligned buffer: correct, only host<->device copies from it are synchronous, and the
engine never fails mid-step for it. The check is the pure function ``_pin_allowed``. Each of the two warnings is issued once per
process (a pool of buffers would otherwise repeat it per buffer). CUDA's host caching allocator
keeps freed pinned blocks for reuse, so the bytes it really holds can exceed ``pinned_bytes()``.
``OFFLOAD_ZERO_MEMLOCK_CHECK=0`` skips the limit check (for drivers that do not charge pinned
allocations to the limit); a failing pinned allocation still falls back.

[Note: huge pages]
An O_DIRECT transfer pins the pages of its user buffer in the kernel for its duration
(get_user_pages) and releases them after: per 4 KiB page, so a step that moves gigabytes
spends a measurable share of its CPU time there (a few percent of the step on a 2-vCPU VM).
Unpinned buffers of at least ``HUGE_PAGE`` bytes therefore start on a 2 MiB boundary and are
advised ``MADV_HUGEPAGE`` before their first touch: with transparent huge pages in "madvise"
or "always" mode they fault in as 2 MiB pages, 512 times fewer for the kernel to pin. Where
the advice is unavailable or refused (THP "never", not Linux) nothing changes but speed.
Pinned (CUDA) buffers are left as the driver makes them.
"""
from __future__ import annotations

import os
import resource
import sys
import threading
import warnings
import weakref
from typing import Optional

import torch

__all__ = ["ALIGNMENT", "HUGE_PAGE", "aligned_empty", "is_aligned", "pinned_bytes"]

ALIGNMENT = 4096
"""Bytes. Required alignment of buffer addresses, file offsets and lengths for O_DIRECT."""

HUGE_PAGE = 2 * 1024 * 1024
"""Bytes. Unpinned buffers of at least this size start on this boundary and are advised as
transparent huge pages (see [Note: huge pages])."""


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
            host<->device copies can run asynchronously. Without CUDA it is a no-op. When
            pinning would exceed the locked-memory limit or fails, a ``RuntimeWarning`` is
            issued and the buffer is returned unpinned (see
            [Note: pinning and the locked-memory limit]).

    Returns:
        A contiguous tensor of shape ``(numel,)`` and dtype ``dtype`` on the CPU with
        ``data_ptr() % ALIGNMENT == 0``. It is a view of a slightly larger ``uint8`` storage
        (at most ``ALIGNMENT - 1`` extra bytes) which it keeps alive. An unpinned buffer of
        ``HUGE_PAGE`` bytes or more starts on a ``HUGE_PAGE`` boundary instead (at most
        ``HUGE_PAGE - 1`` extra bytes) and is advised as huge pages (see [Note: huge pages]).

    Raises:
        ValueError: ``numel`` is negative or not an int, or ``dtype`` is not a torch dtype.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"aligned_empty: numel must be an int >= 0, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"aligned_empty: dtype must be a torch.dtype, got {dtype!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    raw_nbytes = nbytes + ALIGNMENT - 1
    raw = _try_pinned(raw_nbytes) if pin and torch.cuda.is_available() else None
    align = ALIGNMENT
    if raw is None:
        if nbytes >= HUGE_PAGE:
            align = HUGE_PAGE
            raw_nbytes = nbytes + HUGE_PAGE - 1
        raw = torch.empty(raw_nbytes, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % align
    if align == HUGE_PAGE:
        _advise_huge(raw.data_ptr() + offset, nbytes)
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


# ---- pinning ---------------------------------------------------------------------------------

_pinned_lock = threading.Lock()
_pinned_total = 0  # bytes of live storages pinned through aligned_empty (guarded by the lock)
_CAP_IPC_LOCK = 14  # bit of the capability in /proc/self/status CapEff
_warned: set = set()  # "limit" / "failed": warnings already issued by this process


def pinned_bytes() -> int:
    """Bytes this process currently holds pinned through ``aligned_empty`` (live storages,
    over-allocation included). See [Note: pinning and the locked-memory limit]."""
    with _pinned_lock:
        return _pinned_total


def _pin_allowed(wanted_bytes: int, already_pinned: int, limit: Optional[int]) -> bool:
    """Whether pinning ``wanted_bytes`` more keeps this process within ``limit``.

    Args:
        wanted_bytes: bytes of the new pinned block.
        already_pinned: bytes already pinned (by ``aligned_empty``).
        limit: the soft ``RLIMIT_MEMLOCK`` in bytes, or None when there is no limit
            (unlimited, or the process holds ``CAP_IPC_LOCK``).
    """
    return limit is None or already_pinned + wanted_bytes <= limit


def _has_cap_ipc_lock() -> bool:
    """Whether the effective capabilities include CAP_IPC_LOCK (False when unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _memlock_limit() -> Optional[int]:
    """The locked-memory limit that applies to this process in bytes, or None for none
    (unlimited, CAP_IPC_LOCK held, or the check disabled by OFFLOAD_ZERO_MEMLOCK_CHECK=0)."""
    if os.environ.get("OFFLOAD_ZERO_MEMLOCK_CHECK", "1").strip() == "0":
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft < 0 or _has_cap_ipc_lock():
        return None
    return soft


def _empty_pinned(nbytes: int) -> torch.Tensor:
    """A pinned uint8 host tensor of ``nbytes`` (CUDA's host allocator: cudaHostAlloc)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _release_pinned(nbytes: int) -> None:
    global _pinned_total
    with _pinned_lock:
        _pinned_total -= nbytes


def _warn_once(reason: str, message: str) -> None:
    with _pinned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(message, RuntimeWarning, stacklevel=4)  # the caller of aligned_empty


def _try_pinned(nbytes: int) -> Optional[torch.Tensor]:
    """A pinned block of ``nbytes``, or None after a RuntimeWarning when the locked-memory limit
    would be exceeded or the pinned allocation fails."""
    global _pinned_total
    limit = _memlock_limit()
    with _pinned_lock:  # reserve first, so concurrent callers cannot both squeeze in
        already = _pinned_total
        allowed = _pin_allowed(nbytes, already, limit)
        if allowed:
            _pinned_total += nbytes
    if not allowed:
        # NVIDIA's driver pins without charging RLIMIT_MEMLOCK on most systems (containers with
        # a 64 KiB limit pin gigabytes), so a low limit is a warning, not a refusal: the pin is
        # still tried, and only a pin that fails falls back to unpinned memory.
        _warn_once("limit",
                   f"aligned_empty: pinning {nbytes} bytes: {already} already pinned + "
                   f"{nbytes} = {already + nbytes} bytes wanted exceeds the locked-memory limit "
                   f"RLIMIT_MEMLOCK (soft) of {limit} bytes; trying anyway, and if the pin "
                   f"fails the buffer is unpinned and host<->device copies from it are "
                   f"synchronous (raise the limit with `ulimit -l` or grant CAP_IPC_LOCK; "
                   f"later buffers over the limit give no further warning)")
        with _pinned_lock:
            _pinned_total += nbytes
    try:
        raw = _empty_pinned(nbytes)
    except RuntimeError as exc:
        _release_pinned(nbytes)
        message = " ".join(str(exc).split())
        _warn_once("failed",
                   f"aligned_empty: pinning {nbytes} bytes failed ({message}); returning "
                   f"unpinned memory, so host<->device copies from it are synchronous (later "
                   f"failures fall back without a warning)")
        return None
    # Storage objects are kept alive by every view, so this fires when the memory is freed.
    weakref.finalize(raw.untyped_storage(), _release_pinned, nbytes)
    return raw


# ---- huge pages ------------------------------------------------------------------------------

_MADV_HUGEPAGE = 14  # linux/mman.h
_libc = None


def _advise_huge(address: int, nbytes: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` over the whole 2 MiB pages inside ``[address, address +
    nbytes)``; False where it is not available (not Linux, THP off) or refused. Never raises:
    the advice only changes speed."""
    global _libc
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            import ctypes
            import ctypes.util
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return _libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False
