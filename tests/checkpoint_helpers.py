"""What the checkpoint tests share: a model with a frozen part, an engine on a tier, a few
training steps, and a snapshot of everything a resume must restore, compared bit for bit."""
import os

import torch

from models import TinyLM, lm_loss
from offload_zero import OffloadEngine
from offload_zero import checkpoint as ckpt

F32, BF16 = torch.float32, torch.bfloat16


def _model(seed, n_blocks=3):
    """TinyLM with a frozen tensor beside trainable ones (block 1's LayerNorm weight), its
    values drawn from ``seed`` so that two seeds differ everywhere, frozen values included."""
    torch.manual_seed(seed)
    model = TinyLM(n_blocks=n_blocks)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.blocks[1].ln.weight.requires_grad_(False)
    return model


def _engine(model, offload, swap_dir, **kw):
    path = None
    if offload == "nvme":
        os.makedirs(swap_dir, exist_ok=True)
        path = str(swap_dir)
    return OffloadEngine(model, offload=offload, path=path, **kw)


def _train(eng, data, rank=None, per_rank=2):
    for x, y in data:
        if rank is not None:
            lo, hi = rank * per_rank, (rank + 1) * per_rank
            x, y = x[lo:hi], y[lo:hi]
        eng.backward(lm_loss(eng(x), y))
        eng.step()


def _snapshot(eng):
    """Everything a resume must restore: the exported weights, every flat parameter's shard,
    master weights, moments and step count, lr and skipped_steps."""
    state = {}
    for fp in eng.flat_params:
        shard = fp.home.read(fp) if fp.home is not None else fp.sharded.detach().cpu().clone()
        state[f"{fp.name}/param"] = shard
        if fp.requires_grad:
            for key, t in zip(("master", "exp_avg", "exp_avg_sq"), eng.store.read_all(fp)):
                state[f"{fp.name}/{key}"] = t
            state[f"{fp.name}/step"] = eng.step_counts[fp]
    return {"weights": eng.full_state_dict(), "state": state, "lr": eng.lr,
            "skipped_steps": eng.skipped_steps}


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _differences(got, want):
    """Names of the entries that are not identical bit for bit (empty when all are)."""
    bad = [k for k in ("lr", "skipped_steps") if got[k] != want[k]]
    for part in ("weights", "state"):
        g, w = got[part], want[part]
        if g.keys() != w.keys():
            bad.append(f"{part} keys")
            continue
        for k in w:
            if isinstance(w[k], torch.Tensor):
                same = (g[k].dtype == w[k].dtype and g[k].shape == w[k].shape
                        and torch.equal(_bits(g[k]), _bits(w[k])))
            else:
                same = g[k] == w[k]
            if not same:
                bad.append(f"{part}[{k}]")
    return bad


def _assert_identical(got, want):
    assert not _differences(got, want)


def _full_state(folder):
    """Every saved tensor of the checkpoint in ``folder`` with its rank shards joined and cut to
    the flat parameter's ``numel`` (the padding dropped), and each step count, by name: what a
    checkpoint means, whatever the world size that wrote it."""
    from safetensors.torch import load_file
    meta = ckpt.read_metadata(folder)
    files = [load_file(os.path.join(folder, ckpt.rank_file_name(r)))
             for r in range(meta["world_size"])]
    full = {}
    for f in meta["flat_params"]:
        for name in files[0]:
            if name.startswith(f["name"] + "/"):
                if name.endswith("/step"):
                    assert all(torch.equal(t[name], files[0][name]) for t in files)
                    full[name] = files[0][name]
                else:
                    full[name] = torch.cat([t[name] for t in files])[:f["numel"]]
    return full


def _same_full_state(a, b):
    """Names whose tensors differ between two :func:`_full_state` results (bit for bit)."""
    assert a.keys() == b.keys()
    return [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])))]
