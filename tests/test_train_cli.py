"""End-to-end tests of ``offload-zero train`` and unit tests of its helpers.

The end-to-end cases run the real entry point in a subprocess (``python -m offload_zero.cli``)
with tiny models, short sequences and few steps, so the file stays well under two minutes on
two CPU cores.
"""
import argparse
import errno
import gzip
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from offload_zero import cli, train

REPO = Path(__file__).resolve().parents[1]
FAST = ["--seq-len", "64", "--batch-size", "4", "--log-every", "0"]


def _run(args, cwd, timeout=240, **env_overrides):
    """Run ``python -m offload_zero.cli ARGS`` in ``cwd`` with the repo importable."""
    env = dict(os.environ, **env_overrides)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    env.setdefault("OMP_NUM_THREADS", "2")
    return subprocess.run([sys.executable, "-m", "offload_zero.cli", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _files_under(path: Path):
    return sorted(p for p in path.rglob("*") if not p.is_dir())


def _tiny_checkpoint(folder: Path, vocab_size: int, **config_fields) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                         max_position_embeddings=128, **config_fields)
    LlamaForCausalLM(config).save_pretrained(folder)


def _train_bpe_tokenizer(text: str, folder: Path) -> int:
    """Train a small byte-level BPE offline, save it as a HF tokenizer, return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


# --- end to end -------------------------------------------------------------------------------

def test_train_nvme_on_stdlib(tmp_path):
    swap = tmp_path / "swap"
    out = tmp_path / "out.json"
    proc = _run(["train", "--preset", "tiny", "--steps", "30", "--offload", "nvme",
                 "--path", swap, "--json", out, *FAST], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "summary" in proc.stdout and "tokens/s" in proc.stdout
    summary = json.loads(out.read_text())
    assert summary["offload"] == "nvme" and summary["stage"] == 3
    assert summary["corpus"] == "stdlib" and summary["steps"] == 30
    assert len(summary["losses"]) == 30
    assert summary["last_loss"] < summary["first_loss"]
    assert set(summary["peak_bytes"]) == {"device", "host", "nvme"}
    assert summary["nvme_written_bytes"] > 0
    assert summary["wall_s"] > 0 and summary["tokens_per_s"] > 0
    assert summary["tokens"] == 30 * 4 * 64
    assert _files_under(swap) == [], "swap files left behind"


def test_a_swap_folder_the_run_created_is_removed(tmp_path):
    made = tmp_path / "new-swap"
    proc = _run(["train", "--preset", "tiny", "--steps", "2", "--offload", "nvme", "--path", made,
                 *FAST], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not made.exists()
    kept = tmp_path / "user-swap"
    kept.mkdir()
    proc = _run(["train", "--preset", "tiny", "--steps", "2", "--offload", "nvme", "--path", kept,
                 *FAST], cwd=tmp_path)
    assert proc.returncode == 0 and kept.is_dir() and list(kept.iterdir()) == []


def test_update_in_backward_is_on_by_default_and_changes_no_number(tmp_path):
    """The main job updates units inside backward by default; --update-timing next_forward (the
    engine's auto here) gives the very same losses (same arithmetic, other moment)."""
    losses = []
    for flag in ([], ["--update-timing", "next_forward"]):
        out = tmp_path / f"out{len(flag)}.json"
        proc = _run(["train", "--preset", "tiny", "--steps", "6", "--offload", "nvme",
                     "--path", tmp_path, "--json", out, *flag, *FAST], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads(out.read_text())
        assert (summary["update_timing"] == "backward") is (not flag)
        assert ("step in backward" in proc.stdout) is (not flag)
        losses.append(summary["losses"])
    assert losses[0] == losses[1]
    # asked for where it cannot work: one line, exit 2, before anything is built
    proc = _run(["train", "--update-timing", "backward", "--stage", "1", "--steps", "2"],
                cwd=tmp_path)
    assert proc.returncode == 2 and "--update-timing backward needs --stage 2 or 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_update_in_next_forward_is_on_where_the_nvme_step_is_not_in_backward(tmp_path, capsys):
    """With --offload nvme at stage 3 a run whose step does not run in backward (--dtype fp16
    by default) applies its updates just before the next forward's gathers; the losses and the
    skipped steps are those of --update-timing step. With --offload cpu there is no disk I/O to
    hide and it stays off. Asked for where it cannot work: one line, exit 2."""
    runs = []
    for flag in ([], ["--update-timing", "step"]):
        path = tmp_path / f"swap{len(flag)}"
        path.mkdir()
        summary = train.run(_parse("--preset", "tiny", "--steps", 6, "--offload", "nvme",
                                   "--path", path, "--dtype", "fp16", "--no-progress", *flag,
                                   *FAST))
        assert (summary["update_timing"] == "next_forward") is (not flag)
        assert ("step in forward" in train.format_summary(summary)) is (not flag)
        runs.append((summary["losses"], summary["skipped_steps"]))
    assert runs[0] == runs[1]
    cpu = train.run(_parse("--preset", "tiny", "--steps", 1, "--dtype", "fp16", "--no-progress",
                           *FAST))
    assert cpu["update_timing"] == "step"
    asked = train.run(_parse("--preset", "tiny", "--steps", 1, "--update-timing",
                             "next_forward", "--no-progress", *FAST))  # fp32: asked, not auto
    assert asked["update_timing"] == "next_forward"
    capsys.readouterr()
    for flags, message in ((["--update-timing", "sideways"], "invalid choice: 'sideways'"),
                           (["--update-timing", "next_forward", "--stage", "2"],
                            "--update-timing next_forward needs --stage 3, got --stage 2")):
        assert cli.main(["train", "--preset", "tiny", "--steps", "2", *flags, *FAST]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_finetune_local_checkpoint_with_its_tokenizer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(argparse.__file__).read_text()[:60_000])
    ckpt = tmp_path / "ckpt"
    vocab = _train_bpe_tokenizer(corpus.read_text(), ckpt)
    _tiny_checkpoint(ckpt, vocab)
    out = tmp_path / "out.json"
    temp = tmp_path / "temp"  # --offload nvme without --path swaps to a temporary folder here
    temp.mkdir()
    proc = _run(["train", "--model", ckpt, "--data", corpus, "--steps", "4", "--offload", "nvme",
                 "--stage", "2", "--json", out, "--no-progress", "--log-every", "2", *FAST[:4]],
                cwd=tmp_path, TMPDIR=str(temp))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2/4" in proc.stderr and "step 4/4" in proc.stderr
    assert "Loading weights" not in proc.stderr  # --no-progress hides transformers' bar too
    assert list(temp.iterdir()) == [], "temporary swap folder left behind"
    summary = json.loads(out.read_text())
    assert summary["nvme_written_bytes"] > 0
    assert summary["model"] == f"checkpoint {ckpt}"
    assert not summary["tokenizer"].startswith("byte")
    assert summary["corpus"] == "data" and len(summary["losses"]) == 4


def test_checkpoint_without_tokenizer_uses_bytes(tmp_path):
    ckpt = tmp_path / "ckpt"
    _tiny_checkpoint(ckpt, vocab_size=300)
    out = tmp_path / "out.json"
    proc = _run(["train", "--model", ckpt, "--steps", "2", "--offload", "cpu", "--stage", "1",
                 "--dtype", "bf16", "--json", out, "--no-progress", *FAST], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no tokenizer files" in proc.stderr
    summary = json.loads(out.read_text())
    assert summary["tokenizer"] == "byte" and summary["dtype"] == "bf16"
    assert all(math.isfinite(v) for v in summary["losses"])


def test_torchrun_two_ranks(tmp_path):
    swap = tmp_path / "swap"
    out = tmp_path / "out.json"
    saved = tmp_path / "saved"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "offload_zero.cli", "train", "--preset", "tiny", "--steps", "4", "--offload",
         "nvme", "--path", str(swap), "--json", str(out), "--no-progress", "--save", str(saved),
         *FAST, "--log-every", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("summary") == 1  # rank 0 only
    assert proc.stdout.count("saved ") == 1  # rank 0 writes the weights gathered from both
    assert proc.stderr.count("(rank 0)") == 2  # the log lines say whose loss they show
    assert sorted(os.listdir(saved)) == ["config.json", "generation_config.json", "model.safetensors"]
    import safetensors.torch
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(str(saved)))
    model.load_state_dict(safetensors.torch.load_file(str(saved / "model.safetensors")),
                          strict=True)  # full shapes, every name: both ranks' shards
    summary = json.loads(out.read_text())
    assert summary["world_size"] == 2 and summary["tokens"] == 4 * 4 * 64 * 2
    assert summary["nvme_written_bytes"] > 0
    assert _files_under(swap) == []


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


# --- flags and help, in process ---------------------------------------------------------------

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


# --- helpers ----------------------------------------------------------------------------------

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
                       "written_bytes": 50}}
    losses = [float(v) for v in range(30, 0, -1)]
    s = train.summarize(losses, report, wall_s=2.0, tokens=1000, extra={"steps": 30})
    assert s["first_loss"] == pytest.approx(28.0) and s["last_loss"] == pytest.approx(3.0)
    assert s["peak_bytes"] == {"device": 10, "host": 20, "nvme": 30}
    assert (s["nvme_read_bytes"], s["nvme_written_bytes"]) == (40, 50)
    assert s["tokens_per_s"] == pytest.approx(500.0)
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
    assert train._fmt_bytes(summary["peak_rss_bytes"]) in text


def test_a_disk_too_small_for_the_nvme_files_is_one_line_before_training(tmp_path, capsys,
                                                                           monkeypatch):
    """Checked before anything is built: the bytes the NVMe files need on --path's file system
    (the estimator's count, this engine's files), what is free there, and what to do."""
    swap = tmp_path / "swap"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(train.shutil, "disk_usage",
                        lambda path: usage._replace(free=1 << 20))  # 1 MiB free
    assert cli.main(["train", "--preset", "tiny", "--steps", "1", "--offload", "nvme",
                     "--path", str(swap), "--no-progress", *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"{str(swap)!r}" in err and "1.0 MiB free" in err
    assert "smaller model" in err and "--offload auto" in err and "another --path" in err
    assert not swap.exists()  # nothing was created


def test_a_disk_that_fills_up_during_the_run_is_the_same_one_line(tmp_path, capsys,
                                                                  monkeypatch):
    """A disk that fills up after the check (another job writing there) ends the run with the
    same line, not a SwapIOError traceback naming one file's bytes."""
    from offload_zero.memory import swapper

    def full(fd, path, nbytes):
        raise swapper.SwapIOError(errno.ENOSPC, f"cannot reserve {nbytes} bytes for {path}: "
                                  "[Errno 28] No space left on device", path, 0, nbytes)
    monkeypatch.setattr(swapper, "_reserve", full)
    swap = tmp_path / "swap"
    assert cli.main(["train", "--preset", "tiny", "--steps", "1", "--offload", "nvme",
                     "--path", str(swap), "--no-progress", *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "no space left" in err and f"{str(swap)!r}" in err and " free" in err
    assert "--offload auto" in err


def test_memory_plot_auto_offload_and_checkpointing(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "mem.png"
    out = tmp_path / "out.json"
    proc = _run(["train", "--preset", "tiny", "--steps", "4", "--offload", "auto", "--path",
                 tmp_path / "swap", "--activation-checkpointing", "--memory-plot", png,
                 "--json", out, *FAST], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert json.loads(out.read_text())["steps"] == 4


@pytest.mark.parametrize("signame,code,word", [("SIGTERM", 143, "terminated (SIGTERM)"),
                                               ("SIGINT", 130, "interrupted (Ctrl-C)")])
def test_sigterm_removes_swap_files(signame, code, word, tmp_path):
    """torchrun, Slurm and docker stop send SIGTERM, a user Ctrl-C: the run must unwind, clean
    up, and say so in one line."""
    import signal
    import time
    swap = tmp_path / "swap"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    proc = subprocess.Popen([sys.executable, "-m", "offload_zero.cli", "train", "--preset", "tiny",
                             "--steps", "100000", "--offload", "nvme", "--path", str(swap), *FAST],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(swap.rglob("*.swp")):
        time.sleep(0.2)
    assert list(swap.rglob("*.swp")), "the run never created its swap files"
    time.sleep(1.0)
    proc.send_signal(getattr(signal, signame))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert f"{word}; swap files removed" in err and "Traceback" not in err
    assert _files_under(swap) == []


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


# --- --warmup against --steps -----------------------------------------------------------------

def _parse(*argv):
    return cli.build_parser().parse_args(["train", *map(str, argv)])


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


# --- --save -----------------------------------------------------------------------------------

def _run_capturing_weights(monkeypatch, argv):
    """``train.run`` in process; returns (summary, the fp32 tensors the export took from
    engine.iter_full_parameters, by name)."""
    from offload_zero import OffloadEngine

    captured = {}
    original = OffloadEngine.iter_full_parameters

    def spy(self, *args, **kwargs):
        for name, tensor in original(self, *args, **kwargs):
            captured[name] = tensor
            yield name, tensor

    monkeypatch.setattr(OffloadEngine, "iter_full_parameters", spy)
    summary = train.run(_parse(*argv, "--no-progress", *FAST))
    assert captured, "--save did not take the engine's weights"
    return summary, captured


def test_save_writes_the_trained_weights(tmp_path, monkeypatch, capsys):
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    out = tmp_path / "tuned" / "nested"  # parents are created
    summary, engine_state = _run_capturing_weights(
        monkeypatch, ["--preset", "tiny", "--steps", 2, "--save", out])
    weights = out / "model.safetensors"
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]  # no temp file left
    assert f"saved        {weights}" in capsys.readouterr().out
    assert summary["saved"]["weights"] == str(weights)
    assert summary["saved"]["tensors"] == len(engine_state)

    # the file holds exactly what the engine returned
    loaded = safetensors.torch.load_file(str(weights))
    assert loaded.keys() == engine_state.keys()
    for name, value in engine_state.items():
        assert torch.equal(loaded[name], value), name
    # ... which is not the initial model: training changed the weights
    initial, _, _ = train.build_model(_parse("--preset", "tiny", *FAST))
    assert any(not torch.equal(t, loaded[n]) for n, t in initial.state_dict().items())

    # a fresh model of the same config loads it strictly; from_pretrained loads the folder
    fresh = LlamaForCausalLM(LlamaConfig.from_pretrained(str(out)))
    fresh.load_state_dict(loaded, strict=True)
    pretrained = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh.eval()(ids).logits, pretrained.eval()(ids).logits)


def test_save_tied_checkpoint_with_tokenizer_round_trips(tmp_path, monkeypatch, capsys):
    """A checkpoint with tied embeddings and its own tokenizer: the tied copy is left out of the
    file (safetensors refuses shared tensors) as transformers does, from_pretrained ties it
    again, the tokenizer is written as it was loaded, and --model fine-tunes the result."""
    import json as json_lib

    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(argparse.__file__).read_text()[:20_000])
    ckpt = tmp_path / "ckpt"
    vocab = _train_bpe_tokenizer(corpus.read_text(), ckpt)
    _tiny_checkpoint(ckpt, vocab, tie_word_embeddings=True)
    out = tmp_path / "out"
    summary, engine_state = _run_capturing_weights(
        monkeypatch, ["--model", ckpt, "--data", corpus, "--steps", 2, "--save", out])
    assert engine_state["lm_head.weight"] is engine_state["model.embed_tokens.weight"]
    assert summary["saved"]["dropped_tied"] == ["lm_head.weight"]
    assert "tokenizer.json" in summary["saved"]["files"]
    loaded = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert set(loaded) == set(engine_state) - {"lm_head.weight"}
    max_len = json_lib.loads((out / "tokenizer_config.json").read_text()).get("model_max_length")
    assert max_len != 1 << 62, "the training-only model_max_length was saved"

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    state = model.state_dict()
    for name, value in engine_state.items():
        assert torch.equal(state[name], value), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    capsys.readouterr()
    again = train.run(_parse("--model", out, "--data", corpus, "--steps", 1, "--no-progress",
                             *FAST))
    assert again["model"] == f"checkpoint {out}" and not again["tokenizer"].startswith("byte")


def test_save_path_errors_name_the_path(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=f"--save '{a_file}' exists and is not a folder"):
        train.check_args(_parse("--save", a_file))
    with pytest.raises(ValueError, match=f"cannot be created: '{a_file}' is not a folder"):
        train.check_args(_parse("--save", a_file / "sub" / "dir"))
    (tmp_path / "d" / "model.safetensors").mkdir(parents=True)
    with pytest.raises(ValueError, match="model.safetensors' is a folder"):
        train.check_args(_parse("--save", tmp_path / "d"))
    train.check_args(_parse("--save", tmp_path / "new" / "dir"))  # creatable: fine
    assert not (tmp_path / "new").exists()  # and checking created nothing


def test_failed_save_leaves_no_half_written_weights(tmp_path, monkeypatch):
    import errno

    import safetensors.torch
    import torch

    state = {"w": torch.arange(6.0).view(2, 3)}
    train.save_checkpoint(str(tmp_path), state)
    good = (tmp_path / "model.safetensors").read_bytes()

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(ValueError, match=f"--save '{tmp_path}': cannot write.*No space left"):
        train.save_checkpoint(str(tmp_path), {"w": torch.zeros(2, 3)})
    assert os.listdir(tmp_path) == ["model.safetensors"]  # the temporary file is gone
    assert (tmp_path / "model.safetensors").read_bytes() == good  # the earlier save is intact
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError):
        train.save_checkpoint(str(fresh), state)
    assert os.listdir(fresh) == []
    with pytest.raises(ValueError, match="no weights to write"):
        train.save_checkpoint(str(fresh), {})


def test_unshare_tensors():
    import torch

    weight = torch.randn(4, 3)
    state = {"embed.weight": weight, "head.weight": weight, "norm": torch.ones(3)}
    out, dropped = train.unshare_tensors(state, ["head.weight"])  # a declared tie: dropped
    assert dropped == ["head.weight"] and set(out) == {"embed.weight", "norm"}
    assert out["embed.weight"] is weight and set(state) == {"embed.weight", "head.weight", "norm"}
    out, dropped = train.unshare_tensors(state)  # undeclared: both kept, one a copy
    assert dropped == [] and set(out) == set(state)
    assert torch.equal(out["head.weight"], weight)
    assert out["head.weight"].data_ptr() != out["embed.weight"].data_ptr()
    flat = torch.arange(8.0)
    out, dropped = train.unshare_tensors({"a": flat[:6], "b": flat[2:]}, ["b"])  # overlapping
    assert dropped == [] and torch.equal(out["b"], flat[2:])
    assert out["b"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    zero_size = torch.empty(0)
    assert set(train.unshare_tensors({"x": zero_size, "y": zero_size})[0]) == {"x", "y"}


def test_tied_weight_patterns():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=16)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert "lm_head.weight" in train.tied_weight_patterns(model)
    assert train.tied_weight_patterns(torch.nn.Linear(2, 2)) == []


# --- --save writes the generation config ------------------------------------------------------

def test_save_writes_the_generation_config(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, GenerationConfig

    source, _, _ = train.build_model(_parse("--preset", "tiny", *FAST))
    out = tmp_path / "out"
    summary, _ = _run_capturing_weights(monkeypatch, ["--preset", "tiny", "--steps", 2,
                                                      "--save", out])
    assert (out / "generation_config.json").is_file(), sorted(os.listdir(out))
    assert "generation_config.json" in summary["saved"]["files"]
    saved = GenerationConfig.from_pretrained(str(out))
    assert saved.eos_token_id == source.generation_config.eos_token_id == 258
    assert saved.pad_token_id == source.generation_config.pad_token_id == 256
    assert saved.bos_token_id == source.generation_config.bos_token_id == 257
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.generation_config.eos_token_id == 258


def test_save_keeps_a_checkpoints_own_generation_config(tmp_path, monkeypatch):
    """A checkpoint whose generation settings differ from its config.json: without
    generation_config.json, from_pretrained would rebuild them from config.json (eos 2)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    ckpt = tmp_path / "ckpt"
    _tiny_checkpoint(ckpt, vocab_size=300)  # config.json: bos 1, eos 2, no pad
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 7], pad_token_id=0,
                     max_new_tokens=17).save_pretrained(ckpt)
    source = AutoModelForCausalLM.from_pretrained(str(ckpt)).generation_config
    assert source.eos_token_id == [2, 7]
    out = tmp_path / "out"
    _run_capturing_weights(monkeypatch, ["--model", ckpt, "--steps", 1, "--stage", 1,
                                         "--save", out])
    saved = GenerationConfig.from_pretrained(str(out))
    assert saved.eos_token_id == source.eos_token_id
    assert (saved.pad_token_id, saved.max_new_tokens) == (0, 17)
    assert AutoModelForCausalLM.from_pretrained(str(out)).generation_config.eos_token_id == [2, 7]


def test_save_without_or_with_a_default_generation_config(tmp_path):
    import torch
    from transformers import GenerationConfig

    state = {"w": torch.arange(6.0).view(2, 3)}
    none = train.save_checkpoint(str(tmp_path / "none"), state, generation_config=None)
    assert sorted(os.listdir(tmp_path / "none")) == ["model.safetensors"]
    assert none["files"] == ["model.safetensors"]
    default = train.save_checkpoint(str(tmp_path / "default"), state,
                                    generation_config=GenerationConfig())
    assert default["files"] == ["generation_config.json", "model.safetensors"]
    assert GenerationConfig.from_pretrained(str(tmp_path / "default")).eos_token_id is None


def test_generation_config_write_errors(tmp_path, monkeypatch, caplog):
    """An I/O error fails the save before the weights are written, like config.json's; a
    generation config that transformers refuses to save is left out with a warning (the
    trained weights are still written)."""
    import torch
    from transformers import GenerationConfig

    state = {"w": torch.arange(6.0).view(2, 3)}

    def disk_full(self, folder, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder))

    monkeypatch.setattr(GenerationConfig, "save_pretrained", disk_full)
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match=f"--save '{fresh}': cannot write.*No space left"):
        train.save_checkpoint(str(fresh), state, generation_config=GenerationConfig())
    assert os.listdir(fresh) == []

    def refused(self, folder, *args, **kwargs):
        raise ValueError("GenerationConfig is invalid: `temperature` is set but not sampling")

    monkeypatch.setattr(GenerationConfig, "save_pretrained", refused)
    with caplog.at_level(logging.WARNING, logger="offload_zero.train"):
        saved = train.save_checkpoint(str(fresh), state, generation_config=GenerationConfig())
    assert saved["files"] == ["model.safetensors"]
    assert os.listdir(fresh) == ["model.safetensors"]
    assert "generation_config.json" in caplog.text and "temperature" in caplog.text


# --- --data must be UTF-8 text ----------------------------------------------------------------

@pytest.mark.parametrize("name, content", [
    ("weights.bin", bytes(range(256)) * 4),
    ("corpus.txt.gz", gzip.compress(bytes(range(256)) * 4)),
], ids=["bin", "gzip"])
def test_binary_data_file_is_a_clean_error(tmp_path, capsys, name, content):
    blob = tmp_path / name
    blob.write_bytes(content)
    assert cli.main(["train", "--preset", "tiny", "--steps", "1", "--data", str(blob),
                     "--no-progress", *FAST]) == 2
    err = capsys.readouterr().err
    assert str(blob) in err and "UTF-8 text" in err and "byte offset" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_non_ascii_utf8_data_trains(tmp_path, capsys):
    text = tmp_path / "unicode.txt"
    text.write_text("naïve café 東京 — Grüße, ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\n" * 20, encoding="utf-8")
    summary = train.run(_parse("--preset", "tiny", "--steps", 2, "--data", text,
                               "--no-progress", *FAST))
    assert summary["corpus"] == "data" and summary["files"] == 1
    assert len(summary["losses"]) == 2


# --- fp16 ----------------------------------------------------------------------------------------

def test_fp16_trains_with_a_dynamic_loss_scale(capsys):
    """--dtype fp16 scales the loss dynamically: the losses stay finite, the summary gives the
    final scale (a power of two at most the initial 2**16) and the steps skipped on overflow."""
    summary = train.run(_parse("--preset", "tiny", "--dtype", "fp16", "--steps", "4",
                               "--no-progress", "--stage", "2", *FAST))
    assert all(math.isfinite(x) for x in summary["losses"])
    scale = summary["loss_scale"]
    assert scale <= 2 ** 16 and math.log2(scale).is_integer()
    assert 0 <= summary["skipped_steps"] < 4
    assert scale == 2 ** (16 - summary["skipped_steps"])  # window 2000: it never grew back
    out = capsys.readouterr().out
    assert f"loss scale {scale:g}" in out and "dtype fp16" in out
    assert summary["update_timing"] != "backward"  # not auto's choice with fp16: overflows skip whole steps


# --- --checkpoint / --resume -----------------------------------------------------------------------

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


def test_int_flags_say_what_is_wrong(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--checkpoint-every", "abc"])
    err = capsys.readouterr().err
    assert "must be an integer, got 'abc'" in err and "_nonnegative_int" not in err


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


def test_swap_folders_of_killed_runs_are_named_not_removed(tmp_path, monkeypatch, caplog):
    """A SIGKILLed run leaves its default swap folder (nothing runs to remove it). The next
    NVMe run warns with the folder, its bytes and the command that removes it, and leaves it
    (and a live run's folder) alone."""
    import tempfile
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"offload-zero-swap-{gone.pid}-abc123"
    (stale / "rank0").mkdir(parents=True)
    (stale / "rank0" / "unit0.swp").write_bytes(b"\0" * 8192)
    live = tmp_path / f"offload-zero-swap-{os.getpid()}-live99"
    live.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with caplog.at_level("WARNING", logger="offload_zero.train"):
        train.run(_parse("--preset", "tiny", "--steps", 1, "--offload", "nvme", "--no-progress",
                         *FAST))
    warnings = [r.getMessage() for r in caplog.records if "left by killed runs" in r.getMessage()]
    assert warnings == [f"1 swap folder(s) left by killed runs hold 8.0 KiB; remove them with: "
                        f"rm -r {stale}"]
    assert (stale / "rank0" / "unit0.swp").is_file() and live.is_dir()
    ours = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("offload-zero-swap-"))
    assert ours == sorted([stale.name, live.name])  # this run's own folder is gone


def test_an_interrupted_run_that_left_swap_files_names_them(tmp_path, capsys, monkeypatch):
    """A clean-up cut short (a second Ctrl-C, say) that left swap files under --path used to
    end with 'swap files removed' all the same; the next run then refused to start. The last
    line now names what is left and says to remove it."""
    from offload_zero import cli, train
    left = tmp_path / "swap" / "rank0"
    left.mkdir(parents=True)

    runs = []

    def interrupted(args):
        if not runs:  # the first run leaves a file behind
            (left / "unit0.trainable.swp").write_bytes(b"")
        runs.append(args)
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "run", interrupted)
    assert cli.main(["train", "--path", str(tmp_path / "swap")]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "interrupted (Ctrl-C); 1 swap file(s) left under" in err and "removed" not in err
    assert "unit0.trainable.swp" in err and err.endswith("remove them")
    (left / "unit0.trainable.swp").unlink()
    assert cli.main(["train", "--path", str(tmp_path / "swap")]) == 130
    assert capsys.readouterr().err.strip().endswith("interrupted (Ctrl-C); swap files removed")


def test_an_interrupted_program_ignores_further_signals_while_it_exits(monkeypatch, capsys):
    """Run as the program (no argv) and interrupted, the CLI ignores a further Ctrl-C or
    SIGTERM on its way out: a second Ctrl-C landing in the interpreter's exit handlers printed
    a traceback after the last line (seen from torch's own). Called with argv, it changes no
    handler."""
    import signal
    from offload_zero import cli, train

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "run", interrupted)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert cli.main(["train"]) == 130
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    monkeypatch.setattr(sys, "argv", ["offload-zero", "train"])
    try:
        assert cli.main() == 130
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    assert capsys.readouterr().err.count("interrupted (Ctrl-C)") == 2
