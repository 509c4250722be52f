"""Training systems on the one runtime, and the registry that names them.

A system is a pair: a coordinator half (`System`: placement, what each device is sent
per round, which stage the coordinator runs itself, how a round's results become the
global model, what it checkpoints) and a device half (`DeviceHalf`,
aiopipe.runtime.device_half: what a device does in a round beyond the shell every
system shares). The coordinator half's class declares the pair and what the runtime
must know of the system before it is set up (`System`'s class attributes:
``device_half``, ``links_devices``, ``recovers_lost_devices``).

Each built-in system lives in its own package, with the modules only it uses:
`star` (fl, sl, sfl and PiPar), `pipeline` (a synchronous multi-device pipeline),
`ftpipehd`, `asteroid` and `hadfl`. A run's ``mode`` names one of them, or a system
written outside the package as ``"module:attribute"`` (the convention ``model``,
``loss`` and ``optimizer`` use): `base.system_class` finds it, through the
registry (`registry.find_system`). This package's own module imports nothing, so that
importing one system's module loads no other. The coordinator
(aiopipe.runtime.coordinator) and the device shell (aiopipe.runtime.device_node) do the
rest the same way for every system.
"""
