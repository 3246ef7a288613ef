"""DeepSpeed configs (offload_zero.deepspeed_config): numerics of a mapped ZeRO-3 NVMe config
against plain torch, one row per key of the table (mapped keys set the right setting, keys
handled automatically are logged, refused keys raise), unknown keys, batch sizes, "auto",
the schedules, ``offload-zero train --deepspeed``, docs/deepspeed.md, and the loud errors of
handing the engine's objects to accelerate's ``prepare()``."""
import copy
import difflib
import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch

from models import TinyLM, batches, lm_loss, max_param_diff
from offload_zero import OffloadEngine, from_deepspeed_config
from offload_zero.deepspeed_config import (AUTO, KEYS, MAPPED, OFF, REFUSED, keys_by_kind,
                                           markdown_table, parse_deepspeed_config)

REPO = Path(__file__).resolve().parents[1]


def nest(path, value, into=None):
    """``{"a": {"b": value}}`` for path ``"a.b"`` (merged into ``into``)."""
    root = {} if into is None else into
    node = root
    *heads, last = path.split(".")
    for head in heads:
        node = node.setdefault(head, {})
    node[last] = value
    return root


def parse(config, **overrides):
    return parse_deepspeed_config(config, overrides, world_size=1)


# -- numerics: a ZeRO-3 NVMe config against torch ------------------------------------------------

def _decay_lr(t, low, high, warmup, total):
    """WarmupDecayLR as DeepSpeed documents it, written out here (log warmup, linear decay)."""
    w = max(2, warmup)
    if t < w:
        return low + (high - low) * math.log(t + 1) / math.log(w)
    return low + (high - low) * max(0.0, (total - t) / max(1.0, total - w))


def test_zero3_nvme_config_matches_torch(tmp_path, torch_single_thread):
    steps, clip, low, high, warmup = 6, 0.05, 1e-3, 1e-2, 3
    config = {
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": "auto",
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path),
                                  "pin_memory": True, "buffer_count": 4},
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "gradient_clipping": clip,
        "train_micro_batch_size_per_gpu": 4, "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": high, "betas": [0.9, 0.95],
                                                   "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": low, "warmup_max_lr": high, "warmup_num_steps": warmup,
            "total_num_steps": steps}},
    }
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=high, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, foreach=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with from_deepspeed_config(model, str(path)) as eng:
        assert (eng.config.stage, eng.config.offload_optimizer, eng.config.offload_param) == (
            3, "nvme", "nvme")
        assert eng.config.max_grad_norm == clip and eng.config.betas == (0.9, 0.95)
        assert eng.train_micro_batch_size_per_gpu == 4 and eng.train_batch_size == 4
        for t, (x, y) in enumerate(batches(steps)):
            lr = _decay_lr(t, low, high, warmup, steps)
            assert eng.lr == pytest.approx(lr, rel=1e-12)
            eng.backward(lm_loss(eng(x), y))
            eng.step()  # (steps engine.lr_scheduler too)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad()
            lm_loss(ref(x), y).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            opt.step()
        assert eng.lr == pytest.approx(_decay_lr(steps, low, high, warmup, steps), abs=1e-15)
        assert max_param_diff(eng.full_state_dict(), ref) <= 1e-6


def test_schedule_steps_once_per_update_not_per_micro_batch():
    config = {"gradient_accumulation_steps": 2, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4,
        "warmup_type": "linear"}}}
    with from_deepspeed_config(TinyLM(2), config, offload="none") as eng:
        lrs = []
        for x, y in batches(6):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            lrs.append(eng.lr)
    assert lrs == pytest.approx([0.0, 2.5e-3, 2.5e-3, 5e-3, 5e-3, 7.5e-3])


