"""Small models shared by the tests: awkward widths on purpose."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH = 53, 24


class Block(nn.Module):
    """LayerNorm + two Linear of odd widths, residual."""

    def __init__(self, d=WIDTH, hidden=37):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.ln(x))))


class TinyLM(nn.Module):
    """Embedding, a ModuleList of blocks, a head; optional tied head and embedding."""

    def __init__(self, n_blocks=6, tie=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.skip = set()    # block indices to skip in forward
        self.repeat = set()  # block indices to run twice

    def forward(self, x):
        h = self.emb(x)
        for i, b in enumerate(self.blocks):
            if i in self.skip:
                continue
            h = b(h)
            if i in self.repeat:
                h = b(h)
        return self.head(self.norm(h))


def lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def adamw_reference(model, global_batches, lr=1e-2, wd=0.1):
    """A copy of ``model`` trained by single-process ``torch.optim.AdamW`` on each whole global
    batch in turn: ``{name: parameter}``, what data-parallel training on its slices must give."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd, foreach=False)
    for x, y in global_batches:
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
    return {n: p.detach() for n, p in ref.named_parameters()}


def batches(n, seed=0, batch=4, seq=9):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (batch, seq), generator=g),
             torch.randint(0, VOCAB, (batch, seq), generator=g)) for _ in range(n)]


class UnpaddedHeadLM(nn.Module):
    """Input embeddings and an LM head of ``vocab`` x ``width`` each (one parameter, no padding
    for sizes of 1024 elements or more), a final norm, and residual blocks of two Linear layers
    far smaller: the root outweighs the blocks, as in an LM."""

    def __init__(self, vocab=1024, width=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                  nn.Linear(2 * width, width)) for _ in range(3))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


def flat_param_of(engine, name: str):
    """The flat parameter of ``engine`` that holds the parameter named ``name``."""
    return next(fp for fp in engine.flat_params
                if any(fqn == name for e in fp.entries for _, _, fqn in e.refs))


def max_param_diff(state_dict, reference: nn.Module) -> float:
    return max((state_dict[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


class WideNet(nn.Module):
    """LayerNorm, then residual blocks of 640x640 Linear-GELU-Linear: big enough that shard
    padding stays under 2% (memory and communication checks against the paper's formulas)."""

    def __init__(self, width=640, n_blocks=4):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
            for _ in range(n_blocks))

    def forward(self, x):
        x = self.norm(x)
        for b in self.blocks:
            x = x + b(x)
        return x


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def big_root_lm(n_blocks=3, vocab_scale=1):
    """A :class:`TinyLM` with tiny blocks (hidden width 3), so its root (embeddings, LM head)
    is far larger than a block: the root's optimizer state does not fit the update_timing="backward"
    read-ahead buffers and streams in chunks. ``vocab_scale`` widens the embeddings and the LM
    head (labels from :func:`batches` stay below ``VOCAB``)."""
    model = TinyLM(n_blocks=n_blocks)
    model.blocks = nn.ModuleList(Block(WIDTH, hidden=3) for _ in range(n_blocks))
    if vocab_scale > 1:
        model.emb = nn.Embedding(vocab_scale * VOCAB, WIDTH)
        model.head = nn.Linear(WIDTH, vocab_scale * VOCAB, bias=False)
    return model


class BackwardFault(torch.autograd.Function):
    """Identity in forward; in backward, per ``fault``: None passes the gradient on, ``"nan"``
    makes its first element nan, ``"raise"`` raises ArithmeticError (an error inside backward),
    ``"interrupt"`` raises KeyboardInterrupt (Ctrl-C inside backward).
    Use as ``BackwardFault.apply(x, fault)``."""

    @staticmethod
    def forward(ctx, x, fault):
        ctx.fault = fault
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.fault == "raise":
            raise ArithmeticError("failed in backward")
        if ctx.fault == "interrupt":
            raise KeyboardInterrupt
        if ctx.fault == "nan":
            g = g.clone()
            g.view(-1)[0] = float("nan")
        return g, None


def last_step_nvme_bytes(eng, data):
    """Train ``eng`` on each ``(x, y)`` of ``data`` (``lm_loss``), waiting for the disk before
    each backward and after each step, so that every transfer a step starts counts in it (a
    read ahead in backward then never waits for a write of the step before); returns the NVMe
    bytes ``[read, written]`` of the last step (``memory_report()["nvme"]``)."""
    marks = []
    for x, y in data:
        loss = lm_loss(eng(x), y)
        eng.swapper.wait_all()
        eng.backward(loss)
        eng.step()
        eng.swapper.wait_all()
        nvme = eng.memory_report()["nvme"]
        marks.append((nvme["read_bytes"], nvme["written_bytes"]))
    return [b - a for a, b in zip(marks[-2], marks[-1])]
