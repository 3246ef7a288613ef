"""Which flat parameters keep their optimizer state in host memory when it is on NVMe.

[Note: host cache]
With the optimizer state on NVMe (``offload_optimizer="nvme"``) every step reads and writes
each flat parameter's state file (fp32 master weights and two moments: 12 bytes per element of
its shard each way). A flat parameter whose state stays in host memory instead moves none of
those bytes: no file, no I/O, the same kernel on the same values (bit-identical weights).
``host_cache_bytes`` is the host memory the engine may spend on that. One rule chooses the flat
parameters, used by the engine (:class:`offload_zero.memory.state_stores.NVMeStore.keep_in_host`) and
by the estimator alike (:func:`plan_host_cache`):

1. the flat parameter ``tail_state_in_host`` keeps (the input embeddings, updated last in
   backward and needed first in forward), whatever the budget; its bytes count against it;
2. then, in this order, each trainable flat parameter whose state fits in what is left of the
   budget (one that does not fit is passed over, a smaller later one may still fit):
   the root's parts (embeddings, then the parts used after the blocks: the LM head, the final
   norm), whose I/O has the least compute to hide behind; then the blocks from both ends of
   the update order alternately (the first updated, the last, the second, the second last,
   ...), whose reads and write-backs start or end the step's stream and overlap least.

A flat parameter's cost is ``bytes_per_element * shard_numel``: 12 (fp32 master, two fp32
moments) or 8 (bf16 moments, ``moment_dtype="bf16"``), 2 less with a bf16 master
(``master_dtype="bf16"``), the master's bytes less when it is the parameter shard itself (a
master of the compute dtype on a CPU device).
Everything not chosen stays on NVMe, so the bytes read and written per step are the state
bytes of the NVMe-resident flat parameters, each way.

3. then, with the parameter shards on NVMe too (``offload_param="nvme"``) and budget left,
   the frozen flat parameters' shards (K bytes per element, the compute dtype's), each that
   fits (:func:`plan_frozen_cache`): the blocks' in forward order, read twice a step (forward
   and backward), then the root's, read once (gathered from forward to backward). A frozen
   shard kept in host memory saves K bytes read twice a step per K bytes of RAM, as a state
   saves its bytes read and written: with PEFT/LoRA, whose few trainable parameters leave most
   of the budget, the frozen base weights are most of what crosses the disk.

With the parameter shards on NVMe too (``offload_param="nvme"``), a chosen flat parameter's
shard leaves the disk as well: in the master's dtype (fp32, or bf16 with bf16 masters) it is
the host master itself; in another dtype it stays in host memory beside its state (K bytes per element, counted on the host tier as parameters
but not against ``host_cache_bytes``), written by the update and read by the gathers there,
so the disk is spared its K bytes written per step and its reads. The pool buffers such a
shard would have gone through are not planned either (an outsized root part's own buffer).

[Note: host cache report]
``memory_report()["host_cache"]`` says where this rank keeps its optimizer state and its
parameter shards, host memory or NVMe, with the keys of :data:`REPORT_KEYS` in every
configuration (offload settings, stage 1/2/3), 0 where nothing applies (state or shards on the
device). Counts are flat parameters; bytes are this rank's, as allocated:

- ``host_flat_params`` / ``host_state_bytes``: trainable flat parameters whose optimizer state
  (master weights, moments, int8 moments' scales) is in host memory, and its bytes: every one
  with ``offload_optimizer="cpu"``; with ``"nvme"`` those rules 1-2 keep. A master that is the
  parameter shard itself (a CPU device, a master of the compute dtype) adds no bytes.
- ``nvme_flat_params`` / ``nvme_state_bytes``: those whose state is in NVMe files, and the
  files' bytes (padding included): what each step reads and writes once. (Their int8
  moments' scales stay in host memory, counted in neither.)
- ``host_param_flat_params`` / ``host_param_bytes``: flat parameters whose compute-dtype
  parameter shard has memory of its own in host memory (stage 3), K bytes per element: every
  one with ``offload_param="cpu"``; with ``"nvme"`` the frozen shards rule 3 keeps and the
  trainable shards kept beside their state in host memory in a dtype other than the master's.
  A shard of the master's dtype whose state is kept is that host master: counted in
  ``host_state_bytes``, in neither parameter count.
- ``nvme_param_flat_params`` / ``nvme_param_bytes``: flat parameters whose shard each gather
  reads from NVMe (its own file, or its master's bytes in the optimizer's file), K bytes per
  element.
- ``host_frozen_flat_params`` / ``host_frozen_bytes``: the frozen ones among
  ``host_param_*``.

What ``host_cache_bytes`` took is ``host_state_bytes`` with the state on NVMe, plus
``host_frozen_bytes`` with the shards on NVMe too. The plan states the same figures
(:attr:`offload_zero.plan.MemoryPlan.host_cache`); the engine reports what its store and its
parameter home allocated and checks after building that the two agree.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Set, Tuple

# (block, trainable, shard_numel): block is the block's position in forward order, None for the
# root unit; shard_numel in elements
FlatInfo = Tuple[Optional[int], bool, int]

# the keys of memory_report()["host_cache"] and MemoryPlan.host_cache, in every configuration
# (see [Note: host cache report]): counts of flat parameters, then bytes
REPORT_KEYS = ("host_flat_params", "nvme_flat_params", "host_state_bytes", "nvme_state_bytes",
               "host_param_flat_params", "nvme_param_flat_params", "host_param_bytes",
               "nvme_param_bytes", "host_frozen_flat_params", "host_frozen_bytes")


def cache_order(flat: Sequence[FlatInfo], blocks_reversed: bool = False) -> List[int]:
    """Indices into ``flat`` of the trainable flat parameters in the order the host cache takes
    them (see [Note: host cache]): the root's parts last-constructed first (the embeddings,
    then the LM head, then the rest), then the blocks alternately from the two ends of the
    update order. ``blocks_reversed``: the blocks are updated last first (``update_timing="backward"``),
    else first first; with both ends taken alternately this only decides which end leads."""
    root = [i for i, (b, t, _) in enumerate(flat) if b is None and t]
    blocks = sorted({b for b, t, _ in flat if b is not None and t}, reverse=blocks_reversed)
    ends: List[int] = []
    lo, hi = 0, len(blocks) - 1
    while lo <= hi:
        ends.append(blocks[lo])
        if hi != lo:
            ends.append(blocks[hi])
        lo, hi = lo + 1, hi - 1
    by_block = [i for b in ends for i, (fb, t, _) in enumerate(flat) if fb == b and t]
    return list(reversed(root)) + by_block


def plan_host_cache(flat: Sequence[FlatInfo], budget_bytes: int, bytes_per_element: int,
                    tail: Optional[int] = None, blocks_reversed: bool = False) -> Set[int]:
    """The indices into ``flat`` whose optimizer state stays in host memory (see
    [Note: host cache]).

    Args:
        flat: ``(block, trainable, shard_numel)`` per flat parameter in construction order
            (``block``: position of its block unit in forward order, None for the root).
        budget_bytes: ``host_cache_bytes``, bytes >= 0.
        bytes_per_element: host bytes of one element's state (12 with fp32 moments, 8 with
            bf16, 2 less with a bf16 master; the master's bytes less when it is the parameter
            shard itself).
        tail: the index ``tail_state_in_host`` keeps (taken whatever the budget), or None.
        blocks_reversed: as for :func:`cache_order`.

    Returns:
        The chosen indices (empty with a budget of 0 and no tail).

    Raises:
        ValueError: ``budget_bytes`` or ``bytes_per_element`` is negative.
    """
    if budget_bytes < 0 or bytes_per_element < 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} and bytes_per_element="
                         f"{bytes_per_element!r} must be >= 0")
    chosen: Set[int] = set()
    left = budget_bytes
    if tail is not None:
        chosen.add(tail)
        left -= bytes_per_element * flat[tail][2]
    for i in cache_order(flat, blocks_reversed):
        cost = bytes_per_element * flat[i][2]
        if i not in chosen and cost <= left:
            chosen.add(i)
            left -= cost
    return chosen


def plan_frozen_cache(flat: Sequence[FlatInfo], budget_bytes: float, itemsize: int) -> Set[int]:
    """The indices into ``flat`` of frozen flat parameters whose parameter shard stays in host
    memory (rule 3 of [Note: host cache]): the blocks' in forward order, then the root's, each
    whose ``itemsize * shard_numel`` bytes fit in what is left of ``budget_bytes``.

    Args:
        flat: ``(block, trainable, shard_numel)`` per flat parameter, as for
            :func:`plan_host_cache`.
        budget_bytes: bytes of ``host_cache_bytes`` the states left (<= 0: none).
        itemsize: bytes per element of a parameter shard (the compute dtype's, K).

    Returns:
        The chosen indices (trainable ones never).
    """
    frozen = [i for i, (b, t, _) in enumerate(flat) if not t]
    order = (sorted((i for i in frozen if flat[i][0] is not None), key=lambda i: flat[i][0])
             + [i for i in frozen if flat[i][0] is None])
    chosen: Set[int] = set()
    left = budget_bytes
    for i in order:
        cost = itemsize * flat[i][2]
        if cost <= left:
            chosen.add(i)
            left -= cost
    return chosen
