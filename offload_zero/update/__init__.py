"""When and how a flat parameter's update runs.

- :mod:`offload_zero.update.rules`: the ``update_timing`` setting, its ``"auto"`` choice and
  what each timing works with (stage, clipping, accumulation, fp16), written once.
- :mod:`offload_zero.update.state`: each flat parameter's update state, one owner, with its
  legal transitions ([Note: update states]).
- :mod:`offload_zero.update.adam`: Adam/AdamW on one shard, chunk by chunk.
- :mod:`offload_zero.update.timings`: the three timings at work (plain step, in backward, in
  the next forward), given the stores, scheduler and communicator they act on.
"""
