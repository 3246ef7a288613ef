"""Units, flat parameters, gradient shards and the gather/free schedule (ZeRO stages 1-3)."""
from offload_zero.partition.flat_param import FlatParam, ShardedState  # noqa: F401
from offload_zero.partition.grads import GradientShards  # noqa: F401
from offload_zero.partition.schedule import UnitScheduler  # noqa: F401
from offload_zero.partition.units import Unit, UnitState, find_unit_modules, group_parameters  # noqa: F401
