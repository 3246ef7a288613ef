"""Settings: bad input named with what would be valid, numpy numbers, unused paths, and
offload="auto"'s placement (budgets, what fits, the plain step where only it fits)."""
import os
import re
import subprocess
import tempfile

import numpy as np
import pytest
import torch

from models import TinyLM, batches, lm_loss
from offload_zero import OffloadEngine


def _deep():
    # many small units: parameter shards outweigh the NVMe read-ahead pool, so each candidate
    # needs less of the scarce tier than the one before it
    return TinyLM(n_blocks=32)


def _needs(stage=3):
    """Each candidate's bytes per tier; ``"host"`` at its smallest, the optimizer state
    streamed in the smallest chunks (what a host budget may shrink it to)."""
    from offload_zero.estimator import placement_bytes
    from offload_zero.placement import CANDIDATES
    return {c: _floor(placement_bytes(_deep(), stage, *c, dtype=torch.float32, accelerator=False))
            for c in CANDIDATES}


def _floor(placement) -> dict:
    """``placement``'s bytes per tier, its host tier with the pipeline's smallest chunks."""
    import dataclasses
    from offload_zero.plan import memory_plan
    plan = placement.plan
    smallest = memory_plan(plan.layout, dataclasses.replace(plan.settings,
                                                            pipeline_chunk_numel=1024))
    return {"device": plan.tier_bytes("device"), "host": smallest.tier_bytes("host"),
            "nvme": plan.tier_bytes("nvme")}


@pytest.mark.parametrize("kwargs, match", [
    ({"offload": "tape"}, r"offload='tape'.*none.*cpu.*nvme"),
    ({"stage": 0}, r"stage=0.*\(1, 2, 3\)"),
    ({"stage": 4}, r"stage=4.*\(1, 2, 3\)"),
    ({"lr": -1e-3}, r"lr=-0.001.*>= 0"),
    ({"offload": "nvme"}, r"^offload='nvme' needs path="),
    ({"offload": "nvme", "path": "/nonexistent/swap"},
     r"/nonexistent/swap.*; offload='nvme' needs an existing"),
    ({"offload": "cpu", "offload_param": "nvme"}, r"^offload_param='nvme' needs path="),
    ({"path": 123}, r"^path=123 is not valid; give the folder .* as a str or os.PathLike"),
    ({"offload": "nvme", "path": 123}, r"^path=123 is not valid; .*str or os.PathLike"),
    ({"betas": (0.9, 1.5)}, r"betas\[1\]=1.5"),
    ({"dtype": torch.int32}, r"dtype=torch.int32"),
])
def test_bad_input_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadEngine(TinyLM(), **kwargs)


@pytest.mark.parametrize("name", ["adamw", "activation_checkpointing", "offload_activations",
                                  "tail_state_in_host"])
def test_on_off_options_take_bools_and_refuse_anything_else(name):
    """A switch is True or False (numpy's bools too, from a config array or a sweep), or None
    where that means automatic: a string such as 'no' used to be taken as true (adamw,
    activation_checkpointing, offload_activations), and numpy's bools were refused."""
    from offload_zero.config import EngineConfig
    cfg = EngineConfig(**{name: np.bool_(False)})
    assert getattr(cfg, name) is False
    for bad in ("no", 1, 0.0):
        with pytest.raises(ValueError, match=rf"^{name}={bad!r} is not valid; use .*True or False"):
            EngineConfig(**{name: bad})


