"""aligned_empty: 4096-byte aligned host tensors that keep their storage alive."""
import gc

import pytest
import torch

from offload_zero.memory.aligned import ALIGNMENT, aligned_empty, is_aligned

DTYPES = [torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int32,
          torch.float64, torch.int64, torch.complex64, torch.bool]
SIZES = [0, 1, 2, 3, 7, 127, 1023, 1024, 1025, 4093, 4096, 4097, 65537]


def test_alignment_constant():
    assert ALIGNMENT == 4096


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", SIZES)
def test_aligned_shape_dtype_alignment(numel, dtype):
    t = aligned_empty(numel, dtype)
    assert t.shape == (numel,)
    assert t.dtype == dtype
    assert t.device.type == "cpu"
    assert t.is_contiguous()
    assert t.data_ptr() % ALIGNMENT == 0
    # The storage covers the data, and the over-allocation is bounded.
    itemsize = t.element_size()
    storage_bytes = t.untyped_storage().nbytes()
    assert storage_bytes >= t.storage_offset() * itemsize + numel * itemsize
    assert storage_bytes == numel * itemsize + ALIGNMENT - 1


def test_every_element_writable_and_readable():
    t = aligned_empty(4097, torch.float32)
    t.copy_(torch.arange(4097, dtype=torch.float32))
    assert torch.equal(t, torch.arange(4097, dtype=torch.float32))


def test_storage_outlives_temporaries():
    # Only a view survives; writing to it after a GC must not touch freed memory.
    views = []
    for _ in range(8):
        t = aligned_empty(3 * 1024, torch.float32)
        views.append(t[5:10])
        t.fill_(7.0)
        del t
    gc.collect()
    churn = [torch.empty(3 * 1024, dtype=torch.float32).fill_(-1.0) for _ in range(8)]
    for v in views:
        assert torch.equal(v, torch.full((5,), 7.0))
    del churn


def test_pin_is_noop_without_cuda():
    t = aligned_empty(1000, torch.bfloat16, pin=True)
    assert t.data_ptr() % ALIGNMENT == 0
    if not torch.cuda.is_available():
        assert not t.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to pin host memory")
def test_pin_with_cuda():
    t = aligned_empty(12345, torch.float32, pin=True)
    assert t.is_pinned()
    assert t.data_ptr() % ALIGNMENT == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, True])
def test_bad_numel(bad):
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(").replace(".", r"\.")):
        aligned_empty(bad, torch.float32)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        aligned_empty(4, "float32")


def test_is_aligned():
    t = aligned_empty(2048, torch.float32)  # 8192 bytes
    assert is_aligned(t)
    assert not is_aligned(t[1:1025])  # misaligned address
    assert not is_aligned(t[:1000])  # length not a multiple of 4096 bytes
    assert not is_aligned(t.view(2, 1024).t())  # not contiguous
