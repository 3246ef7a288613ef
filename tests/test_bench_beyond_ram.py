"""benchmarks/bench_beyond_ram.py's own parts: the unit-by-unit checkpoint writer, and the skip
where no memory cgroup can be made."""
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import bench_beyond_ram as bench  # noqa: E402

TINY = ["--layers", "3", "--hidden", "32", "--intermediate", "64", "--heads", "4",
        "--vocab", "64"]


def test_checkpoint_written_unit_by_unit_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM
    args = bench.parse_args(TINY)
    model = bench._meta_model(args)
    written = bench.write_checkpoint(model, str(tmp_path / "ckpt"))
    assert all(p.device.type == "meta" for p in model.parameters())  # (put back on meta)
    with open(tmp_path / "ckpt" / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) == 3 + 3  # embeddings, 3 layers, final norm, head: one shard each
    assert {weight_map["model.layers.1.mlp.up_proj.weight"]} == {
        weight_map[n] for n in weight_map if n.startswith("model.layers.1.")}
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"))
    sd = loaded.state_dict()
    assert set(weight_map) == set(sd) and written == 2 * sum(t.numel() for t in sd.values())
    assert torch.equal(sd["model.norm.weight"], torch.ones(32))
    std = sd["model.layers.0.self_attn.q_proj.weight"].std().item()
    assert abs(std - loaded.config.initializer_range) < 0.005  # the model's own initialiser
    again = bench._meta_model(args)
    bench.write_checkpoint(again, str(tmp_path / "again"))
    same = AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).state_dict()
    assert all(torch.equal(sd[k], same[k]) for k in sd)  # seeded per unit


def test_skips_without_a_memory_cgroup(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "CGROUP_ROOT", str(tmp_path / "no-cgroup"))
    assert bench.main(TINY) == 0
    out = capsys.readouterr().out
    assert out.startswith("bench_beyond_ram: skipped: no cgroup v1 memory controller at ")
    assert "the limit cannot be enforced here" in out
