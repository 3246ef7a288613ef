"""``--save DIR``: the trained weights as a Hugging Face folder (tied weights, tokenizer,
generation config) that ``--model DIR`` and ``from_pretrained`` load, written atomically, and
:func:`offload_zero.train.save_hf_folder`'s errors."""
import argparse
import errno
import logging
import os
from pathlib import Path

import pytest

from offload_zero import train
from train_cli_helpers import (FAST, _parse, _run_capturing_weights, _tiny_checkpoint,
                               _train_bpe_tokenizer)


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
    train.save_hf_folder(str(tmp_path), state)
    good = (tmp_path / "model.safetensors").read_bytes()

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(ValueError, match=f"--save '{tmp_path}': cannot write the model's "
                                         "weights folder: .*No space left"):
        train.save_hf_folder(str(tmp_path), {"w": torch.zeros(2, 3)})
    assert os.listdir(tmp_path) == ["model.safetensors"]  # the temporary file is gone
    assert (tmp_path / "model.safetensors").read_bytes() == good  # the earlier save is intact
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError):
        train.save_hf_folder(str(fresh), state)
    assert os.listdir(fresh) == []
    with pytest.raises(ValueError, match="no weights to write"):
        train.save_hf_folder(str(fresh), {})


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
    none = train.save_hf_folder(str(tmp_path / "none"), state, generation_config=None)
    assert sorted(os.listdir(tmp_path / "none")) == ["model.safetensors"]
    assert none["files"] == ["model.safetensors"]
    default = train.save_hf_folder(str(tmp_path / "default"), state,
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
        train.save_hf_folder(str(fresh), state, generation_config=GenerationConfig())
    assert os.listdir(fresh) == []

    def refused(self, folder, *args, **kwargs):
        raise ValueError("GenerationConfig is invalid: `temperature` is set but not sampling")

    monkeypatch.setattr(GenerationConfig, "save_pretrained", refused)
    with caplog.at_level(logging.WARNING, logger="offload_zero.train"):
        saved = train.save_hf_folder(str(fresh), state, generation_config=GenerationConfig())
    assert saved["files"] == ["model.safetensors"]
    assert os.listdir(fresh) == ["model.safetensors"]
    assert "generation_config.json" in caplog.text and "temperature" in caplog.text