def test_schedule_does_not_step_after_a_skipped_fp16_step():
    config = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8},
              "scheduler": {"type": "WarmupLR", "params": {
                  "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"}}}
    with from_deepspeed_config(TinyLM(2), config, offload="cpu") as eng:
        (x, y), (x2, y2) = batches(2)
        eng.backward(lm_loss(eng(x), y) * float("inf"))
        eng.step()
        assert (eng.skipped_steps, eng.lr) == (1, 0.0)  # skipped: the schedule waits
        eng.backward(lm_loss(eng(x2), y2))
        eng.step()
        assert (eng.skipped_steps, eng.lr) == (1, 2.5e-3)


def _sgd_lrs(schedule, base_lr, n):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_warmup_lr_and_warmup_cosine_lr_follow_the_formulas():
    warm = parse({"scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}}})
    assert warm.engine_kwargs["lr"] == 1e-3
    expect = [1e-4 + 9e-4 * (math.log(t + 1) / math.log(5) if t < 5 else 1.0) for t in range(9)]
    assert _sgd_lrs(warm.schedule, 1e-3, 9) == pytest.approx(expect, rel=1e-12)

    cos = parse({"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
                 "scheduler": {"type": "WarmupCosineLR", "params": {
                     "total_num_steps": 10, "warmup_num_steps": 4, "warmup_type": "linear",
                     "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}}})
    assert cos.engine_kwargs["lr"] == 2e-3

    def ratio(t):
        if t < 4:
            return 0.1 + 0.9 * t / 4
        return max(0.0, 0.05 + 0.95 * (1 + math.cos(math.pi * (t - 3) / 6)) / 2)
    assert _sgd_lrs(cos.schedule, 2e-3, 12) == pytest.approx([2e-3 * ratio(t) for t in range(12)],
                                                            rel=1e-12)


# -- one row per key of the table --------------------------------------------------------------

def _zo(**sections):
    return {"zero_optimization": sections}


def _kw(name):
    return lambda s: s.engine_kwargs[name]


def _sched(kind, **params):
    return {"scheduler": {"type": kind, "params": params}}


def _param(name):
    return lambda s: s.schedule.params[name]


_FP16 = {"enabled": True}
# path -> (config, what to read from the settings, the value expected)
MAPPED_CASES = {
    "zero_optimization.stage": (_zo(stage=2), _kw("stage"), 2),
    "zero_optimization.offload_optimizer.device": (
        _zo(offload_optimizer={"device": "cpu"}), _kw("offload_optimizer"), "cpu"),
    "zero_optimization.offload_optimizer.nvme_path": (
        _zo(offload_optimizer={"device": "nvme", "nvme_path": "/swap"}), _kw("path"), "/swap"),
    "zero_optimization.offload_param.device": (
        _zo(stage=3, offload_param={"device": "cpu"}), _kw("offload_param"), "cpu"),
    "zero_optimization.offload_param.nvme_path": (
        _zo(stage=3, offload_param={"device": "nvme", "nvme_path": "/swap"}), _kw("path"),
        "/swap"),
    "gradient_clipping": ({"gradient_clipping": 0.5}, _kw("max_grad_norm"), 0.5),
    "gradient_accumulation_steps": ({"gradient_accumulation_steps": 4},
                                    _kw("gradient_accumulation_steps"), 4),
    "train_micro_batch_size_per_gpu": ({"train_micro_batch_size_per_gpu": 3},
                                       lambda s: s.train_micro_batch_size_per_gpu, 3),
    "train_batch_size": ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3},
                         _kw("gradient_accumulation_steps"), 4),
    "bf16.enabled": ({"bf16": {"enabled": True}}, _kw("dtype"), torch.bfloat16),
    "bf16.bf16_master_weights_and_grads": (
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        lambda s: (s.engine_kwargs["master_dtype"], s.engine_kwargs["grad_dtype"]),
        ("bf16", torch.bfloat16)),
    "bf16.bf16_optimizer_states": (
        {"bf16": {"enabled": True, "bf16_optimizer_states": True}}, _kw("moment_dtype"), "bf16"),
    "fp16.enabled": ({"fp16": {"enabled": True}}, _kw("dtype"), torch.float16),
    "fp16.loss_scale": ({"fp16": {**_FP16, "loss_scale": 128}}, _kw("loss_scale"), 128.0),
    "fp16.initial_scale_power": ({"fp16": {**_FP16, "initial_scale_power": 12}},
                                 _kw("initial_loss_scale"), 4096.0),
    "fp16.loss_scale_window": ({"fp16": {**_FP16, "loss_scale_window": 500}},
                               _kw("loss_scale_window"), 500),
    "fp16.min_loss_scale": ({"fp16": {**_FP16, "min_loss_scale": 0.25}},
                            _kw("min_loss_scale"), 0.25),
    "optimizer.type": ({"optimizer": {"type": "ADAMW", "params": {"adam_w_mode": False}}},
                       _kw("adamw"), True),
    "optimizer.params.lr": ({"optimizer": {"type": "Adam", "params": {"lr": 0.02}}},
                            _kw("lr"), 0.02),
    "optimizer.params.betas": ({"optimizer": {"type": "Adam", "params": {"betas": [0.8, 0.9]}}},
                               _kw("betas"), (0.8, 0.9)),
    "optimizer.params.eps": ({"optimizer": {"type": "Adam", "params": {"eps": 1e-6}}},
                             _kw("eps"), 1e-6),
    "optimizer.params.weight_decay": ({"optimizer": {"type": "AdamW", "params": {
        "weight_decay": 0.2}}},
                                      _kw("weight_decay"), 0.2),
    "optimizer.params.adam_w_mode": ({"optimizer": {"type": "adam", "params": {
        "adam_w_mode": False}}}, _kw("adamw"), False),
    "scheduler.type": (_sched("WarmupLR"), lambda s: s.schedule.kind, "WarmupLR"),
    "scheduler.params.warmup_min_lr": (_sched("WarmupLR", warmup_min_lr=1e-4),
                                       _param("warmup_min_lr"), 1e-4),
    "scheduler.params.warmup_max_lr": (_sched("WarmupLR", warmup_max_lr=0.05), _kw("lr"), 0.05),
    "scheduler.params.warmup_num_steps": (_sched("WarmupLR", warmup_num_steps=7),
                                          _param("warmup_num_steps"), 7),
    "scheduler.params.warmup_type": (_sched("WarmupLR", warmup_type="linear"),
                                     _param("warmup_type"), "linear"),
    "scheduler.params.total_num_steps": (_sched("WarmupDecayLR", total_num_steps=50),
                                         _param("total_num_steps"), 50),
    "scheduler.params.warmup_min_ratio": (
        _sched("WarmupCosineLR", total_num_steps=2000, warmup_min_ratio=0.1),
        _param("warmup_min_ratio"), 0.1),
    "scheduler.params.cos_min_ratio": (
        _sched("WarmupCosineLR", total_num_steps=2000, cos_min_ratio=0.2),
        _param("cos_min_ratio"), 0.2),
    "aio.block_size": ({"aio": {"block_size": 1 << 20}}, _kw("aio_block_size"), 1 << 20),
    "aio.queue_depth": ({"aio": {"queue_depth": 16}}, _kw("aio_queue_depth"), 16),
}


def test_low_precision_keywords_pass_through_without_their_keys():
    """master_dtype= / moment_dtype= given beside a config without DeepSpeed's bf16 options
    reach the engine as they are, and nothing else is set for them (no grad_dtype); with the
    key, a grad_dtype= that disagrees is named."""
    for kw in ({"master_dtype": "bf16"}, {"moment_dtype": "int8"}):
        got = parse({"bf16": {"enabled": True}}, **kw).engine_kwargs
        assert {k: got[k] for k in kw} == kw and "grad_dtype" not in got
    with pytest.raises(ValueError, match=r"grad_dtype=torch.float32 conflicts with the "
                                         r"DeepSpeed config's bf16.bf16_master_weights_and_grads"):
        parse({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
              grad_dtype=torch.float32)


def test_every_mapped_key_has_a_case():
    assert set(MAPPED_CASES) == set(keys_by_kind(MAPPED))
    assert set(keys_by_kind(MAPPED)) | set(keys_by_kind(AUTO)) | set(keys_by_kind(REFUSED)) \
        == set(KEYS)


@pytest.mark.parametrize("path", keys_by_kind(MAPPED))
def test_mapped_key_sets_its_setting(path):
    config, read, expected = MAPPED_CASES[path]
    assert read(parse(config)) == expected
    without = copy.deepcopy(config)
    node = without
    for head in path.split(".")[:-1]:
        node = node[head]
    del node[path.split(".")[-1]]
    try:
        before = read(parse(without))
    except (KeyError, AttributeError, ValueError):
        before = None  # (a schedule without its type, say)
    assert before != expected  # the key itself changed the setting


def _section_for(path):
    """The config a key needs around it (a schedule's or optimizer's type)."""
    if path.startswith("scheduler.params."):
        return _sched("WarmupLR")
    return {"optimizer": {"type": "AdamW"}} if path.startswith("optimizer.params.") else {}


@pytest.mark.parametrize("path", keys_by_kind(AUTO))
def test_automatic_key_is_accepted_and_logged(path, caplog):
    config = nest(path, "auto" if path.endswith("_size") else 1, _section_for(path))
    with caplog.at_level(logging.INFO, logger="offload_zero"):
        settings = parse(config)
    assert settings.engine_kwargs == parse(_section_for(path)).engine_kwargs
    assert settings.automatic == (path,)
    lines = [r.getMessage() for r in caplog.records if "handled automatically" in r.getMessage()]
    assert len(lines) == 1 and path in lines[0]


def _refused_value(key):
    if key.accepts == OFF:
        return {"enabled": True}
    for candidate in (True, False, 3, "fp32", {"partition_activations": True}):
        if not any(candidate == ok and isinstance(candidate, bool) == isinstance(ok, bool)
                   for ok in key.accepts):
            return candidate
    raise AssertionError(key)


@pytest.mark.parametrize("path", keys_by_kind(REFUSED))
def test_refused_key_raises_unless_off(path):
    key = KEYS[path]
    base = _section_for(path)
    with pytest.raises(NotImplementedError, match=path.replace(".", r"\.")):
        parse(nest(path, _refused_value(key), copy.deepcopy(base)))
    for ok in ({"enabled": False},) if key.accepts == OFF else key.accepts:
        parse(nest(path, ok, copy.deepcopy(base)))  # DeepSpeed's "off": accepted


def test_a_mapped_and_automatic_config_logs_one_line(caplog):
    config = _zo(stage=3, overlap_comm=True, reduce_bucket_size="auto",
                 offload_param={"device": "cpu", "pin_memory": True})
    config.update(steps_per_print=100, wall_clock_breakdown=False)
    with caplog.at_level(logging.INFO, logger="offload_zero"):
        parse(config)
    lines = [r.getMessage() for r in caplog.records if "handled automatically" in r.getMessage()]
    assert len(lines) == 1
    for path in ("zero_optimization.overlap_comm", "zero_optimization.offload_param.pin_memory",
                 "steps_per_print", "wall_clock_breakdown"):
        assert path in lines[0]


# -- unknown keys, bad values, conflicts ---------------------------------------------------------

def test_unknown_key_names_its_path_and_the_nearest_key():
    config = _zo(stage=3, offload_optimizer={"device": "cpu", "thread_cuont": 4})
    with pytest.raises(ValueError) as info:
        parse(config)
    msg = str(info.value)
    siblings = sorted(p.rsplit(".", 1)[1] for p in KEYS
                      if p.startswith("zero_optimization.offload_optimizer."))
    nearest = difflib.get_close_matches("thread_cuont", siblings, n=1, cutoff=0.0)[0]
    assert "'zero_optimization.offload_optimizer.thread_cuont'" in msg
    assert f"nearest valid key: 'zero_optimization.offload_optimizer.{nearest}'" in msg


@pytest.mark.parametrize("config, says", [
    (_zo(stage=3, aio={"block_size": 1 << 20}),
     "'zero_optimization.aio': 'aio' is not a key under 'zero_optimization'; aio belongs at "
     "the top level of the config: move it there"),
    (_zo(stage=3, offload_optimizer={"device": "cpu", "thread_count": 4}),
     "thread_count belongs under 'aio' (as 'aio.thread_count'): move it there"),
    ({"stage": 3}, "'stage' is not a key at the top level of the config; stage belongs under "
                   "'zero_optimization' (as 'zero_optimization.stage')"),
])
def test_a_misplaced_key_or_section_says_where_it_belongs(config, says):
    """A key or section of another section is misplaced, not misspelled: the message says
    where it belongs, not the nearest spelling beside it (zero_optimization.elastic_checkpoint
    for aio)."""
    with pytest.raises(ValueError) as info:
        parse(config)
    msg = str(info.value)
    assert says in msg and "nearest valid key" not in msg, msg


def test_unknown_top_level_key_suggests_the_spelling():
    with pytest.raises(ValueError, match="nearest valid key: 'gradient_clipping'"):
        parse({"gradient_cliping": 1.0})


@pytest.mark.parametrize("config, match", [
    ({"optimizer": {"type": "Lamb"}}, "'Lamb' is not supported"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "'OneBitAdam'"),
    (_sched("OneCycle"), "'OneCycle' is not supported"),
    ({"fp16": {"enabled": True, "hysteresis": 4}}, "fp16.hysteresis"),
    (_zo(stage=0), "stage 0"),
])
def test_unsupported_types_raise_not_implemented(config, match):
    with pytest.raises(NotImplementedError, match=match):
        parse(config)


@pytest.mark.parametrize("config, match", [
    (_zo(stage=3, offload_optimizer={"device": "nvme", "nvme_path": "/a"},
         offload_param={"device": "nvme", "nvme_path": "/b"}), "must agree"),
    (_zo(offload_optimizer={"device": "disk"}), "'disk' is not valid"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both true"),
    (_sched("WarmupLR", total_num_steps=10), "not parameters of WarmupLR"),
    (_sched("WarmupDecayLR"), "needs scheduler.params.total_num_steps"),
    (_sched("WarmupLR", warmup_type="cosine"), "warmup_type"),
    ({"zero_optimization": 3}, "must be an object"),
    ({"optimizer": {"params": {"lr": 1e-3}}}, "without optimizer.type"),
    ({"fp16": {"enabled": True, "initial_scale_power": "high"}},
     "'fp16.initial_scale_power'='high' is not valid"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": "yes"}},
     "'bf16.bf16_master_weights_and_grads'='yes' is not valid: 'yes' is not true or false"),
])
def test_bad_values_raise_value_error(config, match):
    with pytest.raises(ValueError, match=match):
        parse(config)


def test_batch_sizes_follow_deepspeeds_rule():
    s = parse_deepspeed_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4},
                               world_size=2)
    assert (s.train_micro_batch_size_per_gpu, s.gradient_accumulation_steps) == (4, 2)
    s = parse_deepspeed_config({"train_batch_size": 16, "gradient_accumulation_steps": 4},
                               world_size=2)
    assert s.train_micro_batch_size_per_gpu == 2
    s = parse({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3})
    assert s.train_batch_size == 12


@pytest.mark.parametrize("world_size", [1, 3])
def test_inconsistent_train_batch_size_names_the_numbers(world_size):
    config = {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": 2}
    with pytest.raises(ValueError) as info:
        parse_deepspeed_config(config, world_size=world_size)
    msg = str(info.value)
    assert "train_batch_size=10" in msg and "train_micro_batch_size_per_gpu=4" in msg
    assert "gradient_accumulation_steps=2" in msg and f"world size {world_size}" in msg


HF_STYLE = {
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
}
HF_OVERRIDES = dict(dtype=torch.bfloat16, lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1,
                    warmup_min_lr=0.0, warmup_num_steps=10, total_num_steps=100,
                    gradient_accumulation_steps=2, max_grad_norm=1.0,
                    train_micro_batch_size_per_gpu=8)


def test_auto_values_resolve_from_the_overrides():
    s = parse(HF_STYLE, **HF_OVERRIDES)
    kw = s.engine_kwargs
    assert kw["dtype"] == torch.bfloat16 and kw["lr"] == 3e-4 and kw["betas"] == (0.9, 0.95)
    assert (kw["eps"], kw["weight_decay"], kw["max_grad_norm"]) == (1e-6, 0.1, 1.0)
    assert (s.train_micro_batch_size_per_gpu, s.gradient_accumulation_steps,
            s.train_batch_size) == (8, 2, 16)
    assert s.schedule.params["warmup_max_lr"] == 3e-4  # (from lr=, as transformers resolves it)
    assert s.schedule.params["total_num_steps"] == 100


@pytest.mark.parametrize("kind, extra", [("WarmupLR", {}),
                                         ("WarmupDecayLR", {"total_num_steps": 100})])
def test_auto_warmup_min_lr_is_zero_as_transformers_resolves_it(kind, extra):
    """transformers' DeepSpeed integration fills an "auto" warmup_min_lr with 0 (no trainer
    argument sets it); a warmup_min_lr= override still resolves it first."""
    config = _sched(kind, warmup_min_lr="auto", warmup_max_lr=1e-3, warmup_num_steps=10,
                    **extra)
    assert parse(config).schedule.params["warmup_min_lr"] == 0.0
    assert parse(config, warmup_min_lr=1e-5).schedule.params["warmup_min_lr"] == 1e-5
    schedule = parse(config).schedule
    assert schedule.lr_at(0, 1e-3) == pytest.approx(0.0)  # log warmup from the floor, 0


@pytest.mark.parametrize("missing, key", [
    ("lr", "optimizer.params.lr"), ("dtype", "bf16.enabled"),
    ("total_num_steps", "scheduler.params.total_num_steps"),
    ("train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu"),
    ("gradient_accumulation_steps", "gradient_accumulation_steps"),
])
def test_an_unresolved_auto_names_its_key(missing, key):
    overrides = {k: v for k, v in HF_OVERRIDES.items() if k != missing}
    with pytest.raises(ValueError, match=f"'{key}' is \"auto\""):
        parse(HF_STYLE, **overrides)


def test_fallbacks_fill_auto_batch_sizes():
    config = {k: "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                  "gradient_accumulation_steps")}
    s = parse_deepspeed_config(config, fallbacks=dict(train_micro_batch_size_per_gpu=4,
                                                      gradient_accumulation_steps=3),
                               world_size=2)
    assert (s.train_micro_batch_size_per_gpu, s.gradient_accumulation_steps,
            s.train_batch_size) == (4, 3, 24)
    s = parse_deepspeed_config({**config, "train_batch_size": 24},
                               fallbacks=dict(gradient_accumulation_steps=3), world_size=2)
    assert s.train_micro_batch_size_per_gpu == 4


def test_an_override_that_contradicts_the_config_raises():
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True}}
    with pytest.raises(ValueError, match=r"lr=0.01 conflicts .* optimizer\.params\.lr=0\.001"):
        parse(config, lr=1e-2)
    with pytest.raises(ValueError, match="conflicts"):
        parse(config, dtype=torch.float16)
    assert parse(config, lr=1e-3, prefetch=2).engine_kwargs["prefetch"] == 2  # (passes through)


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        parse(str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        parse(str(tmp_path / "missing.json"))


# -- docs -------------------------------------------------------------------------------------

def test_docs_table_is_the_modules_table():
    doc = (REPO / "docs" / "deepspeed.md").read_text()
    assert markdown_table() in doc, "regenerate docs/deepspeed.md's table from markdown_table()"
    readme = (REPO / "README.md").read_text()
    assert "## Coming from DeepSpeed" in readme and "docs/deepspeed.md" in readme


# -- the CLI ----------------------------------------------------------------------------------

def _cli(args, cwd):
    from dist_harness import run_cli
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    return run_cli(["train", *args], cwd, env=env, timeout=240)


CLI_CONFIG = {
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "reduce_bucket_size": "auto"},
    "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2, "train_batch_size": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                              "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1,
                                                      "total_num_steps": "auto"}},
    "steps_per_print": 10,
}


def test_cli_trains_from_a_deepspeed_config(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(CLI_CONFIG))
    run = _cli(["--deepspeed", "ds.json", "--steps", "3", "--preset", "tiny", "--seq-len", "64",
                "--log-every", "0", "--no-progress", "--json", "run.json"], tmp_path)
    assert run.returncode == 0, run.stderr
    line = next(l for l in run.stdout.splitlines() if l.strip().startswith("deepspeed"))
    for shown in ("stage 3", "optimizer state cpu", "AdamW lr 0.001 betas (0.9, 0.95)",
                  "clip 1", "WarmupDecayLR(", "total_num_steps=3", "batch 4 x 2 accum"):
        assert shown in line, line
    assert "handled automatically" in run.stderr and "zero_optimization.overlap_comm" in run.stderr
    summary = json.loads((tmp_path / "run.json").read_text())
    assert (summary["batch_size"], summary["grad_accum"], summary["stage"]) == (4, 2, 3)
    assert summary["update_timing"] != "backward"  # (clipping needs the whole gradient)


def test_a_missing_nvme_path_is_made_as_deepspeed_makes_it(tmp_path):
    swap = tmp_path / "not" / "yet"
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(swap)}}}
    with from_deepspeed_config(TinyLM(2), config) as eng:
        assert swap.is_dir() and eng.config.offload_optimizer == "nvme"
        assert any(f.endswith(".swp") for _, _, fs in os.walk(swap) for f in fs)
        for x, y in batches(1):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
    assert swap.is_dir()  # (left in place, as DeepSpeed leaves it)


