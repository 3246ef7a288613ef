"""The engine's life: swap files removed on close, garbage collection, errors and SIGTERM; a
closed engine refuses work; Ctrl-C and errors inside backward; zero_grad's cases."""
import gc
import subprocess

import pytest
import torch

from engine_common import twins
from models import BackwardFault, TinyLM, batches, lm_loss
from offload_zero import OffloadEngine


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


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_zero_grad_cannot_skip_a_batch_that_backward_already_applied(offload, tmp_path):
    """update_timing="backward" updates each unit in backward: "backward(); zero_grad();
    step()", torch's way to skip a batch, would keep the update. zero_grad() raises instead,
    saying to call step() or use another timing, and changes nothing; step() then ends the
    step and training goes on as in a run that never called zero_grad() (the same weights,
    bit for bit). Through the optimizer facade and the wrapped model too."""
    torch.manual_seed(3)
    model = TinyLM(n_blocks=3)
    a, b = twins(model, tmp_path, sib_a=True, sib_b=True, offload=offload, stage=3)
    data = batches(3)
    with a, b:
        for i, (x, y) in enumerate(data):
            a.backward(lm_loss(a(x), y))
            a.step()
            b.backward(lm_loss(b(x), y))
            if i == 1:
                before = b.full_state_dict()
                for zero_grad in (b.zero_grad, b.optimizer.zero_grad, b.module.zero_grad):
                    with pytest.raises(RuntimeError, match="cannot be dropped.*call step"):
                        zero_grad()
                after = b.full_state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
            b.step()
            b.zero_grad()  # (after step(): nothing to drop, no error)
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
    a, b = twins(TinyLM(n_blocks=4), tmp_path, sib_a=sib, sib_b=sib, offload=offload, stage=3)
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
    a, b = twins(TinyLM(n_blocks=2), tmp_path, sib_b=False, offload=offload, stage=1)
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
