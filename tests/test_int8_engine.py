"""moment_dtype="int8": blockwise 8-bit moments in every store, 6 bytes of optimizer state per
parameter on NVMe (6.03 in host memory): training against exact AdamW, bytes moved and held,
the same numbers across tiers, step modes and chunking, parameter groups that cut a block,
checkpoints that resume bit for bit, and errors."""
import copy

import pytest
import torch

from offload_zero import OffloadEngine
from offload_zero.memory.state_format import StateFormat, moment_dtype_of
from models import TinyLM
from test_host_cache import CacheLM
from test_moment_dtype import (_engine, _run_and_save_halfway, _train,
                               assert_resumes_exactly, assert_same_everywhere)


def test_state_format_of_int8_moments():
    fmt = StateFormat(moment_dtype_of("int8"))
    assert (fmt.bytes_per_element, fmt.resident_bytes_per_element) == (6, 6.03125)
    assert fmt.exchange_dtype == torch.float32 and fmt.chunk_multiple == 4096
    assert fmt.nbytes(4096) == 6 * 4096
    assert fmt.nbytes(3072) == 4 * 3072 + 2 * 4096  # each code region padded to 4096 bytes
    assert fmt.scale_bytes(3072) == 8 * 12 and fmt.scale_bytes(257) == 16
    assert tuple(fmt.new_scales(1000).shape) == (2, 4)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_int8_moments_train_close_to_exact_adamw(offload, tmp_path):
    """Thirty steps on one batch: the loss falls as with exact AdamW (fp32 moments), within 3%
    of it at every step from the fifth (the documented tolerance), and not bit-identical."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=3)
    runs = {}
    for moments in ("fp32", "int8"):
        with _engine(copy.deepcopy(model), tmp_path, moments, stage=3, lr=3e-3,
                     offload=offload, moment_dtype=moments) as eng:
            runs[moments] = _train(eng, steps=30, seed=1, repeat=True)
    fp32, int8 = runs["fp32"], runs["int8"]
    assert int8[-1] < 0.9 * int8[0]
    assert all(abs(a - b) <= 0.03 * a for a, b in zip(fp32[4:], int8[4:])), (fp32, int8)
    assert fp32 != int8


def test_int8_moments_are_the_same_in_every_tier_mode_and_chunking(tmp_path, monkeypatch):
    """Rounding keyed by each element's place in its flat parameter and blocks at fixed
    places: the plain step, update timings "backward", "next_forward", a host cache, offload="cpu" and
    NVMe state streamed in chunks of 4096 elements give the same weights bit for bit."""
    assert_same_everywhere(tmp_path, monkeypatch, {"stage": 3, "moment_dtype": "int8"},
                           200_000, 4096)


def test_int8_moments_move_six_bytes_per_element(tmp_path):
    """The NVMe state files hold 4 + 1 + 1 bytes per element (each code region padded to 4096
    bytes), a step reads and writes exactly those, and the scales (8 bytes per 256 elements)
    are host moments."""
    torch.manual_seed(0)
    with _engine(CacheLM(), tmp_path, "int8", stage=3, moment_dtype="int8",
                 tail_state_in_host=False, update_timing="step") as eng:
        pad = lambda nbytes: -(-nbytes // 4096) * 4096  # noqa: E731
        formula = sum(4 * fp.shard_numel + 2 * pad(fp.shard_numel) for fp in eng.trainable)
        rep = eng.memory_report()
        assert rep["host_cache"]["nvme_state_bytes"] == formula
        assert rep["nvme"]["by_kind"]["moments"]["current_bytes"] == sum(
            2 * pad(fp.shard_numel) for fp in eng.trainable)
        assert rep["host"]["by_kind"]["moments"]["current_bytes"] == sum(
            8 * -(-fp.shard_numel // 256) for fp in eng.trainable)
        before = (rep["nvme"]["state_read_bytes"], rep["nvme"]["state_written_bytes"])
        _train(eng)
        eng.apply_pending_updates()
        eng.store.drain()
        rep = eng.memory_report()
        after = (rep["nvme"]["state_read_bytes"], rep["nvme"]["state_written_bytes"])
    assert [b - a for a, b in zip(before, after)] == [5 * formula] * 2
    assert formula < 0.55 * 12 * sum(fp.shard_numel for fp in eng.trainable)


def test_parameter_groups_that_cut_a_block_train(tmp_path):
    """Two parameter groups (no decay for biases and norms) whose runs start inside 256-element
    blocks: the same weights on the CPU tier and on NVMe, and close to exact AdamW's."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.dim() > 1]
        rest = [p for n, p in m.named_parameters() if p.dim() <= 1]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]

    out = {}
    for name, kw in {"cpu": {"offload": "cpu", "moment_dtype": "int8"},
                     "nvme": {"moment_dtype": "int8"}, "exact": {"offload": "cpu"}}.items():
        m = copy.deepcopy(model)
        with _engine(m, tmp_path, name, stage=3, param_groups=groups(m), **kw) as eng:
            cuts = [a for runs in eng._updates.adam.segments.values() for a, _, _ in runs[1:]]
            assert any(a % 256 for a in cuts)
            _train(eng, steps=4)
            out[name] = eng.full_state_dict()
    assert all(torch.equal(out["cpu"][k], out["nvme"][k]) for k in out["cpu"])
    assert all(torch.allclose(out["cpu"][k], out["exact"][k], atol=5e-3) for k in out["cpu"])


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_int8_checkpoint_resumes_bit_for_bit(offload, tmp_path):
    """Saved with int8 moments (decoded, float32), loaded into a fresh engine, two more steps:
    the weights of the run that did not stop; the moments read back are the saved ones; the
    same checkpoint loads into an fp32-moment engine with those values exactly."""
    kw = {"stage": 3, "moment_dtype": "int8", "offload": offload}
    model, whole, xs, saved, scales = _run_and_save_halfway(tmp_path, kw)

    def check(b):
        for fp in b.trainable:
            assert torch.equal(b.store.scales(fp), scales[fp.name])
            assert all(torch.equal(g, w) for g, w in zip(b.store.read_all(fp), saved[fp.name]))

    assert_resumes_exactly(tmp_path, kw, model, whole, xs, check)
    with _engine(copy.deepcopy(model), tmp_path, "fp32", stage=3, offload=offload) as c:
        c.load_checkpoint(str(tmp_path / "ckpt"))
        for fp in c.trainable:
            assert all(torch.equal(g, w) for g, w in zip(c.store.read_all(fp), saved[fp.name]))


