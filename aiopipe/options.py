"""The options of each built-in system, as the dataclasses a run's `RunConfig.options`
holds: ``RunConfig(mode="hadfl", options=HADFLOptions(ring_size=2))`` (or the mapping
``options={"ring_size": 2}``; a config file's ``[hadfl]`` table), read back as
``config.options.ring_size``. Each class's docstring says what its options mean; a
system's own package declares and checks them (aiopipe.runtime.systems.<name>.options).
"""

from __future__ import annotations

from aiopipe.runtime.systems.asteroid.options import AsteroidOptions
from aiopipe.runtime.systems.fedbuff.options import FedBuffOptions
from aiopipe.runtime.systems.ftpipehd.options import FTPipeHDOptions
from aiopipe.runtime.systems.hadfl.options import HADFLOptions
from aiopipe.runtime.systems.pipeline.options import PipelineOptions
from aiopipe.runtime.systems.star.options import ReplicaOptions, StarOptions

__all__ = ["AsteroidOptions", "FTPipeHDOptions", "FedBuffOptions", "HADFLOptions",
           "PipelineOptions", "ReplicaOptions", "StarOptions"]
