"""Streamed export: ``engine.iter_full_parameters()`` and ``engine.save_pretrained()`` write
Hugging Face's sharded safetensors layout that ``from_pretrained`` loads; peak host memory of
loading and exporting bounded by a unit, measured by the OS."""
import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

import hf_tiny
from dist_harness import run_ranks
from offload_zero import OffloadEngine, hf_export

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))


def _trained(tied, stage=3, offload="cpu", path=None):
    torch.manual_seed(0)
    eng = OffloadEngine(hf_tiny.empty_model(tied), offload=offload, path=path, stage=stage,
                        init="model", lr=1e-2)
    hf_tiny.train(eng, hf_tiny.batches(2))
    return eng


def _data_bytes(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - n


def _digest(folder):
    return {f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(folder))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tied", [True, False])
def test_export_loads_with_from_pretrained(tmp_path, tied, dtype):
    from transformers import AutoModelForCausalLM
    eng = _trained(tied)
    want = eng.full_state_dict()
    out = tmp_path / "a" / "export"  # parents are created
    saved = eng.save_pretrained(out, dtype=dtype, max_shard_size="20KB")
    eng.close()
    files = hf_tiny.shard_files(out)
    assert saved["shards"] == len(files) > 2 and saved["weights"] == str(out / hf_export.INDEX_NAME)
    assert sorted(os.listdir(out)) == sorted(saved["files"]) == sorted(
        files + ["config.json", "generation_config.json", hf_export.INDEX_NAME])
    index = json.loads((out / hf_export.INDEX_NAME).read_text())
    assert sorted(set(index["weight_map"].values())) == files
    for f in files:  # each shard within the limit (a larger tensor would stand alone)
        assert _data_bytes(out / f) <= 20_000
    assert index["metadata"]["total_size"] == sum(_data_bytes(out / f) for f in files)
    assert saved["dropped_tied"] == (["lm_head.weight"] if tied else [])
    assert ("lm_head.weight" in index["weight_map"]) != tied  # a tied weight written once
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.dtype == dtype
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value.to(dtype)), name
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_one_shard_is_model_safetensors_and_iterator_names(tmp_path):
    eng = _trained(True)
    names = [n for n, _ in eng.iter_full_parameters()]
    assert sorted(names) == sorted(eng.full_state_dict())
    pairs = dict(eng.iter_full_parameters(torch.float16))
    assert pairs["lm_head.weight"] is pairs["model.embed_tokens.weight"]
    assert pairs["model.norm.weight"].dtype == torch.float16
    saved = eng.save_pretrained(tmp_path / "one")
    assert hf_tiny.shard_files(tmp_path / "one") == ["model.safetensors"]
    assert saved["weights"] == str(tmp_path / "one" / "model.safetensors")
    assert not (tmp_path / "one" / hf_export.INDEX_NAME).exists()
    eng.close()


def test_default_export_dtype_is_the_compute_dtype_as_model_save_pretrained(tmp_path):
    """Without ``dtype=`` the export keeps the engine's compute dtype, as the wrapped model's
    own ``save_pretrained`` does: an fp32 run reloads bit for bit (not rounded to bf16)."""
    from safetensors.torch import load_file
    eng = _trained(False)
    eng.save_pretrained(tmp_path / "ours")
    eng.module.save_pretrained(tmp_path / "hf")
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "hf" / "model.safetensors"))
    full = eng.full_state_dict()
    assert {t.dtype for t in ours.values()} == {t.dtype for t in theirs.values()} == {torch.float32}
    for name, tensor in ours.items():
        assert torch.equal(tensor, full[name]), name
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["dtype"] == "float32"
    eng.close()


