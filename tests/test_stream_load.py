"""Empty models and streamed initial values: ``OffloadEngine(model, load_from=DIR)`` from a
Hugging Face safetensors checkpoint, ``init="model"``, meta buffers, and bad checkpoints."""
import json
import os

import pytest
import torch
import torch.nn as nn

import hf_tiny
from dist_harness import run_ranks
from offload_zero import OffloadEngine
from offload_zero import stream_load

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{tied: folder} of sharded bf16 checkpoints transformers wrote."""
    root = tmp_path_factory.mktemp("ckpt")
    return {tied: hf_tiny.write_checkpoint(root / f"tied{int(tied)}", tied)
            for tied in (True, False)}


def _engine(model, offload, stage, tmp_path, **kw):
    path = None
    if offload == "nvme":
        path = tmp_path / f"swap{len(os.listdir(tmp_path))}"
        path.mkdir()
    return OffloadEngine(model, offload=offload, path=path and str(path), stage=stage, lr=1e-2,
                         **kw)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_meta_model_loads_as_the_eager_model(checkpoints, tmp_path, stage, offload, tied,
                                             torch_single_thread):
    folder = checkpoints[tied]
    assert len(hf_tiny.shard_files(folder)) > 2  # sharded
    how = "meta" if stage != 2 else "init_empty_weights"
    streamed = _engine(hf_tiny.empty_model(tied, how), offload, stage, tmp_path, load_from=folder)
    eager = _engine(hf_tiny.eager_model(folder), offload, stage, tmp_path)
    with streamed, eager:
        a, b = streamed.full_state_dict(), eager.full_state_dict()
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
        if tied:
            assert a["lm_head.weight"] is a["model.embed_tokens.weight"]
        data = hf_tiny.batches(3)
        assert hf_tiny.train(streamed, data) == pytest.approx(hf_tiny.train(eager, data), abs=1e-6)
        a, b = streamed.full_state_dict(), eager.full_state_dict()
        assert max((a[n] - b[n]).abs().max().item() for n in a) <= 1e-6
        assert not any(torch.equal(a[n], v) for n, v in hf_tiny.eager_model(folder)
                       .state_dict().items() if "norm" not in n)  # training changed them
        assert streamed.load_report == {"missing_keys": [], "unexpected_keys": []}


def test_load_from_overwrites_a_normal_model_and_every_stored_dtype(tmp_path):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        folder = hf_tiny.write_checkpoint(tmp_path / str(dtype), False, dtype=dtype, seed=3)
        from transformers import LlamaForCausalLM
        torch.manual_seed(7)
        normal = LlamaForCausalLM(hf_tiny.config(False))  # other values: replaced
        with OffloadEngine(normal, offload="cpu", stage=3, load_from=folder) as eng:
            got = eng.full_state_dict()
        want = hf_tiny.eager_model(folder).state_dict()
        for name, value in want.items():
            assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name


def test_bf16_compute_derives_shards_from_fp32_masters(checkpoints, tmp_path):
    folder = checkpoints[False]
    with OffloadEngine(hf_tiny.empty_model(False), offload="cpu", stage=3, load_from=folder,
                       dtype=torch.bfloat16) as eng:
        got = eng.full_state_dict()
        fp = eng.blocks[0].flat_params[0]
        master = eng.store.read_master(fp)
        assert torch.equal(fp.sharded.float(), master)  # bf16-exact values: the same numbers
    want = hf_tiny.eager_model(folder).state_dict()
    assert all(torch.equal(got[n], want[n]) for n in want)


def _ranges_rank(rank, world_size, folder, stage):
    """Load on ``world_size`` ranks counting every byte range read; returns ranges, the
    state and the losses of 3 steps."""
    reads = []
    original = stream_load.pread

    def counting(fd, buf, offset):
        reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, len(buf)))
        original(fd, buf, offset)

    stream_load.pread = counting
    try:
        eng = OffloadEngine(hf_tiny.empty_model(False), offload="cpu", stage=stage,
                            load_from=folder, lr=1e-2)
    finally:
        stream_load.pread = original
    ref = OffloadEngine(hf_tiny.eager_model(folder), offload="cpu", stage=stage, lr=1e-2)
    first = eng.full_state_dict()
    same = all(torch.equal(first[n], v) for n, v in ref.full_state_dict().items())
    data = hf_tiny.batches(3, seed=10 + rank)
    losses = (hf_tiny.train(eng, data), hf_tiny.train(ref, data))
    a, b = eng.full_state_dict(), ref.full_state_dict()
    diff = max((a[n] - b[n]).abs().max().item() for n in a)
    mine = 0  # the bytes of this rank's shards of the flat layout, in the stored bf16
    for fp in eng.flat_params:
        lo, hi = rank * fp.shard_numel, min(fp.numel, (rank + 1) * fp.shard_numel)
        mine += 2 * max(0, hi - lo)
    eng.close()
    ref.close()
    return reads, same, losses, diff, mine


def test_two_ranks_read_only_their_own_byte_ranges(checkpoints):
    folder = checkpoints[False]
    results = run_ranks(_ranges_rank, 2, folder, 3, timeout_s=300)
    total = sum(os.path.getsize(os.path.join(folder, f)) for f in hf_tiny.shard_files(folder))
    headers = sum(8 + int.from_bytes(open(os.path.join(folder, f), "rb").read(8), "little")
                  for f in hf_tiny.shard_files(folder))
    spans = []
    for reads, same, (losses, ref_losses), diff, mine in results:
        assert same and diff <= 1e-6 and losses == pytest.approx(ref_losses, abs=1e-6)
        # exactly the bytes of its own shards (a rank's share is uneven on a model this small:
        # shards are 4096-byte aligned)
        assert sum(n for _, _, n in reads) == mine < total - headers
        spans += reads
    spans.sort()
    for (p1, o1, n1), (p2, o2, n2) in zip(spans, spans[1:]):
        assert p1 != p2 or o1 + n1 <= o2, "two reads of the same bytes"
    # together the ranks read every tensor's bytes once: the files less their headers
    assert sum(n for _, _, n in spans) == total - headers


# -- names -----------------------------------------------------------------------------------

def test_base_model_prefix_is_added_or_stripped(tmp_path):
    from transformers import LlamaForCausalLM, LlamaModel
    torch.manual_seed(0)
    full = LlamaForCausalLM(hf_tiny.config(False))
    full.save_pretrained(str(tmp_path / "full"))
    with torch.device("meta"):
        base = LlamaModel(hf_tiny.config(False))
    # a ForCausalLM checkpoint ("model." keys, an LM head) into the base model: prefix stripped
    with OffloadEngine(base, offload="cpu", load_from=tmp_path / "full", strict=False) as eng:
        got = eng.full_state_dict()
        assert eng.load_report["unexpected_keys"] == ["lm_head.weight"]
    assert torch.equal(got["layers.0.mlp.up_proj.weight"], full.model.layers[0].mlp.up_proj.weight)
    full.model.save_pretrained(str(tmp_path / "base"))
    with pytest.raises(ValueError, match=r"missing keys \['lm_head.weight'\]"):
        OffloadEngine(hf_tiny.empty_model(False), offload="cpu", load_from=tmp_path / "base")
    # ... and the other way: "model." added; the missing head from the model's initialiser
    with OffloadEngine(hf_tiny.empty_model(False), offload="cpu", load_from=tmp_path / "base",
                       init="model", strict=False) as eng:
        got = eng.full_state_dict()
        assert eng.load_report["missing_keys"] == ["lm_head.weight"]
    assert torch.equal(got["model.norm.weight"], full.model.norm.weight)
    assert got["lm_head.weight"].std().item() == pytest.approx(0.02, rel=0.3)


# -- init="model" ----------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_init_model_is_deterministic_for_a_seed(tied):
    def build(seed, stage):
        torch.manual_seed(seed)
        with OffloadEngine(hf_tiny.empty_model(tied, "init_empty_weights"), offload="cpu",
                           stage=stage, init="model") as eng:
            return eng.full_state_dict()

    a, b, c = build(0, 3), build(0, 1), build(1, 3)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"],
                           c["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(32))  # the model's own rule
    assert a["model.layers.3.self_attn.q_proj.weight"].std().item() == pytest.approx(0.02, rel=0.2)
    if tied:
        assert a["lm_head.weight"] is a["model.embed_tokens.weight"]


def _init_rank(rank, world_size):
    torch.manual_seed(0)
    with OffloadEngine(hf_tiny.empty_model(False), offload="cpu", stage=3, init="model") as eng:
        return {n: t.numpy() for n, t in eng.full_state_dict().items()}  # (picklable)


def test_init_model_on_two_ranks_matches_one(tmp_path):
    one = _init_rank(0, 1)
    for got in run_ranks(_init_rank, 2, timeout_s=300):
        assert all((got[n] == one[n]).all() for n in one)


def test_plain_module_reset_parameters_and_meta_errors():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is on the meta device"):
        OffloadEngine(model, offload="cpu")
    torch.manual_seed(0)
    with OffloadEngine(model, offload="cpu", init="model") as eng:
        got = eng.full_state_dict()
    torch.manual_seed(0)
    want = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).state_dict()
    assert all(torch.equal(got[n], want[n]) for n in want)  # torch's own init, same order


# -- buffers ---------------------------------------------------------------------------------

def test_rotary_inv_freq_is_recomputed_on_a_meta_model(checkpoints):
    model = hf_tiny.empty_model(False, "meta")
    assert model.model.rotary_emb.inv_freq.is_meta
    with OffloadEngine(model, offload="cpu", load_from=checkpoints[False]):
        got = model.model.rotary_emb.inv_freq
        want = hf_tiny.eager_model(checkpoints[False]).model.rotary_emb.inv_freq
        assert not got.is_meta and torch.equal(got, want)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4), persistent=False)
        self.register_buffer("stats", torch.zeros(4))  # persistent

    def forward(self, x):
        return self.lin(x) * self.scale + self.stats


def test_meta_buffer_nothing_fills_is_an_error(tmp_path):
    from safetensors.torch import save_file
    with torch.device("meta"):
        model = nn.Sequential(_Scaled())
    save_file({"0.lin.weight": torch.ones(4, 4), "0.lin.bias": torch.zeros(4),
               "0.stats": torch.full((4,), 2.0)}, str(tmp_path / "model.safetensors"))
    swap = tmp_path / "swap"
    swap.mkdir()
    with pytest.raises(ValueError, match=r"buffers \['0.scale'\].*init_empty_weights"):
        OffloadEngine(model, offload="nvme", path=str(swap), load_from=tmp_path)
    assert os.listdir(swap) == []
    from accelerate import init_empty_weights
    with init_empty_weights():  # buffers stay real: the persistent one comes from the file
        model = nn.Sequential(_Scaled())
    with OffloadEngine(model, offload="cpu", load_from=tmp_path) as eng:
        assert torch.equal(eng.full_state_dict()["0.stats"], torch.full((4,), 2.0))


# -- bad checkpoints -------------------------------------------------------------------------

def _copy(folder, dest):
    import shutil
    shutil.copytree(folder, dest)
    return dest


def _refused(folder, tmp_path, match):
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    with pytest.raises(ValueError, match=match):
        OffloadEngine(hf_tiny.empty_model(False), offload="nvme", path=str(swap),
                      load_from=folder)
    assert os.listdir(swap) == []  # no swap files (nor a rank folder) left


def test_missing_shard_file(checkpoints, tmp_path):
    folder = _copy(checkpoints[False], tmp_path / "c")
    victim = hf_tiny.shard_files(folder)[1]
    os.remove(folder / victim)
    _refused(folder, tmp_path, f"shard file '{folder / victim}' is missing.*model.layers")


def test_truncated_file(checkpoints, tmp_path):
    folder = _copy(checkpoints[False], tmp_path / "c")
    victim = folder / hf_tiny.shard_files(folder)[-1]
    os.truncate(victim, os.path.getsize(victim) - 100)
    _refused(folder, tmp_path, f"'{victim}' is truncated or corrupt: tensor '")


def test_wrong_shape_and_unexpected_key(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = _copy(checkpoints[False], tmp_path / "c")
    name = hf_tiny.shard_files(folder)[0]
    tensors = load_file(str(folder / name))
    key = next(iter(tensors))
    wrong = dict(tensors, **{key: torch.zeros(3, 5, dtype=torch.bfloat16)})
    save_file(wrong, str(folder / name), metadata={"format": "pt"})
    _refused(folder, tmp_path, f"'{key}' in '{folder / name}' has shape \\[3, 5\\]")
    extra = dict(tensors, **{"model.extra.weight": torch.zeros(2, dtype=torch.bfloat16)})
    save_file(extra, str(folder / name), metadata={"format": "pt"})
    _refused(folder, tmp_path, r"in '.*/c': missing keys \[\], unexpected keys "
                               rf"\['model.extra.weight'\] \(in \['model.extra.weight \({name}\)")
    with OffloadEngine(hf_tiny.empty_model(False), offload="cpu", load_from=folder,
                       strict=False) as eng:
        assert eng.load_report["unexpected_keys"] == ["model.extra.weight"]


def test_missing_parameter_of_a_meta_model_even_when_not_strict(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = _copy(checkpoints[False], tmp_path / "c")
    index = json.loads((folder / stream_load.INDEX_NAME).read_text())
    name = index["weight_map"].pop("model.norm.weight")
    tensors = load_file(str(folder / name))
    del tensors["model.norm.weight"]
    save_file(tensors, str(folder / name), metadata={"format": "pt"})
    (folder / stream_load.INDEX_NAME).write_text(json.dumps(index))
    swap = tmp_path / "swap"
    swap.mkdir()
    # strict: the hint names what loads (strict=False alone would hit the error below)
    with pytest.raises(ValueError, match=r"missing keys \['model.norm.weight'\].*"
                                         r"strict=False with init='model' loads anyway"):
        OffloadEngine(hf_tiny.empty_model(False), offload="nvme", path=str(swap),
                      load_from=folder)
    with pytest.raises(ValueError, match=r"\['model.norm.weight'\] are on the meta device and "
                                         r"missing in '.*/c'"):
        OffloadEngine(hf_tiny.empty_model(False), offload="nvme", path=str(swap),
                      load_from=folder, strict=False)
    assert os.listdir(swap) == []


def test_not_a_checkpoint_folder_and_bad_init(tmp_path):
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        OffloadEngine(hf_tiny.empty_model(False), offload="cpu", load_from=tmp_path)
    with pytest.raises(ValueError, match=r"init='random': valid values are \[None, 'model'\]"):
        OffloadEngine(hf_tiny.empty_model(False), offload="cpu", init="random")


def test_cli_model_dir_under_torchrun_streams_a_sharded_checkpoint(tmp_path):
    """``offload-zero train --model DIR`` on 2 ranks: the model is built empty from
    config.json and each rank streams its shards of the sharded bf16 checkpoint in; --save
    exports what both trained."""
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), repo) if p))
    out, saved = tmp_path / "out.json", tmp_path / "saved"
    ckpt = hf_tiny.write_checkpoint(tmp_path / "ckpt", True, vocab_size=300,
                                    max_shard_size="40KB")  # (the byte tokenizer fits)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "offload_zero.cli", "train", "--model", ckpt, "--steps", "2",
         "--stage", "3", "--offload", "cpu", "--seq-len", "16", "--batch-size", "2",
         "--json", str(out), "--no-progress", "--save", str(saved)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["world_size"] == 2 and summary["saved"]["dropped_tied"] == ["lm_head.weight"]
    tuned = hf_tiny.eager_model(saved).state_dict()
    start = hf_tiny.eager_model(ckpt).state_dict()
    assert tuned.keys() == start.keys()
    assert any(not torch.equal(tuned[n], start[n]) for n in start)  # trained


def test_an_moe_model_loads_its_own_layout_and_refuses_a_converted_one(tmp_path):
    """A Mixtral (transformers' fused experts, whose checkpoint conversion merges per-expert
    tensors): a folder in the model's own layout (engine.save_pretrained's) streams into an
    empty model with the eager model's logits (every MoE folder was refused); the per-expert
    layout from_pretrained converts is refused, saying which folder would load."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4)
    model = transformers.MixtralForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    model.save_pretrained(str(tmp_path / "per_expert"))
    with OffloadEngine(model, offload="cpu", stage=3) as eng:
        eng.save_pretrained(str(tmp_path / "own"))
    for folder in ("own", "per_expert"):
        with accelerate.init_empty_weights():
            empty = transformers.MixtralForCausalLM(cfg)
        if folder == "per_expert":
            with pytest.raises(NotImplementedError, match="the model's own layout"):
                OffloadEngine(empty, offload="cpu", stage=3, load_from=str(tmp_path / folder))
            continue
        with OffloadEngine(empty, offload="nvme", path=str(tmp_path), stage=3,
                           load_from=str(tmp_path / folder)) as eng, torch.no_grad():
            assert torch.equal(eng(input_ids=ids).logits, want)
