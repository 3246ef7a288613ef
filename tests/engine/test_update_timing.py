"""update_timing: every timing gives the plain step's numbers; the rules of which timing works
with what (one module), "auto", the old keywords refused by name, the update states."""
import copy

import pytest
import torch

from engine_common import F32
from models import TinyLM, batches, big_root_lm, lm_loss, max_param_diff
from offload_zero import OffloadEngine
from offload_zero.memory.tiers import NVMeStore


class _HiddenStateLoss(TinyLM):
    """A model trained on the blocks' output: its final norm and LM head get no gradient."""

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return h


TIMING_CASES = [  # (timing, offload, offload_param, stage, dtype, extra engine keywords)
    ("backward", "none", None, 2, F32, {}), ("backward", "cpu", None, 3, F32, {}),
    ("backward", "cpu", "cpu", 3, torch.bfloat16, {}), ("backward", "nvme", "none", 2, F32, {}),
    ("backward", "nvme", "nvme", 3, F32, {}), ("backward", "nvme", "nvme", 3, torch.bfloat16, {}),
    ("next_forward", "cpu", "none", 3, F32, {}), ("next_forward", "nvme", "nvme", 3, F32, {}),
    ("next_forward", "nvme", "none", 3, F32, {}), ("next_forward", "nvme", "cpu", 3, F32, {}),
    ("next_forward", "nvme", "nvme", 3, torch.bfloat16, {}),
    ("next_forward", "nvme", "nvme", 3, F32, {"max_grad_norm": 0.05}),
    ("next_forward", "cpu", "cpu", 3, torch.float16, {}),
    ("next_forward", "nvme", "nvme", 3, F32, {"prefetch": 2})]


def _train_in(timing, model, kw, path, steps, micro):
    """Train ``model`` ``steps`` steps of ``micro`` backward calls each with ``timing``; returns
    the losses, an evaluation forward's logits right after the last step (before anything
    else reads the weights), the final weights, the skipped steps, the NVMe bytes read by the
    end of each step's backward, and the final memory report."""
    nvme = "nvme" in (kw.get("offload"), kw.get("offload_param"))
    losses, reads = [], []
    with OffloadEngine(model, lr=1e-2, weight_decay=0.1, update_timing=timing,
                       path=str(path) if nvme else None, **kw) as eng:
        data = batches(steps * micro, seed=3)
        for i in range(steps):
            for x, y in data[i * micro:(i + 1) * micro]:  # (micro > 1: gradient accumulation)
                loss = lm_loss(eng(x), y)
                eng.backward(loss)
                losses.append(loss.item())
            reads.append(eng.memory_report()["nvme"]["read_bytes"])
            eng.step()
        with torch.no_grad():
            logits = eng(data[0][0]).clone()
        return (losses, logits, eng.full_state_dict(), eng.skipped_steps, reads,
                eng.memory_report(), [fp for u in eng.blocks for fp in u.flat_params])


@pytest.mark.parametrize("timing,offload,offload_param,stage,dtype,extra", TIMING_CASES,
                         ids=[f"{t}-{o}-{p}-{s}-{str(d)[6:]}-{'-'.join(e) or 'plain'}"
                              for t, o, p, s, d, e in TIMING_CASES])
