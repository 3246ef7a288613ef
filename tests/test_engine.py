"""OffloadEngine at world size 1: numerics against torch.optim on an unsharded copy, residency
from tensor storages, NVMe files, memory accounting, awkward model structures, bad input."""
import copy
import gc
import math
import os
import re
import stat
import subprocess

import numpy as np
import pytest
import torch
import torch.nn as nn

from models import (BackwardFault, TinyLM, batches, big_root_lm, flat_param_of, lm_loss,
                    max_param_diff)
from offload_zero import OffloadEngine
from offload_zero.memory.tiers import NVMeStore

F32 = torch.float32

OFFLOADS = ["none", "cpu", "nvme"]


def _engine(model, offload, tmp_path, **kw):
    kw.setdefault("path", str(tmp_path) if offload == "nvme" else None)
    return OffloadEngine(model, offload=offload, **kw)


def _train_both(model, engine_kw, tmp_path, offload, steps=5, adamw=True, lr=1e-2, wd=0.1,
                before_step=None, on_engine=None):
    ref = copy.deepcopy(model)
    opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = opt_cls(ref.parameters(), lr=lr, weight_decay=wd, foreach=False)
    eng = _engine(model, offload, tmp_path, lr=lr, weight_decay=wd, adamw=adamw, **engine_kw)
    if on_engine:
        on_engine(eng)
    for i, (x, y) in enumerate(batches(steps)):
        if before_step:
            before_step(i, model, ref)
        eng.backward(lm_loss(eng(x), y))
        eng.step()
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
    return eng, ref


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_matches_torch_adam(offload, adamw, stage, tmp_path):
    torch.manual_seed(0)
    eng, ref = _train_both(TinyLM(), {"stage": stage}, tmp_path, offload, adamw=adamw)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6


@pytest.mark.parametrize("offload", OFFLOADS)
def test_tied_embedding_is_one_parameter(offload, tmp_path):
    torch.manual_seed(1)
    model = TinyLM(tie=True)
    eng, ref = _train_both(model, {}, tmp_path, offload)
    with eng:
        sd = eng.full_state_dict()
        assert torch.equal(sd["emb.weight"], sd["head.weight"])
        assert max_param_diff(sd, ref) <= 1e-6
        flat_numel = sum(fp.numel for fp in eng.flat_params)
        assert flat_numel == sum(p.numel() for p in ref.parameters())  # counted once


def test_full_state_dict_loads_strictly_into_a_fresh_llama():
    """Non-persistent buffers (rotary inv_freq) are not in the export, as in the model's own
    state_dict(), so a fresh Hugging Face model loads it strictly."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    expected = set(model.state_dict())
    with OffloadEngine(model, offload="cpu") as eng:
        x = torch.randint(0, 100, (2, 8))
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
        sd = eng.full_state_dict()
    assert set(sd) == expected
    LlamaForCausalLM(config).load_state_dict(sd)  # strict


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_a_module_used_under_two_names_exports_both(offload, tmp_path):
    """A module registered twice (``self.c = self.a``) has its parameters under both names in
    ``model.state_dict()``: the export has both too (it had only the first, so a fresh model's
    strict ``load_state_dict`` failed), with the trained values, and a checkpoint restores the
    model. Training matches torch's AdamW (one parameter each, however many names)."""
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.c = self.a

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x))))).pow(2).mean()

    torch.manual_seed(0)
    model = Shared()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    path = str(tmp_path) if offload == "nvme" else None
    x = torch.randn(4, 8)
    with OffloadEngine(model, offload=offload, path=path, lr=1e-2, weight_decay=0.1) as eng:
        for _ in range(3):
            eng.backward(eng(x))
            eng.step()
            ref(x).backward()
            opt.step()
            opt.zero_grad()
        sd = eng.full_state_dict()
        assert set(sd) == set(ref.state_dict()) == {f"{m}.{k}" for m in "abc" for k in
                                                     ("weight", "bias")}
        assert max_param_diff(sd, ref) <= 1e-6
        fresh = Shared()
        fresh.load_state_dict(sd)  # strict
        assert fresh.c is fresh.a and torch.equal(fresh.a.weight, sd["c.weight"])
        eng.save_checkpoint(tmp_path / "ck")
    with OffloadEngine(Shared(), offload=offload, path=path, lr=1e-2) as other:
        other.load_checkpoint(tmp_path / "ck")
        assert all(torch.equal(v, sd[k]) for k, v in other.full_state_dict().items())


def test_full_state_dict_names_and_shapes(tmp_path):
    model = TinyLM()
    expected = {n: p.shape for n, p in model.state_dict().items()}
    with OffloadEngine(model) as eng:
        sd = eng.full_state_dict()
    assert {n: t.shape for n, t in sd.items()} == expected
    assert all(t.dtype == torch.float32 for t in sd.values())
    fresh = TinyLM()
    fresh.load_state_dict(sd)  # strict


@pytest.mark.parametrize("offload_param", ["cpu", "nvme"])
def test_at_most_three_blocks_hold_storage(offload_param, tmp_path):
    """Residency from the tensors' own storage: the views a block's modules see while it runs
    share the storage of the gathered buffer, so their ``nbytes`` tell whether it is held.

    Parameter shards off the device (host or NVMe): the device holds only gathered units. (One
    rank with its shards on the device keeps them as the parameters; see the next test.)"""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=8)
    offload = "cpu"
    blocks = list(model.blocks)
    views = {}
    counts = []

    def held_blocks():
        return sum(any(t.untyped_storage().nbytes() > 0 for t in views[i]) for i in views)

    def pre_forward(i):
        def hook(mod, args):  # runs after the engine's pre-forward hook: views are live
            views[i] = [mod.up.weight, mod.down.weight, mod.ln.weight]
            assert all(t.untyped_storage().nbytes() > 0 for t in views[i])
            counts.append(("forward", i, held_blocks()))
        return hook

    def post_forward(i):
        def hook(mod, args, out):
            out.register_hook(lambda grad: counts.append(("backward", i, held_blocks())))
        return hook

    eng = _engine(model, offload, tmp_path, offload_param=offload_param, path=str(tmp_path))
    for i, b in enumerate(blocks):
        b.register_forward_pre_hook(pre_forward(i))
        b.register_forward_hook(post_forward(i))
    with eng:
        for step, (x, y) in enumerate(batches(3)):
            counts.clear()
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            assert len(counts) == 16
            if step:  # from the second step every block's views are known
                assert max(c for _, _, c in counts) <= 3, counts
                assert min(c for _, _, c in counts) >= 1, counts
            assert held_blocks() == 0  # nothing stays gathered between steps
            assert eng.memory_report()["live_units"]["current"] == 0
        assert eng.memory_report()["live_units"]["peak"] <= 4  # 3 blocks + root


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_with_device_shards_gathers_nothing(stage):
    """World size 1, shards on the device: the shard is the whole parameter, so no unit is
    copied into a second buffer (device parameter bytes never exceed the shards)."""
    with OffloadEngine(TinyLM(n_blocks=8), stage=stage, offload="cpu") as eng:
        shards = 4 * sum(fp.shard_numel for fp in eng.flat_params)
        for x, y in batches(2):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        params = eng.memory_report()["device"]["by_kind"]["parameters"]
        assert params["current_bytes"] == params["peak_bytes"] == shards
        assert all(fp.sharded.data_ptr() == fp.full_values().data_ptr() for fp in eng.flat_params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvme_swap_files(dtype, tmp_path):
    model = big_root_lm(4, vocab_scale=4)  # (embeddings and LM head each larger than a block)
    eng = OffloadEngine(model, offload="nvme", path=str(tmp_path), dtype=dtype,
                        update_timing="step")  # (the plain step's I/O, counted below)
    folder = tmp_path / "rank0"
    for x, y in batches(2):
        eng.backward(lm_loss(eng(x), y))
        eng.step()
    files = sorted(folder.glob("*.swp"))
    # per flat parameter: [master | exp_avg | exp_avg_sq] and, at stage 3, the parameter shard,
    # which in fp32 is the master's own bytes (no file of its own, never written separately)
    k = 4 if dtype == torch.float32 else 2
    assert len(files) == (1 if k == 4 else 2) * len(eng.trainable)
    for f in files:
        st = f.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size > 0 and st.st_size % 4096 == 0
    total = sum(f.stat().st_size for f in files)
    s = sum(fp.shard_numel for fp in eng.trainable)
    rep = eng.memory_report()
    assert rep["nvme"]["current_bytes"] == total == 12 * s + (0 if k == 4 else k * s)
    assert rep["nvme"]["by_kind"]["parameters"]["current_bytes"] == k * s
    assert rep["nvme"]["by_kind"]["master_weights"]["current_bytes"] == (0 if k == 4 else 4 * s)
    # two steps: optimizer state read twice and written twice, plus the initial write of the
    # master alone (the moments' bytes of a new file read as zeros, never written);
    # block shards read in forward and backward of each step; the root's in each forward (it
    # stays gathered from forward to backward), its outsized parts (embeddings, LM head) only
    # in the first (they have buffers of their own, where their updated shards stay for the
    # next forward); bf16 shards written once at start and after each step
    big = [fp for fp in eng.root.flat_params if fp.entries[0].names[0] != "norm.weight"]
    s_big = sum(fp.shard_numel for fp in big)
    s_root = sum(fp.shard_numel for fp in eng.root.flat_params)
    assert len(big) == 2 and eng.pools["param_shards_root"].numel == max(
        fp.shard_numel for fp in big) > max(fp.shard_numel for fp in eng.blocks[0].flat_params)
    assert rep["nvme"]["read_bytes"] == (2 * 12 * s + 2 * 2 * k * (s - s_root)
                                         + 2 * k * (s_root - s_big) + k * s_big)
    assert rep["nvme"]["written_bytes"] == 2 * 12 * s + 4 * s + (0 if k == 4 else 3 * k * s)
    eng.close()
    assert not folder.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", [{"update_timing": "step"}, {"update_timing": "next_forward"},
                                  {"update_timing": "backward"}])
@pytest.mark.parametrize("steps", [0, 2])
def test_swap_files_removed_on_garbage_collection_and_on_error(mode, steps, tmp_path):
    # every step mode's hooks and callbacks: none may keep the engine alive (its finalizer
    # holds the scheduler, the stores and the pools)
    eng = OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path), **mode)
    assert (tmp_path / "rank0").exists()
    for batch in batches(steps):
        eng.backward(lm_loss(eng(batch[0]), batch[1]))
        eng.step()
    del eng
    gc.collect()
    assert not (tmp_path / "rank0").exists()
    with pytest.raises(ZeroDivisionError):
        with OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path)) as eng:
            x, y = batches(1)[0]
            eng.backward(lm_loss(eng(x), y))
            1 / 0
    assert not (tmp_path / "rank0").exists()


@pytest.mark.parametrize("own_handler", [False, True])
def test_swap_files_removed_when_a_script_using_the_api_gets_sigterm(own_handler, tmp_path):
    """SIGTERM (torchrun, Slurm, docker stop) to a script of the user's: the process exits
    with 143 and its swap files are gone (they used to stay: SIGTERM's default action ends the
    process at once). A SIGTERM handler of the script's own is kept."""
    import signal
    import sys
    import textwrap
    child = textwrap.dedent(f'''
        import signal, sys, time, torch
        from offload_zero import OffloadEngine
        if {own_handler}:
            signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        engine = OffloadEngine(model, offload="nvme", path={str(tmp_path)!r})
        engine.backward(engine(torch.randn(4, 16)).sum())
        engine.step()
        print("ready", flush=True)
        time.sleep(60)
    ''')
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert (tmp_path / "rank0").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == (7 if own_handler else 143)
    finally:
        proc.kill()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("offload", OFFLOADS)
def test_memory_report_matches_numel_arithmetic(offload, tmp_path):
    with _engine(TinyLM(), offload, tmp_path, update_timing="step") as eng:
        s = sum(fp.shard_numel for fp in eng.trainable)
        rep = eng.memory_report()
        kinds = {t: {k: v["current_bytes"] for k, v in rep[t]["by_kind"].items()} for t in ("device", "host", "nvme")}
        param_tier = "nvme" if offload == "nvme" else "device"  # offload="nvme" at stage 3: both
        assert kinds[param_tier]["parameters"] == 4 * s  # fp32 shards at rest, nothing gathered
        tier = {"none": "device", "cpu": "host", "nvme": "nvme"}[offload]
        assert kinds[tier]["moments"] == 8 * s
        # fp32 compute with master and shard in one memory (the device, the host when the CPU
        # is the device, or NVMe at stage 3): the shard is the master (no second copy)
        assert kinds[tier]["master_weights"] == 0
        grad_tier = "device" if offload == "none" else "host"
        # with the host as the device, one rank adopts the reduced gradient as its host shard
        # (no copy): the shard bytes exist from backward to step
        assert kinds[grad_tier]["gradients"] == (4 * s if offload == "none" else 0)
        for x, y in batches(1):
            eng.backward(lm_loss(eng(x), y))
            held = eng.memory_report()[grad_tier]["by_kind"]["gradients"]["current_bytes"]
            assert held == 4 * s
            eng.step()
        rep = eng.memory_report()
        biggest_unit = max(fp.padded_numel for fp in eng.flat_params)
        if offload == "nvme":  # a unit's full gradient comes and goes on the device
            assert rep["device"]["peak_bytes"] >= rep["device"]["current_bytes"] + 4 * biggest_unit
        if offload == "cpu":  # the CPU is the device: the fp32 master is the shard's memory
            assert all(eng.store._state[fp][0].data_ptr() == fp.sharded.data_ptr()
                       for fp in eng.trainable)
        # storage-level check: every resident shard really holds its bytes
        if offload != "nvme":
            assert sum(fp.sharded.untyped_storage().nbytes() for fp in eng.flat_params) == 4 * sum(
                fp.shard_numel for fp in eng.flat_params)
        else:
            assert all(fp.sharded is None for fp in eng.flat_params)
            assert rep["pools"]["param_shards"]["in_use"] == 0


def test_shards_are_4096_byte_aligned():
    with OffloadEngine(TinyLM(), dtype=torch.bfloat16) as eng:
        for fp in eng.flat_params:
            assert (fp.shard_numel * 2) % 4096 == 0 and fp.padded_numel >= fp.numel
            assert fp.sharded.data_ptr() % 64 == 0


def test_skipped_and_repeated_units_and_two_forwards(tmp_path):
    torch.manual_seed(3)
    model = TinyLM()

    def vary(i, m, ref):
        for mm in (m, ref):
            mm.skip = {2} if i % 2 else set()
            mm.repeat = {4} if i == 1 else set()

    eng, ref = _train_both(model, {}, tmp_path, "cpu", before_step=vary)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        # two forwards before one backward accumulate into the same gradients
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        (x1, y1), (x2, y2) = batches(2, seed=9)
        eng.backward(lm_loss(eng(x1), y1) + lm_loss(eng(x2), y2))
        eng.step()
        ref_opt.zero_grad()
        (lm_loss(ref(x1), y1) + lm_loss(ref(x2), y2)).backward()
        # fresh AdamW state on the reference: compare only the direction of the accumulated grad
        assert all(p.grad is not None for p in ref.parameters())


