"""The memory estimator: the ZeRO paper's figures, the per-stage formulas, offload tiers, input
validation, and the estimate against the engine's own byte accounting."""
import json
import math

import pytest
import torch
import torch.nn as nn

from offload_zero import OffloadEngine
from offload_zero.estimator import (KINDS, OFFLOADS, STAGES, TIERS, assumed_layout,
                                    estimate_memory, format_table, model_layout)
from offload_zero.memory.accounting import TierAccountant
from offload_zero.partition.flat_param import FlatParam, build_entries
from models import TinyLM, UnpaddedHeadLM, batches, big_root_lm, flat_param_of, lm_loss

GB = 1e9


def _gb1(nbytes):
    return f"{nbytes / GB:.1f}"


# -- the paper's figures (Rajbhandari et al., 2019, Figure 1 and sec. 5) ------------------------
def test_paper_worked_example_7_5b_on_64():
    est = estimate_memory(7.5e9, world_size=64, gpus_per_node=64, stage=0)
    got = [_gb1(est.placement(s, "none").model_state_bytes_per_device) for s in STAGES]
    assert got == ["120.0", "31.4", "16.6", "1.9"]
    exact = [est.placement(s, "none").model_state_bytes_per_device for s in STAGES]
    assert exact == [120_000_000_000, 31_406_250_000, 16_640_625_000, 1_875_000_000]
    assert est.model_state_bytes_per_device == 120_000_000_000  # selected: stage 0


def test_paper_trillion_parameters_on_1024():
    est = estimate_memory(1e12, world_size=1024, gpus_per_node=16, stage=3)
    assert est.model_state_bytes_per_device == 15_625_000_000
    assert _gb1(est.model_state_bytes_per_device) == "15.6"
    assert est.nodes == 64


