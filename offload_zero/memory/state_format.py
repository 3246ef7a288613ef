"""The bytes of one flat parameter's optimizer state: master weights in fp32 or bf16
(``master_dtype``) and Adam's two moments in fp32, bf16 or blockwise 8-bit codes
(``moment_dtype``).

[Note: state layout]
A state of ``n`` elements (a shard) is three regions, each a multiple of 4096 bytes (O_DIRECT):
``[master: align(w n) | exp_avg: align(s n) | exp_avg_sq: align(s n)]``, with w the master's
bytes per element (4 for fp32, 2 for bf16), s the moments' (4 for fp32, 2 for bf16, 1 for int8
codes) and align() rounding up to 4096 bytes. A shard is a multiple of 4096 bytes of its
compute dtype, so an fp32 master is never padded, nor a bf16 master of a bf16 model; bf16
moments of a shard of an odd multiple of 1024 elements get 2048 bytes of padding each, int8
codes up to 3072. The NVMe state file has this layout at offset 0, and so do the host buffers
that hold a whole state or one chunk of it (with the buffer's capacity in place of n): a
transfer of elements [lo, hi) of a region starts at the region's offset plus ``w * lo`` (or
``s * lo``) and moves ``align(w * (hi - lo))`` bytes, so ``lo`` must be a multiple of
``4096 / min(w, s)`` elements (the NVMe store's chunks are). Bytes per element with an fp32
master: 12 with fp32 moments, 8 with bf16, 6 with int8; with a bf16 master 2 fewer: 10, 6, 4
(plus that padding).

[Note: bf16 master weights]
With ``master_dtype="bf16"`` (a bf16 model only) the master weights are bf16, updated by the
C++ kernel in fp32 and stored with stochastic rounding (bits independent of the moments': see
:func:`offload_zero.optim.kernel.adam_step_`), so a master is the bf16 parameter shard itself
and there is no second copy of the weights in another dtype. Everywhere the master is
exchanged (``read_all``, ``write_all``, checkpoints, exports) it is fp32 values, exact widened
bf16, and a master written in fp32 is rounded to the nearest bf16.

[Note: int8 moment scales]
With ``moment_dtype="int8"`` each moment also has one fp32 absmax per block of 256 elements of
the shard (:mod:`offload_zero.optim.int8_moments`): 8 bytes per 256 elements for both moments,
a ``(2, ceil(n / 256))`` fp32 tensor (row 0 exp_avg's, row 1 exp_avg_sq's). They are not in
the file: every store keeps them in host memory (device memory for a device store), beside
the codes or for the whole run beside an NVMe file (0.5% of the state's bytes: 4.7 MB per
149M parameters), so the disk moves 6 bytes per element each way and a chunk needs no
second, unaligned transfer. Host bytes per element of a state kept there: 6 + 8/256 =
6.03125 (:attr:`StateFormat.resident_bytes_per_element`). ``read_all`` returns int8 moments
decoded to fp32 (:attr:`StateFormat.exchange_dtype`) and ``write_all`` encodes fp32 moments
to nearest, so checkpoints hold them as fp32 values that encode back to the same codes and
absmax exactly.
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

import torch

ALIGN_BYTES = 4096
# int8 moments are uint8 codes (indices into an 8-bit map) plus per-block scales
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INT8_BLOCK_NUMEL = 256  # elements per absmax block (offload_zero.optim.int8_moments)


def moment_dtype_of(value) -> torch.dtype:
    """``moment_dtype`` as a torch dtype: ``"fp32"``/``"bf16"``/``"int8"`` (or
    ``torch.float32`` / ``torch.bfloat16`` / ``torch.uint8`` themselves, uint8 being int8's
    codes). Raises ValueError naming the value and the choices."""
    if isinstance(value, str) and value in MOMENT_DTYPES:
        return MOMENT_DTYPES[value]
    if value in (torch.float32, torch.bfloat16, torch.uint8):
        return value
    raise ValueError(f"moment_dtype={value!r} is not valid; choose one of "
                     f"{tuple(MOMENT_DTYPES)} (Adam's moments in fp32, bf16 with stochastic "
                     "rounding, or blockwise 8-bit codes)")


def master_dtype_of(value) -> torch.dtype:
    """``master_dtype`` as a torch dtype: ``"fp32"``/``"bf16"`` (or ``torch.float32`` /
    ``torch.bfloat16`` themselves). Raises ValueError naming the value and the choices."""
    if isinstance(value, str) and value in MASTER_DTYPES:
        return MASTER_DTYPES[value]
    if value in (torch.float32, torch.bfloat16):
        return value
    raise ValueError(f"master_dtype={value!r} is not valid; choose one of "
                     f"{tuple(MASTER_DTYPES)} (master weights in fp32, or in bf16 with "
                     "stochastic rounding)")


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """The layout of a state of master weights of ``master_dtype`` (float32, or bfloat16: [Note:
    bf16 master weights]) and two moments of ``moment_dtype`` (see [Note: state layout];
    torch.uint8: int8 codes, with the scales of [Note: int8 moment scales]). Units: elements
    and bytes as named."""

    moment_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32

    @property
    def master_itemsize(self) -> int:
        """Bytes per element of the master region: 4 (fp32) or 2 (bf16)."""
        return torch.empty(0, dtype=self.master_dtype).element_size()

    def master_bytes(self, n: int) -> int:
        """Bytes of the master region of ``n`` elements, padding included."""
        return _align(self.master_itemsize * n)

    @property
    def blockwise(self) -> bool:
        """Whether the moments are int8 codes with a per-block absmax (``moment_dtype="int8"``)."""
        return self.moment_dtype == torch.uint8

    @property
    def exchange_dtype(self) -> torch.dtype:
        """The moments' dtype in ``read_all``/``write_all`` and checkpoints: the moment dtype,
        float32 for int8 (decoded values; see [Note: int8 moment scales])."""
        return torch.float32 if self.blockwise else self.moment_dtype

    @property
    def moment_itemsize(self) -> int:
        """Bytes per element of one moment's region: 4 (fp32), 2 (bf16) or 1 (int8 codes)."""
        return torch.empty(0, dtype=self.moment_dtype).element_size()

    @property
    def bytes_per_element(self) -> int:
        """Bytes per element of master weights and both moments' regions (what the NVMe file
        holds and a step moves each way), unpadded: 12, 8 or 6 with an fp32 master, 10, 6 or 4
        with a bf16 one."""
        return self.master_itemsize + 2 * self.moment_itemsize

    @property
    def resident_bytes_per_element(self) -> float:
        """Bytes per element of a state kept in host (or device) memory, the int8 scales
        included: 12, 8 or 6.03125 (6 + 8/256) with an fp32 master, 2 fewer with a bf16 one."""
        return self.bytes_per_element + (8 / INT8_BLOCK_NUMEL if self.blockwise else 0)

    def scale_bytes(self, n: int) -> int:
        """Bytes of both moments' absmax of a state of ``n`` elements: 8 per block of 256
        (rounded up) with int8 moments, else 0."""
        return 8 * -(-n // INT8_BLOCK_NUMEL) if self.blockwise else 0

    def resident_moment_bytes(self, n: int) -> int:
        """Bytes of both moments of ``n`` elements held in memory (unpadded; scales
        included)."""
        return 2 * self.moment_itemsize * n + self.scale_bytes(n)

    def new_scales(self, n: int, device=None) -> torch.Tensor:
        """Zeroed scales of a state of ``n`` elements: fp32 of shape (2, ceil(n / 256)) (row
        0 exp_avg's absmax, row 1 exp_avg_sq's), on ``device`` (CPU by default). Raises
        ValueError unless the moments are int8."""
        if not self.blockwise:
            raise ValueError(f"moments of {self.moment_dtype} have no scales (int8 only)")
        return torch.zeros(2, -(-n // INT8_BLOCK_NUMEL), dtype=torch.float32, device=device)

    @property
    def chunk_multiple(self) -> int:
        """Elements a chunk boundary must be a multiple of, so that every region's part of it
        starts on a 4096-byte boundary: 1024 (fp32 master and moments), 2048 (bf16 moments or
        master) or 4096 (int8, also a whole number of 256-element blocks)."""
        return ALIGN_BYTES // min(self.moment_itemsize, self.master_itemsize)

    def moment_bytes(self, n: int) -> int:
        """Bytes of both moment regions of ``n`` elements, padding included."""
        return 2 * _align(self.moment_itemsize * n)

    def nbytes(self, n: int) -> int:
        """Bytes of a whole state of ``n`` elements (file or buffer), padding included."""
        return self.master_bytes(n) + self.moment_bytes(n)

    def buffer_numel(self, n: int) -> int:
        """fp32 elements of a host buffer that holds a state of up to ``n`` elements."""
        return self.nbytes(n) // 4

    def offsets(self, n: int) -> Tuple[int, int, int]:
        """Byte offsets of the master, exp_avg and exp_avg_sq regions of a state of capacity
        ``n`` elements."""
        m = self.master_bytes(n)
        return 0, m, m + _align(self.moment_itemsize * n)

    def views(self, buf: torch.Tensor, cap: int, count: int, padded: bool = False):
        """``(master, exp_avg, exp_avg_sq)``: the first ``count`` elements of each region of
        ``buf``, a contiguous host tensor laid out for ``cap`` elements (``count <= cap``).
        ``padded``: each view rounded up to a multiple of 4096 bytes, as transferred."""
        raw = buf.view(torch.uint8)
        out = []
        for off, dtype in zip(self.offsets(cap),
                              (self.master_dtype, self.moment_dtype, self.moment_dtype)):
            size = torch.empty(0, dtype=dtype).element_size()
            nbytes = _align(size * count) if padded else size * count
            out.append(raw[off:off + nbytes].view(dtype))
        return tuple(out)


def decode_moments(fmt: StateFormat, m: torch.Tensor, v: torch.Tensor,
                   scales: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 CPU copies of both moments: int8 codes ``m``, ``v`` (uint8, (n,)) decoded with
    ``scales`` ((2, ceil(n / 256)) fp32), or the moments themselves converted for other
    formats."""
    if not fmt.blockwise:
        return m.detach().to("cpu", copy=True), v.detach().to("cpu", copy=True)
    from offload_zero.optim.int8_moments import dequantize
    return tuple(dequantize(c.detach().cpu().contiguous(), s.cpu().contiguous(), signed=signed)
                 for c, s, signed in ((m, scales[0], True), (v, scales[1], False)))


def encode_moments_(fmt: StateFormat, m32: torch.Tensor, v32: torch.Tensor, m: torch.Tensor,
                    v: torch.Tensor, scales: torch.Tensor) -> None:
    """Write fp32 moments ``m32``, ``v32`` ((n,)) into int8 codes ``m``, ``v`` and ``scales``
    in place, rounding to nearest (int8 moments only; see [Note: int8 moment scales])."""
    from offload_zero.optim.int8_moments import quantize_
    for x, codes, row, signed in ((m32, m, 0, True), (v32, v, 1, False)):
        c = torch.empty(codes.shape, dtype=torch.uint8)
        sc = torch.empty(scales.shape[1], dtype=torch.float32)
        quantize_(x.detach().to("cpu", torch.float32).contiguous(), c, sc, signed=signed)
        codes.copy_(c)
        scales[row].copy_(sc)
