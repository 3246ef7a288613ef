"""The full gradients' memory is reused from step to step on a CPU device (see
[Note: reused gradient memory] in offload_zero/partition/grads.py)."""
import copy

import pytest
import torch
import torch.nn as nn

from offload_zero import OffloadEngine
from models import UnpaddedHeadLM

# one block: four 1536x1536 layers, each one's gradient (9.4 MB) small enough for malloc to
# recycle, the block's flat gradient (37.8 MB) not (malloc maps anything over 32 MiB afresh)
WIDTH, LAYERS = 1536, 4


def _block():
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


class Wide(nn.Module):
    def __init__(self, n_blocks=2):
        super().__init__()
        self.blocks = nn.ModuleList(_block() for _ in range(n_blocks))
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.unused = nn.Linear(4, 4)  # in the root's flat parameter, never called
        self.repeat_first = False

    def forward(self, x):
        x = x * self.scale
        for i, b in enumerate(self.blocks):
            x = b(x)
            if i == 0 and self.repeat_first:
                x = b(x)  # the same unit twice: two gradients to add
        return x


@pytest.mark.parametrize("kw", [
    dict(stage=3, offload="cpu"),
    dict(stage=3, offload="cpu", update_timing="backward"),
    dict(stage=3, offload="cpu", update_timing="next_forward"),
    dict(stage=2, offload="cpu"),
    dict(stage=3, offload="none"),
], ids=["stage3-cpu", "stage3-cpu-sib", "stage3-cpu-sif", "stage2-cpu", "stage3-none"])
def test_every_step_writes_the_gradients_into_the_same_memory(kw):
    """Each block's flat gradient (37.8 MB) was a fresh allocation every backward: mapped by
    malloc, unmapped at free, so its 9200 pages faulted in again every step. Holding on to
    every gradient's storage here, a fresh allocation could not reuse an old address."""
    torch.manual_seed(0)
    x = torch.randn(2, WIDTH)
    with OffloadEngine(Wide(), lr=1e-3, **kw) as eng:
        seen = {fp: [] for fp in eng.trainable}
        for fp in eng.trainable:
            # (a hook on the leaf sees each gradient before it is accumulated)
            fp.full.register_hook(lambda g, fp=fp: seen[fp].append(g.untyped_storage()))
        for _ in range(4):
            eng.backward(eng(x).square().mean())
            eng.step()
        assert sum(len(sts) == 4 for sts in seen.values()) >= 3  # the blocks and the root
        for fp, storages in seen.items():
            # (with update_timing="backward" the unused layer is a flat parameter of its own: no
            # gradient at all)
            assert len(storages) in (0, 4), fp.name
            assert len({st.data_ptr() for st in storages[1:]}) <= 1, fp.name
        if kw["offload"] == "none":  # (each reduced at once: all share one buffer)
            assert len({st.data_ptr() for sts in seen.values() for st in sts[1:]}) == 1


@pytest.mark.parametrize("kw", [
    dict(stage=3, offload="cpu"),
    dict(stage=3, offload="cpu", update_timing="backward"),
    dict(stage=2, offload="none"),
], ids=["stage3-cpu", "stage3-cpu-sib", "stage2-none"])
def test_reused_gradient_memory_gives_adamw_numbers(kw):
    """Gradients written into reused memory, with a block run twice in one forward, a unit
    whose parameters get no gradient, and every buffer reused from the second step: the
    weights are plain AdamW's."""
    torch.manual_seed(1)
    model = Wide()
    model.repeat_first = True
    ref = copy.deepcopy(model)
    # (an unused parameter: no gradient in torch, zeros in its flat parameter here, which
    # AdamW without weight decay leaves unchanged too)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    xs = [torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with OffloadEngine(model, lr=1e-3, weight_decay=0.0, **kw) as eng:
        for x in xs:
            eng.backward(eng(x).square().mean())
            eng.step()
            opt.zero_grad()
            ref(x).square().mean().backward()
            opt.step()
        state = eng.full_state_dict()
    assert ref.unused.weight.grad is None
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=1e-5)


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict(dict(a=nn.Linear(8, 8), b=nn.Linear(8, 8)))])
        self.use_b = True

    def forward(self, x):
        y = self.blocks[0]["a"](x)
        return (self.blocks[0]["b"](y) if self.use_b else y).pow(2).mean()


@pytest.mark.parametrize("kw", [dict(stage=2, offload="cpu"), dict(stage=3, offload="none"),
                                dict(stage=3, offload="cpu", update_timing="backward")],
                         ids=["stage2-cpu", "stage3-none", "stage3-cpu-sib"])
