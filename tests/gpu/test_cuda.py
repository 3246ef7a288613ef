"""The CUDA path: pinned aligned buffers, host<->device staging, NCCL on one GPU, device memory
measured by the CUDA allocator. Skipped without CUDA (see conftest.py)."""
import copy
import os

import pytest
import torch

from models import TinyLM, batches, big_root_lm, lm_loss, max_param_diff
from offload_zero import OffloadEngine
from offload_zero.memory.aligned import aligned_empty
from offload_zero.memory.pool import storage_rebinding_supported

DEV = torch.device("cuda", 0)


def test_pinned_aligned_host_buffers():
    t = aligned_empty(12345, torch.bfloat16, pin=True)
    assert t.is_pinned() and t.data_ptr() % 4096 == 0 and t.numel() == 12345
    d = torch.randn(12345, device=DEV).bfloat16()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        t.copy_(d, non_blocking=True)
    stream.synchronize()
    assert torch.equal(t, d.cpu())


@pytest.mark.parametrize("mode", ["plain", "backward", "next_forward"])
@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_engine_on_cuda_matches_torch_adamw(offload, mode, tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model).to(DEV)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    with OffloadEngine(model, offload=offload, path=str(tmp_path) if offload == "nvme" else None,
                       lr=1e-2, weight_decay=0.1,
                       device=DEV, **({"update_timing": "step"} if mode == "plain"
                                      else {"update_timing": mode})) as eng:
        for x, y in batches(5):
            x, y = x.to(DEV), y.to(DEV)
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            opt.zero_grad()
            lm_loss(ref(x), y).backward()
            opt.step()
        sd = eng.full_state_dict()
        # GPU matmuls (TF32 off by default for fp32) and a different summation order: 1e-5
        assert max_param_diff(sd, ref.cpu()) <= 1e-5


def test_nccl_process_group_of_one(tmp_path):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        full = torch.empty(8, device=DEV)
        shard = torch.arange(8, dtype=torch.float32, device=DEV)
        dist.all_gather_into_tensor(full, shard)
        assert torch.equal(full, shard)
        with OffloadEngine(TinyLM(), offload="cpu", device=DEV) as eng:
            assert eng.world_size == 1 and dist.get_backend() == "nccl"
            x, y = batches(1)[0]
            eng.backward(lm_loss(eng(x.to(DEV)), y.to(DEV)))
            eng.step()
    finally:
        dist.destroy_process_group()


def test_stage3_device_memory_stays_below_the_model(tmp_path):
    """With parameters and optimizer state on NVMe, the CUDA allocator's peak during a step is
    a few units' worth, not the model: measured by torch.cuda.max_memory_allocated."""
    torch.manual_seed(0)

    class Wide(torch.nn.Module):
        def __init__(self, n=12, d=1024):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))

        def forward(self, x):
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x

    model = Wide()
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    torch.cuda.reset_peak_memory_stats(DEV)
    base = torch.cuda.memory_allocated(DEV)
    with OffloadEngine(model, offload="nvme", path=str(tmp_path), device=DEV) as eng:
        x = torch.randn(4, 1024, device=DEV)
        eng.backward(eng(x).pow(2).mean())
        eng.step()
        peak = torch.cuda.max_memory_allocated(DEV) - base
        rep = eng.memory_report()
    unit_bytes = 1024 * 1024 * 4 + 1024 * 4
    assert peak < 0.5 * model_bytes, (peak, model_bytes)
    # the engine's own device accounting is within what the allocator saw
    assert rep["device"]["peak_bytes"] <= peak
    assert peak < 8 * unit_bytes


def test_checkpointed_activations_offloaded_to_host():
    torch.manual_seed(0)
    results = []
    for kw in ({}, {"activation_checkpointing": True, "offload_activations": True}):
        torch.manual_seed(0)
        with OffloadEngine(TinyLM(n_blocks=4), device=DEV, **kw) as eng:
            x, y = batches(1)[0]
            eng.backward(lm_loss(eng(x.to(DEV)), y.to(DEV)))
            results.append({fp.name: eng.grads.buf[fp].cpu().clone() for fp in eng.trainable})
    for name in results[0]:
        assert (results[0][name] - results[1][name]).abs().max().item() <= 1e-5


