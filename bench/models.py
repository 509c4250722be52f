"""Per-unit cost of the zoo's models: what the split-point planner trades off.

For each model, at a batch of CIFAR-shaped inputs (3×32×32; 10 classes for the small
models, 100 for vgg16 / resnet101 / mobilenetv3-large as in pipar.txt §5.1), one table
row per split unit:

- fwd / bwd: median milliseconds of the unit's forward and backward pass for the batch;
  a unit's backward includes the gradient with respect to its input (every unit but the
  first must send that gradient on), the first unit's does not;
- out: the unit's output shape, bytes per sample and per batch (float32), which is what
  travels uplink if the model is split after this unit;
- state: the unit's parameter and buffer bytes (what travels at aggregation);
- dev f+b: cumulative forward+backward of units 1..P, the device's compute at split P.

Then a full training step (forward, cross-entropy, backward, SGD step) of the whole model,
measured on its own, beside the sum of the per-unit figures. One torch thread; every
figure is the median of ``--repeat`` runs after one warm-up.

    .venv/bin/python bench/models.py [--models vgg5 resnet18 ...] [--batch 100] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from aiopipe.models import MODEL_NAMES, build
from aiopipe.models.mobilenet import InvertedResidual
from aiopipe.models.resnet import BasicBlock, Bottleneck

IN_SHAPE = (3, 32, 32)
CLASSES = {"vgg16": 100, "resnet101": 100, "mobilenetv3-large": 100}
ORDER = ("vgg5", "resnet18", "mobilenetv3-small", "vgg16", "resnet101", "mobilenetv3-large")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(ORDER),
        help="model names, space- or comma-separated (default: all six)",
    )
    parser.add_argument("--batch", type=int, default=100, help="batch size (default 100)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per figure (default 5)")
    args = parser.parse_args(argv)
    names = [n for item in args.models for n in item.split(",") if n]
    unknown = [n for n in names if n not in MODEL_NAMES]
    if unknown or args.batch < 1 or args.repeat < 1:
        parser.error(
            f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODEL_NAMES)}"
            if unknown
            else "--batch and --repeat must be >= 1"
        )
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread, batch {args.batch}, "
        f"input {'×'.join(map(str, IN_SHAPE))}, median of {args.repeat} runs\n"
    )
    for name in names:
        bench_model(name, args.batch, args.repeat)
    return 0


def bench_model(name: str, batch: int, repeat: int) -> None:
    torch.manual_seed(0)
    classes = CLASSES.get(name, 10)
    model = build(name, num_classes=classes, in_shape=IN_SHAPE).train()
    x = torch.randn(batch, *IN_SHAPE)
    y = torch.randint(0, classes, (batch,))
    params = sum(p.numel() for p in model.parameters())
    print(f"== {name}: {len(model)} units, {params / 1e6:.2f} M parameters, {classes} classes")
    header = (
        f"{'unit':>4}  {'layers':<24} {'out shape':<14} {'fwd ms':>8} {'bwd ms':>8} "
        f"{'out KB/sample':>13} {'out MB/batch':>12} {'state MB':>9} {'dev f+b ms':>10}"
    )
    print(header)
    print("-" * len(header))
    total_f = total_b = 0.0
    for index, unit in enumerate(model, start=1):
        fwd, bwd, out = _time_unit(unit, x, first=index == 1, repeat=repeat)
        total_f, total_b = total_f + fwd, total_b + bwd
        per_sample = out[0].numel() * out.element_size()
        unit_bytes = sum(t.numel() * t.element_size() for t in unit.state_dict().values())
        shape = "×".join(map(str, out.shape[1:]))
        print(
            f"{index:>4}  {_describe(unit):<24} {shape:<14} {fwd * 1e3:>8.2f} {bwd * 1e3:>8.2f} "
            f"{per_sample / 1e3:>13.2f} {per_sample * batch / 1e6:>12.3f} "
            f"{unit_bytes / 1e6:>9.2f} {(total_f + total_b) * 1e3:>10.1f}"
        )
        x = out
    step = _time_step(model, torch.randn(batch, *IN_SHAPE), y, repeat)
    units = total_f + total_b
    print(
        f"sum of units: fwd {total_f * 1e3:.1f} ms + bwd {total_b * 1e3:.1f} ms = "
        f"{units * 1e3:.1f} ms; full training step (fwd+loss+bwd+SGD) {step * 1e3:.1f} ms "
        f"(step / sum of units = {step / units:.2f}); {batch / step:.0f} samples/s\n"
    )


def _time_unit(
    unit: nn.Module, x: Tensor, *, first: bool, repeat: int
) -> tuple[float, float, Tensor]:
    inp = x.detach().requires_grad_(not first)
    fwd: list[float] = []
    bwd: list[float] = []
    out = unit(inp)
    grad = torch.randn_like(out)
    for run in range(repeat + 1):  # run 0 warms up
        unit.zero_grad(set_to_none=True)
        inp.grad = None
        start = time.perf_counter()
        out = unit(inp)
        middle = time.perf_counter()
        torch.autograd.backward(out, grad)
        end = time.perf_counter()
        if run:
            fwd.append(middle - start)
            bwd.append(end - middle)
    return statistics.median(fwd), statistics.median(bwd), out.detach()


def _time_step(model: nn.Module, x: Tensor, y: Tensor, repeat: int) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()

    return _median_time(step, repeat)


def _median_time(fn: Callable[[], None], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


_SHORT = {
    "Conv2d": "conv",
    "BatchNorm2d": "bn",
    "ReLU": "relu",
    "Hardswish": "hswish",
    "MaxPool2d": "pool",
    "AdaptiveAvgPool2d": "gap",
    "Flatten": "flat",
    "Linear": "fc",
}


def _describe(unit: nn.Module) -> str:
    if isinstance(unit, BasicBlock):
        return f"basic block {unit.conv1.out_channels}"
    if isinstance(unit, Bottleneck):
        return f"bottleneck {unit.conv3.out_channels}"
    if isinstance(unit, InvertedResidual):
        return "bneck" + (" +skip" if unit.residual else "")
    layers = list(unit) if isinstance(unit, nn.Sequential) else [unit]
    parts = []
    for layer in layers:
        part = _SHORT.get(type(layer).__name__, type(layer).__name__)
        if isinstance(layer, nn.Conv2d):
            kernel = layer.kernel_size[0]
            part = f"conv{kernel}-{layer.out_channels}"
        elif isinstance(layer, nn.Linear):
            part = f"fc-{layer.out_features}"
        parts.append(part)
    return "+".join(parts)


if __name__ == "__main__":
    sys.exit(main())