# -- formulas ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("stage", STAGES)
def test_model_state_formula(stage, n):
    psi = 1_234_568  # a multiple of 1, 2, 4 but of no alignment: exact integers
    est = estimate_memory(psi, world_size=n, stage=stage)
    want = {0: 16 * psi, 1: 4 * psi + 12 * psi // n, 2: 2 * psi + 14 * psi // n,
            3: 16 * psi // n}[stage]
    assert est.model_state_bytes_per_device == want
    odd = estimate_memory(psi - 1, world_size=n, stage=stage)  # fractions: each kind rounded
    odd_want = want * (psi - 1) / psi
    assert abs(odd.model_state_bytes_per_device - odd_want) <= 2
    dev = est.model_states["device"]
    assert dev["parameters"] == round(2 * psi / (n if stage == 3 else 1))
    assert dev["gradients"] == round(2 * psi / (n if stage >= 2 else 1))
    opt = psi if stage == 0 else psi / n
    assert dev["master_weights"] == round(4 * opt) and dev["moments"] == round(8 * opt)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_moves_optimizer_state_and_gradient_shards(stage):
    psi, n = 8_000_000, 4
    est = estimate_memory(psi, world_size=n, gpus_per_node=2, stage=stage, accelerator=False,
                          update_timing="step")
    none, cpu, nvme = (est.placement(stage, o) for o in OFFLOADS)
    shard = psi // n
    # cpu: 12Ψ/N of fp32 state and 4Ψ/N of fp32 gradient shards leave the device for the host
    assert cpu.model_states["host"] == {"parameters": 0, "gradients": 4 * shard,
                                        "master_weights": 4 * shard, "moments": 8 * shard,
                                        "buffers": 0}
    moved_grads = 2 * shard if stage >= 2 else 0  # stage 1 keeps full gradients until the step
    assert none.model_state_bytes_per_device - cpu.model_state_bytes_per_device == \
        12 * shard + moved_grads
    assert cpu.host_bytes == 2 * cpu.host_bytes_per_rank  # two ranks per node
    # nvme: master and moments in files (and, at stage 3, the bf16 parameter shards);
    # gradient shards stay on the host
    params_on_disk = 2 * shard if stage == 3 else 0
    assert nvme.model_states["nvme"] == {"parameters": params_on_disk, "gradients": 0,
                                         "master_weights": 4 * shard, "moments": 8 * shard,
                                         "buffers": 0}
    assert nvme.model_states["host"]["gradients"] == 4 * shard
    device = dict(cpu.model_states["device"], parameters=cpu.model_states["device"]["parameters"] - params_on_disk)
    assert nvme.model_states["device"] == device
    # three pipeline host buffer sets of 3 x largest shard x 4 bytes; at stage 3 the pool of
    # parameter-shard buffers, f * (prefetch + 2) + 2 of the largest bf16 shard (f = 1 flat
    # parameter per block of the assumed layout)
    largest_shard = math.ceil(est.largest_unit_numel / n) if est.largest_unit_numel else 0
    # the root split by gradient order: for a parameter count two halves (the embeddings and
    # the LM head)
    root_shard = math.ceil(est.root_numel / 2 / n)
    biggest = max(largest_shard, root_shard)
    pool = 0
    if stage == 3:  # block-sized main pool, plus a buffer per root part bigger than a block
        pool = (1 * (1 + 2) + 2) * largest_shard * 2
        pool += 2 * root_shard * 2 if root_shard > largest_shard else 0
    # (unpadded arithmetic: shards are fractions here, so allow the rounding of a few bytes)
    assert abs(nvme.extras["host"]["buffers"] - (3 * 3 * biggest * 4 + pool)) <= 16
    assert none.nvme_bytes == cpu.nvme_bytes == 0


def test_stage_3_nvme_counts_next_forward_as_the_engine_does_by_default():
    # 10 blocks of 1000 elements and a root of 1000 (two embeddings of 500), bf16, N = 2
    kw = dict(world_size=2, largest_unit_numel=1000, root_numel=1000, stage=3, offload="nvme")
    auto, plain = estimate_memory(11_000, **kw), estimate_memory(11_000, **kw, update_timing="step")
    on = estimate_memory(11_000, **kw, update_timing="next_forward")
    assert auto.selected.to_dict() == on.selected.to_dict()
    assert [p.update_timing == "next_forward" for p in auto.table] == [
        p.stage == 3 and p.offload == "nvme" for p in auto.table]
    assert "with update_timing next_forward (3 nvme)" in format_table(auto)
    assert "next_forward" not in format_table(plain)
    a, p = auto.selected, plain.selected
    # the input embeddings' state (shard 250: under a quarter of the state) moves to host memory
    for kind, per in (("master_weights", 4), ("moments", 8)):
        assert a.model_states["host"][kind] - p.model_states["host"][kind] == per * 250
        assert p.model_states["nvme"][kind] - a.model_states["nvme"][kind] == per * 250
    # and its bf16 parameter shard with it, off the disk
    assert p.model_states["nvme"]["parameters"] - a.model_states["nvme"]["parameters"] == 2 * 250
    assert a.model_states["host"]["parameters"] - p.model_states["host"]["parameters"] == 2 * 250
    # three read-ahead buffers of a block's whole fp32 state (block shard 500)
    assert a.extras["host"]["buffers"] - p.extras["host"]["buffers"] == 3 * 12 * 500
    # other rows: as before
    for stage, offload in [(3, "cpu"), (3, "none"), (2, "nvme"), (1, "nvme")]:
        assert auto.placement(stage, offload).to_dict() == plain.placement(stage, offload).to_dict()
        assert (on.placement(stage, offload).update_timing == "next_forward") is (stage == 3)
    with pytest.raises(ValueError, match="update_timing='yes'"):
        estimate_memory(11_000, **kw, update_timing="yes")
    with pytest.raises(ValueError, match="update_timing='next_forward' needs stage 3"):
        estimate_memory(11_000, **dict(kw, stage=2), update_timing="next_forward")
    # the footnote says what applies to which rows
    assert "with update_timing next_forward (3 nvme): updates applied in the next forward; with NVMe" in \
        format_table(auto)
    text = format_table(estimate_memory(11_000, **dict(kw, offload="cpu"), update_timing="next_forward"))
    assert ("with update_timing next_forward (3 none, 3 cpu, 3 nvme): updates applied in the "
            "next forward; with NVMe") in text


def test_fp32_master_aliases_parameter_shard():
    est = estimate_memory(1000, world_size=1, stage=2, dtype="fp32")
    assert est.model_states["device"]["master_weights"] == 0
    assert est.placement(2, "cpu").model_states["host"]["master_weights"] == 4000
    assert est.itemsize == 4 and est.dtype == "fp32"


def test_table_has_every_stage_and_offload():
    est = estimate_memory(7.5e9, world_size=8, gpus_per_node=8, stage=2, offload="cpu")
    assert [(p.stage, p.offload) for p in est.table] == [(s, o) for s in STAGES for o in OFFLOADS]
    assert est.selected is est.placement(2, "cpu")
    assert not est.placement(0, "none").engine_supported
    d = json.loads(json.dumps(est.to_dict()))
    assert len(d["table"]) == 12 and d["selected"]["stage"] == 2
    assert set(d["selected"]["model_states"]) == set(TIERS)


def test_extras_for_stage_3_are_the_gather_pool():
    # 10 blocks of 1000 elements and a root of 500, bf16, N = 2
    est = estimate_memory(10_500, world_size=2, largest_unit_numel=1000, root_numel=500, stage=3,
                          prefetch=2)
    assert est.model_states["device"]["parameters"] == 2 * 10_500 / 2
    assert est.extras["device"]["parameters"] == 0
    # gather pool: prefetch + 1 block slots and a root slot; plus the reduce-scatter scratch shard
    assert est.extras["device"]["buffers"] == 2 * (3 * 1000 + 500) + 2 * 1000 / 2
    assert est.extras["device"]["gradients"] == 2 * 1000  # one unit's gradient in flight
    # one rank with its shards on the device gathers nothing: the shard is the parameter
    one = estimate_memory(10_500, largest_unit_numel=1000, root_numel=500, stage=3, prefetch=2)
    assert one.extras["device"]["parameters"] == one.extras["device"]["buffers"] == 0
    # stage 1: nothing gathered, no gradient in flight; only the reduce-scatter scratch shard
    assert est.placement(1, "none").tier_bytes("device", model_states=False) == 2 * 1000 / 2


def test_assumed_layout_sums_to_the_count():
    for psi in (1, 7, 10_000, 7_500_000_000, 10 ** 12):
        layout = assumed_layout(psi)
        assert sum(s.numel for s in layout) == psi
    blocks = [s for s in assumed_layout(7_500_000_000) if s.unit >= 0]
    assert len(blocks) == 34


# -- model input --------------------------------------------------------------------------------
def test_tied_parameters_counted_once():
    untied, tied = TinyLM(tie=False), TinyLM(tie=True)
    n_untied = sum(p.numel() for p in untied.parameters())
    e_untied, e_tied = estimate_memory(untied), estimate_memory(tied)
    assert e_untied.num_params == n_untied
    assert e_tied.num_params == n_untied - tied.emb.weight.numel()
    assert e_tied.num_params == sum(p.numel() for p in tied.parameters())  # torch dedups too


def test_layout_matches_engine_units_and_frozen_split():
    model = TinyLM(n_blocks=3)
    model.blocks[1].ln.weight.requires_grad_(False)
    layout = model_layout(model)
    # (the root split by gradient order: the final norm, the LM head, the embeddings)
    assert [(s.unit, s.trainable) for s in layout] == [
        (0, True), (1, True), (1, False), (2, True), (-1, True), (-1, True), (-1, True)]
    assert [s.numel for s in layout[-3:]] == [48, 53 * 24, 53 * 24]
    est = estimate_memory(model)
    assert est.trainable_params == est.num_params - 24


@pytest.mark.parametrize("numel,n,dtype", [
    (1, 1, torch.bfloat16), (4097, 2, torch.float32), (10_007, 4, torch.bfloat16),
    (2048 * 4, 4, torch.float16)])
def test_padding_matches_flat_param(numel, n, dtype):
    p = nn.Parameter(torch.zeros(numel))
    fp = FlatParam("t", build_entries([(p, [])]), [p.detach()], True, dtype, torch.device("cpu"),
                   rank=0, world_size=n, keep_unsharded=False, accountant=TierAccountant())
    model = nn.Linear(numel, 1, bias=False)  # one root flat parameter of numel elements
    est = estimate_memory(model, world_size=n, stage=3, dtype=dtype)
    assert est.model_states["device"]["parameters"] == fp.shard_numel * fp.itemsize


def test_preset_and_checkpoint_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    est = estimate_memory("tiny", stage=3)
    assert est.source.startswith("preset tiny")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, tie_word_embeddings=True)
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        ref = transformers.LlamaForCausalLM(cfg)
    from_dir = estimate_memory(str(tmp_path))
    assert from_dir.num_params == sum(p.numel() for p in ref.parameters())
    assert from_dir.largest_unit_numel == sum(p.numel() for p in ref.model.layers[0].parameters())


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,needle", [
    (dict(stage=5), "stage=5"), (dict(stage=True), "stage=True"),
    (dict(world_size=0), "world_size=0"), (dict(offload="disk"), "offload='disk'"),
    (dict(gpus_per_node=3, world_size=4), "gpus_per_node=3"), (dict(dtype="int8"), "int8"),
    (dict(prefetch=-1), "prefetch=-1")])