def test_gradient_accumulation_over_two_backwards(tmp_path):
    torch.manual_seed(4)
    model = TinyLM()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    with OffloadEngine(model, offload="cpu", lr=1e-2) as eng:
        for step in range(3):
            bs = batches(2, seed=step)
            for x, y in bs:
                eng.backward(lm_loss(eng(x), y))
            eng.step()
            opt.zero_grad()
            for x, y in bs:
                lm_loss(ref(x), y).backward()
            opt.step()
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6


def test_frozen_parameters_stay_sharded_and_unchanged(tmp_path):
    torch.manual_seed(5)
    model = TinyLM()
    for b in model.blocks[:3]:
        b.up.weight.requires_grad_(False)
    model.emb.weight.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    eng, ref = _train_both(model, {"update_timing": "step"}, tmp_path, "nvme")
    with eng:
        sd = eng.full_state_dict()
        for n, v in frozen.items():
            assert torch.equal(sd[n], v), n
        assert max_param_diff(sd, ref) <= 1e-6
        assert all(fp.requires_grad for fp in eng.trainable)
        frozen_fps = [fp for fp in eng.flat_params if not fp.requires_grad]
        assert len(frozen_fps) == 4  # three blocks + root
        # optimizer state for the trainable shards (fp32: a trainable shard is its master's
        # bytes), the frozen shards in files of their own
        assert eng.memory_report()["nvme"]["current_bytes"] == 12 * sum(
            fp.shard_numel for fp in eng.trainable) + 4 * sum(fp.shard_numel for fp in frozen_fps)


def test_buffers_are_not_sharded_and_eval_between_steps():
    torch.manual_seed(6)

    class WithBN(nn.Module):
        def __init__(self):
            super().__init__()
            # no bias before the norm: its gradient would be pure rounding noise, which Adam
            # normalises into full-size steps in both runs alike but not identically
            # (nor a norm right after a norm, through a linear map, for the same reason)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8),
                                                      nn.Tanh()) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = WithBN()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    with OffloadEngine(model, lr=1e-2) as eng:
        target = torch.randn(16, 8)
        for i in range(3):
            x = torch.randn(16, 8)
            eng.train()
            eng.backward((eng(x) - target).pow(2).mean())
            eng.step()
            ref.train()
            opt.zero_grad()
            (ref(x) - target).pow(2).mean().backward()
            opt.step()
            eng.eval()
            ref.eval()
            with torch.no_grad():
                assert torch.allclose(eng(x), ref(x), atol=1e-5)
            with torch.inference_mode():
                assert torch.allclose(eng(x), ref(x), atol=1e-5)
        sd = eng.full_state_dict()
        for n, b in ref.named_buffers():
            assert torch.allclose(sd[n].to(b.dtype), b), n
        assert max_param_diff(sd, ref) <= 1e-6


def test_reading_another_units_parameter_names_it():
    class Peeking(TinyLM):
        def forward(self, x):
            return super().forward(x) + self.blocks[3].up.bias.sum()

    # shards off the device: the other unit is not gathered, so the read fails, naming it
    with OffloadEngine(Peeking(), offload_param="cpu") as eng:
        x, _ = batches(1)[0]
        with pytest.raises(RuntimeError, match=r"blocks\.3\.up\.bias"):
            eng(x)
    # one rank with its shards on the device: every parameter is always there, so it reads
    # the real value
    torch.manual_seed(0)
    model = Peeking()
    ref = copy.deepcopy(model)
    with OffloadEngine(model) as eng:
        x, _ = batches(1)[0]
        assert torch.equal(eng(x), ref(x))


@pytest.mark.parametrize("kwargs, match", [
    ({"offload": "tape"}, r"offload='tape'.*none.*cpu.*nvme"),
    ({"stage": 0}, r"stage=0.*\(1, 2, 3\)"),
    ({"stage": 4}, r"stage=4.*\(1, 2, 3\)"),
    ({"lr": -1e-3}, r"lr=-0.001.*>= 0"),
    ({"offload": "nvme"}, r"^offload='nvme' needs path="),
    ({"offload": "nvme", "path": "/nonexistent/swap"},
     r"/nonexistent/swap.*; offload='nvme' needs an existing"),
    ({"offload": "cpu", "offload_param": "nvme"}, r"^offload_param='nvme' needs path="),
    ({"betas": (0.9, 1.5)}, r"betas\[1\]=1.5"),
    ({"dtype": torch.int32}, r"dtype=torch.int32"),
])
def test_bad_input_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadEngine(TinyLM(), **kwargs)


@pytest.mark.parametrize("name", ["adamw", "activation_checkpointing", "offload_activations",
                                  "tail_state_in_host"])
def test_on_off_options_take_bools_and_refuse_anything_else(name):
    """A switch is True or False (numpy's bools too, from a config array or a sweep), or None
    where that means automatic: a string such as 'no' used to be taken as true (adamw,
    activation_checkpointing, offload_activations), and numpy's bools were refused."""
    from offload_zero.config import EngineConfig
    cfg = EngineConfig(**{name: np.bool_(False)})
    assert getattr(cfg, name) is False
    for bad in ("no", 1, 0.0):
        with pytest.raises(ValueError, match=rf"^{name}={bad!r} is not valid; use .*True or False"):
            EngineConfig(**{name: bad})


def test_number_options_take_numpy_numbers():
    """lr, eps, weight_decay, betas and max_grad_norm (and set_lr's lr) come from numpy as
    often as not (a sweep's np.logspace): numpy floats of any width are taken as Python
    floats (np.float32 was refused); a bool is refused (set_lr took True as 1.0). Counts
    (stage, prefetch, byte limits) from numpy are Python ints (np.int32 was refused)."""
    from offload_zero.config import EngineConfig
    cfg = EngineConfig(lr=np.float32(1e-3), eps=np.float16(1e-4), weight_decay=np.int64(0),
                       max_grad_norm=np.float32(1.0), betas=np.array([0.9, 0.95], np.float32),
                       stage=np.int64(2), prefetch=np.int32(2), max_host_bytes=np.uint64(1 << 30))
    assert all(type(getattr(cfg, k)) is int for k in ("stage", "prefetch", "max_host_bytes"))
    assert type(cfg.lr) is float and cfg.lr == float(np.float32(1e-3))
    assert all(type(getattr(cfg, k)) is float for k in ("eps", "weight_decay", "max_grad_norm"))
    assert cfg.betas == (float(np.float32(0.9)), float(np.float32(0.95)))
    with pytest.raises(ValueError, match=r"^lr=True is not valid; it must be a finite number >= 0"):
        EngineConfig(lr=True)
    with pytest.raises(ValueError, match=r"^lr=np.float32\(nan\) is not valid"):
        EngineConfig(lr=np.float32("nan"))
    with OffloadEngine(TinyLM()) as eng:  # set_lr: the same rule (True used to set lr=1.0)
        eng.set_lr(np.float32(0.5))
        assert type(eng.lr) is float and eng.lr == 0.5
        for bad in (True, "1e-3", -1):  # (0 is valid: a warmup's first step)
            with pytest.raises(ValueError, match=rf"^lr={bad!r} is not valid; it must be a finite number >= 0"):
                eng.set_lr(bad)
        assert eng.lr == 0.5


@pytest.mark.parametrize("kw, match", [
    ({"lr": float("inf")}, r"^lr=inf is not valid; it must be a finite number >= 0"),
    ({"eps": float("inf")}, r"^eps=inf is not valid"),
    ({"weight_decay": np.float32("inf")}, r"^weight_decay=np.float32\(inf\) is not valid"),
    ({"max_grad_norm": float("inf")}, r"^max_grad_norm=inf is not valid"),
    ({"stage": 3.0}, r"^stage=3.0 is not valid; choose one of \(1, 2, 3\)"),
    ({"betas": np.array([[0.9], [0.99]])}, r"^betas\[0\]=array\(\[0.9\]\) is not valid"),
    ({"betas": 0.9}, r"^betas=0.9 must be a pair"),
    ({"betas": (0.9, "0.99")}, r"^betas\[1\]='0.99' is not valid"),
    ({"timeout_s": -1}, r"^timeout_s=-1 is not valid; it must be a finite number > 0"),
    ({"timeout_s": 0}, r"^timeout_s=0 is not valid"),
])
def test_bad_numbers_are_refused_by_name(kw, match):
    """An infinite lr was taken, and the first update then left every later forward,
    full_state_dict() and checkpoint raising (the weights could not be read out); a float
    stage, a badly shaped betas array and a timeout <= 0 (a socket error under torchrun) got
    through or failed without naming the setting. Each is refused up front, by name."""
    with pytest.raises(ValueError, match=match):
        OffloadEngine(TinyLM(), **kw)


def test_set_lr_refuses_inf_and_takes_what_torch_optim_takes():
    """set_lr(inf) is refused and changes nothing (it used to poison the next update); a 0-d
    tensor (as torch.optim takes) or a 0-d numpy array is taken as its float."""
    with OffloadEngine(TinyLM(), lr=torch.tensor(1e-3)) as eng:
        assert type(eng.lr) is float and eng.lr == pytest.approx(1e-3)
        for bad in (float("inf"), float("-inf")):
            with pytest.raises(ValueError, match=r"is not valid; it must be a finite number >= 0"):
                eng.set_lr(bad)
        eng.set_lr(np.array(2e-3))
        assert eng.lr == 2e-3
        x, y = batches(1)[0]
        eng.backward(lm_loss(eng(x), y))
        eng.step()
        assert all(torch.isfinite(t).all() for t in eng.full_state_dict().values())


@pytest.mark.parametrize("kw", [{"offload": "cpu"}, {"offload": "none", "stage": 2},
                                {"offload": "nvme", "offload_optimizer": "cpu", "offload_param": "cpu"}])
def test_path_without_nvme_warns_that_it_is_unused(kw, tmp_path):
    """path= given where nothing goes to NVMe is a likely mistake (the user believes the state
    is on disk): a UserWarning names the path and the tiers, and no file is created there."""
    fix = "set offload_optimizer or offload_param to 'nvme'" if kw["offload"] == "nvme" else (
        "set offload='nvme'")
    with pytest.warns(UserWarning, match=r"path='.*' is not used: offload=.*puts nothing on NVMe; "
                                         + re.escape(fix)):
        OffloadEngine(TinyLM(), path=str(tmp_path), **kw).close()
    assert list(tmp_path.iterdir()) == []


def test_read_only_path_raises_value_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = False
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
        mounted = r.returncode == 0
        if not mounted:
            pytest.skip(f"running as root and cannot mount a read-only tmpfs: {r.stderr!r}")
    else:
        ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not writable"):
            OffloadEngine(TinyLM(), offload="nvme", path=str(ro))
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=False)


def test_closed_engine_refuses_work():
    eng = OffloadEngine(TinyLM())
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        eng(batches(1)[0][0])
    eng = OffloadEngine(TinyLM(), stage=3, offload_param="cpu")
    x, y = batches(1)[0]
    loss = lm_loss(eng(x), y)
    eng.close()
    with pytest.raises(RuntimeError, match="closed before this backward"):
        loss.backward()  # a graph from before close()


def test_a_closed_engine_with_updates_pending_refuses_every_call_that_works(tmp_path):
    """Closed right after a update_timing="next_forward" step (its updates pending): each call that would
    do work says the engine is closed (apply_pending_updates raised a KeyError; set_lr
    passed silently)."""
    eng = OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path))
    x, y = batches(1)[0]
    eng.backward(lm_loss(eng(x), y))
    eng.step()
    assert "pending" in eng.update_states().values()
    eng.close()
    calls = [lambda: eng(x), eng.step, eng.zero_grad, eng.apply_pending_updates,
             eng.full_state_dict, lambda: eng.set_lr(1e-3),
             lambda: eng.save_checkpoint(tmp_path / "ckpt"),
             lambda: eng.load_checkpoint(tmp_path / "ckpt")]
    for call in calls:
        with pytest.raises(RuntimeError, match="this OffloadEngine is closed"):
            call()


def test_zero_grad_takes_torchs_set_to_none():
    """``zero_grad(set_to_none=...)`` as torch's optimizers have it: gradients are dropped
    either way (the shards are the engine's own buffers)."""
    eng = OffloadEngine(TinyLM(), stage=2, offload="cpu")
    x, y = batches(1)[0]
    for set_to_none in (True, False):
        eng.backward(lm_loss(eng(x), y))
        eng.zero_grad(set_to_none=set_to_none)
        assert not any(eng.grads.has_grad[fp] for fp in eng.trainable)
    eng.close()


def test_a_model_wrapped_twice_is_refused_by_name():
    model = TinyLM()
    with OffloadEngine(model):
        with pytest.raises(ValueError, match="TinyLM is already wrapped by an OffloadEngine"):
            OffloadEngine(model)


def test_bf16_compute_trains_and_keeps_fp32_master(tmp_path):
    torch.manual_seed(7)
    model = TinyLM()
    with OffloadEngine(model, offload="nvme", path=str(tmp_path), dtype=torch.bfloat16, lr=1e-2) as eng:
        losses = []
        x, y = batches(1)[0]
        for _ in range(15):
            loss = lm_loss(eng(x), y)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
        assert losses[-1] < losses[0] - 0.5
        assert all(fp.dtype == torch.bfloat16 for fp in eng.flat_params)
        assert eng.pools["param_shards"].dtype == torch.bfloat16
        sd = eng.full_state_dict()
        # master weights carry precision bf16 cannot hold
        assert any(not torch.equal(t, t.bfloat16().float()) for t in sd.values())


