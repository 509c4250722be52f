"""Cost tables of the split models measured where this runs, on the CPU or a CUDA GPU:
what the server's passes cost on a GPU, for virtual-time runs that charge the server
from it (issue 27: PiPar's server on a GPU).

For each model: the table at every batch size a PiPar run of ``--batch-size`` with "auto"
plans may use (`aiopipe.runtime.systems.planning_batch_sizes`), forward, backward (the last
unit with the loss) and step per unit, with SGD at the run's learning rate and
momentum; each figure the median of ``--repeats`` timed passes after warm-ups, the GPU
synchronised at every mark (`aiopipe.scheduler.costs.measure_costs`). Written as JSON:
``{model: {"device": ..., "torch": ..., "sizes": [...], "table": CostTable.to_mapping()}}``.

    python bench/gpu_costs.py --device cuda --out costs-cuda.json \\
        [--models resnet18,vgg5,mobilenetv3-small] [--batch-size 100] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from aiopipe.config import RunConfig
from aiopipe.runtime.factories import build_model
from aiopipe.scheduler.costs import measure_costs


def measure(name: str, device: torch.device, batch_size: int, repeats: int
            ) -> dict[str, object]:
    """One model's table on ``device``."""
    from aiopipe.runtime.systems.base import planning_batch_sizes

    config = RunConfig(model=name, batch_size=batch_size, split_point="auto",
                       parallel_batches="auto")
    sizes = planning_batch_sizes(config)
    model = build_model(config, num_classes=10, in_shape=(3, 32, 32)).to(device)
    started = time.perf_counter()
    table = measure_costs(model, (3, 32, 32), sizes, repeats=repeats, warmup=3,
                          learning_rate=config.learning_rate, momentum=config.momentum)
    spent = time.perf_counter() - started
    whole = table.forward_time(0, table.units, batch_size) + table.backward_time(
        0, table.units, batch_size) + table.step_time(0, table.units)
    print(f"{name} on {device}: {len(sizes)} sizes in {spent:.1f} s; a whole pass and step "
          f"at {batch_size}: {1e3 * whole:.2f} ms", flush=True)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or "cpu", "torch": torch.__version__,
            "sizes": sizes, "table": table.to_mapping()}


def main() -> None:
    """Measure and write."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="resnet18,vgg5,mobilenetv3-small")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    tables = {name: measure(name, device, args.batch_size, args.repeats)
              for name in args.models.split(",")}
    args.out.write_text(json.dumps(tables, indent=1))


if __name__ == "__main__":
    main()