def test_number_options_take_numpy_numbers():
    """lr, eps, weight_decay, betas and max_grad_norm (and set_lr's lr) come from numpy as
    often as not (a sweep's np.logspace): numpy floats of any width are taken as Python
    floats (np.float32 was refused); a bool is refused (set_lr took True as 1.0). Counts
    (stage, prefetch, byte limits) from numpy are Python ints (np.int32 was refused)."""
    from offload_zero.config import EngineConfig
    cfg = EngineConfig(lr=np.float32(1e-3), eps=np.float16(1e-4), weight_decay=np.int64(0),
                       max_grad_norm=np.float32(1.0), betas=np.array([0.9, 0.95], np.float32),
                       stage=np.int64(2), prefetch=np.int32(2), max_host_bytes=np.uint64(1 << 30))
    assert all(type(getattr(cfg, k)) is int for k in ("stage", "prefetch", "max_host_bytes"))
    assert type(cfg.lr) is float and cfg.lr == float(np.float32(1e-3))
    assert all(type(getattr(cfg, k)) is float for k in ("eps", "weight_decay", "max_grad_norm"))
    assert cfg.betas == (float(np.float32(0.9)), float(np.float32(0.95)))
    with pytest.raises(ValueError, match=r"^lr=True is not valid; it must be a finite number >= 0"):
        EngineConfig(lr=True)
    with pytest.raises(ValueError, match=r"^lr=np.float32\(nan\) is not valid"):
        EngineConfig(lr=np.float32("nan"))
    with OffloadEngine(TinyLM()) as eng:  # set_lr: the same rule (True used to set lr=1.0)
        eng.set_lr(np.float32(0.5))
        assert type(eng.lr) is float and eng.lr == 0.5
        for bad in (True, "1e-3", -1):  # (0 is valid: a warmup's first step)
            with pytest.raises(ValueError, match=rf"^lr={bad!r} is not valid; it must be a finite number >= 0"):
                eng.set_lr(bad)
        assert eng.lr == 0.5


@pytest.mark.parametrize("kw, match", [
    ({"lr": float("inf")}, r"^lr=inf is not valid; it must be a finite number >= 0"),
    ({"eps": float("inf")}, r"^eps=inf is not valid"),
    ({"weight_decay": np.float32("inf")}, r"^weight_decay=np.float32\(inf\) is not valid"),
    ({"max_grad_norm": float("inf")}, r"^max_grad_norm=inf is not valid"),
    ({"stage": 3.0}, r"^stage=3.0 is not valid; choose one of \(1, 2, 3\)"),
    ({"betas": np.array([[0.9], [0.99]])}, r"^betas\[0\]=array\(\[0.9\]\) is not valid"),
    ({"betas": 0.9}, r"^betas=0.9 must be a pair"),
    ({"betas": (0.9, "0.99")}, r"^betas\[1\]='0.99' is not valid"),
    ({"timeout_s": -1}, r"^timeout_s=-1 is not valid; it must be a finite number > 0"),
    ({"timeout_s": 0}, r"^timeout_s=0 is not valid"),
])
def test_bad_numbers_are_refused_by_name(kw, match):
    """An infinite lr was taken, and the first update then left every later forward,
    full_state_dict() and checkpoint raising (the weights could not be read out); a float
    stage, a badly shaped betas array and a timeout <= 0 (a socket error under torchrun) got
    through or failed without naming the setting. Each is refused up front, by name."""
    with pytest.raises(ValueError, match=match):
        OffloadEngine(TinyLM(), **kw)


def test_set_lr_refuses_inf_and_takes_what_torch_optim_takes():
    """set_lr(inf) is refused and changes nothing (it used to poison the next update); a 0-d
    tensor (as torch.optim takes) or a 0-d numpy array is taken as its float."""
    with OffloadEngine(TinyLM(), lr=torch.tensor(1e-3)) as eng:
        assert type(eng.lr) is float and eng.lr == pytest.approx(1e-3)
        for bad in (float("inf"), float("-inf")):
            with pytest.raises(ValueError, match=r"is not valid; it must be a finite number >= 0"):
                eng.set_lr(bad)
        eng.set_lr(np.array(2e-3))
        assert eng.lr == 2e-3
        x, y = batches(1)[0]
        eng.backward(lm_loss(eng(x), y))
        eng.step()
        assert all(torch.isfinite(t).all() for t in eng.full_state_dict().values())


@pytest.mark.parametrize("kw", [{"offload": "cpu"}, {"offload": "none", "stage": 2},
                                {"offload": "nvme", "offload_optimizer": "cpu", "offload_param": "cpu"}])