def test_a_parameter_without_gradient_beside_others_updates_with_zeros(kw):
    """As documented (README): in a flat parameter whose other parameters get gradients, a
    parameter without one is updated with a zero gradient (moments decay, weight decay
    applies), as flat parameters do in FSDP and DeepSpeed; torch.optim would skip it."""
    torch.manual_seed(0)
    model = _TwoLayers()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(4, 8)
    with OffloadEngine(model, lr=1e-2, weight_decay=0.1, **kw) as eng:
        for step in range(4):
            model.use_b = ref.use_b = step == 0  # b gets a gradient in the first step only
            eng.backward(eng(x))
            eng.step()
            opt.zero_grad()
            ref(x).backward()
            for p in ref.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            opt.step()
        state = eng.full_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=1e-6)


class _OneWeightBlocks(nn.Module):
    """Blocks of one 1024x1024 weight (no bias, no padding: a flat parameter of one
    parameter), then a block of several, like an LM head beside transformer blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(1024, 1024, bias=False),
                                     nn.Linear(1024, 1024, bias=False), _block()])
        self.blocks[2][0] = nn.Linear(1024, WIDTH)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.square().mean()


@pytest.mark.parametrize("kw", [
    dict(stage=3, offload="cpu"),
    dict(stage=3, offload="cpu", update_timing="next_forward"),
    dict(stage=3, offload="cpu", update_timing="backward"),
    dict(stage=3, offload="nvme"),
], ids=["stage3-cpu", "stage3-cpu-sif", "stage3-cpu-sib", "stage3-nvme"])
def test_a_one_parameter_flat_gradient_is_taken_as_autograd_made_it(kw, tmp_path):
    """A flat parameter of one parameter and no padding: autograd's gradient of that parameter
    is its flat gradient. It used to be copied into a lent buffer that then sat idle from the
    update to the next backward (an LM head's or an embedding's 131 MB on the bench model, at
    the step's peak). Now no buffer of its size is ever lent or kept, and the weights are
    plain AdamW's."""
    torch.manual_seed(3)
    model = _OneWeightBlocks()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    xs = [torch.randn(2, 1024, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    if kw["offload"] == "nvme":
        kw = dict(kw, path=str(tmp_path))
    with OffloadEngine(model, lr=1e-3, weight_decay=0.0, **kw) as eng:
        single = [fp for fp in eng.trainable if len(fp.entries) == 1]
        assert len(single) == 2 and all(fp.padded_numel == fp.numel == 1 << 20 for fp in single)
        seen_sizes = set()
        for x in xs:
            eng.backward(eng(x))
            seen_sizes |= {b.numel() for b in eng.grads._lent.values()}
            eng.step()
            seen_sizes |= {b.numel() for bufs in eng.grads._free.values() for b in bufs}
            opt.zero_grad()
            ref(x).backward()
            opt.step()
        assert 1 << 20 not in seen_sizes  # no buffer of the one-weight blocks' size, ever
        assert seen_sizes  # (the block of several still writes into lent memory)
        state = eng.full_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kw", [
    dict(stage=2, offload="cpu"),
    dict(stage=3, offload="cpu"),
    dict(stage=3, offload="cpu", update_timing="next_forward"),
    dict(stage=3, offload="cpu", update_timing="backward"),
    dict(stage=3, offload="nvme"),
    dict(stage=3, offload="nvme", update_timing="step"),
], ids=["stage2-cpu", "stage3-cpu", "stage3-cpu-sif", "stage3-cpu-sib", "stage3-nvme",
        "stage3-nvme-plain"])
def test_the_lm_head_is_a_flat_parameter_of_its_own_and_borrows_no_gradient_buffer(kw, tmp_path):
    """The root is split by gradient order in every mode: the LM head's weight (most of the
    part used after the blocks) is a flat parameter of its own, apart from the final norm and
    the embeddings: autograd's
    gradient of it is its flat gradient, so no buffer of its size is ever lent or kept. (With
    the final norm in the same flat parameter, a buffer of both sat idle from the update to the
    next backward and was written at the LM head's backward, the bench model's peak, beside
    autograd's gradient: 131 MB there; the plain step kept the root whole, LM head and
    embeddings in one 262 MB buffer.) The weights are plain AdamW's."""
    torch.manual_seed(5)
    model = UnpaddedHeadLM(vocab=1024, width=64)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randint(0, 1024, (2, 5), generator=g) for _ in range(3)]
    if kw["offload"] == "nvme":
        kw = dict(kw, path=str(tmp_path))
    with OffloadEngine(model, lr=1e-3, weight_decay=0.1, **kw) as eng:
        parts = [[e.names[0] for e in fp.entries] for fp in eng.root.flat_params]
        assert parts == [["norm.weight", "norm.bias"], ["head.weight"], ["emb.weight"]]
        seen_sizes = set()
        for x in xs:
            eng.backward(eng(x).square().mean())
            seen_sizes |= {b.numel() for b in eng.grads._lent.values()}
            eng.step()
            seen_sizes |= {b.numel() for bufs in eng.grads._free.values() for b in bufs}
            opt.zero_grad()
            ref(x).square().mean().backward()
            opt.step()
        assert seen_sizes and max(seen_sizes) < 1024 * 64  # nothing of the LM head's size
        state = eng.full_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=1e-5)