def test_bad_arguments_raise_value_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        estimate_memory(1000, **kwargs)


@pytest.mark.parametrize("value", [-5, 0, -1e9, float("nan"), 1.5, "no-such-preset", True])
def test_bad_model_raises_value_error(value):
    with pytest.raises(ValueError, match=repr(value) if not isinstance(value, str) else value):
        estimate_memory(value)


def test_numpy_numbers_and_bools_are_taken_as_python_ones():
    """Counts and switches from numpy (a sweep over np.arange, a config array) give the same
    estimate as Python's, and its JSON form still serialises (numpy ints were refused)."""
    import numpy as np
    kw = dict(world_size=2, gpus_per_node=2, prefetch=1, largest_unit_numel=10_000,
              root_numel=5_000)
    ref = estimate_memory(1_000_000, stage=3, offload="nvme", update_timing="step", **kw)
    est = estimate_memory(np.int64(1_000_000), stage=np.int64(3), offload="nvme",
                          update_timing="step",
                          **{k: np.int64(v) for k, v in kw.items()})
    assert est.to_dict() == ref.to_dict()
    json.dumps(est.to_dict())
    with pytest.raises(ValueError, match=r"world_size=np.int64\(0\) is not valid"):
        estimate_memory(1000, world_size=np.int64(0))
    with pytest.raises(ValueError, match=r"update_timing='no' is not valid; choose one of"):
        estimate_memory(1000, update_timing="no")


