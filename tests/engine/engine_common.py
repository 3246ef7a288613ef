"""What several of the engine's test files share: an engine over a model, training beside an
unsharded torch.optim reference, and twin engines for comparing update timings."""
import copy

import torch

from models import batches, lm_loss
from offload_zero import OffloadEngine

F32 = torch.float32


OFFLOADS = ["none", "cpu", "nvme"]


def make_engine(model, offload, tmp_path, **kw):
    kw.setdefault("path", str(tmp_path) if offload == "nvme" else None)
    return OffloadEngine(model, offload=offload, **kw)


def train_both(model, engine_kw, tmp_path, offload, steps=5, adamw=True, lr=1e-2, wd=0.1,
                before_step=None, on_engine=None):
    ref = copy.deepcopy(model)
    opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = opt_cls(ref.parameters(), lr=lr, weight_decay=wd, foreach=False)
    eng = make_engine(model, offload, tmp_path, lr=lr, weight_decay=wd, adamw=adamw, **engine_kw)
    if on_engine:
        on_engine(eng)
    for i, (x, y) in enumerate(batches(steps)):
        if before_step:
            before_step(i, model, ref)
        eng.backward(lm_loss(eng(x), y))
        eng.step()
        opt.zero_grad()
        lm_loss(ref(x), y).backward()
        opt.step()
    return eng, ref


def twins(model, tmp_path, sib_a=False, sib_b=True, **kw):
    """Engines ``(a, b)`` on ``model`` and a deep copy of it, each with a swap folder of its
    own under ``tmp_path``, lr 1e-2 and weight decay 0.1 unless ``kw`` says otherwise: ``a``
    with ``update_timing="backward"`` if ``sib_a`` (the reference), ``b`` if ``sib_b``; one
    without it takes the plain step (``update_timing="step"``) unless ``kw`` says."""
    kw = {"lr": 1e-2, "weight_decay": 0.1, **kw}
    twin = copy.deepcopy(model)
    nvme = "nvme" in (kw.get("offload"), kw.get("offload_optimizer"), kw.get("offload_param"))
    for name in "ab":
        (tmp_path / name).mkdir()
    a, b = ((str(tmp_path / name) if nvme else None) for name in "ab")
    plain = {"update_timing": "step"}
    timing = {"update_timing": "backward"}
    return (OffloadEngine(model, path=a, **(timing if sib_a else plain), **kw),
            OffloadEngine(twin, path=b, **(timing if sib_b else plain), **kw))
