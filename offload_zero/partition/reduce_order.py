"""Gradient reduction in one order on every rank, whatever each rank's backward ran.

[Note: reduction order]
At stages 1 and 2 every rank holds the whole model, and nothing pairs the ranks' collectives in
backward but their order. A rank used to reduce a flat parameter's gradient as soon as its own
backward produced it. When the ranks' backwards differ (one rank's tokens went to another
expert, a branch was skipped), the k-th reduce-scatter of rank 0 then met another flat
parameter's on rank 1, and both went on with the two summed: wrong weights, no error. So, at
world size > 1:

- The gradients are reduced in one order that every rank computes from the model alone
  (:func:`grad_order`: by the modules' registration order, last first, which is backward's
  usual order), and every trainable flat parameter is reduced in every backward, as DDP does
  with ``find_unused_parameters``.
- In backward, a gradient is reduced once it and every one before it in the order are ready
  (in the usual case at once, so the overlap with backward is kept).
- When backward ends, the rest are reduced in order. A flat parameter this rank did not use
  contributes zeros.
- Which flat parameters no rank used is then known from one flag per flat parameter, summed
  over the ranks. Those keep no gradient and the step skips them, as ``torch.optim`` skips a
  parameter whose ``.grad`` is None. With ``update_timing="backward"`` each update follows its
  reduction, and the flag rides on that update's inf/nan all-reduce
  (``OffloadEngine._grad_flags``), so no collective is added.

Stage 1 reduces at :meth:`OffloadEngine.step`: the flags first, then every flat parameter that
some rank used (:func:`reduce_stage1`).

Stage 3 needs none of this. Its gathers are collectives too, and so a rank that runs another
unit is caught by the lockstep check ([Note: lockstep]); ``leaf_modules`` makes a MoE layer
one unit, which every rank gathers whole.

A gradient that waits for its turn stays in full until then: one whose backward runs out of
the registration order holds its memory a while longer (never past the end of backward).
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.nn as nn

from offload_zero.partition.flat_param import FlatParam


def grad_order(model: nn.Module, flat_params: List[FlatParam]) -> List[FlatParam]:
    """``flat_params`` in the order their gradients are reduced on every rank: by the position
    (in ``model.named_modules()``) of the earliest module using any of their parameters, last
    first, ties by construction order, last first. Depends only on the model, so every rank
    computes the same list."""
    position = {name: i for i, (name, _) in enumerate(model.named_modules())}

    def first_use(fp: FlatParam) -> int:
        uses = [position.get(n.rpartition(".")[0], 0) for e in fp.entries for n in e.names]
        return min(uses, default=0)

    indexed = list(enumerate(flat_params))
    indexed.sort(key=lambda item: (first_use(item[1]), item[0]), reverse=True)
    return [fp for _, fp in indexed]


def zero_full_grad(fp: FlatParam) -> None:
    """Give ``fp`` a full gradient of zeros (its contribution where this rank did not use it):
    shape (padded_numel,), ``fp.dtype``, on ``fp``'s device."""
    fp.full.grad = torch.zeros(fp.padded_numel, dtype=fp.dtype, device=fp.device)


class OrderedReduction:
    """Stage 2 at world size > 1: hands gradients on in :func:`grad_order`, zeros for those this
    rank's backward did not produce (see [Note: reduction order]).

    Args:
        order: the trainable flat parameters, from :func:`grad_order`.
        emit: ``f(flat_param)``: reduce its ``full.grad`` (and update, with update_timing="backward").
        grads: the :class:`offload_zero.partition.grads.GradientShards`.
        comm: the data-parallel :class:`offload_zero.comm.Comm`.
        flags_in_update: True when ``emit`` itself sums the used flags over the ranks (the
            update_timing="backward" update); else one all-reduce of them ends each backward.

    Attributes:
        used: the flat parameters this rank's current (or last) backward gave a gradient.
    """

    def __init__(self, order: List[FlatParam], emit: Callable, grads, comm,
                 flags_in_update: bool = False):
        self.order, self._emit, self._grads, self._comm = order, emit, grads, comm
        self._flags_in_update = flags_in_update
        self._next = 0
        self._ready: set = set()
        self.used: set = set()
        self._zeroed: Dict[FlatParam, bool] = {}  # contributed zeros -> had a gradient before
        self._open = False

    def grad_ready(self, fp: FlatParam) -> None:
        """``fp.full.grad`` was accumulated in backward (the scheduler's gradient hook)."""
        if not self._open:
            self._open = True
            self._next, self._ready, self.used, self._zeroed = 0, set(), set(), {}
        self.used.add(fp)
        if fp in self._ready:  # a second gradient in the same backward: already handed on
            self._emit(fp)
            return
        self._ready.add(fp)
        while self._next < len(self.order) and self.order[self._next] in self._ready:
            self._next += 1
            self._emit(self.order[self._next - 1])

    def end_backward(self) -> None:
        """Backward ended: hand on the rest in order (zeros for the unused), then forget the
        gradient of every flat parameter no rank used. Collective; a no-op when nothing
        happened since the last call."""
        if not self._open:
            return
        self._open = False
        for fp in self.order[self._next:]:
            if fp not in self._ready:
                self._zeroed[fp] = self._grads.has_grad[fp]
                zero_full_grad(fp)
            self._emit(fp)
        self._next = len(self.order)
        if self._flags_in_update or not self._zeroed:
            return
        flags = torch.tensor([float(fp in self.used) for fp in self.order], dtype=torch.float32,
                             device=self.order[0].device)
        self._comm.all_reduce_sum(flags, what="used flags", count=False)
        for fp, f in zip(self.order, flags.tolist()):
            if f == 0 and fp in self._zeroed and not self._zeroed[fp]:
                self._grads.forget(fp)


def reduce_stage1(grads, order: List[FlatParam], comm) -> None:
    """Stage 1 at :meth:`OffloadEngine.step`: reduce, in ``order`` on every rank, every flat
    parameter some rank has a gradient for (zeros where this rank has none), after one
    all-reduce of a flag per flat parameter. Collective."""
    if comm.world_size > 1:
        flags = torch.tensor([float(fp.full.grad is not None) for fp in order],
                             dtype=torch.float32, device=order[0].device if order else None)
        comm.all_reduce_sum(flags, what="used flags", count=False)
        for fp, f in zip(order, flags.tolist()):
            if f > 0 and fp.full.grad is None:
                zero_full_grad(fp)
    grads.reduce_all_full(order)