def test_bf16_on_cuda_trains(tmp_path):
    torch.manual_seed(0)
    with OffloadEngine(TinyLM(), offload="cpu", dtype=torch.bfloat16, lr=1e-2, device=DEV) as eng:
        x, y = batches(1)[0]
        x, y = x.to(DEV), y.to(DEV)
        losses = []
        for _ in range(15):
            loss = lm_loss(eng(x).float(), y)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_fp16_on_cuda_scales_the_loss_and_trains(offload, tmp_path):
    """fp16 on the device (torch Adam ops with offload none, the C++ Adam with cpu): a scale
    high enough to overflow backs off step by step (skipped steps leave the weights as they
    were), then the model trains."""
    torch.manual_seed(0)
    with OffloadEngine(TinyLM(), offload=offload, dtype=torch.float16, lr=1e-2, device=DEV,
                       initial_loss_scale=2.0 ** 24) as eng:
        x, y = batches(1)[0]
        x, y = x.to(DEV), y.to(DEV)
        losses = []
        for _ in range(25):
            before = eng.skipped_steps
            weights = eng.full_state_dict() if eng.loss_scaler.scale > 2 ** 18 else None
            loss = lm_loss(eng(x).float(), y)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
            if weights is not None and eng.skipped_steps > before:
                after = eng.full_state_dict()
                assert all(torch.equal(weights[n], after[n]) for n in weights)
        assert eng.skipped_steps >= 1 and eng.loss_scaler.scale < 2.0 ** 24
    assert losses[-1] < losses[0] - 0.5


