"""``offload-zero train``'s flags in process: bad values exit 2 naming them, ``--help``, the
presets, the learning-rate schedule, the summary, and the checks made before training."""
import json
import os
import shutil
import subprocess

import pytest

from offload_zero import cli, train
from offload_zero.train.summary import fmt_bytes
from train_cli_helpers import (FAST, REPO, _engine_keywords, _parse, _run, _tiny_checkpoint,
                               unwritable_folder)


def test_run_error_is_one_line_exit_2(tmp_path):
    proc = _run(["train", "--data", tmp_path / "missing.txt"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing.txt" in lines[0] and "error" in lines[0]


def test_console_script_is_declared():
    assert "offload-zero=offload_zero.cli:main" in (REPO / "setup.py").read_text()
    assert callable(cli.main)


@pytest.mark.skipif(shutil.which("offload-zero") is None, reason="console script not installed")
def test_console_script_help():
    proc = subprocess.run(["offload-zero", "train", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "--offload" in proc.stdout


@pytest.mark.parametrize("argv, word", [
    (["train", "--offload", "tape"], "tape"),
    (["train", "--stage", "4"], "4"),
    (["train", "--dtype", "fp8"], "fp8"),
    (["train", "--steps", "0"], "0"),
    (["train", "--preset", "huge"], "huge"),
    (["fly"], "fly"),
    ([], "command"),
])
def test_bad_flags_exit_nonzero_naming_the_value(argv, word, capsys):
    """A bad flag is one line on stderr (no usage block before it) naming the value and where
    the valid ones are listed; exit status 2."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    prog = "offload-zero train" if argv[:1] == ["train"] else "offload-zero"
    assert err.count("\n") == 1 and "usage:" not in err and word in err
    assert err.startswith(f"{prog}: error: ") and err.rstrip().endswith(f"(see '{prog} --help')")


def test_help_lists_commands_and_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    assert "train" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    for needle in ("--offload", "(default: cpu)", "--stage", "(default: 3)", "--preset",
                   "tiny", "--json", "--model", "standard library"):
        assert needle in text


def test_host_cache_bytes_help_says_the_embeddings_state_stays_in_ram(tmp_path, capsys):
    """--host-cache-bytes 0 is not "all on NVMe": with updates in backward or next_forward the
    embeddings' optimizer state stays in host memory (tail_state_in_host), as an engine built
    with host_cache_bytes=0 shows."""
    from models import TinyLM
    from offload_zero import OffloadEngine

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    start = text.rindex("--host-cache-bytes SIZE")  # (its entry, after the usage line)
    help_text = text[start:text.index("--max-host-bytes SIZE", start)]
    assert "all on NVMe" not in help_text
    for needle in ("default 0: no cache", "input embeddings' state stays in RAM",
                   "backward or next_forward", "tail_state_in_host"):
        assert needle in help_text, help_text
    with OffloadEngine(TinyLM(), offload="nvme", path=str(tmp_path), host_cache_bytes=0,
                       update_timing="next_forward") as engine:
        assert engine.memory_report()["host_cache"]["host_flat_params"] == 1


def test_value_errors_exit_2(tmp_path, capsys):
    assert cli.main(["train", "--offload", "cpu", "--path", str(tmp_path)]) == 2
    assert "--path is only used with --offload nvme" in capsys.readouterr().err
    assert cli.main(["train", "--hidden-size", "64", "--heads", "3"]) == 2
    assert "--heads 3" in capsys.readouterr().err


def test_model_flags_conflict_and_small_vocab(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _tiny_checkpoint(ckpt, vocab_size=100)
    assert cli.main(["train", "--model", str(ckpt), "--preset", "tiny"]) == 2
    assert "--preset cannot be combined with --model" in capsys.readouterr().err
    assert cli.main(["train", "--model", str(ckpt)]) == 2
    assert "too small for the byte tokenizer" in capsys.readouterr().err
    assert cli.main(["train", "--model", str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_int_flags_say_what_is_wrong(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--checkpoint-every", "abc"])
    err = capsys.readouterr().err
    assert "must be an integer, got 'abc'" in err and "_nonnegative_int" not in err


def test_presets_parameter_counts():
    from transformers import LlamaConfig, LlamaForCausalLM

    def params(name):
        s = train.PRESETS[name]
        config = LlamaConfig(vocab_size=259, hidden_size=s.hidden_size, num_hidden_layers=s.layers,
                             num_attention_heads=s.heads, num_key_value_heads=s.heads,
                             intermediate_size=s.intermediate_size)
        with __import__("torch").device("meta"):
            return sum(p.numel() for p in LlamaForCausalLM(config).parameters())

    assert 1e5 < params("tiny") < 1e6
    assert 1e7 < params("small") < 3e7
    assert params("base") > 1e8


def test_lr_schedule():
    lrs = [train.lr_at(s, 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] >= 0.1 and lrs[-1] < 0.11
    assert train.lr_at(0, 5, 1.0, 0) == pytest.approx(1.0)


def test_summary_averages_first_and_last_steps():
    report = {"device": {"current_bytes": 1, "peak_bytes": 10},
              "host": {"current_bytes": 2, "peak_bytes": 20},
              "nvme": {"current_bytes": 0, "peak_bytes": 30, "read_bytes": 40,
                       "written_bytes": 50, "wait_s": 1.25}}
    losses = [float(v) for v in range(30, 0, -1)]
    s = train.summarize(losses, report, wall_s=2.0, tokens=1000, extra={"steps": 30})
    assert s["first_loss"] == pytest.approx(28.0) and s["last_loss"] == pytest.approx(3.0)
    assert s["peak_bytes"] == {"device": 10, "host": 20, "nvme": 30}
    assert (s["nvme_read_bytes"], s["nvme_written_bytes"], s["nvme_wait_s"]) == (40, 50, 1.25)
    assert s["tokens_per_s"] == pytest.approx(500.0)
    s.update(model="m", params=1, tokenizer="t", offload="nvme", stage=3, dtype="bf16",
             world_size=1, steps=30, setup_s=0.5)
    assert "read 40 B | written 50 B | training waited 1.2 s on it" in train.format_summary(s)
    s = train.summarize([4.0, 2.0], report, wall_s=1.0, tokens=1, extra={})
    assert (s["first_loss"], s["last_loss"], s["loss_window_steps"]) == (4.0, 2.0, 1)
    json.dumps(s)


def test_summary_labels_the_engines_bytes_and_the_process_peak_rss(capsys):
    """The summary's per-tier bytes are the engine's own accounting, far below the process's
    peak RSS (torch, the model, activations): both are printed, each labelled as what it is."""
    summary = train.run(_parse("--preset", "tiny", "--steps", 1, "--no-progress", *FAST))
    text = capsys.readouterr().out
    assert summary["peak_rss_bytes"] > summary["peak_bytes"]["host"] > 0
    assert "engine-held (accounting): device" in text
    assert "process peak RSS" in text
    assert fmt_bytes(summary["peak_rss_bytes"]) in text


@pytest.mark.parametrize("flags, word", [
    (["--offload", "nvme", "--path", "{file}"], "is not a folder"),
    (["--offload", "nvme", "--path", "/nonexistent-parent/swap"], "does not exist"),
    (["--json", "/nonexistent-parent/out.json"], "--json"),
    (["--memory-plot", "/nonexistent-parent/m.png"], "--memory-plot"),
    (["--save", "{file}"], "exists and is not a folder"),
    (["--save", "{file}/out"], "cannot be created"),
    (["--steps", "20", "--warmup", "50"], "--warmup 50 is more than --steps 20"),
])
def test_bad_output_paths_fail_before_training(tmp_path, flags, word):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    flags = [f.replace("{file}", str(a_file)) for f in flags]
    proc = _run(["train", "--preset", "tiny", "--steps", "1000", *flags, *FAST], cwd=tmp_path,
                timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert word in proc.stderr and "Traceback" not in proc.stderr
    assert "step " not in proc.stderr  # nothing was trained


@pytest.mark.parametrize("flags, name", [
    (["--json", "{ro}/summary.json"], "summary.json"),
    (["--memory-plot", "{ro}/memory.png"], "memory.png"),
    (["--save", "{ro}/x"], "x"),
    (["--checkpoint", "{ro}/ck"], "ck"),
    (["--offload", "nvme", "--path", "{ro}/swap"], "swap"),
])
def test_an_output_folder_that_cannot_be_written_fails_before_anything_is_built(
        flags, name, capsys, monkeypatch):
    """Each output flag's folder is tried by creating a file there, before the model is built:
    ``os.access`` says root may write to /proc, where every file creation fails. One line: the
    flag, the path, the OS error and what to do."""
    ro = unwritable_folder()
    flags = [f.replace("{ro}", ro) for f in flags]

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the output flags were checked")
    monkeypatch.setattr(train.loop, "build_model", no_build)
    assert cli.main(["train", "--preset", "tiny", "--steps", "1", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    flag, value = flags[-2:]
    assert err.startswith(f"offload-zero train: error: {flag} {value!r} cannot be written: "
                          f"creating a file in {ro!r} failed ([Errno "), err
    assert err.endswith(f"give another {flag}, in a folder this process can write to"), err


def test_output_checks_leave_nothing_behind_and_refuse_a_folder_or_a_format(tmp_path):
    """Writable output paths pass, and the test files are gone; a --json that names a folder,
    and a --memory-plot in a format matplotlib cannot write, fail up front too."""
    train.check_args(_parse("--json", tmp_path / "s.json", "--memory-plot", tmp_path / "m.png",
                            "--save", tmp_path / "new" / "dir", "--checkpoint", tmp_path / "ck",
                            "--offload", "nvme", "--path", tmp_path / "swap"))
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=f"^--json '{tmp_path}' is a folder; give a file name"):
        train.check_args(_parse("--json", tmp_path))
    with pytest.raises(ValueError, match=r"^--memory-plot '.*m\.txt': matplotlib cannot draw "
                                         r"to a 'txt' file; give a name ending in \.png"):
        train.check_args(_parse("--memory-plot", tmp_path / "m.txt"))
    with pytest.raises(ValueError, match=r"^--json '/nonexistent-parent/s\.json': folder "
                                         r"'/nonexistent-parent' does not exist; create it"):
        train.check_args(_parse("--json", "/nonexistent-parent/s.json"))


def test_a_json_that_cannot_be_written_after_the_run_is_a_value_error(monkeypatch):
    """Should the --json folder turn unwritable during the run (checked before it), the write
    raises a ValueError naming the flag (one line from the CLI), not an OSError traceback."""
    ro = unwritable_folder()
    monkeypatch.setattr(train.loop, "check_args", lambda args: None)  # (as if it changed since)
    with pytest.raises(ValueError, match=rf"^--json '{ro}/s.json' cannot be written: .*the "
                                         "summary is printed above"):
        train.run(_parse("--preset", "tiny", "--steps", 1, "--no-progress", "--json",
                         f"{ro}/s.json", *FAST))


def test_warmup_more_than_steps_is_an_error(capsys):
    message = "--warmup 50 is more than --steps 20; give --warmup between 0 and 20"
    assert cli.main(["train", "--steps", "20", "--warmup", "50"]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError) as info:  # run(args) checks it too, before building anything
        train.run(_parse("--steps", 20, "--warmup", 50))
    assert str(info.value) == message
    for warmup in (0, 1, 19, 20):  # the valid range's edges pass
        train.check_args(_parse("--steps", 20, "--warmup", warmup))
    with pytest.raises(ValueError, match="--warmup 21 is more than --steps 20"):
        train.check_args(_parse("--steps", 20, "--warmup", 21))


def test_state_format_and_host_memory_flags_reach_the_engine(tmp_path, monkeypatch):
    """--moment-dtype, --host-cache-bytes and --max-host-bytes set the engine's options of
    those names; the summary names the first two."""
    seen = _engine_keywords(monkeypatch)
    summary = train.run(_parse("--preset", "tiny", "--steps", 1, "--no-progress", "--offload",
                               "nvme", "--path", tmp_path, "--moment-dtype", "int8",
                               "--host-cache-bytes", "64KiB", "--max-host-bytes", "4GB", *FAST))
    assert (seen["moment_dtype"], seen["host_cache_bytes"], seen["max_host_bytes"]) == (
        "int8", 64 * 1024, 4 * 10 ** 9)
    assert (summary["moment_dtype"], summary["host_cache_bytes"]) == ("int8", 64 * 1024)
    assert ", int8 moments, host cache " in train.format_summary(summary)


def test_master_dtype_flag_reaches_the_engine_and_is_checked(tmp_path, monkeypatch, capsys):
    """--master-dtype bf16 (with --dtype bf16) sets the engine's master_dtype and the summary
    names it; with another --dtype it is a one-line error that says what to change."""
    seen = _engine_keywords(monkeypatch)
    summary = train.run(_parse("--preset", "tiny", "--steps", 1, "--no-progress", "--offload",
                               "nvme", "--path", tmp_path, "--dtype", "bf16", "--master-dtype",
                               "bf16", *FAST))
    assert seen["master_dtype"] == "bf16" and summary["master_dtype"] == "bf16"
    assert ", bf16 master weights" in train.format_summary(summary)
    assert cli.main(["train", "--master-dtype", "bf16", "--dtype", "fp32", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--master-dtype bf16 needs --dtype bf16 (got --dtype fp32): the "
                            "master is the bf16 weights themselves; or --master-dtype fp32"), err


def test_deepspeed_low_precision_keys_reach_the_engine_once(tmp_path, monkeypatch, capsys):
    """--deepspeed with bf16_master_weights_and_grads and bf16_optimizer_states: the engine
    gets bf16 masters, bf16 gradient shards and bf16 moments, once each (the CLI's own
    --master-dtype / --moment-dtype agree with the config or are refused naming both)."""
    import torch
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                 "bf16_optimizer_states": True},
        "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}))
    seen = _engine_keywords(monkeypatch)
    summary = train.run(_parse("--preset", "tiny", "--steps", 1, "--no-progress",
                               "--deepspeed", config, "--master-dtype", "bf16", *FAST))
    assert (seen["master_dtype"], seen["moment_dtype"], seen["grad_dtype"]) == (
        "bf16", "bf16", torch.bfloat16)
    assert (summary["master_dtype"], summary["moment_dtype"]) == ("bf16", "bf16")
    assert cli.main(["train", "--preset", "tiny", "--steps", "1", "--deepspeed", str(config),
                     "--master-dtype", "fp32"]) == 2
    assert ("--master-dtype 'fp32' conflicts with the DeepSpeed config's "
            "bf16.bf16_master_weights_and_grads" in capsys.readouterr().err)


def test_a_bad_size_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--host-cache-bytes", "2XB"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("offload-zero train: error: argument --host-cache-bytes: '2XB' "
                              "is not a size; give bytes"), err


def test_the_summary_shows_no_host_cache_where_it_is_unused(tmp_path):
    """--host-cache-bytes with the optimizer state off NVMe: the engine warns it is unused,
    and the summary does not claim a cache."""
    with pytest.warns(UserWarning, match="host_cache_bytes=65536 is not used"):
        summary = train.run(_parse("--preset", "tiny", "--steps", 1, "--no-progress",
                                   "--offload", "cpu", "--host-cache-bytes", "64KiB", *FAST))
    assert summary["host_cache_bytes"] == 0
    assert "host cache" not in train.format_summary(summary)
