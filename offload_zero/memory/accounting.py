"""Byte accounting per tier and per kind of training state.

Every allocation the engine makes on a tier is recorded here (``add``) and every release too
(``sub``), so ``memory_report()`` shows current and peak bytes per tier without asking the
allocator. Tests cross-check these counters against the tensors' own storages.
"""
from __future__ import annotations

import collections
import enum
from typing import Dict

from offload_zero.config import Tier


class StateKind(enum.Enum):
    """What a block of bytes holds."""

    PARAMS = "parameters"
    """Compute-dtype parameters: the rank's shards and the gathered (unsharded) units."""
    GRADS = "gradients"
    """Gradients: full unit gradients in flight and the reduced gradient shards."""
    MASTER = "master_weights"
    """fp32 master weights."""
    MOMENTS = "moments"
    """Adam first and second moments (fp32)."""
    BUFFERS = "buffers"
    """Buffers in flight: NVMe staging buffers, host<->device staging."""


class TierAccountant:
    """Current and peak bytes per :class:`Tier`, broken down by :class:`StateKind`.

    Units: bytes. Not thread-safe by design: only the training thread updates it.
    Raises ``RuntimeError`` if a release would take a counter below zero (a broken invariant).
    """

    def __init__(self, rank: int = 0):
        self._rank = rank
        self._current: Dict[Tier, Dict[StateKind, int]] = {
            t: collections.defaultdict(int) for t in Tier}
        self._peak_total: Dict[Tier, int] = {t: 0 for t in Tier}
        self._peak_kind: Dict[Tier, Dict[StateKind, int]] = {
            t: collections.defaultdict(int) for t in Tier}
        self._closing = False

    def add(self, tier: Tier, kind: StateKind, nbytes: int) -> None:
        """Record ``nbytes`` (>= 0) newly held on ``tier`` as ``kind``."""
        cur = self._current[tier]
        cur[kind] += int(nbytes)
        self._peak_kind[tier][kind] = max(self._peak_kind[tier][kind], cur[kind])
        self._peak_total[tier] = max(self._peak_total[tier], self.current(tier))

    def sub(self, tier: Tier, kind: StateKind, nbytes: int) -> None:
        """Record ``nbytes`` released from ``tier``; raises RuntimeError below zero, except
        after :meth:`closing` (the counter stops at zero)."""
        cur = self._current[tier]
        if cur[kind] < nbytes:
            if self._closing:
                cur[kind] = 0
                return
            raise RuntimeError(f"[rank {self._rank}] accounting underflow on {tier.value}/{kind.value}: "
                               f"held {cur[kind]} bytes, releasing {nbytes}")
        cur[kind] -= int(nbytes)

    def closing(self) -> None:
        """The engine is releasing everything: from now on a release below zero stops the
        counter at zero instead of raising. An interrupt (Ctrl-C, SIGTERM) can land between
        an allocation or release and its record, and closing must still free every buffer."""
        self._closing = True

    def current(self, tier: Tier) -> int:
        """Bytes held on ``tier`` now."""
        return sum(self._current[tier].values())

    def peak(self, tier: Tier) -> int:
        """Highest total bytes held on ``tier`` since construction."""
        return self._peak_total[tier]

    def report(self) -> Dict[str, dict]:
        """``{tier: {"current_bytes", "peak_bytes", "by_kind": {kind: {"current_bytes", "peak_bytes"}}}}``."""
        out = {}
        for tier in Tier:
            out[tier.value] = {
                "current_bytes": self.current(tier),
                "peak_bytes": self.peak(tier),
                "by_kind": {k.value: {"current_bytes": self._current[tier][k],
                                      "peak_bytes": self._peak_kind[tier][k]} for k in StateKind},
            }
        return out
