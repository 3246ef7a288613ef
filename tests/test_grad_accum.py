"""gradient_accumulation_steps (DeepSpeed's semantics) in the engine and --grad-accum in the
main job, against torch with accumulated micro-batches of their mean loss."""
import math
import tempfile

import pytest
import torch

from dist_harness import run_ranks
from models import TinyLM, batches, lm_loss
from test_optimizer import CASES, LR, STEPS, _cosine, _diff, _engine, _reference

from offload_zero import OffloadEngine, cli, train

@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_gradient_accumulation_deepspeed_loop_matches_torch(case, tmp_path, torch_single_thread):
    """backward and step on every micro-batch with gradient_accumulation_steps=2 trains as
    torch with two accumulated micro-batches of their mean loss (a scheduler stepped at the
    boundaries); zero_grad() after a step that only ended a micro-batch drops nothing."""
    stage, offload = case
    torch.manual_seed(0)
    model = TinyLM()
    data = batches(2 * STEPS, seed=6, batch=2)
    expected = _reference(model, data, accumulate=2)
    got = []
    with _engine(model, stage, offload, tmp_path, gradient_accumulation_steps=2) as eng:
        sched = _cosine(eng.optimizer)
        for i, (x, y) in enumerate(data):
            assert eng.is_gradient_accumulation_boundary() == (i % 2 == 1)
            eng.backward(lm_loss(eng(x), y))
            boundary = eng.is_gradient_accumulation_boundary()
            eng.step()
            eng.zero_grad()
            if boundary:
                sched.step()
                got.append(eng.full_state_dict())
    assert len(got) == STEPS
    assert max(_diff(g, e) for g, e in zip(got, expected)) <= 1e-6


