"""Resumable training checkpoints: every rank saves and loads its own shard of the training state.

:func:`save_checkpoint` and :func:`load_checkpoint` are the engine's
:meth:`~offload_zero.engine.OffloadEngine.save_checkpoint` and
:meth:`~offload_zero.engine.OffloadEngine.load_checkpoint`. Both are collective (every rank of
the data-parallel group calls them with the same folder) and run between steps.

Modules: :mod:`~offload_zero.checkpoint.layout` (the folder's and files' format, [Note:
checkpoint layout]), :mod:`~offload_zero.checkpoint.folder` (locks, checks and the atomic swap,
[Note: atomic save]), :mod:`~offload_zero.checkpoint.agree` (ranks agree on success),
:mod:`~offload_zero.checkpoint.save`, :mod:`~offload_zero.checkpoint.validate` (the checks
before a load changes anything) and :mod:`~offload_zero.checkpoint.load` (resharding).

What they take from the engine: its public attributes (``flat_params``, ``store``,
``param_home``, ``scheduler``, ``comm``, ``optimizer``, ``module``, ``config``,
``skipped_steps``, ``loss_scaler``) and the block of
:meth:`~offload_zero.engine.OffloadEngine.settle_between_steps`,
:attr:`~offload_zero.engine.OffloadEngine.step_counts` and
:attr:`~offload_zero.engine.OffloadEngine.entry_groups`; no private attribute.
"""
from offload_zero.checkpoint.folder import check_creatable, check_destination  # noqa: F401
from offload_zero.checkpoint.layout import (FORMAT_NAME, FORMAT_VERSION, META_NAME,  # noqa: F401
                                            rank_file_name, read_metadata)
from offload_zero.checkpoint.load import load_checkpoint  # noqa: F401
from offload_zero.checkpoint.save import save_checkpoint  # noqa: F401

__all__ = ["save_checkpoint", "load_checkpoint", "read_metadata", "check_destination",
           "check_creatable", "rank_file_name", "META_NAME", "FORMAT_NAME", "FORMAT_VERSION"]