def test_failed_export_leaves_the_earlier_folder(tmp_path, monkeypatch):
    eng = _trained(False)
    out = tmp_path / "export"
    eng.save_pretrained(out, max_shard_size="20KB")
    before = _digest(out)
    hf_tiny.train(eng, hf_tiny.batches(1, seed=5))  # new weights: a different export
    calls = []
    original = hf_export.write_tensor

    def failing(f, tensor):
        calls.append(1)
        if len(calls) == 7:
            raise OSError(28, "No space left on device")
        original(f, tensor)

    monkeypatch.setattr(hf_export, "write_tensor", failing)
    with pytest.raises(OSError, match="No space left"):
        eng.save_pretrained(out, max_shard_size="20KB")
    assert _digest(out) == before  # the earlier export, whole
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no temporary folder left
    calls.clear()
    with pytest.raises(OSError):
        eng.save_pretrained(tmp_path / "fresh")
    assert sorted(os.listdir(tmp_path)) == ["export"]
    monkeypatch.setattr(hf_export, "write_tensor", original)
    eng.save_pretrained(out, max_shard_size="20KB")  # the engine goes on; a new export works
    assert _digest(out) != before
    eng.close()


def test_export_refuses_a_folder_of_other_files_and_bad_arguments(tmp_path):
    eng = _trained(False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("keep me")
    with pytest.raises(ValueError, match=r"holds \['notes.md'\], which an export does not write"):
        eng.save_pretrained(tmp_path / "mine")
    assert os.listdir(tmp_path / "mine") == ["notes.md"]
    with pytest.raises(ValueError, match="max_shard_size='5 parsecs'"):
        eng.save_pretrained(tmp_path / "x", max_shard_size="5 parsecs")
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        eng.save_pretrained(tmp_path / "x", dtype=torch.int8)
    assert sorted(os.listdir(tmp_path)) == ["mine"]
    eng.close()


def test_parse_size():
    assert hf_export.parse_size("5GB") == 5 * 10 ** 9
    assert hf_export.parse_size("500MiB") == 500 * 2 ** 20
    assert hf_export.parse_size("20KB") == 20_000 and hf_export.parse_size(4096) == 4096
    for bad in (0, -1, "GB", "1.5XB", True):
        with pytest.raises(ValueError):
            hf_export.parse_size(bad)


def test_export_on_two_ranks(tmp_path):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "export"
    results = run_ranks(_export_rank2, 2, str(out), str(tmp_path / "swap"), timeout_s=300)
    (state, saved), (state1, saved1) = results
    assert set(saved1["files"]) < set(saved["files"]) == set(os.listdir(out))  # (rank 0 wrote)
    got = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    for name, value in state.items():
        assert (state1[name] == value).all() and torch.equal(got[name], torch.from_numpy(value))


def _export_rank2(rank, world_size, out, swap):
    os.makedirs(swap, exist_ok=True)
    torch.manual_seed(0)
    eng = OffloadEngine(hf_tiny.empty_model(True), offload="nvme", path=swap, stage=3,
                        init="model", lr=1e-2)
    hf_tiny.train(eng, hf_tiny.batches(2, seed=20 + rank))
    state = {n: t.numpy() for n, t in eng.full_state_dict().items()}
    saved = eng.save_pretrained(out, dtype=torch.float32, max_shard_size="20KB")
    eng.close()
    return state, saved


def test_peak_host_memory_of_load_and_export_is_about_a_unit(tmp_path):
    """In a fresh process, VmHWM reset before each phase: streaming a checkpoint in (state and
    parameter shards on NVMe) and exporting it each peak at a few units above what was
    resident, for a model 24 units large (materialising it would take 76 MB; a unit is 3 MB).

    glibc's malloc is given a fixed mmap threshold: its default raises the threshold up to
    32 MiB after each free of a large block, so this test's 3 MB blocks would come from the
    heap, where freed ones stay resident when fragmented (RSS then creeps up a unit per block
    without any live tensor behind it). Units of a real model are larger and always mmapped."""
    sys.path.insert(0, HERE)
    from stream_mem_job import BIG
    ckpt = hf_tiny.write_checkpoint(tmp_path / "ckpt", False, dtype=torch.float32,
                                    max_shard_size="10MB", **BIG)
    (tmp_path / "swap").mkdir()
    run = subprocess.run([sys.executable, os.path.join(HERE, "stream_mem_job.py"), ckpt,
                          str(tmp_path / "swap"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 << 10)))
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    unit, slack = m["unit_fp32_bytes"], 8 << 20
    assert m["model_fp32_bytes"] >= 8 * unit  # a model many units large
    assert m["load_peak"] <= 5 * unit + slack < m["model_fp32_bytes"] / 2, m
    assert m["export_peak"] <= 6 * unit + slack, m
    print(json.dumps(m))
