"""The bytes of one flat parameter's optimizer state: fp32 master weights and Adam's two moments
in fp32 or bf16 (``moment_dtype``).

[Note: state layout]
A state of ``n`` elements (a shard) is three regions, each a multiple of 4096 bytes (O_DIRECT):
``[master: 4n | exp_avg: align(s n) | exp_avg_sq: align(s n)]``, with s the moments' bytes per
element (4 for fp32, 2 for bf16) and align() rounding up to 4096 bytes. A shard is a multiple of
1024 elements, so the master region is never padded; bf16 moments of a shard of an odd multiple
of 1024 elements get 2048 bytes of padding each. The NVMe state file has this layout at offset
0, and so do the host buffers that hold a whole state or one chunk of it (with the buffer's
capacity in place of n): a transfer of elements [lo, hi) of a region starts at the region's
offset plus ``s * lo`` and moves ``align(s * (hi - lo))`` bytes, so ``lo`` must be a multiple of
``4096 / s`` elements (the NVMe store's chunks are). Bytes per element: 12 with fp32 moments,
8 with bf16 (plus that padding).
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

import torch

ALIGN_BYTES = 4096
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def moment_dtype_of(value) -> torch.dtype:
    """``moment_dtype`` as a torch dtype: ``"fp32"``/``"bf16"`` (or ``torch.float32`` /
    ``torch.bfloat16`` themselves). Raises ValueError naming the value and the choices."""
    if isinstance(value, str) and value in MOMENT_DTYPES:
        return MOMENT_DTYPES[value]
    if value in (torch.float32, torch.bfloat16):
        return value
    raise ValueError(f"moment_dtype={value!r} is not valid; choose one of "
                     f"{tuple(MOMENT_DTYPES)} (Adam's moments in fp32, or bf16 with stochastic "
                     "rounding)")


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """The layout of a state of fp32 master weights and two moments of ``moment_dtype`` (see
    [Note: state layout]). Units: elements and bytes as named."""

    moment_dtype: torch.dtype = torch.float32

    @property
    def moment_itemsize(self) -> int:
        """Bytes per element of one moment: 4 (fp32) or 2 (bf16)."""
        return torch.empty(0, dtype=self.moment_dtype).element_size()

    @property
    def bytes_per_element(self) -> int:
        """Bytes per element of master weights and both moments, unpadded: 12 or 8."""
        return 4 + 2 * self.moment_itemsize

    @property
    def chunk_multiple(self) -> int:
        """Elements a chunk boundary must be a multiple of, so that every region's part of it
        starts on a 4096-byte boundary: 1024 (fp32 moments) or 2048 (bf16)."""
        return ALIGN_BYTES // self.moment_itemsize

    def moment_bytes(self, n: int) -> int:
        """Bytes of both moment regions of ``n`` elements, padding included."""
        return 2 * _align(self.moment_itemsize * n)

    def nbytes(self, n: int) -> int:
        """Bytes of a whole state of ``n`` elements (file or buffer), padding included."""
        return 4 * n + self.moment_bytes(n)

    def buffer_numel(self, n: int) -> int:
        """fp32 elements of a host buffer that holds a state of up to ``n`` elements."""
        return self.nbytes(n) // 4

    def offsets(self, n: int) -> Tuple[int, int, int]:
        """Byte offsets of the master, exp_avg and exp_avg_sq regions of a state of capacity
        ``n`` elements."""
        m = 4 * n
        return 0, m, m + _align(self.moment_itemsize * n)

    def views(self, buf: torch.Tensor, cap: int, count: int, padded: bool = False):
        """``(master, exp_avg, exp_avg_sq)``: the first ``count`` elements of each region of
        ``buf``, a contiguous host tensor laid out for ``cap`` elements (``count <= cap``).
        ``padded``: each view rounded up to a multiple of 4096 bytes, as transferred."""
        raw = buf.view(torch.uint8)
        out = []
        for off, dtype in zip(self.offsets(cap),
                              (torch.float32, self.moment_dtype, self.moment_dtype)):
            size = torch.empty(0, dtype=dtype).element_size()
            nbytes = _align(size * count) if padded else size * count
            out.append(raw[off:off + nbytes].view(dtype))
        return tuple(out)