def test_cli_without_a_scheduler_section_keeps_the_learning_rate_constant(tmp_path):
    """As DeepSpeed (and from_deepspeed_config): no ``scheduler`` section, no schedule; the
    CLI's own warmup and cosine decay are not applied behind the config's back."""
    config = {k: v for k, v in CLI_CONFIG.items() if k != "scheduler"}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    run = _cli(["--deepspeed", "ds.json", "--steps", "4", "--preset", "tiny", "--seq-len", "32",
                "--log-every", "1", "--no-progress"], tmp_path)
    assert run.returncode == 0, run.stderr
    lrs = [l.split("  lr ")[1].split()[0] for l in run.stderr.splitlines() if "  lr " in l]
    assert lrs == ["1.00e-03"] * 4, run.stderr
    line = next(l for l in run.stdout.splitlines() if l.strip().startswith("deepspeed"))
    assert "constant lr" in line, line
    warm = _cli(["--deepspeed", "ds.json", "--steps", "4", "--preset", "tiny", "--warmup", "2"],
                tmp_path)
    assert warm.returncode == 2
    assert warm.stderr.strip().splitlines()[-1].startswith(
        "offload-zero train: error: --warmup 2: --deepspeed ds.json has "
        "no scheduler section"), warm.stderr


@pytest.mark.slow
def test_cli_resume_continues_the_configured_schedule(tmp_path):
    config = copy.deepcopy(CLI_CONFIG)
    config["scheduler"]["params"]["total_num_steps"] = 4
    (tmp_path / "ds.json").write_text(json.dumps(config))
    common = ["--deepspeed", "ds.json", "--preset", "tiny", "--seq-len", "32", "--log-every", "0",
              "--no-progress"]
    whole = _cli(common + ["--steps", "4", "--json", "whole.json"], tmp_path)
    first = _cli(common + ["--steps", "2", "--checkpoint", "ck"], tmp_path)
    rest = _cli(common + ["--steps", "4", "--resume", "ck", "--json", "rest.json"], tmp_path)
    for run in (whole, first, rest):
        assert run.returncode == 0, run.stderr
    losses = json.loads((tmp_path / "whole.json").read_text())["losses"]
    assert json.loads((tmp_path / "rest.json").read_text())["losses"] == losses[2:]