def test_path_without_nvme_warns_that_it_is_unused(kw, tmp_path):
    """path= given where nothing goes to NVMe is a likely mistake (the user believes the state
    is on disk): a UserWarning names the path and the tiers, and no file is created there."""
    fix = "set offload_optimizer or offload_param to 'nvme'" if kw["offload"] == "nvme" else (
        "set offload='nvme'")
    with pytest.warns(UserWarning, match=r"path='.*' is not used: offload=.*puts nothing on NVMe; "
                                         + re.escape(fix)):
        OffloadEngine(TinyLM(), path=str(tmp_path), **kw).close()
    assert list(tmp_path.iterdir()) == []


def test_construction_warnings_name_the_line_that_built_the_engine(tmp_path):
    """The config's and the build's warnings point at the caller's ``OffloadEngine(...)`` line
    (where the setting to change is), not at the engine's own code."""
    with pytest.warns(UserWarning) as record:
        OffloadEngine(TinyLM(), offload="cpu", path=str(tmp_path)).close()
        OffloadEngine(TinyLM(), offload="cpu", update_timing="backward",
                      tail_state_in_host=True).close()
    messages = [str(w.message) for w in record]
    assert any("is not used" in m for m in messages) and any("no effect" in m for m in messages)
    assert {w.filename for w in record} == {__file__}, [(w.filename, w.lineno) for w in record]


def test_read_only_path_raises_value_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = False
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
        mounted = r.returncode == 0
        if not mounted:
            pytest.skip(f"running as root and cannot mount a read-only tmpfs: {r.stderr!r}")
    else:
        ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not writable"):
            OffloadEngine(TinyLM(), offload="nvme", path=str(ro))
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=False)


def test_a_path_no_file_can_be_created_in_raises_value_error():
    """/proc passes os.access for root, and is no read-only mount, yet no file can be created
    there: the folder is tried by creating one, and the error names path= and the OS error."""
    try:
        with tempfile.NamedTemporaryFile(dir="/proc"):
            pass
    except OSError:
        pass
    else:
        pytest.skip("no /proc to stand for a folder that cannot be written")
    with pytest.raises(ValueError, match=r"^path='/proc' is not writable \(creating a file "
                                         r"there: \[Errno \d+\] .*\); offload='nvme' needs an "
                                         r"existing folder this process can write to"):
        OffloadEngine(TinyLM(), offload="nvme", path="/proc")


def test_a_model_wrapped_twice_is_refused_by_name():
    model = TinyLM()
    with OffloadEngine(model):
        with pytest.raises(ValueError, match="TinyLM is already wrapped by an OffloadEngine"):
            OffloadEngine(model)


def test_offload_param_needs_stage_3():
    with pytest.raises(ValueError, match=r"offload_param='cpu' needs stage=3"):
        OffloadEngine(TinyLM(), stage=2, offload_param="cpu")


def test_auto_picks_the_cheapest_placement_that_fits(tmp_path):
    needs = _needs()
    big = 10**12
    cases = [
        ((big, big), ("none", "none")),
        ((needs[("none", "none")]["device"] - 1, big), ("cpu", "none")),
        ((needs[("cpu", "none")]["device"] - 1, big), ("cpu", "cpu")),
        ((needs[("cpu", "none")]["device"] - 1, needs[("cpu", "cpu")]["host"] - 1), ("nvme", "cpu")),
        ((needs[("cpu", "none")]["device"] - 1, needs[("nvme", "cpu")]["host"] - 1), ("nvme", "nvme")),
    ]
    for (max_dev, max_host), expected in cases:
        if expected == ("nvme", "nvme"):
            assert needs[expected]["host"] <= max_host, "test budget leaves no room for the NVMe pool"
        with OffloadEngine(_deep(), offload="auto", path=str(tmp_path), max_device_bytes=max_dev,
                           max_host_bytes=max_host) as eng:
            got = (eng.config.offload_optimizer, eng.config.offload_param)
            assert got == expected, (max_dev, max_host, eng.placement.tried)
            x, y = batches(1)[0]
            eng.backward(lm_loss(eng(x), y))
            eng.step()
            rep = eng.memory_report()
            # the measured peaks stay inside the budgets the choice was made for
            assert rep["device"]["peak_bytes"] <= max_dev
            assert rep["host"]["peak_bytes"] <= max_host


