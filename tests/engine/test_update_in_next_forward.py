"""update_timing="next_forward": updates decided by step() and applied before each unit's next
read; the state I/O in the next forward, the LM head's stream, deferred write-backs, errors,
and what reads the weights in between."""
import copy
import math
import os

import pytest
import torch

from engine_common import F32
from models import TinyLM, batches, big_root_lm, flat_param_of, lm_loss
from offload_zero import OffloadEngine
from offload_zero.memory.tiers import NVMeStore
from offload_zero.update.state import StateIO


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


class _ReadsHeadEarly(TinyLM):
    """A forward that reads the LM head's and final norm's weights before the blocks run."""

    def forward(self, x):
        assert self.head.weight.shape == (self.head.out_features, self.head.in_features)
        h = self.emb(x) * (1 + self.norm.weight.mean() + 0.01 * self.head.weight.norm())
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


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
            io = eng.store.io_stages
            for fp in io.in_stage(StateIO.READ_AHEAD):
                for h in io.handles(fp):  # (bytes count once read: the reads backward started)
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
        deferred = []  # at each update made: the write-backs deferred (WRITE_DEFERRED)
        b._updates._applied = lambda fp: (events.append(("applied", fp.name)), deferred.append(
            [f.name for f in b.store.io_stages.in_stage(StateIO.WRITE_DEFERRED)]),
            applied(fp))[2]
        for i, (x, y) in enumerate(batches(4)):
            events.clear()
            deferred.clear()
            for eng in (a, b):
                loss = lm_loss(eng(x), y)
                if eng is b:
                    forward = list(events)
                    assert b.store.deferred_writes == 0  # (started by the last update)
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
            # deferred exactly there, in forward order, until the forward's last update
            assert deferred[-1] == names[-3:] and deferred[0] == []
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
            results.append((eng.full_state_dict(), {e.names[0]: eng.step_counts[fp]
                                                    for fp in eng.trainable for e in fp.entries}))
    (w0, n0), (w1, n1) = results
    assert n0 == n1 and all(torch.equal(w0[k], w1[k]) for k in w0)


def test_update_in_next_forward_gathers_a_new_shard_without_waiting_for_its_write(
        tmp_path, monkeypatch):
    """bf16 parameter shards on NVMe: the next forward's update of a block writes its new shard
    from a pool buffer, and the block's gather reads that buffer while the write is in flight;
    the buffer goes back to the pool once the write is done, which nothing in this forward waits
    for (the pool has room). Waiting for the write before the gather, or right after it, made
    each block wait for the whole disk queue. The weights equal the plain step's."""
    from offload_zero.memory.swapper import SwapHandle
    events = []
    wait = SwapHandle.wait

    def logged_wait(handle, timeout_s=None):
        if handle.op == "out" and handle.key.endswith(".param") and not handle.done():
            events.append(("write waited", handle.key[:-len(".param")]))
        return wait(handle, timeout_s)

    def on_gather(home):
        shard_for_gather = home.shard_for_gather

        def logged(fp):
            events.append(("gathered", fp.name))
            return shard_for_gather(fp)
        return logged

    weights = []
    for sif in (False, True):
        torch.manual_seed(0)
        (tmp_path / f"s{sif}").mkdir()
        with OffloadEngine(TinyLM(n_blocks=4), offload="nvme", path=str(tmp_path / f"s{sif}"),
                           dtype=torch.bfloat16, lr=1e-2,
                           update_timing="next_forward" if sif else "step") as eng:
            for i, (x, y) in enumerate(batches(3, seed=5)):
                if sif and i == 1:
                    monkeypatch.setattr(SwapHandle, "wait", logged_wait)
                    monkeypatch.setattr(eng.param_home, "shard_for_gather",
                                        on_gather(eng.param_home))
                loss = lm_loss(eng(x), y)
                if sif and i == 1:
                    monkeypatch.undo()
                    forward_events = list(events)
                eng.backward(loss)
                eng.step()
            weights.append(eng.full_state_dict())
    blocks = [f"unit{k}.trainable" for k in range(4)]
    assert [n for e, n in forward_events if e == "gathered" and n in blocks] == blocks
    waited = [n for e, n in forward_events if e == "write waited"]
    assert waited == [], f"new shards' writes waited for in the forward: {waited}"
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