def _ws2_rank(rank, world_size, cases):
    torch.set_num_threads(1)
    out = {}
    for stage, offload in cases:
        torch.manual_seed(0)
        model = TinyLM()
        data = batches(2 * STEPS, seed=6, batch=2 * world_size)
        expected = _reference(model, data, accumulate=2)[-1]
        with tempfile.TemporaryDirectory() as d, \
                _engine(model, stage, offload, d, gradient_accumulation_steps=2) as eng:
            sched = _cosine(eng.optimizer)
            for i, (x, y) in enumerate(data):
                eng.backward(lm_loss(eng(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
                eng.step()
                if i % 2:
                    sched.step()
            out[(stage, offload)] = _diff(eng.full_state_dict(), expected)
    return out


def test_gradient_accumulation_matches_torch_world_size_2():
    for result in run_ranks(_ws2_rank, 2, [(1, "cpu"), (3, "nvme")]):
        assert all(d <= 1e-6 for d in result.values()), result


def test_gradient_accumulation_steps_is_checked():
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match=rf"^gradient_accumulation_steps={bad!r} is not "
                                             r"valid; it must be an int >= 1"):
            OffloadEngine(TinyLM(), gradient_accumulation_steps=bad)
    with pytest.raises(ValueError, match=r"update_timing='backward' cannot accumulate gradients"):
        OffloadEngine(TinyLM(), stage=2, update_timing="backward", gradient_accumulation_steps=2)


def test_zero_grad_after_backward_restarts_the_accumulation_window(torch_single_thread):
    """A micro-batch dropped with zero_grad() after its backward (a bad batch) drops the
    window's earlier ones too, and the next two step() calls make the update."""
    torch.manual_seed(0)
    model = TinyLM()
    data = batches(3, seed=7, batch=2)
    constant = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # noqa: E731
    expected = _reference(model, data[1:], constant, accumulate=2)[0]
    with _engine(model, 2, "cpu", None, gradient_accumulation_steps=2) as eng:
        sched = constant(eng.optimizer)
        eng.backward(lm_loss(eng(data[0][0]), data[0][1]))
        eng.step()  # (ends a micro-batch)
        eng.backward(lm_loss(eng(data[0][0]), data[0][1]))
        eng.zero_grad()  # drops both
        assert not eng.is_gradient_accumulation_boundary()
        for x, y in data[1:]:
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        sched.step()
        assert _diff(eng.full_state_dict(), expected) <= 1e-6
        assert math.isclose(eng.lr, LR)


def _parse(*argv):
    return cli.build_parser().parse_args(["train", *map(str, argv)])


def test_grad_accum_in_the_main_job_matches_one_batch_of_all_the_micro_batches(tmp_path,
                                                                             capsys):
    """--grad-accum 2 --batch-size 2 trains on the windows --batch-size 4 takes, in the same
    steps: the same losses (a step's loss is its micro-batches' mean) and the same schedule;
    --steps counts optimizer steps. --update-timing backward with it exits 2 before anything is
    built, and a resume with another --grad-accum is refused."""
    common = ["--preset", "tiny", "--steps", 4, "--seq-len", 32, "--log-every", 0,
              "--no-progress", "--stage", 2]
    whole = train.run(_parse(*common, "--batch-size", 4))
    ckpt = tmp_path / "ckpt"
    accum = train.run(_parse(*common, "--batch-size", 2, "--grad-accum", 2,
                             "--checkpoint", ckpt))
    assert accum["grad_accum"] == 2 and accum["steps"] == 4 and accum["update_timing"] != "backward"
    assert "2 micro-batches a step" in train.format_summary(accum)
    assert "micro-batches" not in train.format_summary(whole)
    assert whole["update_timing"] == "backward"  # (its default with one micro-batch a step)
    assert accum["losses"] == pytest.approx(whole["losses"], rel=1e-5)
    capsys.readouterr()
    assert cli.main(["train", "--grad-accum", "2", "--update-timing", "backward", "--steps",
                     "1"]) == 2
    assert "cannot accumulate --grad-accum 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"the saved run used --grad-accum 2, this one 1"):
        train.run(_parse(*common, "--steps", 6, "--batch-size", 2, "--resume", ckpt))


def test_the_micro_step_count_alone_matches_deepspeeds_boundaries():
    """update/accumulation.py on its own (no engine): with 3 steps every third step() updates,
    backward's loss is divided by 3, a step that only ended a micro-batch reshards the units,
    and zero_grad() after a backward restarts the window (the next update is 3 calls away)."""
    from offload_zero.update.accumulation import Accumulation
    from offload_zero.update.state import UpdateStates

    class Scheduler:
        resharded = 0

        def reshard_all(self):
            self.resharded += 1

    states, sched = UpdateStates(0), Scheduler()
    acc = Accumulation(3, "step", states, sched, hypers=lambda: ())
    updates = []
    for call in range(6):
        loss = acc.start_backward(torch.tensor(6.0, requires_grad=True))
        assert loss.item() == 2.0 and states.grads_pending
        if not acc.ends_micro_batch():
            acc.updated()
            updates.append(call)
    assert updates == [2, 5] and sched.resharded == 4 and acc.micro_steps == 6
    acc.start_backward(torch.tensor(1.0, requires_grad=True))
    assert acc.ends_micro_batch() and acc.micro_steps == 7 and sched.resharded == 5
    assert acc.nothing_to_drop()  # (step(); zero_grad() after a micro-batch accumulates)
    acc.start_backward(torch.tensor(1.0, requires_grad=True))
    assert not acc.nothing_to_drop()
    acc.dropped()  # zero_grad() after a backward: the window starts again after the 6 calls
    assert acc.micro_steps == 6 and not states.grads_pending
    assert [acc.ends_micro_batch() for _ in range(2)] == [True, True] and acc.is_boundary()
    with pytest.raises(ValueError, match="scalar loss tensor that requires grad"):
        acc.check_backward(torch.ones(2))
    acc.check_backward(torch.tensor(1.0, requires_grad=True))  # (timing "step": nothing else)

    def bad_group():
        raise ValueError("parameter group 0: lr=-1.0")
    in_backward = Accumulation(1, "backward", states, sched, hypers=bad_group)
    with pytest.raises(ValueError, match="lr=-1.0"):  # (before backward's hooks run)
        in_backward.check_backward(torch.tensor(1.0, requires_grad=True))
    states.grads_pending = True
    with pytest.raises(RuntimeError, match="cannot accumulate over several backward calls"):
        in_backward.check_backward(torch.tensor(1.0, requires_grad=True))


def test_update_modules_import_no_engine():
    """The update modules, the construction and the build are given their collaborators: none
    imports the engine (no import cycle; they never call back into it)."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "offload_zero"
    files = sorted(root.glob("update/*.py")) + [root / n for n in ("construct.py", "build.py",
                                                                  "lifetime.py", "inputs.py")]
    assert len(files) >= 9

    def engine_imports(path):
        tree = ast.parse(path.read_text())
        return [node.lineno for node in ast.walk(tree)
                if (isinstance(node, ast.ImportFrom) and (node.module == "offload_zero.engine" or (
                    node.module == "offload_zero" and any(a.name == "OffloadEngine"
                                                          for a in node.names))))
                or (isinstance(node, ast.Import)
                    and any(a.name == "offload_zero.engine" for a in node.names))]
    assert not {f.name: engine_imports(f) for f in files if engine_imports(f)}