@pytest.mark.parametrize("offload_param", ["cpu", "nvme"])
def test_parameter_offload_matches_and_bounds_host_residency(offload_param, tmp_path):
    torch.manual_seed(8)
    model = TinyLM(n_blocks=8)
    seen = []
    holder = []

    def probe(mod, args):
        if holder:
            rep = holder[0].memory_report()
            seen.append((rep["host"]["by_kind"]["parameters"]["current_bytes"],
                         rep["pools"].get("param_shards", {}).get("in_use", 0)))

    for b in model.blocks:
        b.register_forward_pre_hook(probe)
    eng, ref = _train_both(model, {"offload_param": offload_param, "offload_optimizer": "cpu",
                                   "path": str(tmp_path)}, tmp_path, "cpu", on_engine=holder.append)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        s_all = sum(fp.shard_numel for fp in eng.flat_params)
        rep = eng.memory_report()
        if offload_param == "cpu":
            assert rep["host"]["by_kind"]["parameters"]["current_bytes"] == 4 * s_all
            assert rep["device"]["by_kind"]["parameters"]["current_bytes"] == 0
        else:
            # host holds parameter shards only for the units in flight: the current unit and
            # the one being read ahead (prefetch=1), never all eight
            assert rep["nvme"]["by_kind"]["parameters"]["current_bytes"] == 4 * s_all
            assert seen and all(host == 0 for host, _ in seen)
            assert max(in_use for _, in_use in seen) <= 2
            assert rep["pools"]["param_shards"]["peak_in_use"] <= eng.pools["param_shards"].count
            assert rep["pools"]["param_shards"]["in_use"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvme_matches_cpu_offload_bit_for_bit(dtype, tmp_path):
    """offload="nvme" (optimizer state and parameter shards in files; fp32 shards read from the
    master's bytes; the root's updated shard kept for the next forward) against host offload
    of both."""
    results = []
    for offload in ("cpu", "nvme"):
        torch.manual_seed(9)
        with _engine(TinyLM(), offload, tmp_path, lr=1e-2, dtype=dtype, stage=3,
                     offload_param=offload) as eng:
            for x, y in batches(5):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            results.append(eng.full_state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_offload_param_needs_stage_3():
    with pytest.raises(ValueError, match=r"offload_param='cpu' needs stage=3"):
        OffloadEngine(TinyLM(), stage=2, offload_param="cpu")


# -- offload="auto" ------------------------------------------------------------------------------

def _deep():
    # many small units: parameter shards outweigh the NVMe read-ahead pool, so each candidate
    # needs less of the scarce tier than the one before it
    return TinyLM(n_blocks=32)


def _needs(stage=3):
    from offload_zero.estimator import placement_bytes
    from offload_zero.placement import CANDIDATES
    return {c: {t: placement_bytes(_deep(), stage, *c, dtype=torch.float32, accelerator=False)
                .tier_bytes(t) for t in ("device", "host", "nvme")} for c in CANDIDATES}


def test_auto_picks_the_cheapest_placement_that_fits(tmp_path):
    needs = _needs()
    big = 10**12
    cases = [
        ((big, big), ("none", "none")),
        ((needs[("none", "none")]["device"] - 1, big), ("cpu", "none")),
        ((needs[("cpu", "none")]["device"] - 1, big), ("cpu", "cpu")),
        ((needs[("cpu", "none")]["device"] - 1, needs[("cpu", "cpu")]["host"] - 1), ("nvme", "cpu")),
        ((needs[("cpu", "none")]["device"] - 1, needs[("nvme", "cpu")]["host"] - 1), ("nvme", "nvme")),
    ]
    for (max_dev, max_host), expected in cases:
        if expected == ("nvme", "nvme"):
            assert needs[expected]["host"] <= max_host, "test budget leaves no room for the NVMe pool"
        with OffloadEngine(_deep(), offload="auto", path=str(tmp_path), max_device_bytes=max_dev,
                           max_host_bytes=max_host) as eng:
            got = (eng.config.offload_optimizer, eng.config.offload_param)
            assert got == expected, (max_dev, max_host, eng.placement.tried)
            x, y = batches(1)[0]
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            rep = eng.memory_report()
            # the measured peaks stay inside the budgets the choice was made for
            assert rep["device"]["peak_bytes"] <= max_dev
            assert rep["host"]["peak_bytes"] <= max_host


def test_auto_raises_before_allocating_when_nothing_fits(tmp_path):
    with pytest.raises(ValueError, match=r"does not fit even with everything offloaded.*short of"):
        OffloadEngine(TinyLM(), offload="auto", path=str(tmp_path), max_device_bytes=0,
                      max_host_bytes=1000)
    assert list(tmp_path.iterdir()) == []  # no swap folder, no files


def test_auto_without_path_never_picks_nvme():
    needs = _needs()
    with pytest.raises(ValueError, match="needs path="):
        OffloadEngine(_deep(), offload="auto", max_device_bytes=needs[("cpu", "none")]["device"] - 1,
                      max_host_bytes=needs[("cpu", "cpu")]["host"] - 1)


# -- activation checkpointing ----------------------------------------------------------------------

def _saved_bytes_and_grads(checkpointing, steps=1):
    torch.manual_seed(10)
    model = TinyLM(n_blocks=8)
    calls = []
    for b in model.blocks:
        b.up.register_forward_hook(
            lambda mod, a, o: calls.append(mod.weight.untyped_storage().nbytes() > 0))
    with OffloadEngine(model, activation_checkpointing=checkpointing) as eng:
        x, y = batches(1, batch=8, seq=32)[0]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
            loss = lm_loss(eng(x), y)
        eng.backward(loss)
        grads = {fp.name: eng.grads.buf[fp].clone() for fp in eng.trainable}
        gathers = eng.comm_report()["total"]["all_gather"]
    return loss.item(), grads, sum(saved), calls


def test_activation_checkpointing_same_numbers_less_memory():
    loss0, grads0, saved0, calls0 = _saved_bytes_and_grads(False)
    loss1, grads1, saved1, calls1 = _saved_bytes_and_grads(True)
    assert abs(loss0 - loss1) <= 1e-6
    for name in grads0:
        assert (grads0[name] - grads1[name]).abs().max().item() <= 1e-6, name
    assert saved1 < 0.5 * saved0, (saved0, saved1)  # only block inputs are kept
    # each block's Linear ran once without checkpointing, twice with (the recomputation), and
    # every time its weight was gathered
    assert len(calls0) == 8 and len(calls1) == 16
    assert all(calls1)


def test_host_memory_flat_over_200_steps_with_nvme(tmp_path):
    """Fixed pools sized at start-up: peak RSS after step 20 and after step 200 within 2%."""
    import json
    import sys
    job = os.path.join(os.path.dirname(__file__), "rss_job.py")
    r = subprocess.run([sys.executable, job, str(tmp_path), "200", "20"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert abs(out["rss_at_end"] - out["rss_at_mark"]) / out["rss_at_mark"] < 0.02, out
    assert out["pools_at_end"] == out["pools_at_mark"]  # same buffers, same peak use
    assert out["pools_at_end"]["param_shards"]["in_use"] == 0


def test_activation_checkpointing_on_a_llama_matches_plain_backward():
    """Regression: views set in a pre-backward hook (grad mode off there) must still track
    gradients, else the recomputation saves fewer tensors and gives no weight gradients."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        with OffloadEngine(LlamaForCausalLM(cfg), activation_checkpointing=checkpointing) as eng:
            eng.backward(eng(input_ids=x, labels=x).loss)
            grads.append({fp.name: eng.grads.buf[fp].clone() for fp in eng.trainable})
    for name, g in grads[0].items():
        assert g.abs().sum() > 0
        assert (g - grads[1][name]).abs().max().item() <= 1e-6, name


def test_bf16_gradient_shards_on_host_halve_their_bytes(tmp_path):
    torch.manual_seed(11)
    model = TinyLM()
    ref_model = copy.deepcopy(model)
    with OffloadEngine(model, offload="cpu", grad_dtype=torch.bfloat16, lr=1e-2) as eng, \
            OffloadEngine(ref_model, offload="cpu", lr=1e-2) as ref:
        s = sum(fp.shard_numel for fp in eng.trainable)
        for i, (x, y) in enumerate(batches(5)):
            for e in (eng, ref):
                e.backward(lm_loss(e(x), y))
            if i == 0:  # gradient shards held between backward and step
                assert eng.memory_report()["host"]["by_kind"]["gradients"]["current_bytes"] == 2 * s
                assert ref.memory_report()["host"]["by_kind"]["gradients"]["current_bytes"] == 4 * s
            for e in (eng, ref):
                e.step()
        a, b = eng.full_state_dict(), ref.full_state_dict()
        # bf16 gradients move each step by at most lr-sized amounts differently; close, not equal
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 5e-2
    with pytest.raises(ValueError, match="grad_dtype"):
        OffloadEngine(TinyLM(), grad_dtype=torch.float16)


def test_nvme_io_settings_probed_by_default_and_overridable(tmp_path):
    with OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path)) as eng:
        assert eng.swapper.tuning["source"] in ("probe", "cache", "default")
        assert eng.swapper.block_size == eng.swapper.tuning["block_size"]
        assert eng.swapper.block_size % 4096 == 0 and eng.swapper.queue_depth >= 1
    with OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path), aio_block_size=1 << 16,
                       aio_queue_depth=3) as eng:
        assert (eng.swapper.block_size, eng.swapper.queue_depth) == (1 << 16, 3)


def test_gradient_clipping_matches_torch_clip_grad_norm(tmp_path):
    torch.manual_seed(12)
    model = TinyLM()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    with OffloadEngine(model, offload="cpu", lr=1e-2, max_grad_norm=0.5) as eng:
        for x, y in batches(5):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            opt.zero_grad()
            lm_loss(ref(x), y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
            opt.step()
            assert abs(eng.last_grad_norm - ref_norm) <= 1e-5 * max(1.0, ref_norm)
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        # a non-finite gradient skips the step and changes nothing
        before = eng.full_state_dict()
        x, y = batches(1)[0]
        loss = lm_loss(eng(x), y) * float("inf")
        eng.backward(loss)
        eng.step()
        assert eng.skipped_steps == 1
        after = eng.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("next_forward", [False, True])
@pytest.mark.parametrize("fault", ["eio", "short"])
def test_nvme_write_fault_names_file_and_offset_and_close_cleans_up(fault, next_forward,
                                                                    tmp_path, monkeypatch):
    """The plain step writes the state back in step(); update_timing="next_forward" in the next forward,
    where the fault then raises."""
    import errno

    from offload_zero.memory.swapper import SwapIOError
    eng = OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path), aio_backend="threads",
                        aio_block_size=4096, aio_queue_depth=2,
                        update_timing="next_forward" if next_forward else "step")
    x, y = batches(1)[0]
    eng.backward(lm_loss(eng(x), y))
    if next_forward:
        eng.step()
    real = os.pwritev
    calls = {"n": 0}

    def faulty(fd, buffers, offset, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            if fault == "eio":
                raise OSError(errno.EIO, "Input/output error")
            return 512  # a short write
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "pwritev", faulty)
    with pytest.raises(SwapIOError) as info:
        eng(x) if next_forward else eng.step()
    msg = str(info.value)
    assert str(tmp_path / "rank0") in msg and ".swp" in msg and "offset" in msg
    monkeypatch.setattr(os, "pwritev", real)
    eng.close()  # still closes cleanly and removes every file
    assert not (tmp_path / "rank0").exists()


def test_a_fault_in_a_deferred_write_back_names_its_file_and_close_cleans_up(tmp_path,
                                                                              monkeypatch):
    """update_timing="next_forward" holds the last blocks' write-backs until the forward's last update: an
    EIO in one of them raises where it is waited for (backward's read-ahead, or at the latest
    step()), naming that block's file and the offset, and close() still removes every file.
    (Every transfer is done by the time it is polled: which reads start when, and so which
    write-backs are held, is then the same in every run.)"""
    import errno

    from offload_zero.memory.swapper import SwapHandle, SwapIOError
    monkeypatch.setattr(SwapHandle, "done", lambda h: h._done.wait() or True)
    eng = OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path), aio_backend="threads",
                        update_timing="next_forward")
    x, y = batches(1)[0]
    for _ in range(2):
        eng.backward(lm_loss(eng(x), y))
        eng.step()
    held = []
    held_by_engine = eng._updates.may_defer_write_back

    def may_defer(fp):
        if held_by_engine(fp):
            held.append(fp.name)
            return True
        return False

    monkeypatch.setattr(eng._updates, "may_defer_write_back", may_defer)
    real = os.pwritev

    def faulty(fd, buffers, offset, *args):
        if held and os.readlink(f"/proc/self/fd/{fd}").endswith(f"/{held[-1]}.swp"):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "pwritev", faulty)
    with pytest.raises(SwapIOError) as info:
        eng.backward(lm_loss(eng(x), y))
        eng.step()
    assert held  # (the fault was in a deferred write)
    msg = str(info.value)
    assert f"{held[-1]}.swp" in msg and "offset" in msg
    monkeypatch.setattr(os, "pwritev", real)
    eng.close()
    assert not (tmp_path / "rank0").exists()


def test_nvme_optimizer_pipeline_in_chunks(tmp_path, monkeypatch):
    """Flat parameters larger than a chunk stream through the pipeline in several chunks: same
    numbers as host-resident state, buffers sized by the chunk, and an overflow found before
    the first chunk is written leaves every chunk unchanged."""
    from offload_zero.memory.tiers import NVMeStore
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    results = []
    for offload in ("cpu", "nvme"):
        torch.manual_seed(13)
        with _engine(big_root_lm(6, vocab_scale=2), offload, tmp_path, lr=1e-2,
                     update_timing="step") as eng:
            if offload == "nvme":
                assert max(fp.shard_numel for fp in eng.trainable) >= 3 * 1024
                assert eng.memory_report()["host"]["by_kind"]["buffers"]["current_bytes"] >= 9 * 1024 * 4
                assert eng.store._bufs[0].numel() == 3 * 1024
            for x, y in batches(4):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            if offload == "nvme":
                before = eng.full_state_dict()
                x, y = batches(1)[0]
                eng.backward(lm_loss(eng(x), y) * float("nan"))
                eng.step()
                assert eng.skipped_steps == 1
                after = eng.full_state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
            results.append(eng.full_state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_check_before_a_chunked_update(dtype):
    """The check that guards a chunked update: exact for inf and nan wherever they sit, and
    finite values whose sum overflows are still finite (checked element by element)."""
    from offload_zero.update.adam import all_finite as _all_finite
    t = torch.randn(10_000, dtype=dtype)
    assert _all_finite(t)
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[7_777] = bad
        assert not _all_finite(u, chunk=1024)
    u = t.clone()
    u[3], u[9_000] = float("inf"), float("-inf")  # the sum is nan, not 0
    assert not _all_finite(u)
    big = torch.full((4096,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert not torch.isfinite(big.sum()) and _all_finite(big, chunk=1000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameter_pool_is_block_sized_with_a_separate_root_pool(dtype, tmp_path):
    """Reads ahead for (prefetch + 2) units of two flat parameters, plus a write-back ring of two
    where the shard is not its master (bf16); the root's outsized parts (embeddings, LM head)
    have a buffer each apart (their read and their write-back never overlap: the step's writes
    are done before the next forward reads), its final norm goes through the blocks' pool."""
    k, ring = (4, 0) if dtype == torch.float32 else (2, 2)
    with OffloadEngine(big_root_lm(4, vocab_scale=4), offload="nvme", path=str(tmp_path),
                       dtype=dtype, update_timing="step") as eng:
        blocks = [fp for u in eng.blocks for fp in u.flat_params]
        roots = eng.root.flat_params
        assert len(roots) == 3
        pools = eng.memory_report()["pools"]
        assert pools["param_shards"]["buffer_bytes"] == k * max(fp.shard_numel for fp in blocks)
        assert pools["param_shards"]["buffers"] == 2 * (1 + 2) + ring
        assert pools["param_shards_root"]["buffers"] == 2
        assert pools["param_shards_root"]["buffer_bytes"] == k * max(fp.shard_numel for fp in roots)
        for x, y in batches(2):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        pools = eng.memory_report()["pools"]
        assert pools["param_shards_root"]["peak_in_use"] == 2
        assert pools["param_shards"]["in_use"] == 0


def test_unknown_keyword_and_stale_swap_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"OffloadEngine got unknown keyword argument\(s\) \['foo'\]"):
        OffloadEngine(TinyLM(), foo=1)
    stale = tmp_path / "rank0"
    stale.mkdir()
    (stale / "unit0.trainable.swp").write_bytes(b"")
    with pytest.raises(ValueError, match=r"earlier run was killed.*delete"):
        OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path))



def _left_by(folder, pid, boot_id=None):
    """A rank folder as a killed run leaves it: a swap file and the owner file naming ``pid``
    (this boot's id unless ``boot_id``)."""
    import json
    import socket
    folder.mkdir()
    (folder / "unit0.trainable.swp").write_bytes(b"\0" * 4096)
    boot = boot_id or open("/proc/sys/kernel/random/boot_id").read().strip()
    (folder / ".owner").write_text(json.dumps({"pid": pid, "boot_id": boot,
                                               "host": socket.gethostname()}))


def test_a_rank_folder_whose_owner_is_gone_is_reclaimed_and_a_live_ones_refused(tmp_path):
    """A run killed with SIGKILL leaves its rank folder; the owner file it holds (pid, boot id)
    lets the next run take it over, with a warning, when that process is gone (or the machine
    rebooted since), and refuse it while it runs. (Without an owner file, the older layout,
    stale swap files are refused as before: test_unknown_keyword_and_stale_swap_files_are_named.)"""
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name, pid, boot in (("dead", dead.pid, None), ("rebooted", os.getpid(), "another-boot")):
        path = tmp_path / name
        path.mkdir()
        _left_by(path / "rank0", pid, boot)
        with pytest.warns(RuntimeWarning, match=rf"left by process {pid}.*gone.*removing 1 "
                                                r"swap file"):
            with OffloadEngine(TinyLM(), offload="nvme", path=str(path)) as eng:
                for x, y in batches(1):
                    eng.backward(lm_loss(eng(x), y))
                    eng.step()
        assert list((path / "rank0").iterdir()) == []  # its files and the owner file removed
    live = subprocess.Popen(["sleep", "60"])
    try:
        path = tmp_path / "live"
        path.mkdir()
        _left_by(path / "rank0", live.pid)
        with pytest.raises(ValueError, match=rf"is in use by process {live.pid}"):
            OffloadEngine(TinyLM(), offload="nvme", path=str(path))
        assert sorted(p.name for p in (path / "rank0").iterdir()) == [".owner",
                                                                      "unit0.trainable.swp"]
    finally:
        live.kill()
        live.wait()


# -- the gather pool ------------------------------------------------------------------------------
def _slot_of(eng, ptr):
    """(pool name, slot index) of a device address inside a gather pool, or None."""
    for name in ("gather", "gather_root"):
        pool = eng.pools.get(name)
        for i, slot in enumerate(pool._slots if pool else []):
            if slot.data_ptr() <= ptr < slot.data_ptr() + pool.slot_bytes:
                return name, i
    return None


@pytest.mark.parametrize("offload_param", ["cpu", "nvme"])
def test_gathered_units_live_in_the_fixed_gather_pool(offload_param, tmp_path):
    """Every gathered parameter the modules see, in forward and backward, lies in the pool's
    slots sized at start-up; a unit may come back in another slot for backward and autograd's
    saved views still see its values (the numbers match plain AdamW)."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=8)
    seen = {"forward": {}, "backward": {}, "root": []}

    def on_engine(eng):
        def record(phase, i, ptr):
            seen[phase].setdefault(i, []).append(_slot_of(eng, ptr))

        def pre(mod, args, i):
            record("forward", i, mod.up.weight.data_ptr())

        def post(mod, args, out, i):
            out.register_hook(lambda g: record("backward", i, mod.up.weight.data_ptr()))

        for i, b in enumerate(model.blocks):
            b.register_forward_pre_hook(lambda mod, args, i=i: pre(mod, args, i))
            b.register_forward_hook(lambda mod, args, out, i=i: post(mod, args, out, i))
        model.head.register_forward_pre_hook(
            lambda mod, args: seen["root"].append(_slot_of(eng, mod.weight.data_ptr())))

    kw = {"stage": 3, "offload_param": offload_param, "path": str(tmp_path)}
    eng, ref = _train_both(model, kw, tmp_path, "cpu", steps=4, on_engine=on_engine)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        rep = eng.memory_report()
        pools = rep["pools"]
        slots = 1 if offload_param == "nvme" else 2  # prefetch + 1, one for NVMe-resident shards
        block_bytes = max(sum(fp.padded_numel * 4 for fp in u.flat_params) for u in eng.blocks)
        assert pools["gather"]["buffers"] == slots and pools["gather"]["grown"] == 0
        assert pools["gather"]["buffer_bytes"] == block_bytes
        assert pools["gather"]["in_use"] == 0 and pools["gather"]["peak_in_use"] == slots
        assert pools["gather_root"]["buffers"] == 1
        assert rep["device"]["by_kind"]["buffers"]["peak_bytes"] == (
            slots * block_bytes + pools["gather_root"]["buffer_bytes"])
        assert rep["device"]["by_kind"]["parameters"]["peak_bytes"] == 0  # nothing else gathered
    every = [s for phase in ("forward", "backward") for v in seen[phase].values() for s in v]
    assert len(every) == 2 * 8 * 4 and all(s is not None and s[0] == "gather" for s in every)
    assert len(seen["root"]) == 4 and all(s == ("gather_root", 0) for s in seen["root"])
    if slots > 1:
        moved = [i for i in range(8) if seen["forward"][i] != seen["backward"][i]]
        assert moved, seen


@pytest.mark.parametrize("timing", ["auto", "backward"])
@pytest.mark.parametrize("offload_param", ["cpu", "nvme"])
def test_without_storage_rebinding_gathers_allocate_and_train_the_same(
        offload_param, timing, tmp_path, monkeypatch, caplog):
    """A torch without storage rebinding (torch 2.11 has none) runs stage 3 without the
    gather pool: each gather allocates its unit, the log says so, the report has no pool, and
    the weights after 4 steps are bit for bit those of the run with the pool."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=4)
    kw = {"stage": 3, "offload_param": offload_param, "update_timing": timing}
    finals = []
    for rebind in (True, False):
        import offload_zero.build as build_mod
        monkeypatch.setattr(build_mod, "storage_rebinding_supported", lambda r=rebind: r)
        run = tmp_path / str(rebind)
        run.mkdir()
        with caplog.at_level("INFO", logger="offload_zero"):
            eng, ref = _train_both(copy.deepcopy(model), dict(kw, path=str(run)), run, "nvme",
                                   steps=4)
        with eng:
            assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
            assert ("gather" in eng.memory_report()["pools"]) is rebind
            finals.append(eng.full_state_dict())
    assert "cannot rebind storages" in caplog.text
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_gather_pool_grows_once_when_a_schedule_holds_more_units(tmp_path, caplog):
    """Blocks that share a weight gather each other (deps): more units at once than the pool was
    sized for. It adds slots with a warning during the first step, the numbers stay right, and
    later steps allocate nothing more."""
    torch.manual_seed(3)
    model = TinyLM(n_blocks=6)
    for i in (2, 4):
        model.blocks[i].up.weight = model.blocks[i - 2].up.weight  # tied across blocks
    engines, grown = [], []

    def before_step(i, model, ref):
        if i:
            grown.append(engines[0].memory_report()["pools"]["gather"]["grown"])

    kw = {"stage": 3, "offload_param": "cpu"}
    with caplog.at_level("WARNING", logger="offload_zero.memory.pool"):
        eng, ref = _train_both(model, kw, tmp_path, "cpu", steps=4, before_step=before_step,
                               on_engine=engines.append)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        pool = eng.memory_report()["pools"]["gather"]
        assert pool["grown"] >= 1 and pool["buffers"] == 2 + pool["grown"]
        assert grown == [pool["grown"]] * 3  # grown during the first step only
    assert any("gather pool 'gather'" in r.getMessage() and "adding one slot" in r.getMessage()
               for r in caplog.records)


def test_views_of_a_gathered_unit_keep_their_values_after_close():
    """An error inside a unit's forward leaves it gathered; closing the engine gives the pool
    back but copies the unit's values out first, so views still referenced stay readable."""
    torch.manual_seed(0)
    model = TinyLM()
    held = []

    def boom(mod, args):
        held.append(mod.up.weight)
        raise KeyError("stop")

    eng = OffloadEngine(model, stage=3, offload="cpu", offload_param="cpu")
    expected = eng.full_state_dict()["blocks.2.up.weight"].clone()
    model.blocks[2].register_forward_pre_hook(boom)
    with pytest.raises(KeyError):
        eng(batches(1)[0][0])
    assert eng.pools["gather"].in_use >= 1
    eng.close()
    assert torch.equal(held[0].float(), expected)


@pytest.mark.parametrize("offload,offload_param", [("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "none")])
def test_units_left_gathered_by_an_error_in_forward_are_freed_by_the_next_forward(
        offload, offload_param, tmp_path, caplog):
    """An error inside a block's forward leaves that block (and the one prefetched after it)
    gathered. Catching it and training on, as a loop that skips a failed batch does, never
    holds more units than a clean run nor grows the gather pool: the next forward frees what
    the failed one left. The weights then
    match plain AdamW that never saw the failed batch."""
    torch.manual_seed(4)
    model = TinyLM(n_blocks=4)
    fail = [False]

    def boom(mod, args):
        if fail[0]:
            raise KeyError("injected")

    model.blocks[2].register_forward_pre_hook(boom)

    engines = []

    def before_step(i, model, ref):
        if i in (1, 2):  # a failed forward before steps 1 and 2, then the batch is trained
            fail[0] = True
            with pytest.raises(KeyError, match="injected"):
                engines[0](batches(1)[0][0])
            fail[0] = False

    with caplog.at_level("WARNING", logger="offload_zero.memory.pool"):
        eng, ref = _train_both(model, {"stage": 3, "offload_param": offload_param}, tmp_path,
                               offload, steps=4, before_step=before_step,
                               on_engine=engines.append)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        pool = eng.memory_report()["pools"].get("gather", {"grown": 0})  # none: no param tier
        assert pool["grown"] == 0, pool
        assert eng.scheduler.live_peak <= 3  # root, a block and the one prefetched
    assert not [r for r in caplog.records if "adding one slot" in r.getMessage()]


def test_blocks_with_frozen_weights_are_freed_during_backward(tmp_path):
    """Frozen weights (the LayerNorm that runs first, and a Linear) are still used by backward
    after the block's trainable gradients are accumulated; the block is freed once its inputs'
    gradients are computed, so backward holds as few blocks as forward and the gather pool never
    grows. Numbers match plain AdamW."""
    torch.manual_seed(6)
    model = TinyLM(n_blocks=8)
    for b in model.blocks:
        b.ln.requires_grad_(False)
        b.up.weight.requires_grad_(False)
    live = []

    def on_engine(eng):
        for b in model.blocks:
            b.register_forward_hook(lambda mod, args, out: out.register_hook(
                lambda g: live.append(eng.scheduler.live_units())) and None)

    kw = {"stage": 3, "offload_param": "cpu"}
    eng, ref = _train_both(model, kw, tmp_path, "cpu", steps=3, on_engine=on_engine)
    with eng:
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6
        pool = eng.memory_report()["pools"]["gather"]
        assert pool["grown"] == 0 and pool["peak_in_use"] <= 2
        assert len(live) == 3 * 8 and max(live) <= 3, live  # two blocks + root


# -- update_timing="backward" --------------------------------------------------------------------------
def _run(model, steps, **kw):
    eng = OffloadEngine(model, lr=1e-2, weight_decay=0.1, **kw)
    reads_after_backward = []
    for x, y in batches(steps):
        eng.backward(lm_loss(eng(x), y))
        reads_after_backward.append(eng.memory_report()["nvme"]["read_bytes"])
        eng.step()
    return eng, reads_after_backward


def _twins(model, tmp_path, sib_a=False, sib_b=True, **kw):
    """Engines ``(a, b)`` on ``model`` and a deep copy of it, each with a swap folder of its
    own under ``tmp_path``, lr 1e-2 and weight decay 0.1 unless ``kw`` says otherwise: ``a``
    with ``update_timing="backward"`` if ``sib_a`` (the reference), ``b`` if ``sib_b``; one
    without it takes the plain step (``update_timing="step"``) unless ``kw`` says."""
    kw = {"lr": 1e-2, "weight_decay": 0.1, **kw}
    twin = copy.deepcopy(model)
    nvme = "nvme" in (kw.get("offload"), kw.get("offload_optimizer"), kw.get("offload_param"))
    for name in "ab":
        (tmp_path / name).mkdir()
    a, b = ((str(tmp_path / name) if nvme else None) for name in "ab")
    plain = {"update_timing": "step"}
    timing = {"update_timing": "backward"}
    return (OffloadEngine(model, path=a, **(timing if sib_a else plain), **kw),
            OffloadEngine(twin, path=b, **(timing if sib_b else plain), **kw))


@pytest.mark.parametrize("offload,offload_param,stage,dtype", [
    ("none", None, 2, torch.float32), ("cpu", None, 3, torch.float32),
    ("cpu", "cpu", 3, torch.bfloat16), ("nvme", "none", 2, torch.float32),
    ("nvme", "nvme", 3, torch.float32), ("nvme", "nvme", 3, torch.bfloat16)])
def test_update_in_backward_gives_the_same_weights_as_the_step(offload, offload_param, stage, dtype,
                                                             tmp_path):
    """Updating each flat parameter as soon as its gradient is final, inside backward, gives
    bit-for-bit the weights of the update in step(); with NVMe the blocks' optimizer state is
    read during backward (the bytes read before step() is called)."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=4)
    twin = copy.deepcopy(model)
    kw = dict(offload=offload, stage=stage, dtype=dtype)
    if offload_param:
        kw["offload_param"] = offload_param
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, _ = _run(model, 4, path=str(tmp_path / "a"), **kw)
    b, reads = _run(twin, 4, path=str(tmp_path / "b"), update_timing="backward", **kw)
    with a, b:
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert b.skipped_steps == a.skipped_steps == 0
        if offload == "nvme":
            blocks = [fp for u in b.blocks for fp in u.flat_params if fp.requires_grad]
            # the blocks' state (master + moments) was read, and written, before step()
            assert reads[1] - reads[0] >= 12 * sum(fp.shard_numel for fp in blocks)
            ring = b.memory_report()["pools"]["optimizer_prefetch"]
            # a third buffer when fp32 parameter shards are gathered from the read-ahead
            from_state = offload_param == "nvme" and dtype == torch.float32
            assert ring["buffers"] == (3 if from_state else 2) and ring["in_use"] == 0
            assert ring["buffer_bytes"] == 12 * max(fp.shard_numel for fp in blocks)


def test_update_in_backward_leaves_no_write_in_flight_after_step(tmp_path):
    """A model whose every unit's state fits the read-ahead buffers is updated entirely in
    backward; step() still waits for every write-back, since the next forward reads fp32
    parameter shards from those very bytes."""
    from models import WIDTH, Block
    torch.manual_seed(2)
    model = TinyLM(n_blocks=3)
    model.blocks = nn.ModuleList(Block(WIDTH, hidden=200) for _ in range(3))  # root < block
    twin = copy.deepcopy(model)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, _ = _run(model, 3, offload="nvme", path=str(tmp_path / "a"))
    b = OffloadEngine(twin, lr=1e-2, weight_decay=0.1, offload="nvme", path=str(tmp_path / "b"),
                      update_timing="backward")
    with a, b:
        root = [fp for fp in b.root.flat_params if fp.requires_grad]
        blocks = [fp for u in b.blocks for fp in u.flat_params if fp.requires_grad]
        assert max(fp.shard_numel for fp in root) <= max(fp.shard_numel for fp in blocks)
        for x, y in batches(3):
            b.backward(lm_loss(b(x), y))
            assert b.store._whole_writes  # updates of the last units still being written
            b.step()
            assert not b.store._whole_writes and not b.store._whole_reads
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("stage", [2, 3])
def test_update_in_backward_streams_outsized_root_states_during_backward(stage, tmp_path,
                                                                       monkeypatch):
    """With update_timing="backward" the root's trainable parameters are three flat parameters: the
    final norm and the LM head, whose gradients backward finishes first (their views are made
    when they run, not at the start of forward), and the embeddings. A state larger than the
    read-ahead buffers is updated chunk by chunk from the hooks that follow its gradient: the
    LM head's is done before backward reaches the first block. Weights equal the plain step's
    bit for bit, and a nan step is skipped by both."""
    from offload_zero.memory.tiers import NVMeStore
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    torch.manual_seed(4)
    model = big_root_lm(4)
    a, b = _twins(model, tmp_path, offload="nvme", stage=stage)
    with a, b:
        norm, head, emb = b.root.flat_params
        assert (norm.name, head.name, emb.name) == (
            "root.trainable", "root.trainable.1", "root.trainable.2")
        assert {fqn for e in norm.entries for _, _, fqn in e.refs} == {"norm.weight",
                                                                      "norm.bias"}
        assert {fqn for e in head.entries for _, _, fqn in e.refs} == {"head.weight"}
        assert {fqn for e in emb.entries for _, _, fqn in e.refs} == {"emb.weight"}
        assert b.store._chunk < head.shard_numel and not b.store.prefetch(head)
        events = []
        on_grad = b.scheduler._on_grad

        def spy(fp):
            done = b.update_states().get(head.name) in ("applied", "overflowed", "unused")
            events.append((fp.name, done))
            on_grad(fp)
        b.scheduler._on_grad = spy
        for i, (x, y) in enumerate(batches(4)):
            scale = float("nan") if i == 2 else 1.0
            for eng in (a, b):
                events.clear()
                eng.backward(lm_loss(eng(x), y) * scale)
                eng.step()
            order = [name for name, _ in events]
            # (the LM head runs last in forward: backward reaches it before the final norm)
            assert order == ["root.trainable.1", "root.trainable"] + [
                f"unit{k}.trainable" for k in (3, 2, 1, 0)] + ["root.trainable.2"], order
            assert dict(events)["unit0.trainable"], events  # the LM head's update is done
            assert "streaming" not in b.update_states().values()
        assert a.skipped_steps == b.skipped_steps == 1
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_update_in_backward_state_read_between_backward_and_step(tmp_path, monkeypatch):
    """An update still streaming when backward returns (the embeddings', whose gradient comes
    last) is finished before anything reads the weights: full_state_dict() and an evaluation
    forward between backward and step see every update of that backward, and training goes on
    bit for bit as without them."""
    from offload_zero.memory.tiers import NVMeStore
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    torch.manual_seed(7)
    model = big_root_lm(3)
    # (the embeddings' state on NVMe: in host memory it would be updated at once)
    a, b = _twins(model, tmp_path, sib_a=True, offload="nvme", tail_state_in_host=False)
    with a, b:
        for x, y in batches(3):
            a.backward(lm_loss(a(x), y))
            a.step()
            b.backward(lm_loss(b(x), y))
            assert "streaming" in b.update_states().values()  # the embeddings' update is still under way
            peek = b.full_state_dict()
            with torch.no_grad():
                b.eval()
                logits = b(x)
                b.train()
            b.step()
            after = a.full_state_dict()
            assert all(torch.equal(peek[k], after[k]) for k in after)
            with torch.no_grad():
                a.eval()
                assert torch.equal(logits, a(x))
                a.train()
        sb = b.full_state_dict()
        assert all(torch.equal(after[k], sb[k]) for k in after)


def test_update_in_backward_interleaved_updates_through_one_staging_buffer(tmp_path, monkeypatch):
    """With shards on an accelerator and the optimizer state off it, every update writes its
    new compute-dtype values into one host staging buffer before they are copied to the device.
    An LM head's update streamed chunk by chunk is interleaved with the blocks' updates, so each
    chunk must reach the device before another update takes the buffer. Emulated on the CPU by
    routing the updates through one shared buffer, as on CUDA; same weights as the plain step."""
    from offload_zero.memory.tiers import NVMeStore
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    from offload_zero.update.adam import ShardAdam
    original = ShardAdam.update_target

    def through_staging(self, fp):
        target = original(self, fp)
        if target is not None and fp.home is None and target.data_ptr() == fp.sharded.data_ptr():
            if getattr(self, "_test_staging", None) is None:
                self._test_staging = torch.empty(max(f.shard_numel for f in self.step_count),
                                                 dtype=fp.sharded.dtype)
            return self._test_staging[:fp.shard_numel]
        return target
    monkeypatch.setattr(ShardAdam, "update_target", through_staging)
    torch.manual_seed(8)
    model = big_root_lm(3, vocab_scale=4)
    a, b = _twins(model, tmp_path, offload="nvme", offload_param="none", stage=3)
    with a, b:
        for x, y in batches(3):
            for eng in (a, b):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
        assert b._updates.adam._test_staging is not None
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        x, y = batches(1, seed=1)[0]
        with torch.no_grad():  # the compute-dtype shards on the device, not only the masters
            a.eval(), b.eval()
            assert torch.equal(a(x), b(x))


def test_update_in_backward_streamed_update_keeps_the_lr_of_its_backward(tmp_path, monkeypatch):
    """An update still streaming when backward returns uses the learning rate of that backward
    to its last chunk, like every other update made in backward: set_lr() between backward and
    step changes the next backward's, as set_lr() after a plain step does."""
    from offload_zero.memory.tiers import NVMeStore
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    torch.manual_seed(10)
    a, b = _twins(big_root_lm(3, vocab_scale=4), tmp_path, offload="nvme")
    with a, b:
        for i, (x, y) in enumerate(batches(3)):
            a.backward(lm_loss(a(x), y))
            a.step()
            a.set_lr(1e-2 / (i + 2))
            b.backward(lm_loss(b(x), y))
            assert "streaming" in b.update_states().values()  # the embeddings' update is still under way
            b.set_lr(1e-2 / (i + 2))
            b.step()
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_in_backward_forward_between_backward_and_step_with_kept_root_shards(dtype,
                                                                                  tmp_path):
    """The root's updated shards stay in buffers of their own for the next forward; a forward
    between backward and step reads them while their write-back may still be in flight. The
    wait must not take a second buffer (one leaked per such forward: the next backward found
    the root's pool empty). Same weights as the plain step."""
    a, b = _twins(big_root_lm(3, vocab_scale=4), tmp_path, offload="nvme", offload_param="nvme",
                  stage=3, dtype=dtype)
    with a, b:
        assert "param_shards_root" in b.pools
        for x, y in batches(4):
            a.backward(lm_loss(a(x), y))
            a.step()
            b.backward(lm_loss(b(x), y))
            with torch.no_grad():
                b.eval()
                b(x)
                b.train()
            b.step()
            assert b.pools["param_shards_root"].in_use <= len(b.root.flat_params)
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_ctrl_c_in_backward_starts_no_step(tmp_path):
    """Ctrl-C inside backward with update_timing="backward": the engine frees the units and starts no
    more I/O (it used to run the whole step while the interrupt unwound, reading and writing
    the NVMe state). The step stays open: backward refuses to accumulate until zero_grad()
    ends it; then training goes on and the engine closes cleanly."""
    torch.manual_seed(12)
    model = TinyLM(n_blocks=4)
    fault = {"kind": None}
    block = model.blocks[1]
    inner = block.forward
    block.forward = lambda x: BackwardFault.apply(inner(x), fault["kind"])
    (x, y), = batches(1)
    with OffloadEngine(model, offload="nvme", path=str(tmp_path), lr=1e-2,
                       update_timing="backward") as eng:
        eng.backward(lm_loss(eng(x), y))
        eng.step()
        fault["kind"] = "interrupt"
        loss = lm_loss(eng(x), y)
        io = eng.swapper.bytes_read, eng.swapper.bytes_written
        with pytest.raises(KeyboardInterrupt):
            eng.backward(loss)
        fault["kind"] = None
        assert eng.scheduler.live_units() == 0 and eng._backward_pending
        assert eng.skipped_steps == 0 and "applied" in eng.update_states().values()  # updates made, the step not ended
        with pytest.raises(RuntimeError, match="cannot accumulate"):
            eng.backward(lm_loss(eng(x), y))
        eng.zero_grad()  # ends the step
        assert not eng._backward_pending and (eng.swapper.bytes_read, eng.swapper.bytes_written) > io
        eng.backward(lm_loss(eng(x), y))
        eng.step()


@pytest.mark.parametrize("offload,sib", [("cpu", False), ("nvme", False), ("nvme", True)])
def test_an_error_in_backward_then_zero_grad_skips_the_batch(offload, sib, tmp_path):
    """An error raised inside backward frees the units as the end of backward would (later
    forwards still free each unit after it runs) and the next backward works. Plain step:
    zero_grad() drops the failed batch's partial gradients, so training continues exactly as
    if that batch had never been seen. update_timing="backward": the step ends with the error."""
    torch.manual_seed(11)
    a, b = _twins(TinyLM(n_blocks=4), tmp_path, sib_a=sib, sib_b=sib, offload=offload, stage=3)
    fail = {"on": False}
    block = b.module.blocks[2]
    inner = block.forward
    block.forward = lambda x: BackwardFault.apply(inner(x), "raise" if fail["on"] else None)
    data = batches(4)
    with a, b:
        for i, (x, y) in enumerate(data):
            if i != 1:
                a.backward(lm_loss(a(x), y))
                a.step()
            fail["on"] = i == 1
            try:
                b.backward(lm_loss(b(x), y))
            except ArithmeticError:
                assert i == 1
                b.zero_grad()
            else:
                b.step()
            fail["on"] = False
            live = []
            h = b.module.blocks[3].register_forward_hook(
                lambda *_: live.append(b.scheduler.live_units()))
            with torch.no_grad():
                b.eval()
                b(x)
                b.train()
            h.remove()
            assert live and live[0] <= 3  # still freed block by block (2 blocks + root)
        if not sib:
            sa, sb = a.full_state_dict(), b.full_state_dict()
            assert all(torch.equal(sa[k], sb[k]) for k in sa)
            assert a.skipped_steps == b.skipped_steps == 0


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_zero_grad_drops_a_stage_1_gradient_held_for_the_step(offload, tmp_path):
    """Stage 1 keeps each full gradient from backward to the step (where it is reduced);
    zero_grad() must drop it, or the next step adds the dropped batch back."""
    torch.manual_seed(12)
    a, b = _twins(TinyLM(n_blocks=2), tmp_path, sib_b=False, offload=offload, stage=1)
    (x0, y0), (x1, y1) = batches(2)
    with a, b:
        b.backward(lm_loss(b(x0), y0))
        b.zero_grad()
        for eng in (a, b):
            eng.backward(lm_loss(eng(x1), y1))
            eng.step()
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_after_an_error_in_backward_serves_no_stale_parameter_read(dtype, tmp_path):
    """Backward reads the next unit's shard ahead; an error can leave that read unused. A
    step() that then updates the unit (it has gradients from an earlier backward) must not let
    the next forward take the read from before the update: the engine's forward equals a
    fresh engine's built from its full_state_dict()."""
    torch.manual_seed(13)
    kw = dict(stage=3, offload="nvme", offload_param="nvme", dtype=dtype, prefetch=1)
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    with OffloadEngine(TinyLM(n_blocks=4), path=str(tmp_path / "b"), **kw) as b:
        fail = {"on": False}
        block = b.module.blocks[2]
        inner = block.forward
        block.forward = lambda x: BackwardFault.apply(inner(x), "raise" if fail["on"] else None)
        data = batches(3)
        b.backward(lm_loss(b(data[0][0]), data[0][1]))
        fail["on"] = True
        with pytest.raises(ArithmeticError):
            b.backward(lm_loss(b(data[1][0]), data[1][1]))
        fail["on"] = False
        b.step()  # applies the first backward's gradients (and what the second finished)
        fresh = TinyLM(n_blocks=4)
        fresh.load_state_dict(b.full_state_dict())
        with OffloadEngine(fresh, path=str(tmp_path / "c"), **kw) as c, torch.no_grad():
            b.eval(), c.eval()
            assert torch.equal(b(data[2][0]), c(data[2][0]))


def test_update_in_backward_with_a_frozen_root_parameter_and_bf16_shards_on_nvme(tmp_path):
    """A root with frozen parameters has one buffer for its outsized shards on NVMe; with
    update_timing="backward" its outsized trainable flat parameters (the LM head, the embeddings) are
    updated one after the other in the same backward (here with frozen blocks between them),
    so the second waits for the first one's write-back to free that buffer (the final norm's
    small part goes through the blocks' buffers). Same weights as the plain step."""
    torch.manual_seed(6)
    model = big_root_lm(3, vocab_scale=4)
    model.norm.weight.requires_grad_(False)
    model.blocks.requires_grad_(False)  # no block update (and write) between the two
    a, b = _twins(model, tmp_path, offload="nvme", stage=3, dtype=torch.bfloat16)
    with a, b:
        assert [fp.name for fp in b.root.flat_params] == [
            "root.trainable", "root.trainable.1", "root.trainable.2", "root.frozen"]
        assert b.memory_report()["pools"]["param_shards_root"]["buffers"] == 1
        for x, y in batches(3):
            for eng in (a, b):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_update_in_backward_gathers_fp32_nvme_parameters_from_the_state_read(tmp_path):
    """fp32 parameter shards on NVMe are their master's bytes: in backward each block is
    gathered from the whole state read ahead for its update, so a step reads one parameter
    shard per block less than the plain step (the blocks' reads in backward); in forward the
    last blocks, whose state the read-ahead ring takes in forward for the start of backward,
    are gathered from that read too (one read less each). Same weights bit for bit. A
    parameter read while the store still writes that shard's master takes it from the
    write's buffer, with no read of the file."""
    torch.manual_seed(5)
    model = TinyLM(n_blocks=4)
    a, b = _twins(model, tmp_path, offload="nvme", offload_param="nvme", stage=3,
                  dtype=torch.float32)
    with a, b:
        blocks = [fp for u in b.blocks for fp in u.flat_params]
        assert all(fp.requires_grad for fp in blocks)
        per_step = {}
        for eng in (a, b):
            reads = []
            for x, y in batches(4):
                reads.append(eng.swapper.bytes_read)
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            per_step[eng] = reads[3] - reads[2]
        ring = b.pools["optimizer_prefetch"].count
        assert ring == 3
        for eng, param_reads in ((a, 2), (b, 1)):  # forward and backward, or forward only
            block_shards = sum(fp.shard_numel for u in eng.blocks for fp in u.flat_params)
            if eng is b:  # the last `ring` blocks in forward: gathered from the state read
                block_shards -= sum(fp.shard_numel for u in eng.scheduler.order[-ring:]
                                    for fp in u.flat_params)
            # (b: the embeddings' state stays in host memory, tail_state_in_host)
            state = sum(fp.shard_numel for fp in eng.trainable if not eng.store.in_host(fp))
            # the root is read in forward unless its updated shards stay in buffers of its own
            root = 0 if "param_shards_root" in eng.pools else sum(
                fp.shard_numel for fp in eng.root.flat_params if not eng.store.in_host(fp))
            assert per_step[eng] == 4 * (param_reads * block_shards + root) + 12 * state
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        x, y = batches(1)[0]
        b.backward(lm_loss(b(x), y))
        pending = [w[0] for w in b.store._whole_writes]
        assert pending  # the last units' updates are still being written
        fp = pending[-1]
        before = b.swapper.bytes_read
        shard = b.param_home.read(fp)  # from the buffer being written: no read of the file
        assert b.swapper.bytes_read == before
        b.step()
        assert torch.equal(shard, b.store.read_master(fp))


def test_update_in_backward_reads_the_first_states_of_backward_during_forward(tmp_path):
    """With the optimizer state on NVMe and parameter shards in memory, a training forward
    starts reading the whole state of the blocks backward updates first (the last in forward
    order, as many as the read-ahead ring holds) before its first block runs, so backward
    starts with them in memory; an evaluation forward (no grad, or eval mode) starts none. Same
    weights as the plain step, bit for bit, with an evaluation forward between the steps."""
    torch.manual_seed(6)
    model = TinyLM(n_blocks=4)
    a, b = _twins(model, tmp_path, offload_optimizer="nvme", offload_param="none", stage=3)
    seen = []
    with a, b:
        ring = b.pools["optimizer_prefetch"]
        assert ring.count == 2

        def at_first_block(module, args):
            seen.append([b.store.prefetched(fp) for u in b.scheduler.order
                         for fp in u.flat_params])
        b.module.blocks[0].register_forward_pre_hook(at_first_block)
        for i, (x, y) in enumerate(batches(4)):
            for eng in (a, b):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
                with torch.no_grad():
                    eng(x)
                eng.eval()
                eng(x)
                eng.train()
        # the first forward records the order; from the second on, the last two blocks'
        # states are being read when block 0 starts; never in an evaluation forward
        assert seen[0] == []  # (no order yet)
        for i in range(1, 4):
            assert seen[3 * i] == [False, False, True, True]
            assert seen[3 * i + 1] == seen[3 * i + 2] == [False] * 4
        assert ring.in_use == 0 and not b.store._whole_reads
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_update_in_backward_forward_read_ahead_keeps_the_parameter_reads_first(tmp_path):
    """When forward reads fp32 parameter shards from NVMe, a last block's whole-state read
    starts with the lead its parameter read would have had (``prefetch`` units), after the
    parameter reads of the blocks before it, and that block is gathered from it: the reads of
    one forward, in the order they are started, are block 0's parameters, then each later
    block's whole state (master, two moments)."""
    torch.manual_seed(7)
    model = TinyLM(n_blocks=4)
    with OffloadEngine(model, offload="nvme", path=str(tmp_path), stage=3, lr=1e-2,
                       update_timing="backward") as eng:
        for x, y in batches(2):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        names = {fp.name: i for i, u in enumerate(eng.scheduler.order) for fp in u.flat_params}
        log = []
        swap_in = eng.swapper.swap_in

        def logged(key, tensor, offset_bytes=0):
            log.append((names.get(key), offset_bytes > 0))
            return swap_in(key, tensor, offset_bytes=offset_bytes)
        eng.swapper.swap_in = logged
        x, y = batches(1)[0]
        loss = lm_loss(eng(x), y)
        eng.swapper.swap_in = swap_in
        # (None: the root's own shards)
        starts = [blk for blk, moment in log if not moment and blk is not None]
        assert starts == [0, 1, 2, 3]  # each read's first (or only) part
        assert sum(moment for _, moment in log) == 2 * 3  # blocks 1-3: whole states
        eng.backward(loss)
        eng.step()


@pytest.mark.parametrize("offload_param,dtype", [("none", torch.float32), ("nvme", torch.float32),
                                                  ("nvme", torch.bfloat16)])
def test_update_in_backward_keeps_the_tail_state_in_host_memory(offload_param, dtype, tmp_path):
    """tail_state_in_host: the flat parameter updated last in backward (the embeddings) keeps
    its master weights and moments in host memory: no swap file of it, 12 bytes per element
    of its shard fewer read and written per step (its fp32 parameter shard, read from the
    master's bytes, is not read either), its bytes on the host tier (8 per element when the
    master is the CPU device's shard itself). Same weights bit for bit as the plain step and
    as the state on NVMe."""
    torch.manual_seed(8)
    model = TinyLM(n_blocks=3)
    twin = copy.deepcopy(model)
    kw = dict(offload="nvme", offload_param=offload_param, stage=3, dtype=dtype, lr=1e-2,
              weight_decay=0.1)
    a, b = _twins(model, tmp_path, sib_a=False, sib_b=True, tail_state_in_host=True, **kw)
    (tmp_path / "c").mkdir()
    c = OffloadEngine(twin, path=str(tmp_path / "c"), update_timing="backward",
                      tail_state_in_host=False, **kw)
    with a, b, c:
        tail = b.root.flat_params[-1]
        assert tail.requires_grad and b.store.in_host(tail) and not c.store.in_host(c.root.flat_params[-1])
        assert not a.store.in_host(a.root.flat_params[-1])  # (needs update_timing="backward")
        # (the state's file; a bf16 parameter shard on NVMe keeps its own .param file)
        assert f"{tail.name}.swp" not in [os.path.basename(f) for f in b.swapper.files]
        assert f"{tail.name}.swp" in [os.path.basename(f) for f in c.swapper.files]
        moved = {}
        for eng in (a, b, c):
            for i, (x, y) in enumerate(batches(4)):
                if i == 3:
                    r0, w0 = eng.swapper.bytes_read, eng.swapper.bytes_written
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            moved[eng] = (eng.swapper.bytes_read - r0, eng.swapper.bytes_written - w0)
        n = tail.shard_numel
        fp32_shard_in_master = offload_param == "nvme" and dtype == torch.float32
        assert moved[c][0] - moved[b][0] == 12 * n + (4 * n if fp32_shard_in_master and
                                                      "param_shards_root" not in c.pools else 0)
        assert moved[c][1] - moved[b][1] == 12 * n
        host = b.memory_report()["host"]["by_kind"]
        host_c = c.memory_report()["host"]["by_kind"]
        aliased = offload_param == "none" and dtype == torch.float32  # the CPU device's shard
        assert (host["master_weights"]["current_bytes"] - host_c["master_weights"]["current_bytes"]
                == (0 if aliased else 4 * n))
        assert host["moments"]["current_bytes"] - host_c["moments"]["current_bytes"] == 8 * n
        if aliased:
            assert b.store.aliases(tail)
        # the chunk pipeline's buffers are sized by the states that stream through them
        from offload_zero.memory.tiers import NVMeStore
        streamed = max(fp.shard_numel for fp in b.trainable if fp is not tail)
        assert b.memory_report()["pools"]["optimizer_pipeline"]["buffer_bytes"] == 3 * 4 * min(
            streamed, NVMeStore.CHUNK_NUMEL)
        sa, sb, sc = a.full_state_dict(), b.full_state_dict(), c.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sc[k]) for k in sa)


def test_tail_state_in_host_by_default_only_when_it_is_a_small_part(tmp_path):
    """tail_state_in_host=None keeps the embeddings' state in host memory only when it is at
    most a quarter of the model's state; True forces it; where it cannot act (no
    update_timing="backward", or the state not on NVMe) True warns and nothing changes; a non-bool is
    refused by name."""
    torch.manual_seed(9)
    small = TinyLM(n_blocks=3)   # embeddings ~1/6 of the parameters
    big = TinyLM(n_blocks=1)     # ~1/3
    for model, default in ((small, True), (big, False)):
        for setting, expected in ((None, default), (True, True), (False, False)):
            with OffloadEngine(copy.deepcopy(model), offload="nvme", path=str(tmp_path),
                               update_timing="backward", tail_state_in_host=setting) as eng:
                assert eng.store.in_host(eng.root.flat_params[-1]) is expected, (model, setting)
    # tied embeddings: the tail is the embedding and LM head; the pipeline is sized by the rest
    from offload_zero.memory.tiers import NVMeStore
    tied = big_root_lm(3)
    tied.head.weight = tied.emb.weight
    with OffloadEngine(tied, offload="nvme", path=str(tmp_path),
                       update_timing="backward", tail_state_in_host=True) as eng:
        tail = eng.root.flat_params[-1]
        assert eng.store.in_host(tail) and tail.shard_numel > max(
            fp.shard_numel for fp in eng.trainable if fp is not tail)
        streamed = max(fp.shard_numel for fp in eng.trainable if fp is not tail)
        assert eng.memory_report()["pools"]["optimizer_pipeline"]["buffer_bytes"] == 3 * 4 * min(
            streamed, NVMeStore.CHUNK_NUMEL)
    with pytest.warns(UserWarning, match="tail_state_in_host=True has no effect"):
        OffloadEngine(copy.deepcopy(small), offload="nvme", path=str(tmp_path),
                      update_timing="step", tail_state_in_host=True).close()
    with pytest.warns(UserWarning, match="it is on 'cpu'"):
        OffloadEngine(copy.deepcopy(small), offload="cpu", update_timing="backward",
                      tail_state_in_host=True).close()
    with pytest.raises(ValueError, match="tail_state_in_host='yes' is not valid"):
        OffloadEngine(copy.deepcopy(small), tail_state_in_host="yes")


def _slow_writes_of(monkeypatch, prefix, seconds=0.3):
    """Make the thread backend's writes to swap files named ``prefix*`` take ``seconds`` more:
    a disk slow to write one state, so a reader that does not wait for it sees the old bytes."""
    import time
    from offload_zero.memory import aio_threads
    run = aio_threads.ThreadsBackend._run

    def slow(request):
        if request.is_write and os.path.basename(request.path).startswith(prefix):
            time.sleep(seconds)
        run(request)
    monkeypatch.setattr(aio_threads.ThreadsBackend, "_run", staticmethod(slow))


def test_update_in_backward_forward_before_step_reads_the_state_backward_wrote(tmp_path,
                                                                             monkeypatch):
    """A training forward between backward and step sees that backward's updates: its
    read-ahead of a block's state (fp32 parameter shards gathered from it) waits for, or is not
    started before, the write-back of that same state still in flight. With that write made
    slow, the losses and weights equal backward; step; forward; backward; step bit for bit."""
    _slow_writes_of(monkeypatch, "unit0.trainable.swp")
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    a, b = _twins(model, tmp_path, sib_a=True, sib_b=True, offload="nvme", offload_param="nvme",
                  stage=3, aio_backend="threads")
    (x1, y1), (x2, y2) = batches(2)
    with a, b:
        a.backward(lm_loss(a(x1), y1))
        a.step()
        want = lm_loss(a(x2), y2)
        a.backward(want)
        a.step()
        b.backward(lm_loss(b(x1), y1))
        got = lm_loss(b(x2), y2)  # a training forward before step()
        b.step()
        b.backward(got)
        b.step()
        assert torch.equal(got, want)
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_update_in_backward_skips_a_non_finite_step_and_refuses_accumulation(tmp_path):
    torch.manual_seed(0)
    model = TinyLM(n_blocks=3)
    with OffloadEngine(model, offload="nvme", path=str(tmp_path), update_timing="backward") as eng:
        x, y = batches(1)[0]
        eng.backward(lm_loss(eng(x), y))
        eng.step()
        before = eng.full_state_dict()
        eng.backward(lm_loss(eng(x), y) * float("nan"))
        eng.step()
        assert eng.skipped_steps == 1
        after = eng.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        eng.backward(lm_loss(eng(x), y))
        with pytest.raises(RuntimeError, match="cannot accumulate"):
            eng.backward(lm_loss(eng(x), y))
        eng.step()


@pytest.mark.parametrize("kwargs,match", [
    ({"update_timing": "backward", "max_grad_norm": 1.0}, "max_grad_norm=1.0"),
    ({"update_timing": "backward", "stage": 1}, "stage=1"),
    ({"update_timing": "yes"}, "update_timing='yes' is not valid; choose one of")])
def test_update_in_backward_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadEngine(TinyLM(), **kwargs)


# -- update_timing="next_forward" ---------------------------------------------------------------------------
SIF_CASES = [("cpu", "none", F32, {}), ("nvme", "nvme", F32, {}), ("nvme", "none", F32, {}),
             ("nvme", "cpu", F32, {}), ("nvme", "nvme", torch.bfloat16, {}),
             ("nvme", "nvme", F32, {"max_grad_norm": 0.05}),
             ("cpu", "cpu", torch.float16, {}), ("nvme", "nvme", F32, {"prefetch": 2})]


def _run_sif_pair(model_fn, engine_kw, tmp_path, steps=4, micro=2, between=None):
    """The same training with the plain step and with update_timing="next_forward": per run, the losses, an
    evaluation forward's logits after the last step (before anything else reads the weights)
    and the final weights."""
    out = []
    for sif in (False, True):
        torch.manual_seed(0)
        model = model_fn()
        path = tmp_path / f"sif{sif}"
        path.mkdir()
        kw = dict(engine_kw, path=str(path) if "nvme" in (engine_kw.get("offload"),
                                                           engine_kw.get("offload_param")) else None)
        losses = []
        with OffloadEngine(model, stage=3, lr=1e-2, weight_decay=0.1,
                           update_timing="next_forward" if sif else "step",
                           **kw) as eng:
            data = batches(steps * micro, seed=3)
            for i in range(steps):
                if between:
                    between(i, model, eng)
                for x, y in data[i * micro:(i + 1) * micro]:  # gradient accumulation
                    loss = lm_loss(eng(x), y)
                    eng.backward(loss)
                    losses.append(loss.item())
                eng.step()
            with torch.no_grad():
                logits = eng(data[0][0]).clone()
            out.append((losses, logits, eng.full_state_dict(), eng.skipped_steps))
    return out


@pytest.mark.parametrize("offload,offload_param,dtype,extra", SIF_CASES,
                         ids=[f"{o}-{p}-{str(d)[6:]}-{'-'.join(e) or 'plain'}"
                              for o, p, d, e in SIF_CASES])
def test_update_in_next_forward_gives_the_weights_of_the_step(offload, offload_param, dtype, extra,
                                                       tmp_path, monkeypatch):
    """Updates decided by step() and applied before each unit's next gather: the losses, the
    logits of an evaluation forward right after the last step and the final weights are those
    of the plain step bit for bit, with gradient accumulation (two backward calls per step),
    clipping, bf16 and fp16 (loss scale), parameter shards on the device, in host memory or on
    NVMe, and the root's state streamed in chunks."""
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    kw = dict(offload=offload, offload_param=offload_param, dtype=dtype, **extra)
    (l0, g0, w0, s0), (l1, g1, w1, s1) = _run_sif_pair(lambda: big_root_lm(3, vocab_scale=2),
                                                       kw, tmp_path)
    assert l0 == l1 and s0 == s1
    assert torch.equal(g0, g1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_update_in_next_forward_moves_the_state_io_into_the_next_forward(tmp_path):
    """With the optimizer state on NVMe, step() writes no state: the next forward applies the
    updates, reading the blocks' whole states ahead into the read-ahead buffers (the first
    blocks' already during backward), and writes 12 bytes per element of every state back,
    except the input embeddings', kept in host memory (``tail_state_in_host``: forward needs
    their update first)."""
    torch.manual_seed(0)
    with OffloadEngine(TinyLM(n_blocks=4), offload="nvme", offload_param="none",
                       path=str(tmp_path), update_timing="next_forward") as eng:
        in_host = [fp for fp in eng.trainable if eng.store.in_host(fp)]
        assert [e.refs[0][2] for fp in in_host for e in fp.entries] == ["emb.weight"]
        x, y = batches(1)[0]
        loss = lm_loss(eng(x), y)
        written, read = eng.store.written_bytes, eng.store.read_bytes
        eng.backward(loss)
        eng.step()
        assert eng.store.written_bytes == written
        state = 12 * sum(fp.shard_numel for fp in eng.trainable if fp not in in_host)
        eng(x)
        eng.store.drain()  # (the last write-backs are left in flight)
        assert eng.store.written_bytes - written == state
        assert eng.store.read_bytes - read == state
        ring = eng.memory_report()["pools"]["optimizer_prefetch"]
        assert ring["buffers"] == 3 and ring["peak_in_use"] == 3


def test_update_in_next_forward_streams_the_lm_head_update_while_the_blocks_run(tmp_path,
                                                                         monkeypatch):
    """The root's parameters used after the blocks are flat parameters of their own (the LM
    head's weight, the final norm's): the next forward gathers the embeddings' part at its
    start, after their update, and streams the LM head's update chunk by chunk while the blocks
    run, gathering it only when the LM head runs. The weights stay those of the plain step."""
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    torch.manual_seed(0)
    model = big_root_lm(4, vocab_scale=6)
    events = []
    with OffloadEngine(model, offload="nvme", path=str(tmp_path), stage=3, lr=1e-2,
                       update_timing="next_forward") as eng:
        norm, head, emb = [fp for fp in eng.root.flat_params if fp.requires_grad]
        assert {e.names[0] for e in norm.entries} == {"norm.weight", "norm.bias"}
        assert [e.names[0] for e in head.entries] == ["head.weight"]
        assert [e.names[0] for e in emb.entries] == ["emb.weight"]
        chunks = math.ceil(head.shard_numel / 1024)
        assert chunks > 4  # more chunks than blocks: some are left for the head's own gather
        update = eng._updates.adam.update

        def logged(fp, lo, *args, **kw):
            events.append((fp.name, lo))
            return update(fp, lo, *args, **kw)

        def mark(label):
            return lambda mod, args: events.append((label, head.state.value, emb.state.value))

        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(mark(f"block{i}"), prepend=True)
        model.head.register_forward_pre_hook(mark("head"), prepend=True)
        x, y = batches(1)[0]
        eng.backward(lm_loss(eng(x), y))
        eng.step()
        monkeypatch.setattr(eng._updates.adam, "update", logged)
        events.clear()
        eng(x)
        at = {e[0]: i for i, e in enumerate(events) if e[0].startswith(("block", "head"))}
        emb_updates = [i for i, e in enumerate(events) if e[0] == emb.name]
        head_updates = [i for i, e in enumerate(events) if e[0] == head.name]
        assert len(head_updates) == chunks and len(emb_updates) >= 1
        assert max(emb_updates) < at["block0"]         # before the root's gather
        assert events[at["block0"]][1:] == ("sharded", "unsharded")
        # one chunk as each block is gathered (the next block's prefetch gathers it early)
        assert sum(at["block0"] < i < at["block3"] for i in head_updates) >= 3
        assert all(i < at["head"] for i in head_updates)  # and the rest just before the head
        # (gathered only when the LM head runs: still sharded as its first pre-hook runs)
        assert events[at["head"]][1:] == ("sharded", "unsharded")


def test_update_in_next_forward_an_error_while_the_lm_head_streams_then_evaluation(tmp_path,
                                                                             monkeypatch):
    """A training forward that fails in a block, after the LM head's update began streaming,
    then an evaluation forward (the loop skips the batch and evaluates): the evaluation sees
    the weights of the last step (the LM head's update ends before its gather), and training on
    gives the plain step's numbers."""
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    seen = []

    def fail_then_evaluate(i, model, eng):
        if i != 2:
            return
        boom = model.blocks[1].register_forward_pre_hook(
            lambda mod, args: (_ for _ in ()).throw(KeyError("injected")))
        with pytest.raises(KeyError, match="injected"):
            eng(batches(1, seed=9)[0][0])
        boom.remove()
        eng.eval()
        with torch.no_grad():
            seen.append(eng(batches(1, seed=9)[0][0]).clone())
        eng.train()

    kw = dict(offload="nvme", offload_param="nvme")
    (l0, g0, w0, _), (l1, g1, w1, _) = _run_sif_pair(lambda: big_root_lm(3, vocab_scale=6), kw,
                                                     tmp_path, between=fail_then_evaluate)
    assert torch.equal(seen[0], seen[1])
    assert l0 == l1 and torch.equal(g0, g1) and all(torch.equal(w0[k], w1[k]) for k in w0)


class _ReadsHeadEarly(TinyLM):
    """A forward that reads the LM head's and final norm's weights before the blocks run."""

    def forward(self, x):
        assert self.head.weight.shape == (self.head.out_features, self.head.in_features)
        h = self.emb(x) * (1 + self.norm.weight.mean() + 0.01 * self.head.weight.norm())
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def test_update_in_next_forward_a_forward_reading_the_lm_head_early_gets_it(tmp_path, monkeypatch):
    """The LM head's flat parameter is gathered when its first module runs; a forward that
    reads its weights earlier (their shape, a computation) gathers it then, ending its streaming
    update first: the numbers are the plain step's."""
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)

    kw = dict(offload="nvme", offload_param="nvme")
    (l0, g0, w0, _), (l1, g1, w1, _) = _run_sif_pair(lambda: _ReadsHeadEarly(n_blocks=3), kw,
                                                     tmp_path)
    assert l0 == l1 and torch.equal(g0, g1) and all(torch.equal(w0[k], w1[k]) for k in w0)


def test_update_in_next_forward_reads_the_first_blocks_state_during_backward(tmp_path, monkeypatch):
    """The next forward updates the first blocks first: their whole states are read into the
    read-ahead ring while backward runs (their fp32 parameter shards on NVMe are gathered for
    backward from that read, one read less each), so the forward reads only the other blocks'
    states and the LM head's. The blocks whose write-backs the forward deferred are gathered
    for backward from those buffers (no read either). Bytes read per phase, from the second
    step on. (Every transfer is done by the time it is polled: which reads start when is then
    the same in every run.)"""
    from offload_zero.memory.swapper import SwapHandle
    monkeypatch.setattr(SwapHandle, "done", lambda h: h._done.wait() or True)
    torch.manual_seed(0)
    with OffloadEngine(TinyLM(n_blocks=6), offload="nvme", path=str(tmp_path),
                       update_timing="next_forward") as eng:
        x, y = batches(1)[0]
        phases, deferred = [], []
        held_by_engine = eng._updates.may_defer_write_back

        def may_defer(fp):
            if held_by_engine(fp):
                deferred[-1].append(fp)
                return True
            return False

        eng._updates.may_defer_write_back = may_defer
        for _ in range(3):
            deferred.append([])
            r0 = eng.store.read_bytes
            loss = lm_loss(eng(x), y)
            r1 = eng.store.read_bytes
            eng.backward(loss)
            for _, handles in list(eng.store._whole_reads.values()):
                for h in handles:  # (bytes count once read: the reads backward started)
                    h.wait()
            r2 = eng.store.read_bytes
            eng.step()
            phases.append((r1 - r0, r2 - r1, eng.store.read_bytes - r2))
        ring = eng.pools["optimizer_prefetch"].count
        blocks = [u.flat_params[0].shard_numel for u in eng.scheduler.order]
        # the root's parts used after the blocks: the final norm's and the LM head's
        head = sum(flat_param_of(eng, name).shard_numel for name in ("norm.weight", "head.weight"))
        first, rest = sum(blocks[:ring]), sum(blocks[ring:])
        # the last blocks' write-backs wait for the forward's last update (at most the ring's
        # buffers less one per later pending update: here the last two blocks')
        last = [u.flat_params[0] for u in eng.scheduler.order[-2:]]
        assert deferred[1] == deferred[2] == last
        held = sum(fp.shard_numel for fp in last)
        # backward: the first blocks' states whole (12 bytes an element), the others' fp32
        # parameter shards (4) but for those held; forward: the other blocks' states and the
        # final norm's and LM head's, and their shards for their gathers (a root no larger than
        # a block has no buffer to keep its updated shards in); step(): nothing
        assert phases[1] == phases[2] == (12 * (rest + head) + 4 * head,
                                          12 * first + 4 * (rest - held), 0)


def test_update_in_next_forward_writes_the_last_blocks_back_after_the_forwards_last_update(
        tmp_path, monkeypatch):
    """The write-backs of the last blocks' updates (as many as the read-ahead ring can hold
    without a later read waiting on them) start only once the forward's last pending update is
    made, here the LM head's streamed one as its gather starts, so the disk serves the reads
    the forward waits for first; the earlier blocks' start right after their update. Same
    weights as the plain step, bit for bit, and the blocks' files hold the same master weights
    and moments. (Every transfer is done by the time it is polled, as on a disk far faster
    than the compute: which reads start when is then the same in every run.)"""
    from offload_zero.memory.swapper import SwapHandle
    monkeypatch.setattr(SwapHandle, "done", lambda h: h._done.wait() or True)
    torch.manual_seed(0)
    model = big_root_lm(n_blocks=5)
    twin = copy.deepcopy(model)
    for name in "ab":
        (tmp_path / name).mkdir()
    kw = dict(offload="nvme", lr=1e-2, weight_decay=0.1)
    with OffloadEngine(model, path=str(tmp_path / "a"), update_timing="step", **kw) as a, \
            OffloadEngine(twin, path=str(tmp_path / "b"), update_timing="next_forward", **kw) as b:
        events = []
        swap_out, applied = b.swapper.swap_out, b._updates._applied
        b.swapper.swap_out = lambda key, t, offset_bytes=0: (
            events.append(("write", key)), swap_out(key, t, offset_bytes=offset_bytes))[1]
        b._updates._applied = lambda fp: (events.append(("applied", fp.name)), applied(fp))[1]
        for i, (x, y) in enumerate(batches(4)):
            events.clear()
            for eng in (a, b):
                loss = lm_loss(eng(x), y)
                if eng is b:
                    forward = list(events)
                eng.backward(loss)
                eng.step()
            if i < 2:
                continue  # (the order is recorded in the first forward)
            names = [u.flat_params[0].name for u in b.scheduler.order]
            last = max(k for k, e in enumerate(forward) if e[0] == "applied")
            # the LM head's stream (queued after the final norm's)
            assert forward[last] == ("applied", flat_param_of(b, "head.weight").name)
            writes = [(k, key) for k, (kind, key) in enumerate(forward) if kind == "write"]
            late = {key for k, key in writes if k > last}
            early = {key for k, key in writes if k < last}
            # a ring of three: the last three blocks' write-backs (the LM head's pending
            # update streams in chunks, too large for the ring: it needs none of its buffers)
            ring = b.pools["optimizer_prefetch"].count
            assert ring == 3 and late == set(names[-3:])
            assert early.isdisjoint(late) and set(names[:-3]) <= early
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        for fa, fb in zip(a.trainable, b.trainable):  # the blocks' files (the root is split)
            if fb.name.startswith("unit"):
                assert fa.name == fb.name
                assert all(torch.equal(x, y) for x, y in zip(a.store.read_all(fa),
                                                             b.store.read_all(fb)))


def test_update_in_next_forward_spreads_the_lm_heads_stream_over_the_blocks(tmp_path, monkeypatch):
    """The LM head's pending update streams in chunks while the blocks run: by the gather of
    the k-th of n blocks, ceil(k/n) of its chunks are done (not all in the first blocks, which
    then wait on the disk while the last ones leave it idle), and it ends only when the head is
    gathered. Same weights as the plain step, bit for bit."""
    from offload_zero.memory.swapper import SwapHandle
    from offload_zero.memory.tiers import NVMeStore
    monkeypatch.setattr(SwapHandle, "done", lambda h: h._done.wait() or True)
    monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    torch.manual_seed(0)
    model = big_root_lm(n_blocks=4, vocab_scale=8)
    twin = copy.deepcopy(model)
    for name in "ab":
        (tmp_path / name).mkdir()
    kw = dict(offload="nvme", lr=1e-2)
    with OffloadEngine(model, path=str(tmp_path / "a"), update_timing="step", **kw) as a, \
            OffloadEngine(twin, path=str(tmp_path / "b"), update_timing="next_forward", **kw) as b:
        seen = []
        pace = b._updates.pace_streams
        b._updates.pace_streams = lambda unit: (pace(unit), unit in b.scheduler.order
                                                and b.scheduler.training_forward and seen.append(
                                                    (b.scheduler.order.index(unit),
                                                     *b._updates._pace,
                                                     "streaming" in b.update_states().values())))
        for i, (x, y) in enumerate(batches(3)):
            seen.clear()
            for eng in (a, b):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
        n = len(b.scheduler.order)
        # (the final norm's small update streams too, queued before the LM head's)
        norm, head = flat_param_of(b, "norm.weight"), flat_param_of(b, "head.weight")
        assert norm is not head
        total = -(-norm.shard_numel // 1024) - (-head.shard_numel // 1024)
        assert n == 4 and total >= 2 * n
        # (a block is gathered twice: its parameter read starts one block ahead)
        assert sorted(set(seen)) == [(k, -(-total * (k + 1) // n), total, True) for k in range(n)]
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("mode", ["plain", "next_forward", "backward"])
def test_zero_grad_right_after_step_is_a_no_op(mode, tmp_path):
    """The torch habit ``step(); zero_grad()``: nothing was accumulated since the step, so
    nothing changes. update_timing="next_forward"'s updates stay pending for the next forward (zero_grad
    used to apply them all there, its I/O then back between backward and forward), and no
    mode counts a step more (update_timing="backward"'s zero_grad used to end a step again: one good
    step more in a dynamic loss scale's window). The weights are those of the loop without
    zero_grad."""
    kw = {"update_timing": "step" if mode == "plain" else mode}
    runs = []
    for habit in (False, True):
        torch.manual_seed(3)
        (tmp_path / str(habit)).mkdir()
        with OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path / str(habit)), lr=1e-2,
                           dtype=torch.float16, initial_loss_scale=16.0, loss_scale_window=2,
                           **kw) as eng:
            for x, y in batches(3):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
                if habit:
                    written = eng.memory_report()["nvme"]["written_bytes"]
                    pending = eng.update_states()
                    eng.zero_grad()
                    assert eng.memory_report()["nvme"]["written_bytes"] == written
                    assert eng.update_states() == pending and (mode != "next_forward" or pending)
            runs.append((eng.full_state_dict(), eng.loss_scaler.scale, eng.skipped_steps))
    (plain_sd, scale, skipped), (habit_sd, habit_scale, habit_skipped) = runs
    assert (habit_scale, habit_skipped) == (scale, skipped)
    assert all(torch.equal(plain_sd[k], habit_sd[k]) for k in plain_sd)


class _HiddenStateLoss(TinyLM):
    """A model trained on the blocks' output: its final norm and LM head get no gradient."""

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return h


def test_a_root_part_without_gradients_is_skipped_in_every_mode(tmp_path):
    """The LM head and the final norm (the root's parts after the blocks) get no gradient.
    The root is split by gradient order in every mode, so each mode skips those parts as
    torch.optim does, and all give the same weights bit for bit: offload="nvme" at stage 3
    (update_timing="next_forward" by default), offload="cpu" with the plain step, with update_timing="next_forward" and
    with update_timing="backward". (With the root one flat parameter, the plain step updated them with
    zeros: weight decay and decaying moments.)"""
    torch.manual_seed(4)
    model = _HiddenStateLoss(n_blocks=3)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    runs = {}
    for name, kw in (("nvme", {"offload": "nvme", "path": str(tmp_path)}),
                     ("cpu+sif", {"offload": "cpu", "update_timing": "next_forward"}),
                     ("cpu+sib", {"offload": "cpu", "update_timing": "backward"}),
                     ("cpu", {"offload": "cpu"})):
        with OffloadEngine(copy.deepcopy(model), lr=1e-2, weight_decay=0.1, **kw) as eng:
            for x, _ in batches(3):
                eng.backward(eng(x).pow(2).mean())
                eng.step()
            runs[name] = eng.full_state_dict()
    for x, _ in batches(3):
        opt.zero_grad()
        ref(x).pow(2).mean().backward()
        opt.step()
    for name in ("head.weight", "norm.weight", "norm.bias"):
        assert torch.equal(runs["cpu"][name], model.state_dict()[name])
    for other in ("nvme", "cpu+sif", "cpu+sib"):
        assert all(torch.equal(runs[other][k], runs["cpu"][k]) for k in runs["cpu"]), other
    assert max_param_diff(runs["cpu"], ref) <= 1e-5


def test_update_in_next_forward_applies_updates_of_units_forward_skipped(tmp_path):
    """A forward that skips a block leaves its update pending: it is applied before anything
    else reads that block (the next backward, the next step, a gather), and the weights stay
    those of the plain step."""
    def skip_block_1_on_step_2(i, model, eng):
        model.skip = {1} if i == 2 else set()

    kw = dict(offload="nvme", offload_param="nvme")
    (l0, _, w0, _), (l1, _, w1, _) = _run_sif_pair(lambda: TinyLM(n_blocks=3), kw, tmp_path,
                                                   between=skip_block_1_on_step_2)
    assert l0 == l1 and all(torch.equal(w0[k], w1[k]) for k in w0)


def test_update_in_next_forward_state_reads_apply_pending_updates(tmp_path):
    """Right after step() (no forward yet), full_state_dict(), a checkpoint and zero_grad() see
    the updated weights and state, as after the plain step; the learning rate of an update is
    the one step() ran with, whatever set_lr() says before the forward that applies it."""
    from safetensors.torch import load_file
    results = []
    for sif in (False, True):
        torch.manual_seed(0)
        (tmp_path / f"s{sif}").mkdir()
        with OffloadEngine(TinyLM(n_blocks=3), offload="nvme", path=str(tmp_path / f"s{sif}"),
                           lr=1e-2, update_timing="next_forward" if sif else "step") as eng:
            for i, (x, y) in enumerate(batches(3)):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
                eng.set_lr(1e-2 / (i + 2))
            weights = eng.full_state_dict()
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            eng.zero_grad()
            eng.save_checkpoint(tmp_path / f"ckpt{sif}")
            results.append((weights, _per_parameter(tmp_path / f"ckpt{sif}")))
    (w0, c0), (w1, c1) = results
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert c0.keys() == c1.keys() and all(torch.equal(c0[k], c1[k]) for k in c0)


def _per_parameter(folder) -> dict:
    """A one-rank checkpoint's optimizer state by parameter, ``{"<name>/<key>": tensor}``
    (master, exp_avg, exp_avg_sq sliced out of each flat parameter by the metadata's layout;
    ``step`` per flat parameter copied to each of its parameters): comparable across engines
    that group the parameters differently."""
    from offload_zero.checkpoint import read_metadata
    from safetensors.torch import load_file
    meta = read_metadata(folder)
    tensors = load_file(os.path.join(folder, "rank00000.safetensors"))
    out = {}
    for fp in meta["flat_params"]:
        offset = 0
        for names, shape in fp["parameters"]:
            n = math.prod(shape)
            for key in ("master", "exp_avg", "exp_avg_sq", "step"):
                t = tensors.get(f"{fp['name']}/{key}")
                if t is not None:
                    out[f"{names[0]}/{key}"] = t if key == "step" else t[offset:offset + n]
            offset += n
    return out


def test_update_in_next_forward_skips_what_the_step_skips(tmp_path):
    """An inf gradient in one flat parameter skips that update only (counted once in
    skipped_steps), decided in step() as in the plain step; the other updates apply later."""
    def poison_head_on_step_1(i, model, eng):
        if i == 1:
            model.head.register_full_backward_pre_hook(
                lambda mod, g: (g[0] * float("inf"),) if model.training else None)

    kw = dict(offload="nvme", offload_param="nvme")
    (l0, _, w0, s0), (l1, _, w1, s1) = _run_sif_pair(lambda: TinyLM(n_blocks=2), kw, tmp_path,
                                                     micro=1, between=poison_head_on_step_1)
    assert s0 == s1 >= 1 and l0 == l1
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_update_in_next_forward_keeps_no_updated_shard_that_no_gather_takes(dtype, tmp_path):
    """Parameter shards on NVMe: an update applied outside a gather (full_state_dict() or a
    checkpoint right after step(), blocks a forward skipped) keeps no buffer of the shard
    pool for a gather that is not coming. With 8 blocks and a pool sized for the units in
    flight, that used to exhaust the pool; now every case trains as the plain step does."""
    def layer_drop(i, model, eng):
        model.skip = {1, 2, 4, 5, 6} if i % 2 else set()
        if i == 2:
            eng.full_state_dict()  # right after a step: every update outside a gather
            eng.save_checkpoint(tmp_path / f"ckpt{eng.config.update_timing == 'next_forward'}")

    kw = dict(offload="nvme", offload_param="nvme", dtype=dtype)
    (l0, g0, w0, _), (l1, g1, w1, _) = _run_sif_pair(lambda: TinyLM(n_blocks=8), kw, tmp_path,
                                                     micro=1, between=layer_drop)
    assert l0 == l1 and torch.equal(g0, g1) and all(torch.equal(w0[k], w1[k]) for k in w0)
    (tmp_path / "load").mkdir()
    with OffloadEngine(TinyLM(n_blocks=8), offload="nvme", path=str(tmp_path / "load"),
                       dtype=dtype, update_timing="next_forward") as eng:
        eng.load_checkpoint(tmp_path / "ckptFalse")
        eng.load_checkpoint(tmp_path / "ckptTrue")


def test_update_in_next_forward_an_error_applying_updates_loses_none(tmp_path, monkeypatch):
    """An error while pending updates are applied (here: no buffer for one block's new
    shard) leaves that update and the ones after it pending, with their gradients and step
    counts as they were: the call raises, and the next one applies them all, giving the
    weights of the plain step."""
    results = []
    for sif in (False, True):
        torch.manual_seed(0)
        (tmp_path / f"s{sif}").mkdir()
        with OffloadEngine(TinyLM(n_blocks=4), offload="nvme", path=str(tmp_path / f"s{sif}"),
                           update_timing="next_forward" if sif else "step") as eng:
            x, y = batches(1)[0]
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            if sif:
                target, calls = eng._updates.adam.update_target, []

                def failing(fp):
                    calls.append(fp.name)
                    if fp.name == "unit2.trainable" and calls.count(fp.name) == 1:
                        raise RuntimeError("host buffer pool 'param_shards' is empty")
                    return target(fp)

                monkeypatch.setattr(eng._updates.adam, "update_target", failing)
                with pytest.raises(RuntimeError, match="is empty"):
                    eng.full_state_dict()
                assert list(eng.update_states()) == ["unit2.trainable", "unit3.trainable"]
            # (by parameter: update_timing="next_forward" splits the root's in two flat parameters)
            results.append((eng.full_state_dict(), {e.names[0]: eng._step_count[fp]
                                                    for fp in eng.trainable for e in fp.entries}))
    (w0, n0), (w1, n1) = results
    assert n0 == n1 and all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.parametrize("kwargs,match", [
    ({"update_timing": "next_forward", "stage": 2}, "update_timing='next_forward' needs stage 3"),
    ({"update_timing": 1}, "update_timing=1 is not valid")])
def test_update_in_next_forward_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadEngine(TinyLM(), **kwargs)


@pytest.mark.parametrize("kwargs,on", [
    ({"offload": "nvme"}, True),
    ({"offload": "nvme", "offload_param": "none"}, True),
    ({"offload_optimizer": "nvme", "offload_param": "cpu"}, True),
    ({"offload": "nvme", "update_timing": "step"}, False),
    ({"offload": "nvme", "update_timing": "backward"}, False),
    ({"offload": "nvme", "stage": 2}, False),
    ({"offload": "cpu"}, False),
    ({"offload_optimizer": "cpu", "offload_param": "nvme"}, False)])
def test_update_in_next_forward_is_the_default_with_the_optimizer_state_on_nvme_at_stage_3(
        kwargs, on, tmp_path):
    """update_timing="auto" (the default) turns next_forward on where the plain step's NVMe state I/O
    would stall between backward and forward: three read-ahead buffers, the update applied in
    the next forward."""
    nvme = "nvme" in (kwargs.get("offload"), kwargs.get("offload_optimizer"),
                      kwargs.get("offload_param"))
    with OffloadEngine(TinyLM(), path=str(tmp_path) if nvme else None, **kwargs) as eng:
        assert (eng.config.update_timing == "next_forward") is on
        split = on or kwargs.get("update_timing") == "backward"
        ring = eng.memory_report()["pools"].get("optimizer_prefetch")
        assert (ring is not None) is (split and eng.config.offload_optimizer == "nvme")
        assert not on or ring["buffers"] == 3
        (x, y), = batches(1)
        eng.backward(lm_loss(eng(x), y))
        written = eng.memory_report()["nvme"]["written_bytes"]
        eng.step()
        # the plain step writes the NVMe optimizer state back in step(); update_timing="next_forward" in
        # the next forward (update_timing="backward" in backward, its writes counted as they end)
        if eng.config.update_timing != "backward":
            plain = eng.config.offload_optimizer == "nvme" and not on
            assert (eng.memory_report()["nvme"]["written_bytes"] > written) is plain
            eng(x)
            assert (eng.memory_report()["nvme"]["written_bytes"] > written) is (plain or on)


def test_auto_turns_next_forward_on_when_it_places_the_state_on_nvme(tmp_path):
    """offload="auto" decides update_timing="next_forward" with the placement, and budgets its buffers."""
    needs = _needs()
    for budget, on in (((10 ** 12, 10 ** 12), False),
                       ((needs[("cpu", "none")]["device"] - 1,
                         needs[("cpu", "cpu")]["host"] - 1), True)):
        with OffloadEngine(_deep(), offload="auto", path=str(tmp_path), max_device_bytes=budget[0],
                           max_host_bytes=budget[1]) as eng:
            assert (eng.config.offload_optimizer == "nvme") is on
            assert (eng.config.update_timing == "next_forward") is on
            (x, y), = batches(1)
            for _ in range(2):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            eng(x)
            assert eng.memory_report()["host"]["peak_bytes"] <= budget[1]


def test_auto_takes_the_plain_step_when_only_it_fits(tmp_path):
    """update_timing="next_forward"'s buffers cost host memory: where no placement fits with it, auto
    tries the NVMe placements again with the plain step before it gives up."""
    from offload_zero.estimator import placement_bytes
    needs = _needs()

    def host(sif):
        return placement_bytes(_deep(), 3, "nvme", "nvme", dtype=torch.float32, accelerator=False,
                               update_timing="next_forward" if sif else "step"
                               ).tier_bytes("host")
    max_dev, max_host = needs[("cpu", "none")]["device"] - 1, host(True) - 1
    assert host(False) <= max_host
    with OffloadEngine(_deep(), offload="auto", path=str(tmp_path), max_device_bytes=max_dev,
                       max_host_bytes=max_host) as eng:
        assert eng.config.offload_optimizer == "nvme" and eng.config.update_timing == "step"
        assert any("nvme+nvme next_forward" in t and "short of host" in t
                   for t in eng.placement.tried)
        assert "plain step" in eng.placement.tried[-1] and "fits" in eng.placement.tried[-1]
        (x, y), = batches(1)
        for _ in range(2):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        assert eng.memory_report()["host"]["peak_bytes"] <= max_host


def test_pools_never_exceed_the_blocks_whatever_prefetch(tmp_path):
    """prefetch counts at most the other blocks: a huge value sizes no huge pool (it used to
    ask the allocator for prefetch-many buffers) and costs no time (the scheduler looped
    prefetch times per unit), and the estimate follows the same rule."""
    from offload_zero.estimator import estimate_memory
    model = TinyLM(n_blocks=2)
    est = estimate_memory(model, stage=3, offload="nvme", dtype=torch.float32, prefetch=10 ** 12,
                          accelerator=False)
    with OffloadEngine(model, offload="nvme", path=str(tmp_path), prefetch=10 ** 12) as eng:
        pools = eng.memory_report()["pools"]
        assert pools["param_shards"]["buffers"] == 2 * (1 + 2)  # one block ahead, no ring at fp32
        x, y = batches(1)[0]
        eng.backward(lm_loss(eng(x), y))
        eng.step()
        rep = eng.memory_report()
    assert {k: rep["host"]["by_kind"][k]["peak_bytes"] for k in ("buffers",)} == {
        "buffers": est.by_kind("host")["buffers"]}
    with OffloadEngine(TinyLM(n_blocks=2), stage=3, offload="cpu", offload_param="cpu",
                       prefetch=10 ** 12) as eng:
        assert eng.memory_report()["pools"]["gather"]["buffers"] == 2
