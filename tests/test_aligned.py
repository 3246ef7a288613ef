"""aligned_empty: 4096-byte aligned host tensors that keep their storage alive."""
import gc
import warnings

import pytest
import torch

from offload_zero.memory import aligned as aligned_mod
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


# ---- pinning and the locked-memory limit (no CUDA needed) ------------------------------------

RAW = ALIGNMENT - 1  # over-allocation of every aligned_empty block


@pytest.mark.parametrize("wanted,already,limit,allowed", [
    (10, 0, None, True),        # no limit (unlimited or CAP_IPC_LOCK)
    (1 << 40, 1 << 40, None, True),
    (10, 0, 10, True),          # exactly at the limit
    (11, 0, 10, False),
    (5, 6, 10, False),          # what is already pinned counts
    (0, 10, 10, True),
    (65536, 0, 65536, True),    # a typical container limit
    (65537, 0, 65536, False),
])
def test_pin_allowed(wanted, already, limit, allowed):
    assert aligned_mod._pin_allowed(wanted, already, limit) is allowed


def test_memlock_limit(monkeypatch):
    import resource

    monkeypatch.setattr(aligned_mod, "_has_cap_ipc_lock", lambda: False)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (65536, 1 << 30))
    assert aligned_mod._memlock_limit() == 65536
    monkeypatch.setattr(resource, "getrlimit",
                        lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert aligned_mod._memlock_limit() is None
    monkeypatch.setattr(resource, "getrlimit", lambda which: (65536, 1 << 30))
    monkeypatch.setattr(aligned_mod, "_has_cap_ipc_lock", lambda: True)
    assert aligned_mod._memlock_limit() is None
    monkeypatch.setattr(aligned_mod, "_has_cap_ipc_lock", lambda: False)
    monkeypatch.setenv("OFFLOAD_ZERO_MEMLOCK_CHECK", "0")
    assert aligned_mod._memlock_limit() is None


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available'; the pinned allocation returns ordinary memory and is recorded."""
    calls = []

    def empty_pinned(nbytes):
        calls.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(aligned_mod, "_empty_pinned", empty_pinned)
    monkeypatch.setattr(aligned_mod, "_warned", set())  # each test sees its first warning
    monkeypatch.setattr(aligned_mod, "_memlock_limit", lambda: 3 * ALIGNMENT)
    return calls


def _check_buffer(t, numel):
    assert t.shape == (numel,) and t.data_ptr() % ALIGNMENT == 0 and not t.is_pinned()
    t.fill_(3)  # the memory is usable


def test_pinned_bytes_counted_and_released(fake_cuda):
    before = aligned_mod.pinned_bytes()
    t = aligned_empty(ALIGNMENT, torch.uint8, pin=True)
    assert fake_cuda == [ALIGNMENT + RAW]
    assert aligned_mod.pinned_bytes() == before + ALIGNMENT + RAW
    view = t[10:20]
    del t
    gc.collect()
    assert aligned_mod.pinned_bytes() == before + ALIGNMENT + RAW  # the view keeps it alive
    del view
    gc.collect()
    assert aligned_mod.pinned_bytes() == before


def test_over_the_limit_warns_and_still_tries_to_pin(fake_cuda):
    first = aligned_empty(ALIGNMENT // 4, torch.float32, pin=True)  # fits in 3 pages
    wanted = 2 * ALIGNMENT + RAW
    already = aligned_mod.pinned_bytes()
    with pytest.warns(RuntimeWarning, match=rf"{already} already pinned \+ {wanted} = "
                                            rf"{already + wanted} bytes wanted exceeds .*"
                                            rf"RLIMIT_MEMLOCK.* of {3 * ALIGNMENT} bytes; trying anyway"):
        second = aligned_empty(ALIGNMENT // 2, torch.float32, pin=True)
    assert fake_cuda == [ALIGNMENT + RAW, wanted]  # the pin was still attempted
    assert aligned_mod.pinned_bytes() == already + wanted
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process, not once per buffer
        third = aligned_empty(ALIGNMENT, torch.uint8, pin=True)
    assert third.data_ptr() % ALIGNMENT == 0
    del first, second, third


def test_over_the_limit_and_pin_fails_falls_back_unpinned(fake_cuda, monkeypatch):
    def refuse(nbytes):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(aligned_mod, "_empty_pinned", refuse)
    before = aligned_mod.pinned_bytes()
    with pytest.warns(RuntimeWarning) as record:
        t = aligned_empty(4 * ALIGNMENT, torch.uint8, pin=True)
    messages = " | ".join(str(w.message) for w in record)
    assert "RLIMIT_MEMLOCK" in messages and "failed" in messages
    _check_buffer(t, 4 * ALIGNMENT)
    assert aligned_mod.pinned_bytes() == before


def test_failed_pin_falls_back_unpinned(fake_cuda, monkeypatch):
    def refuse(nbytes):
        raise RuntimeError("CUDA error: out of memory\n(cudaHostAlloc)")

    monkeypatch.setattr(aligned_mod, "_empty_pinned", refuse)
    monkeypatch.setattr(aligned_mod, "_memlock_limit", lambda: None)
    before = aligned_mod.pinned_bytes()
    with pytest.warns(RuntimeWarning, match=rf"pinning {1000 * 2 + RAW} bytes failed "
                                            rf"\(CUDA error: out of memory \(cudaHostAlloc\)\)"):
        t = aligned_empty(1000, torch.bfloat16, pin=True)
    _check_buffer(t, 1000)
    assert aligned_mod.pinned_bytes() == before  # the reservation was given back


def test_no_check_without_pin(fake_cuda, recwarn):
    t = aligned_empty(10 * ALIGNMENT, torch.uint8)  # pin=False: no limit, no warning
    _check_buffer(t, 10 * ALIGNMENT)
    assert fake_cuda == [] and len(recwarn) == 0


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _anon_huge_kb():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_large_buffers_start_on_a_huge_page():
    n = aligned_mod.HUGE_PAGE * 3 + 12345
    t = aligned_empty(n, torch.uint8)
    assert t.data_ptr() % aligned_mod.HUGE_PAGE == 0
    assert t.untyped_storage().nbytes() == n + aligned_mod.HUGE_PAGE - 1
    small = aligned_empty(aligned_mod.HUGE_PAGE // 2, torch.uint8)
    assert small.untyped_storage().nbytes() == aligned_mod.HUGE_PAGE // 2 + ALIGNMENT - 1


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                    reason="transparent huge pages are off on this machine")
def test_large_buffers_fault_in_as_huge_pages():
    before = _anon_huge_kb()
    t = aligned_empty(32 * aligned_mod.HUGE_PAGE, torch.float32)  # 256 MiB
    t.fill_(1.0)
    gained = _anon_huge_kb() - before
    # the kernel may fall back to small pages for some of them when memory is fragmented
    assert gained >= 128 * 1024, f"only {gained} KiB of huge pages for a 256 MiB buffer"


def test_huge_page_advice_never_raises():
    assert aligned_mod._advise_huge(4096, 100) is False  # no whole huge page inside
    t = aligned_empty(4 * aligned_mod.HUGE_PAGE, torch.uint8)
    assert aligned_mod._advise_huge(t.data_ptr(), t.numel()) in (True, False)
