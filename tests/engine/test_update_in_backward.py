"""update_timing="backward": each flat parameter updated as its gradient is final; the NVMe
state read and written during backward and forward, streamed root states, the tail state in
host memory, overflow and errors."""
import copy
import os

import pytest
import torch
import torch.nn as nn

from engine_common import twins
from models import TinyLM, batches, big_root_lm, lm_loss
from offload_zero import OffloadEngine
from offload_zero.memory.tiers import NVMeStore
from offload_zero.update.state import StateIO


def _run(model, steps, **kw):
    eng = OffloadEngine(model, lr=1e-2, weight_decay=0.1, **kw)
    reads_after_backward = []
    for x, y in batches(steps):
        eng.backward(lm_loss(eng(x), y))
        reads_after_backward.append(eng.memory_report()["nvme"]["read_bytes"])
        eng.step()
    return eng, reads_after_backward


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
            assert b.store.whole_writes()  # updates of the last units still being written
            b.step()
            assert not b.store.whole_writes() and b.store.io_stages.report() == {}
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
    a, b = twins(model, tmp_path, offload="nvme", stage=stage)
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
    a, b = twins(model, tmp_path, sib_a=True, offload="nvme", tail_state_in_host=False)
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
    a, b = twins(model, tmp_path, offload="nvme", offload_param="none", stage=3)
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
    a, b = twins(big_root_lm(3, vocab_scale=4), tmp_path, offload="nvme")
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
    a, b = twins(big_root_lm(3, vocab_scale=4), tmp_path, offload="nvme", offload_param="nvme",
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
    a, b = twins(model, tmp_path, offload="nvme", stage=3, dtype=torch.bfloat16)
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
    a, b = twins(model, tmp_path, offload="nvme", offload_param="nvme", stage=3,
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
        pending = b.store.whole_writes()
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
    a, b = twins(model, tmp_path, offload_optimizer="nvme", offload_param="none", stage=3)
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
        assert ring.in_use == 0 and not b.store.io_stages.in_stage(StateIO.READ_AHEAD)
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

        def logged(key, tensor, offset_bytes=0, **kw):
            log.append((names.get(key), offset_bytes > 0))
            return swap_in(key, tensor, offset_bytes=offset_bytes, **kw)
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
    master's bytes, is not read either; a bf16 one on NVMe stays in host memory beside the
    state: no file of it, 2 bytes per element fewer each way), its bytes on the host tier (8
    per element when the master is the CPU device's shard itself). Same weights bit for bit
    as the plain step and as the state on NVMe."""
    torch.manual_seed(8)
    model = TinyLM(n_blocks=3)
    twin = copy.deepcopy(model)
    kw = dict(offload="nvme", offload_param=offload_param, stage=3, dtype=dtype, lr=1e-2,
              weight_decay=0.1)
    a, b = twins(model, tmp_path, sib_a=False, sib_b=True, tail_state_in_host=True, **kw)
    (tmp_path / "c").mkdir()
    c = OffloadEngine(twin, path=str(tmp_path / "c"), update_timing="backward",
                      tail_state_in_host=False, **kw)
    with a, b, c:
        tail = b.root.flat_params[-1]
        assert tail.requires_grad and b.store.in_host(tail) and not c.store.in_host(c.root.flat_params[-1])
        assert not a.store.in_host(a.root.flat_params[-1])  # (needs update_timing="backward")
        files_b = [os.path.basename(f) for f in b.swapper.files]
        files_c = [os.path.basename(f) for f in c.swapper.files]
        assert f"{tail.name}.swp" not in files_b and f"{tail.name}.swp" in files_c
        # a bf16 parameter shard on NVMe has a file of its own, but not beside a host state
        bf16_shard_on_nvme = offload_param == "nvme" and dtype == torch.bfloat16
        assert f"{tail.name}.param.swp" not in files_b
        assert (f"{tail.name}.param.swp" in files_c) is bf16_shard_on_nvme
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
        shard_bytes = 2 * n if bf16_shard_on_nvme else 0
        assert moved[c][0] - moved[b][0] == 12 * n + shard_bytes + (
            4 * n if fp32_shard_in_master and "param_shards_root" not in c.pools else 0)
        assert moved[c][1] - moved[b][1] == 12 * n + shard_bytes
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


def test_update_in_backward_forward_before_step_reads_the_state_backward_wrote(tmp_path,
                                                                             monkeypatch):
    """A training forward between backward and step sees that backward's updates: its
    read-ahead of a block's state (fp32 parameter shards gathered from it) waits for, or is not
    started before, the write-back of that same state still in flight. With that write made
    slow, the losses and weights equal backward; step; forward; backward; step bit for bit."""
    _slow_writes_of(monkeypatch, "unit0.trainable.swp")
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    a, b = twins(model, tmp_path, sib_a=True, sib_b=True, offload="nvme", offload_param="nvme",
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
