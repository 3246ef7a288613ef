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
