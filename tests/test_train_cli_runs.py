"""End-to-end runs of ``offload-zero train``: NVMe offload on the standard library's sources,
the update modes, fine-tuning a local checkpoint, two ranks under torchrun, fp16, and the
text it accepts.

The cases run the real entry point in a subprocess (``python -m offload_zero.cli``) with tiny
models, short sequences and few steps.
"""
import argparse
import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload_zero import cli, train
from train_cli_helpers import (FAST, REPO, _files_under, _parse, _run, _tiny_checkpoint,
                               _train_bpe_tokenizer)


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
        assert ("update timing backward" in proc.stdout) is (not flag)
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
        assert ("update timing next_forward" in train.format_summary(summary)) is (not flag)
        runs.append((summary["losses"], summary["skipped_steps"]))
    assert runs[0] == runs[1]
    cpu = train.run(_parse("--preset", "tiny", "--steps", 1, "--dtype", "fp16", "--no-progress",
                           *FAST))
    assert cpu["update_timing"] == "step"
    asked = train.run(_parse("--preset", "tiny", "--steps", 1, "--update-timing",
                             "next_forward", "--no-progress", *FAST))  # fp32: asked, not auto
    assert asked["update_timing"] == "next_forward"
    capsys.readouterr()
    for flags, message in ((["--update-timing", "backward", "--stage", "1"],
                            "--update-timing backward needs --stage 2 or 3, got --stage 1"),
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
