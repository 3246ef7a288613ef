"""``--checkpoint`` / ``--resume``: a resumed run continues the saved one bit for bit, and a
run it cannot continue is refused before training, naming the flag and both values."""
import json
import math

import pytest

from offload_zero import cli, train
from train_cli_helpers import FAST, _parse, _run_capturing_weights


def _run_dying_in_step(monkeypatch, n: int, args) -> None:
    """Run the main job with ``args`` (plus --no-progress and FAST) and kill it with
    KeyboardInterrupt in its ``n``-th ``OffloadEngine.step`` (1-based), as a run killed mid-way."""
    from offload_zero import OffloadEngine
    original_step, calls = OffloadEngine.step, []

    def dies(self):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        original_step(self)

    monkeypatch.setattr(OffloadEngine, "step", dies)
    with pytest.raises(KeyboardInterrupt):
        train.run(_parse(*args, "--no-progress", *FAST))
    monkeypatch.setattr(OffloadEngine, "step", original_step)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_resume_continues_the_run_bit_for_bit(offload, tmp_path, monkeypatch):
    """A run checkpointed every 3 steps dies in step 5; --resume from its checkpoint (step 3)
    trains steps 4-8 on the batches the dead run had not seen, with the same learning rates:
    its final weights equal an uninterrupted 8-step run's, bit for bit."""
    import torch

    common = ["--preset", "tiny", "--steps", 8, "--offload", offload, "--lr", "3e-3"]
    _, whole = _run_capturing_weights(monkeypatch, [*common, "--save", tmp_path / "w"])
    whole = {k: v.clone() for k, v in whole.items()}

    ckpt = tmp_path / "ckpt"
    _run_dying_in_step(monkeypatch, 5, [*common, "--checkpoint", ckpt, "--checkpoint-every", 3])
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    assert meta["client_state"]["step"] == 3

    summary, resumed = _run_capturing_weights(
        monkeypatch, [*common, "--resume", ckpt, "--checkpoint", ckpt, "--save", tmp_path / "r"])
    assert summary["resumed_from"] == 3 and summary["steps"] == 5 and len(summary["losses"]) == 5
    assert resumed.keys() == whole.keys()
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert json.loads((ckpt / "checkpoint.json").read_text())["client_state"]["step"] == 8