def test_every_timing_gives_the_numbers_of_the_plain_step(timing, offload, offload_param, stage,
                                                          dtype, extra, tmp_path, monkeypatch):
    """Same numbers in every timing: the losses, the logits of an evaluation forward right
    after the last step and the final weights are those of the plain step bit for bit, and so
    are the skipped steps. "backward" updates each flat parameter as soon as its gradient is
    final, inside backward (stages 2-3; with NVMe the blocks' optimizer state is read during
    backward: the bytes are read before step() is called). "next_forward" decides the updates
    in step() and applies them before each unit's next gather, with gradient accumulation (two
    backward calls per step), clipping, bf16 and fp16 (loss scale), parameter shards on the
    device, in host memory or on NVMe, and the root's state streamed in chunks."""
    backward = timing == "backward"
    if not backward:
        monkeypatch.setattr(NVMeStore, "CHUNK_NUMEL", 1024)
    kw = dict(offload=offload, stage=stage, dtype=dtype, **extra)
    if offload_param:
        kw["offload_param"] = offload_param
    runs = []
    for t in ("step", timing):
        torch.manual_seed(0)
        model = TinyLM(n_blocks=4) if backward else big_root_lm(3, vocab_scale=2)
        (tmp_path / t).mkdir()
        runs.append(_train_in(t, model, kw, tmp_path / t, steps=4, micro=1 if backward else 2))
    (l0, g0, w0, s0, _, _, _), (l1, g1, w1, s1, reads, rep, blocks) = runs
    assert l0 == l1 and s0 == s1 and torch.equal(g0, g1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert s1 == 0 or not backward  # (no step of these "backward" runs overflows)
    if backward and offload == "nvme":
        blocks = [fp for fp in blocks if fp.requires_grad]
        # the blocks' state (master + moments) was read, and written, before step()
        assert reads[1] - reads[0] >= 12 * sum(fp.shard_numel for fp in blocks)
        ring = rep["pools"]["optimizer_prefetch"]
        # a third buffer when fp32 parameter shards are gathered from the read-ahead
        from_state = offload_param == "nvme" and dtype == torch.float32
        assert ring["buffers"] == (3 if from_state else 2) and ring["in_use"] == 0
        assert ring["buffer_bytes"] == 12 * max(fp.shard_numel for fp in blocks)


@pytest.mark.parametrize("old,value,timing", [
    ("step_in_backward", True, "backward"), ("step_in_backward", False, "step"),
    ("step_in_forward", True, "next_forward"), ("step_in_forward", False, "step"),
    ("step_in_forward", None, "auto")])
def test_the_old_switches_raise_a_type_error_naming_the_timing_to_use(old, value, timing):
    """step_in_backward/step_in_forward are gone: passing one raises TypeError naming
    update_timing and the value that means what the old one did, before anything is built;
    two at once are named together."""
    with pytest.raises(TypeError, match=rf"{old}={value!r} -> update_timing='{timing}'"):
        OffloadEngine(TinyLM(), **{old: value})
    with pytest.raises(TypeError, match=r"step_in_backward, step_in_forward no longer exist"):
        OffloadEngine(TinyLM(), step_in_backward=True, step_in_forward=False)


def test_the_timing_rules_are_one_module_for_every_caller(tmp_path):
    """update/rules.py: "auto" is today's default for every stage and tier (next_forward only
    at stage 3 with the optimizer state on NVMe), the engine's config and the CLI refuse the
    same combinations with the same facts, and the CLI's auto prefers "backward" where it
    works (stages 2-3, not fp16, one micro-batch a step, no clipping)."""
    from offload_zero.config import EngineConfig
    from offload_zero.update import rules
    for stage in (1, 2, 3):
        for tier in ("none", "cpu", "nvme"):
            want = "next_forward" if (stage == 3 and tier == "nvme") else "step"
            assert rules.resolve("auto", stage, tier) == want
            cfg = EngineConfig(offload=tier, stage=stage,
                               path=str(tmp_path) if tier == "nvme" else None)
            assert cfg.update_timing == want
    assert rules.resolve("auto", 3, None) == "auto"  # (offload="auto": placed later)
    for timing, stage, accum, clip, fact in [("backward", 1, 1, None, "stage 2 or 3"),
                                             ("backward", 2, 4, None, "accumulate"),
                                             ("backward", 3, 1, 1.0, "cannot clip"),
                                             ("next_forward", 2, 1, None, "needs stage 3")]:
        with pytest.raises(ValueError, match=fact):
            EngineConfig(stage=stage, update_timing=timing, gradient_accumulation_steps=accum,
                         max_grad_norm=clip)
        if clip is None:  # (the CLI takes clipping from a DeepSpeed config: auto avoids it)
            with pytest.raises(ValueError, match=fr"--update-timing {timing}"):
                rules.cli_timing(timing, stage, False, accum)
    assert rules.cli_timing("auto", 2, fp16=False) == "backward"
    assert [rules.cli_timing("auto", *a) for a in [(1, False), (3, True), (3, False, 2),
                                                   (3, False, 1, True)]] == ["auto"] * 4
    assert rules.cli_timing("next_forward", 3, fp16=False) == "next_forward"
    with pytest.raises(ValueError, match=r"update_timing='sideways' is not valid; choose one of"):
        EngineConfig(update_timing="sideways")
    # zero_grad() after a backward: drops the batch, except under "backward" (refused; after
    # an interrupted backward it ends the step instead)
    assert rules.check_zero_grad("step", False) and rules.check_zero_grad("next_forward", True)
    assert rules.check_zero_grad("backward", True) is False
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after backward\(\).*call step\(\)"):
        rules.check_zero_grad("backward", False)


def test_update_states_follow_each_timing_and_refuse_an_illegal_move(tmp_path):
    """engine.update_states() says where each update stands (see [Note: update states]):
    nothing between plain steps; "pending" after a next_forward step, in the order the next
    forward needs them (the root's first), none once a forward applied them; "applied" after
    a backward that updated in backward, none once step() ended it. The owner refuses a
    transition its table does not hold, naming the rank, the flat parameter and both states."""
    from offload_zero.update.state import UpdateState, UpdateStates
    x, y = batches(1)[0]
    with OffloadEngine(TinyLM(), offload="cpu", update_timing="step") as eng:
        eng.backward(lm_loss(eng(x), y))
        assert eng.update_states() == {}
        eng.step()
        assert eng.update_states() == {}
    with OffloadEngine(TinyLM(), offload="cpu", update_timing="next_forward") as eng:
        eng.backward(lm_loss(eng(x), y))
        eng.step()
        pending = eng.update_states()
        assert set(pending.values()) == {"pending"}
        assert list(pending) == [fp.name for u in [eng.root] + eng.scheduler.order
                                 for fp in u.flat_params if fp.requires_grad]
        with torch.no_grad():
            eng(x)
        assert eng.update_states() == {}
    with OffloadEngine(TinyLM(), offload="cpu", update_timing="backward") as eng:
        eng.backward(lm_loss(eng(x), y))
        assert eng.update_states() == {fp.name: "applied" for fp in eng.trainable}
        eng.step()
        assert eng.update_states() == {}
    states = UpdateStates(rank=3)
    fp = eng.trainable[0]
    states.move(fp, UpdateState.APPLIED)
    with pytest.raises(RuntimeError, match=rf"\[rank 3\] .*'{fp.name}' cannot go from APPLIED "
                                           r"to PENDING"):
        states.move(fp, UpdateState.PENDING)


def test_io_stages_refuse_an_illegal_move_and_leave_the_stage_as_it_was():
    """Each I/O stage table (the optimizer state's, the parameter shard's; see [Note: update
    states]) refuses a move it does not hold, naming the rank, the kind, the flat parameter
    and both stages, and the stage, buffer and handles stay as they were."""
    from offload_zero.update.state import ShardIO, StateIO, UpdateStates
    states = UpdateStates(rank=3)
    fp, buf = TinyLM(), torch.zeros(4)
    fp.name = "unit1.trainable"
    with pytest.raises(RuntimeError, match=r"\[rank 3\] internal error: the optimizer state I/O "
                                           r"of 'unit1.trainable' cannot go from AT_REST to "
                                           r"WRITING \(legal: \['IN_UPDATE', 'READ_AHEAD'\]\)"):
        states.state_io.move(fp, StateIO.WRITING)
    states.state_io.move(fp, StateIO.READ_AHEAD, buffer=buf, handles=["read"])
    for illegal in (StateIO.WRITING, StateIO.WRITE_DEFERRED, StateIO.READ_AHEAD):
        with pytest.raises(RuntimeError, match=rf"from READ_AHEAD to {illegal.name}"):
            states.state_io.move(fp, illegal)
    assert states.state_io.stage(fp) is StateIO.READ_AHEAD
    assert states.state_io.buffer(fp) is buf and states.state_io.handles(fp) == ["read"]
    states.state_io.move(fp, StateIO.IN_UPDATE)
    states.state_io.move(fp, StateIO.WRITE_DEFERRED)
    assert states.state_io.buffer(fp) is buf  # (a move keeps the buffer)
    with pytest.raises(RuntimeError, match=r"from WRITE_DEFERRED to IN_UPDATE"):
        states.state_io.move(fp, StateIO.IN_UPDATE)
    with pytest.raises(RuntimeError, match=r"\[rank 3\] internal error: the parameter shard I/O "
                                           r"of 'unit1.trainable' cannot go from AT_REST to KEPT"):
        states.shard_io.move(fp, ShardIO.KEPT)
    assert states.io_report() == {"unit1.trainable": {"optimizer_state": "write_deferred",
                                                      "parameter_shard": "at_rest"}}


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_every_flat_parameters_io_is_at_rest_after_a_step_in_each_timing(dtype, tmp_path):
    """memory_report()["io_stages"] (see [Note: update states]), state and shards on NVMe:
    between a "backward" backward and its step the last units' write-backs are in flight;
    after a step of "step" or "backward" every optimizer state and parameter shard is at rest
    (the step waits for every write), but for the root's shards kept in the buffers of their
    own for the next forward; after a "next_forward" step only pending updates' states are
    read ahead, and the rest in flight are write-backs, none deferred or in an update; once
    full_state_dict() applied them and waited for the state's writes, every optimizer state
    is at rest (shard writes may still be in flight). The three end with the same weights,
    bit for bit."""
    torch.manual_seed(0)
    model = big_root_lm(3)
    weights = {}
    for timing in ("step", "backward", "next_forward"):
        (tmp_path / timing).mkdir()
        with OffloadEngine(copy.deepcopy(model), offload="nvme", path=str(tmp_path / timing),
                           dtype=dtype, update_timing=timing, lr=1e-2) as eng:
            for x, y in batches(3):
                eng.backward(lm_loss(eng(x), y))
                if timing == "backward":
                    stages = eng.memory_report()["io_stages"].values()
                    assert "writing" in {s["optimizer_state"] for s in stages}
                eng.step()
                rep = eng.memory_report()["io_stages"]
                if timing == "next_forward":
                    pending = [n for n, st in eng.update_states().items() if st == "pending"]
                    ahead = {n for n, s in rep.items() if s["optimizer_state"] == "read_ahead"}
                    assert ahead and ahead <= set(pending)
                    assert {s["optimizer_state"] for n, s in rep.items()
                            if n not in ahead} <= {"writing", "at_rest"}
                else:
                    assert all(n.startswith("root.") and s == {"optimizer_state": "at_rest",
                                                               "parameter_shard": "kept"}
                               for n, s in rep.items()), rep
            weights[timing] = eng.full_state_dict()
            assert all(s["optimizer_state"] == "at_rest" and (
                s["parameter_shard"] == "writing" or n.startswith("root."))
                for n, s in eng.memory_report()["io_stages"].items()), timing
    assert all(torch.equal(weights["step"][k], w[k]) for w in weights.values() for k in w)


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


@pytest.mark.parametrize("kwargs,match", [
    ({"update_timing": "backward", "max_grad_norm": 1.0}, "max_grad_norm=1.0"),
    ({"update_timing": "backward", "stage": 1}, "stage=1"),
    ({"update_timing": "yes"}, "update_timing='yes' is not valid; choose one of")])
def test_update_in_backward_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadEngine(TinyLM(), **kwargs)


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
        written = eng.memory_report()["nvme"]["state_written_bytes"]
        eng.step()
        # the plain step writes the NVMe optimizer state back in step(); update_timing=
        # "next_forward" in the next forward (update_timing="backward" in backward, its writes
        # counted as they end); the parameter shards' writes are not the state's
        if eng.config.update_timing != "backward":
            plain = eng.config.offload_optimizer == "nvme" and not on
            assert (eng.memory_report()["nvme"]["state_written_bytes"] > written) is plain
            eng(x)
            assert (eng.memory_report()["nvme"]["state_written_bytes"] > written) is (plain or on)