def test_stage3_on_cuda_device_memory_is_flat_from_step_two(tmp_path):
    """Stage 3 with parameter shards on the host: the CUDA allocator's live bytes after each
    step, and its peak within each step, are the same from the second step on, and the numbers
    match plain AdamW on the GPU. Where this torch can rebind storages, gathered units borrow
    the device slots of the gather pool (no allocation per gather); where it cannot, the
    engine runs without the pool and says so in its report."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=8).to(DEV)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    eng = OffloadEngine(model, stage=3, offload="cpu", offload_param="cpu", device=DEV, lr=1e-2,
                        weight_decay=0.1)
    live, peaks = [], []
    with eng:
        for x, y in batches(5):
            x, y = x.to(DEV), y.to(DEV)
            torch.cuda.reset_peak_memory_stats(DEV)
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            torch.cuda.synchronize(DEV)
            live.append(torch.cuda.memory_allocated(DEV))
            peaks.append(torch.cuda.max_memory_allocated(DEV))
            opt.zero_grad()
            lm_loss(ref(x), y).backward()
            opt.step()
        assert max_param_diff(eng.full_state_dict(), copy.deepcopy(ref).cpu()) <= 1e-5
        if not storage_rebinding_supported():
            assert "gather" not in eng.memory_report()["pools"]
        else:
            pool = eng.memory_report()["pools"]["gather"]
            slots = [(s.data_ptr(), s.data_ptr() + pool["buffer_bytes"])
                     for s in eng.pools["gather"]._slots]
            ptr = None

            def grab(mod, args):
                nonlocal ptr
                ptr = mod.up.weight.data_ptr()

            h = model.blocks[3].register_forward_pre_hook(grab)
            with torch.no_grad():
                eng(batches(1)[0][0].to(DEV))
            h.remove()
            assert any(lo <= ptr < hi for lo, hi in slots)
            assert pool["grown"] == 0 and eng.pools["gather"]._slots[0].device == DEV
    assert len(set(live[1:])) == 1, live
    assert len(set(peaks[1:])) == 1, peaks


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("offload_param", ["none", "nvme"])
def test_update_in_backward_on_cuda_same_weights_as_the_step(offload_param, tail, tmp_path,
                                                           monkeypatch):
    """update_timing="backward" on CUDA with the optimizer state on NVMe: the LM head's state streams
    in chunks interleaved with the blocks' updates, all of them through the one host staging
    buffer (offload_param="none") or the NVMe parameter home; the embeddings' state on NVMe
    too, or kept in host memory (tail_state_in_host; its fp32 parameter shard is that host
    master); bit for bit the plain step."""
    from offload_zero.memory.tiers import NVMeStore
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    torch.manual_seed(9)
    model = big_root_lm(3, vocab_scale=4)
    twin = copy.deepcopy(model)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    kw = dict(lr=1e-2, weight_decay=0.1, offload="nvme", offload_param=offload_param, stage=3,
              device=DEV)
    with OffloadEngine(model, path=str(tmp_path / "a"), update_timing="step", **kw) as a, \
            OffloadEngine(twin, path=str(tmp_path / "b"), update_timing="backward",
                          tail_state_in_host=tail, **kw) as b:
        assert b.store.in_host(b.root.flat_params[-1]) is tail
        for x, y in batches(4):
            x, y = x.to(DEV), y.to(DEV)
            for eng in (a, b):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("offload,dtype", [("none", torch.float32), ("cpu", torch.bfloat16),
                                           ("nvme", torch.bfloat16)])
def test_checkpoint_resume_on_cuda_is_exact(offload, dtype, tmp_path):
    """Saved from device, host or NVMe state (staging through pinned buffers), loaded into a
    fresh engine with another init: the resumed run matches the uninterrupted one bit for bit."""
    data = [(x.to(DEV), y.to(DEV)) for x, y in batches(4)]
    kw = dict(offload=offload, stage=3, dtype=dtype, lr=1e-2, device=DEV)

    def engine(seed, swap):
        torch.manual_seed(seed)
        (tmp_path / swap).mkdir()
        path = str(tmp_path / swap) if offload == "nvme" else None
        return OffloadEngine(TinyLM(), path=path, **kw)

    def train(eng, part):
        for x, y in part:
            eng.backward(lm_loss(eng(x), y))
            eng.step()

    with engine(0, "a") as a:
        train(a, data[:2])
        a.save_checkpoint(tmp_path / "ckpt")
        train(a, data[2:])
        expected = a.full_state_dict()
    with engine(1, "b") as b:
        b.load_checkpoint(tmp_path / "ckpt")
        train(b, data[2:])
        got = b.full_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("timing", ["backward", "next_forward"])
def test_bf16_shards_kept_in_host_memory_on_cuda(timing, tmp_path):
    """bf16 on CUDA, state and parameter shards on NVMe, a host cache of ~40% of the state, a
    deeper read-ahead ring: the cached flat parameters' bf16 shards stay in pinned host memory
    (no file of theirs), gathered to the device from there; bit for bit the all-NVMe run."""
    torch.manual_seed(3)
    model = TinyLM(n_blocks=4)
    state = 12 * sum(p.numel() for p in model.parameters())
    kw = dict(lr=1e-2, weight_decay=0.1, offload="nvme", stage=3, dtype=torch.bfloat16,
              device=DEV, update_timing=timing)
    out = []
    for cache, ring in ((0, None), (int(0.4 * state), 4)):
        folder = tmp_path / str(cache)
        folder.mkdir()
        with OffloadEngine(copy.deepcopy(model), path=str(folder), host_cache_bytes=cache,
                           optimizer_prefetch=ring, **kw) as eng:
            cached = {fp.name for fp in eng.trainable if eng.store.in_host(fp)}
            for x, y in batches(4):
                x, y = x.to(DEV), y.to(DEV)
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            files = {os.path.basename(f) for f in eng.swapper.files}
            out.append((eng.full_state_dict(), cached, files))
    (ref, _, _), (got, cached, files) = out
    assert cached and not {f"{name}.param.swp" for name in cached} & files
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_bf16_masters_on_cuda_are_the_same_on_every_tier(tmp_path):
    """bf16 masters on CUDA: offload="cpu" (host masters, staged to the device shards) and
    "nvme" (the shards read from the masters' bytes, no shard files) give the same weights bit
    for bit; the optimizer state on the device is refused."""
    torch.manual_seed(4)
    model = TinyLM(n_blocks=3)
    kw = dict(lr=1e-2, weight_decay=0.1, stage=3, dtype=torch.bfloat16, device=DEV,
              master_dtype="bf16", moment_dtype="bf16")
    out = {}
    for offload in ("cpu", "nvme"):
        extra = {"path": str(tmp_path)} if offload == "nvme" else {}
        with OffloadEngine(copy.deepcopy(model), offload=offload, **kw, **extra) as eng:
            for x, y in batches(4):
                x, y = x.to(DEV), y.to(DEV)
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            if offload == "nvme":
                files = {os.path.basename(f) for f in eng.swapper.files}
                assert not any(f.endswith(".param.swp") for f in files
                               if any(f.startswith(fp.name) for fp in eng.trainable))
            out[offload] = eng.full_state_dict()
    assert all(torch.equal(out["cpu"][k], out["nvme"][k]) for k in out["cpu"])
    with pytest.raises(NotImplementedError, match="master_dtype='bf16' with the optimizer"):
        OffloadEngine(copy.deepcopy(model), offload="none", **kw)
