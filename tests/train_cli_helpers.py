"""What the ``offload-zero train`` tests share: the CLI run in a child process (forked from the
harness's forkserver) with the repository importable, a tiny Hugging Face checkpoint, a small BPE tokenizer, and flags parsed in process."""
import os
import tempfile
from pathlib import Path

import pytest

from dist_harness import run_cli
from offload_zero import cli, train

REPO = Path(__file__).resolve().parents[1]
FAST = ["--seq-len", "64", "--batch-size", "4", "--log-every", "0"]


def _run(args, cwd, timeout=240, **env_overrides):
    """Run ``python -m offload_zero.cli ARGS`` in ``cwd`` with the repo importable, as a child
    of the harness's forkserver (:func:`dist_harness.run_cli`)."""
    env = dict(os.environ, **env_overrides)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    env.setdefault("OMP_NUM_THREADS", "1")  # (as the test process: see conftest.py)
    return run_cli(args, cwd, env=env, timeout=timeout)


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


def _parse(*argv):
    return cli.build_parser().parse_args(["train", *map(str, argv)])


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


def _engine_keywords(monkeypatch) -> dict:
    """The keywords the ``OffloadEngine`` built next gets, filled in as it is built."""
    from offload_zero import OffloadEngine

    seen = {}
    real_init = OffloadEngine.__init__

    def spy(self, model, **kw):
        seen.update(kw)
        real_init(self, model, **kw)
    monkeypatch.setattr(OffloadEngine, "__init__", spy)
    return seen


def unwritable_folder() -> str:
    """``/proc``: a folder no file can be created in, not even by root, for whom ``os.access``
    says it is writable (skips the test where that does not hold)."""
    try:
        with tempfile.NamedTemporaryFile(dir="/proc"):
            pass
    except OSError:
        return "/proc"
    pytest.skip("no /proc to stand for a folder that cannot be written")
