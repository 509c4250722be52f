"""Bytes a round moves with a frozen base, or with low-rank adapters, against full
fine-tuning, side by side (issue 44, item 4; [Note: frozen bases] in
aiopipe/runtime/systems/star/coordinator.py; aiopipe/models/adapters.py).

Two comparisons, each of two runs that differ only in what trains: three devices of
unequal shares, synthetic-cifar10, virtual time, the same seed and config otherwise.

- *frozen*: a four-unit model (3072 -> 32 -> 32 -> 32 -> 10), its first two units
  frozen (98.6% of its parameters) or not; per mode the last epoch's bytes up and down
  of both runs and their ratio, and whether the frozen units came back bit for bit.
- *lora*: a four-unit MLP (3072 -> 512 -> 512 -> 256 -> 10) fully fine-tuned, or with
  rank-4 adapters on every Linear layer and everything else frozen (`add_lora`); both
  start from the same weights. Per mode: a round's bytes up and down (the last
  epoch's, which is one round: a round is an epoch without ``aggregation_every``), the
  SGD momentum held for the trainable tensors (read from a stepped optimizer's state,
  one model copy), trainable and total parameters, and each epoch's training loss of
  both.

Deterministic: bytes on the wire and tensors, not seconds.

    .venv/bin/python bench/frozen_bases.py [--compare frozen lora] [--modes fl sl sfl pipar]
"""

from __future__ import annotations

import argparse
import asyncio

import torch
from torch import nn

from aiopipe import CostTable, RunConfig, RunResult, VirtualClock, simulate
from aiopipe.models import add_lora
from aiopipe.runtime.factories import make_loss, make_optimizer
from aiopipe.runtime.plan import build_model, train_dataset

COSTS = CostTable.uniform(4, forward=0.001, backward=0.002)


def frozen_base(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """Four units; the first two frozen."""
    features = 1
    for side in in_shape:
        features *= side
    model = nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(features, 32), nn.ReLU()),
                          nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
                          nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
                          nn.Linear(32, num_classes))
    for unit in list(model)[:2]:
        unit.requires_grad_(False)
    return model


def everything_trained(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """The same model with nothing frozen."""
    return frozen_base(num_classes, in_shape).requires_grad_(True)


def wide_mlp(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """Four units of Linear layers wide enough that adapters matter; all trained."""
    features = 1
    for side in in_shape:
        features *= side
    return nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(features, 512), nn.ReLU()),
                         nn.Sequential(nn.Linear(512, 512), nn.ReLU()),
                         nn.Sequential(nn.Linear(512, 256), nn.ReLU()),
                         nn.Linear(256, num_classes))


def wide_mlp_lora(num_classes: int, in_shape: tuple[int, ...]) -> nn.Sequential:
    """`wide_mlp` with rank-4 adapters on every Linear layer, everything else frozen.
    Built under the same seed, its base draws the same weights as `wide_mlp`'s."""
    return add_lora(wide_mlp(num_classes, in_shape), rank=4)


def _config(mode: str, model: object) -> RunConfig:
    return RunConfig(mode=mode, model=model, devices=3,  # type: ignore[arg-type]
                     samples_per_device=(40, 30, 70), batch_size=10, epochs=2,
                     split_point=2, parallel_batches=2, learning_rate=0.05, momentum=0.9,
                     test_samples=20, seed=4)


async def compare(mode: str) -> str:
    config = _config(mode, frozen_base)
    frozen = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    full = await simulate(config.replace(model=everything_trained), clock=VirtualClock(),
                          cost_table=COSTS)
    dataset = train_dataset(config)
    initial = build_model(config, num_classes=dataset.num_classes,
                          in_shape=dataset.in_shape).state_dict()
    kept = all(torch.equal(frozen.model.state_dict()[k], v) for k, v in initial.items()
               if k.startswith(("0.", "1.")))
    a, b = frozen.epochs[-1], full.epochs[-1]
    return (f"| {mode} | {a.bytes_up} | {b.bytes_up} | {a.bytes_up / b.bytes_up:.3f} | "
            f"{a.bytes_down} | {b.bytes_down} | {a.bytes_down / b.bytes_down:.3f} | "
            f"{'yes' if kept else 'NO'} |")


def optimizer_state_bytes(config: RunConfig) -> int:
    """Bytes of the optimizer's state after one step of the run's optimizer on one batch
    of the run's data, over one whole copy of the run's initial model: what a model copy
    holds besides its weights (SGD with momentum: a buffer per tensor that had a
    gradient)."""
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    optimizer = make_optimizer(model, config)
    x, y = dataset.batch(range(config.batch_size))
    make_loss(config)(model(x), y).backward()
    optimizer.step()
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))


def _parameter_counts(config: RunConfig) -> tuple[int, int]:
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    return (sum(p.numel() for p in model.parameters() if p.requires_grad),
            sum(p.numel() for p in model.parameters()))


def _per_round(result: RunResult) -> tuple[int, int]:
    """The last epoch's bytes up and down: one round (no ``aggregation_every`` here)."""
    last = result.epochs[-1]
    return last.bytes_up, last.bytes_down


async def compare_lora(mode: str) -> str:
    config = _config(mode, wide_mlp)
    adapted = config.replace(model=wide_mlp_lora)
    full = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    lora = await simulate(adapted, clock=VirtualClock(), cost_table=COSTS)
    (full_up, full_down), (lora_up, lora_down) = _per_round(full), _per_round(lora)
    trainable, total = _parameter_counts(adapted)
    return (f"| {mode} | {full_up} | {lora_up} | {lora_up / full_up:.4f} | "
            f"{full_down} | {lora_down} | {lora_down / full_down:.4f} | "
            f"{optimizer_state_bytes(config)} | {optimizer_state_bytes(adapted)} | "
            f"{_parameter_counts(config)[0]} / {trainable} / {total} | "
            f"{_losses(full)} | {_losses(lora)} |")


def _losses(result: RunResult) -> str:
    return " -> ".join(f"{epoch.loss:.4f}" for epoch in result.epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", nargs="*", choices=["frozen", "lora"],
                        default=["frozen", "lora"])
    parser.add_argument("--modes", nargs="*", default=["fl", "sl", "sfl", "pipar"])
    args = parser.parse_args()
    if "frozen" in args.compare:
        print("| mode | up B, frozen base | up B, all trained | ratio | down B, frozen | "
              "down B, all | ratio | frozen units bit for bit |")
        print("|---|---|---|---|---|---|---|---|")
        for mode in args.modes:
            print(asyncio.run(compare(mode)))
    if "lora" in args.compare:
        print("\n| mode | up B/round, full | up B/round, LoRA | ratio | down B/round, full "
              "| down B/round, LoRA | ratio | optimizer state B, full | "
              "optimizer state B, LoRA | trainable full / trainable LoRA / total params "
              "| loss by epoch, full | loss by epoch, LoRA |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for mode in args.modes:
            print(asyncio.run(compare_lora(mode)))


if __name__ == "__main__":
    main()