def test_auto_raises_before_allocating_when_nothing_fits(tmp_path):
    with pytest.raises(ValueError, match=r"does not fit even with everything offloaded.*short of"):
        OffloadEngine(TinyLM(), offload="auto", path=str(tmp_path), max_device_bytes=0,
                      max_host_bytes=1000)
    assert list(tmp_path.iterdir()) == []  # no swap folder, no files


def test_auto_without_path_never_picks_nvme():
    needs = _needs()
    with pytest.raises(ValueError, match="needs path="):
        OffloadEngine(_deep(), offload="auto", max_device_bytes=needs[("cpu", "none")]["device"] - 1,
                      max_host_bytes=needs[("cpu", "cpu")]["host"] - 1)


def test_auto_turns_next_forward_on_when_it_places_the_state_on_nvme(tmp_path):
    """offload="auto" decides update_timing="next_forward" with the placement, and budgets its buffers."""
    needs = _needs()
    for budget, on in (((10 ** 12, 10 ** 12), False),
                       ((needs[("cpu", "none")]["device"] - 1,
                         needs[("cpu", "cpu")]["host"] - 1), True)):
        with OffloadEngine(_deep(), offload="auto", path=str(tmp_path), max_device_bytes=budget[0],
                           max_host_bytes=budget[1]) as eng:
            assert (eng.config.offload_optimizer == "nvme") is on
            assert (eng.config.update_timing == "next_forward") is on
            (x, y), = batches(1)
            for _ in range(2):
                eng.backward(lm_loss(eng(x), y))
                eng.step()
            eng(x)
            assert eng.memory_report()["host"]["peak_bytes"] <= budget[1]


def test_auto_takes_the_plain_step_when_only_it_fits(tmp_path):
    """update_timing="next_forward"'s buffers cost host memory: where no placement fits with it, auto
    tries the NVMe placements again with the plain step before it gives up."""
    from offload_zero.estimator import placement_bytes
    needs = _needs()

    def host(sif):
        return _floor(placement_bytes(_deep(), 3, "nvme", "nvme", dtype=torch.float32,
                                      accelerator=False,
                                      update_timing="next_forward" if sif else "step"))["host"]
    max_dev, max_host = needs[("cpu", "none")]["device"] - 1, host(True) - 1
    assert host(False) <= max_host
    with OffloadEngine(_deep(), offload="auto", path=str(tmp_path), max_device_bytes=max_dev,
                       max_host_bytes=max_host) as eng:
        assert eng.config.offload_optimizer == "nvme" and eng.config.update_timing == "step"
        assert any("nvme+nvme next_forward" in t and "short of host" in t
                   for t in eng.placement.tried)
        assert "plain step" in eng.placement.tried[-1] and "fits" in eng.placement.tried[-1]
        (x, y), = batches(1)
        for _ in range(2):
            eng.backward(lm_loss(eng(x), y))
            eng.step()
        assert eng.memory_report()["host"]["peak_bytes"] <= max_host


def test_a_host_budgets_lowered_settings_come_in_a_copy_of_the_config(tmp_path):
    """EngineConfig.lowered: the config itself when nothing changes; else a copy with the
    timing and prefetch in force (what the user left to the engine kept so), the original
    untouched; a change of a setting the user gave is an internal error."""
    from offload_zero.config import EngineConfig
    cfg = EngineConfig(offload="nvme", path=str(tmp_path))
    assert cfg.lowered(cfg.update_timing, cfg.prefetch) is cfg
    low = cfg.lowered("step", 0)
    assert (low.update_timing, low.prefetch) == ("step", 0) and low is not cfg
    assert (cfg.update_timing, cfg.prefetch) != ("step", 0)
    assert low.left_to_engine == cfg.left_to_engine and low.path == cfg.path
    given = EngineConfig(offload="nvme", path=str(tmp_path), update_timing="next_forward")
    with pytest.raises(RuntimeError, match="update_timing='next_forward' was given"):
        given.lowered("step", given.prefetch)