def test_resume_for_more_steps_warns_that_the_schedule_changes(tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    train.run(_parse("--preset", "tiny", "--steps", 2, "--checkpoint", ckpt, "--no-progress", *FAST))
    with caplog.at_level("WARNING", logger="offload_zero.train"):
        summary = train.run(_parse("--preset", "tiny", "--steps", 4, "--resume", ckpt,
                                   "--no-progress", *FAST))
    assert summary["resumed_from"] == 2 and len(summary["losses"]) == 2
    assert any("--steps 2 -> 4: the learning rate follows the new schedule" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("flags,message", [
    (["--checkpoint-every", "2"], "--checkpoint-every 2 needs --checkpoint DIR"),
    (["--resume", "{missing}"], "checkpoint folder '{missing}' does not exist"),
    (["--resume", ""], "--resume needs a checkpoint folder, got an empty name"),
    (["--resume", "{api}"], "its checkpoint was not written by offload-zero train --checkpoint"),
    (["--resume", "{ckpt}", "--stage", "2"], "the saved run used --stage 3, this one 2"),
    (["--resume", "{ckpt}", "--dtype", "bf16"], "the saved run used --dtype 'fp32', this one 'bf16'"),
    (["--resume", "{ckpt}", "--moment-dtype", "int8"],
     "the saved run used --moment-dtype 'fp32', this one 'int8'"),
    (["--resume", "{ckpt}", "--data", "{text}"], "the saved run trained on other text"),
    (["--checkpoint", "{ckpt}"], "already holds a checkpoint, which this run would overwrite"),
    (["--checkpoint", "{other}"], "is not an offload-zero checkpoint (it holds ['notes.txt'])"),
    (["--checkpoint", "{file}/sub"], "cannot be created"),
    (["--checkpoint", ""], "--checkpoint needs a folder, got an empty name"),
    (["--checkpoint", "{new}", "--save", "{new}"], "is inside the --save folder"),
    (["--resume", "{ckpt}", "--seed", "1"], "the saved run used --seed 0, this one 1"),
    (["--resume", "{ckpt}", "--seq-len", "32"], "the saved run used --seq-len 64, this one 32"),
    (["--resume", "{ckpt}", "--steps", "2"], "already did 2 steps; give --steps more than 2"),
    (["--checkpoint", "{file}"], "exists and is not a folder"),
])
def test_bad_checkpoint_flags_fail_before_training(flags, message, tmp_path, capsys):
    from offload_zero import OffloadEngine
    ckpt = tmp_path / "ckpt"
    assert cli.main(["train", "--preset", "tiny", "--steps", "2", "--checkpoint", str(ckpt),
                     "--no-progress", *FAST]) == 0
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep")
    (tmp_path / "text.txt").write_text("some other text to train on. " * 200)
    model, _, _ = train.build_model(_parse("--preset", "tiny"))
    with OffloadEngine(model, offload="cpu") as eng:  # a checkpoint of the API, not of train
        eng.save_checkpoint(tmp_path / "api", client_state={"step": 1})
    capsys.readouterr()
    subs = {"{missing}": str(tmp_path / "nope"), "{ckpt}": str(ckpt), "{api}": str(tmp_path / "api"),
            "{file}": str(tmp_path / "a_file"), "{other}": str(tmp_path / "other"),
            "{text}": str(tmp_path / "text.txt"), "{new}": str(tmp_path / "new")}

    def fill(text):
        for key, value in subs.items():
            text = text.replace(key, value)
        return text

    flags, message = [fill(f) for f in flags], fill(message)
    steps = [] if "--steps" in flags else ["--steps", "4"]
    assert cli.main(["train", "--preset", "tiny", *FAST, *steps, *flags, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "step 1" not in err
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep"
    assert json.loads((ckpt / "checkpoint.json").read_text())["client_state"]["step"] == 2


def test_resume_on_another_world_size_names_both(tmp_path, capsys):
    """The engine reshards a checkpoint onto any world size, but the run's batches depend on
    it: --resume from a run of 2 ranks on 1 is refused, naming both, before anything loads."""
    ckpt = tmp_path / "ckpt"
    assert cli.main(["train", "--preset", "tiny", "--steps", "2", "--checkpoint", str(ckpt),
                     "--no-progress", *FAST]) == 0
    meta_path = ckpt / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta["world_size"] = 2  # as if saved under torchrun --nproc-per-node 2
    meta_path.write_text(json.dumps(meta))
    capsys.readouterr()
    assert cli.main(["train", "--preset", "tiny", "--steps", "4", "--resume", str(ckpt),
                     "--no-progress", *FAST]) == 2
    err = capsys.readouterr().err
    assert "the saved run had world size 2, this one 1" in err and "Traceback" not in err


@pytest.mark.parametrize("first,then", [([], ["--update-timing", "step"]),
                                         (["--update-timing", "step"],
                                          ["--update-timing", "backward"])])
def test_resume_with_the_other_update_timing_continues_the_same_run(first, then, tmp_path,
                                                                      monkeypatch):
    """The two layouts (the root in one flat parameter or split in two) give the same numbers
    and a checkpoint loads into either: a run that died after its step-2 checkpoint, resumed
    with another --update-timing, has the losses of the run that never stopped."""
    whole = train.run(_parse("--preset", "tiny", "--steps", 4, "--no-progress", *first, *FAST))
    ckpt = tmp_path / "ckpt"
    _run_dying_in_step(monkeypatch, 3, ["--preset", "tiny", "--steps", 4, "--checkpoint", ckpt,
                                        "--checkpoint-every", 2, *first])
    summary = train.run(_parse("--preset", "tiny", "--steps", 4, "--resume", ckpt,
                               "--no-progress", *then, *FAST))
    assert summary["resumed_from"] == 2
    assert (summary["update_timing"] == "backward") is (then[-1] == "backward")
    assert summary["losses"] == whole["losses"][2:]


def test_resume_takes_the_saved_runs_update_timing(tmp_path):
    """Without --update-timing a resumed run keeps the saved run's choice (the default
    differs between fp16 and the other dtypes)."""
    ckpt = tmp_path / "ckpt"
    first = train.run(_parse("--preset", "tiny", "--steps", 2, "--checkpoint", ckpt,
                             "--update-timing", "step", "--no-progress", *FAST))
    assert first["update_timing"] == "step"
    summary = train.run(_parse("--preset", "tiny", "--steps", 3, "--resume", ckpt, "--no-progress",
                               *FAST))
    assert summary["resumed_from"] == 2 and summary["update_timing"] == "step"


def test_a_checkpoint_that_cannot_be_written_is_a_clean_error(tmp_path, monkeypatch, capsys):
    """A full disk at a periodic save: one line naming --checkpoint and the cause, exit 2; the
    checkpoint saved before is kept."""
    import errno as errno_mod
    from offload_zero import OffloadEngine
    ckpt = tmp_path / "ckpt"
    original, saves = OffloadEngine.save_checkpoint, []

    def second_save_fails(self, folder, client_state=None):
        saves.append(client_state["step"])
        if len(saves) == 2:
            raise OSError(errno_mod.ENOSPC, "No space left on device")
        original(self, folder, client_state)

    monkeypatch.setattr(OffloadEngine, "save_checkpoint", second_save_fails)
    assert cli.main(["train", "--preset", "tiny", *FAST, "--steps", "4", "--checkpoint", str(ckpt),
                     "--checkpoint-every", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint" in err and "cannot be written at step 4" in err
    assert "No space left on device" in err and "Traceback" not in err
    assert json.loads((ckpt / "checkpoint.json").read_text())["client_state"]["step"] == 2


def test_a_resumed_fp16_run_reports_its_own_skipped_steps(tmp_path, monkeypatch):
    """The loss scale continues from the checkpoint (window 2000: it only halves here, once per
    skipped step); the resumed run's summary counts the steps it skipped itself."""
    from offload_zero.optim.loss_scale import LossScaler
    init = LossScaler.__init__
    # start at 2**24, which overflows this model's fp16 gradients for a few steps
    monkeypatch.setattr(LossScaler, "__init__", lambda self, init_scale=0, **kw: init(
        self, 2.0 ** 24 if kw.get("dynamic", True) else init_scale, **kw))
    ckpt = tmp_path / "ckpt"
    common = ["--preset", "tiny", "--dtype", "fp16", "--no-progress", *FAST]
    first = train.run(_parse(*common, "--steps", 3, "--checkpoint", ckpt))
    assert first["skipped_steps"] >= 1
    second = train.run(_parse(*common, "--steps", 12, "--resume", ckpt))
    total = 24 - int(math.log2(second["loss_scale"]))
    assert second["skipped_steps"] == total - first["skipped_steps"]