def test_int8_on_an_accelerator_state_is_not_implemented(monkeypatch):
    """The update of an optimizer state on the accelerator runs in torch ops: no int8 there
    (the check runs before CUDA is touched, so it is faked present)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(NotImplementedError, match=r"moment_dtype='int8' with the optimizer "
                                                  r"state on cuda"):
        OffloadEngine(TinyLM(n_blocks=2), moment_dtype="int8", offload="none",
                      device=torch.device("cuda"))


def test_auto_placement_keeps_int8_moments_off_an_accelerator():
    """offload="auto" on an accelerator with room for everything still puts int8 moments in
    host memory (their kernel is the host's), saying why it passed over the all-on-device
    placement; with fp32 moments that placement is taken. (bf16: test_moment_dtype.)"""
    moment_dtype = "int8"
    from offload_zero.placement import choose_placement
    model = TinyLM(n_blocks=2)
    kw = dict(stage=3, world_size=1, dtype=torch.float32, prefetch=1, unit_classes=(),
              device=torch.device("cuda"), path=None, max_device_bytes=1 << 40,
              max_host_bytes=1 << 40)
    assert choose_placement(model, **kw).offload_optimizer == "none"
    choice = choose_placement(model, moment_dtype=moment_dtype, **kw)
    assert choice.offload_optimizer == "cpu"
    assert any(f"moment_dtype={moment_dtype!r} needs the optimizer state off the accelerator"
               in line for line in choice.tried)