def test_cli_fills_a_transformers_style_config_from_its_flags(tmp_path):
    from offload_zero import cli, train

    (tmp_path / "ds.json").write_text(json.dumps(HF_STYLE))
    args = cli.build_parser().parse_args(["train", "--deepspeed", str(tmp_path / "ds.json"),
                                          "--steps", "40", "--dtype", "bf16", "--lr", "1e-3",
                                          "--batch-size", "2", "--grad-accum", "3"])
    settings = train.apply_deepspeed_config(args)
    assert (args.stage, args.dtype, args.lr, args.batch_size, args.grad_accum) == (
        3, "bf16", 1e-3, 2, 3)
    assert args.offload == "none" and args.warmup == 4  # (no offload section; steps / 10)
    assert settings.schedule.params["total_num_steps"] == 40
    assert args.ds_kwargs["betas"] == (0.9, 0.999) and "max_grad_norm" not in args.ds_kwargs


def test_cli_flag_in_conflict_with_the_config_is_one_line(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(CLI_CONFIG))
    run = _cli(["--deepspeed", "ds.json", "--steps", "1", "--preset", "tiny", "--lr", "0.01"],
               tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("offload-zero train: error: --deepspeed ds.json: --lr 0.01 "
                                "conflicts with")
    assert "optimizer.params.lr=0.001" in lines[-1]


# -- accelerate -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def accelerator():
    accelerate = pytest.importorskip("accelerate")
    return accelerate.Accelerator(cpu=True)


def _loader():
    data = [(x, y) for xs, ys in batches(2) for x, y in zip(xs, ys)]
    return torch.utils.data.DataLoader(data, batch_size=4)


@pytest.mark.parametrize("what", ["engine", "loader+engine", "model", "engine.optimizer",
                                  "loader+model+optimizer"])
def test_accelerate_prepare_of_what_the_engine_owns_raises(accelerator, what):
    model = TinyLM(2)
    with OffloadEngine(model, offload="cpu") as eng:
        objects = {"engine": [eng], "loader+engine": [_loader(), eng], "model": [model],
                   "engine.optimizer": [eng.optimizer],
                   "loader+model+optimizer": [_loader(), model, eng.optimizer]}[what]
        with pytest.raises(ValueError, match="prepare only the data loader"):
            accelerator.prepare(*objects)


def test_accelerate_pattern_that_works(accelerator):
    torch.manual_seed(0)
    model = TinyLM(2)
    ref = copy.deepcopy(model)
    loader = accelerator.prepare(_loader())
    with OffloadEngine(model, offload="cpu", lr=1e-2) as eng:
        for x, y in loader:
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        assert isinstance(eng, OffloadEngine) and not isinstance(eng, torch.nn.Module)
        state = eng.full_state_dict()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    for x, y in _loader():
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
    assert max_param_diff(state, ref) <= 1e-6
