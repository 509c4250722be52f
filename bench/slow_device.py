"""``python -m aiopipe.device`` whose compute turns FACTOR times slower from batch BATCH of
the epoch on: the capacity change that bench/ftpipehd_capacity.py emulates in a real
device process. The slowdown is the runtime's own emulation (the device waits on the
clock for ``FACTOR - 1`` times each compute item, aiopipe/runtime/compute.py), switched
at the first round that starts at or after BATCH.

    python -m bench.slow_device --from-batch 200 --factor 10 -- --server URL --device-id 3
"""

from __future__ import annotations

import argparse
from typing import Any

from aiopipe import device
from aiopipe.runtime.device_half import DeviceHalf


def main() -> None:
    """Patch the device's rounds, then run ``python -m aiopipe.device`` with the rest."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-batch", type=int, required=True)
    parser.add_argument("--factor", type=float, required=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER,
                        help="-- then python -m aiopipe.device's arguments")
    args = parser.parse_args()
    honest = DeviceHalf.run_round

    async def slowed(self: Any, message: Any) -> int:
        node = self.node
        declared = node.config.device_slowdown_of(node.device_id)
        node.compute.slowdown = (declared * args.factor
                                 if message.first_iteration >= args.from_batch else declared)
        return await honest(self, message)

    DeviceHalf.run_round = slowed  # type: ignore[method-assign]
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    device.main(rest)


if __name__ == "__main__":
    main()