def test_folder_without_config_raises(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        estimate_memory(str(tmp_path))


# -- estimate vs the engine's accounting (the whole grid: tests/test_plan.py) -------------------
class WiderLM(TinyLM):
    """TinyLM with wider blocks (several 4096-byte pages per flat parameter) and a tied head."""

    def __init__(self):
        super().__init__(n_blocks=4, tie=True)
        from models import Block, WIDTH
        self.blocks = nn.ModuleList(Block(WIDTH, hidden=173 + 40 * i) for i in range(4))


def test_format_table_is_readable():
    text = format_table(estimate_memory(7.5e9, world_size=64, gpus_per_node=64))
    rows = [line.split() for line in text.splitlines() if line[:1] in (" ", "*") and
            line.split()[-1].replace(".", "").isdigit()]
    assert len(rows) == 12
    states = {(r[-7], r[-6]): r[-5] for r in rows}
    assert [states[(str(s), "none")] for s in STAGES] == ["120.0", "31.4", "16.6", "1.9"]
    with pytest.raises(ValueError, match="unit='TB'"):
        format_table(estimate_memory(1000), unit="TB")


@pytest.mark.parametrize("mode", ["backward", "next_forward"])
@pytest.mark.parametrize("offload_param", ["none", "nvme"])
def test_placement_bytes_count_the_read_ahead(offload_param, mode, tmp_path):
    """With update_timing "backward" or "next_forward" the engine adds read-ahead buffers of a
    block's whole state (two; three when update_timing="backward" gathers fp32 parameter shards on
    NVMe from them); the bytes placement_bytes gives (what offload="auto" budgets) equal
    memory_report's peaks."""
    from offload_zero.estimator import placement_bytes
    torch.manual_seed(0)
    model = WiderLM()
    plain = placement_bytes(model, 3, "nvme", offload_param, dtype=torch.float32, accelerator=False,
                            update_timing="step")
    est = placement_bytes(model, 3, "nvme", offload_param, dtype=torch.float32, accelerator=False,
                          update_timing=mode)
    with OffloadEngine(model, stage=3, offload="nvme", offload_param=offload_param,
                       path=str(tmp_path), update_timing=mode) as eng:
        for x, y in batches(2):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        eng(batches(1)[0][0])  # (update_timing="next_forward": the last step's updates run here)
        rep = eng.memory_report()
        # (both keep the embeddings' state in host memory here: counted the same)
        assert [fp.name for fp in eng.trainable if eng.store.in_host(fp)] == [
            flat_param_of(eng, "emb.weight").name]
        ring = rep["pools"]["optimizer_prefetch"]["capacity_bytes"]
    assert est.extras["host"]["buffers"] - plain.extras["host"]["buffers"] == ring > 0
    for tier in TIERS:
        measured = {k: rep[tier]["by_kind"][k]["peak_bytes"] for k in KINDS}
        assert measured == {k: est.model_states[tier].get(k, 0) + est.extras[tier].get(k, 0)
                            for k in KINDS}, tier


@pytest.mark.parametrize("offload_param", ["none", "nvme"])
def test_update_in_backward_on_one_cpu_rank_holds_one_gradient_of_each_size(offload_param,
                                                                           tmp_path):
    """With update_timing="backward" each gradient is used up by its update in backward, and its
    memory serves the next gradient of its size: blocks of one size share one buffer. The
    host gradient bytes equal the estimate (one of each size), below every shard at once."""
    from offload_zero.estimator import placement_bytes
    torch.manual_seed(0)
    model = TinyLM(n_blocks=4)
    est = placement_bytes(model, 3, "nvme", offload_param, dtype=torch.float32,
                          accelerator=False, update_timing="backward")
    with OffloadEngine(model, stage=3, offload="nvme", offload_param=offload_param,
                       path=str(tmp_path), update_timing="backward") as eng:
        for x, y in batches(3):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        rep = eng.memory_report()
        every_shard = 4 * sum(fp.shard_numel for fp in eng.trainable)
        sizes = {fp.shard_numel for fp in eng.trainable}
    measured = rep["host"]["by_kind"]["gradients"]["peak_bytes"]
    assert measured == est.model_states["host"]["gradients"] == 4 * sum(sizes) < every_shard


def _train_on_tokens(eng, vocab, steps=3, forward_after=False):
    """``steps`` steps of ``eng`` on random tokens below ``vocab`` (each batch its own target),
    then (``forward_after``) one more forward, where update_timing="next_forward" applies the last step's
    updates; returns ``memory_report()``."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, vocab, (2, 7), generator=g)
        eng.backward(lm_loss(eng(x).float(), x))
        eng.step()
    if forward_after:
        eng(x)
    return eng.memory_report()


class _NearSizedRoot(nn.Module):
    """Input embeddings (with 80 spare rows) and an LM head's weight of nearly one size: with
    update_timing="backward" the root's two large flat parameters differ by 1.6% (the third holds the
    final norm and the LM head's bias)."""

    def __init__(self, vocab=5000, width=64):
        super().__init__()
        self.emb = nn.Embedding(vocab + 80, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.head(self.norm(h))


def test_update_in_backward_shares_one_gradient_buffer_between_near_sizes(tmp_path):
    """The LM head's and the embeddings' gradients (sizes within NEAR_SIZE) take turns in
    one buffer: host gradient bytes are the blocks' one buffer, the final norm's part's and
    one of the root's larger size, as the estimate says."""
    from offload_zero.estimator import placement_bytes
    torch.manual_seed(0)
    model = _NearSizedRoot()
    est = placement_bytes(model, 3, "nvme", "nvme", dtype=torch.float32, accelerator=False,
                          update_timing="backward")
    with OffloadEngine(model, stage=3, offload="nvme", path=str(tmp_path),
                       update_timing="backward") as eng:
        root = sorted((fp.shard_numel for fp in eng.trainable if fp.name.startswith("root")),
                      reverse=True)
        assert len(root) == 3 and root[0] != root[1] and root[0] < 1.0625 * root[1]
        assert root[2] * 1.0625 < root[1]
        block = {fp.shard_numel for fp in eng.trainable if not fp.name.startswith("root")}
        measured = _train_on_tokens(eng, 5000)["host"]["by_kind"]["gradients"]["peak_bytes"]
    assert len(block) == 1
    assert measured == est.model_states["host"]["gradients"] == 4 * (root[0] + root[2]
                                                                      + block.pop())


@pytest.mark.parametrize("dtype,tail,tied,root_buffers", [
    (torch.float32, False, False, 2), (torch.float32, True, False, 1),
    (torch.bfloat16, True, False, 1), (torch.float32, True, True, 0)])
def test_the_roots_small_part_goes_through_the_block_sized_buffers(dtype, tail, tied,
                                                                   root_buffers, tmp_path):
    """Parameter shards on NVMe, the root split by gradient order into the final norm, the LM
    head and the embeddings, the last two larger than a block: only those two get root-sized
    host buffers (one less when the embeddings' state stays in host memory: in fp32 it is
    their shard, in bf16 the shard stays in host memory beside it); the final norm's part
    goes through the block-sized ones. With the LM head tied to
    the embeddings and their fp32 state in host memory, no root-sized buffer at all. The host
    buffer bytes equal the estimate's."""
    from offload_zero.estimator import placement_bytes
    torch.manual_seed(0)
    model = big_root_lm(3, vocab_scale=6)
    if tied:
        model.head.weight = model.emb.weight
    est = placement_bytes(model, 3, "nvme", "nvme", dtype=dtype, accelerator=False,
                          tail_state_in_host=tail)
    with OffloadEngine(model, stage=3, offload="nvme", path=str(tmp_path), dtype=dtype,
                       tail_state_in_host=tail) as eng:
        assert eng.config.update_timing == "next_forward"
        norm, head, emb = (flat_param_of(eng, n) for n in ("norm.weight", "head.weight",
                                                            "emb.weight"))
        block = max(fp.shard_numel for u in eng.blocks for fp in u.flat_params)
        assert len({norm, head, emb}) == (2 if tied else 3) and norm.shard_numel <= block
        assert min(head.shard_numel, emb.shard_numel) > block
        for x, y in batches(2):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        eng(batches(1)[0][0])  # (the last step's updates run here)
        rep = eng.memory_report()
    assert rep["pools"].get("param_shards_root", {"buffers": 0})["buffers"] == root_buffers
    assert rep["host"]["by_kind"]["buffers"]["peak_bytes"] == (
        est.model_states["host"].get("buffers", 0) + est.extras["host"]["buffers"])


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_update_in_backward_keeps_no_buffer_for_gradients_taken_as_autograd_made_them(offload,
                                                                                   tmp_path):
    """update_timing="backward" on one CPU rank: the flat parameters of one unpadded parameter (here a
    tied embedding and the LM head's bias, 4096 elements) take autograd's gradients as they
    are, each used up before the next: the host gradient bytes are one buffer per size class
    of the others plus the largest of those, as the estimate says (it counted a class for
    each, and the engine's classes took them in)."""
    from offload_zero.estimator import placement_bytes
    torch.manual_seed(0)
    model = UnpaddedHeadLM(vocab=4096, width=16)
    model.head.weight = model.emb.weight
    model.head.bias = nn.Parameter(torch.zeros(4096))
    param = "nvme" if offload == "nvme" else "none"
    est = placement_bytes(model, 3, offload, param, dtype=torch.float32, accelerator=False,
                          update_timing="backward")
    kw = {"path": str(tmp_path)} if offload == "nvme" else {}
    with OffloadEngine(model, stage=3, offload=offload, update_timing="backward", **kw) as eng:
        taken = [fp.padded_numel for fp in eng.trainable if fp.grad_as_is]
        others = {fp.padded_numel for fp in eng.trainable if not fp.grad_as_is}
        assert sorted(taken) == [4096, 4096 * 16]
        measured = _train_on_tokens(eng, 4096)["host"]["by_kind"]["gradients"]["peak_bytes"]
    assert measured == est.model_states["host"]["gradients"] == 4 * (4096 * 16 + sum(others))


def test_a_parameter_under_1024_elements_is_not_split_from_the_final_norm(tmp_path):
    """A tied LM head with a bias of 53 elements beside a final norm of 48: the bias is most of
    the part after the blocks but is padded in any dtype (4096-byte aligned shards), so it
    stays with the final norm (a part of its own would save nothing). With update_timing="backward" on
    NVMe (an update deferred while the next gradient arrives) the host gradient bytes then
    equal the estimate (two 1024-element parts of one size class were held at once)."""
    from offload_zero.estimator import placement_bytes
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2, tie=True)
    model.head.bias = nn.Parameter(torch.zeros(model.head.out_features))
    est = placement_bytes(model, 3, "nvme", "nvme", dtype=torch.float32, accelerator=False,
                          update_timing="backward")
    with OffloadEngine(model, stage=3, offload="nvme", path=str(tmp_path),
                       update_timing="backward") as eng:
        norm = flat_param_of(eng, "norm.weight")
        assert norm is flat_param_of(eng, "head.bias")
        rep = _train_on_tokens(eng, 53, steps=2, forward_after=True)
    assert rep["host"]["by_kind"]["gradients"]["peak_bytes"] == \
        est.model_states["host"]["gradients"]
