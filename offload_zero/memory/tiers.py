"""The tiers of model state off the device, by the modules that hold them:
:mod:`offload_zero.memory.state_stores` (master weights and moments: device, host, NVMe),
:mod:`offload_zero.memory.read_ahead` (the NVMe store's whole-state read-ahead ring) and
:mod:`offload_zero.memory.param_homes` (parameter shards in host memory or NVMe files).
The names are importable from here too.
"""
from offload_zero.memory.param_homes import HostParamHome, NVMeParamHome  # noqa: F401
from offload_zero.memory.state_stores import (DeviceStore, HostStore, NVMeStore,  # noqa: F401
                                              StateTuple)
