"""Label inference (issue 45 item 6): what an honest-but-curious server learns of the
devices' labels in PiPar and in U-shaped split learning, with and without gradient noise.

Each system trains in a simulation (memory links, virtual time) while the bench records
what the coordinator receives from the devices and what it sends them
(`capture_traffic`: the coordinator's session is wrapped, its behaviour unchanged), and
the labels the devices' stages sent up (the truth, taken where the device sends, before
U-shaped zeroes them). Then the server's attacks (`aiopipe.attacks.label_inference`):

- **labels read**: the labels in the activations the server received, against the truth
  (PiPar sends them; U-shaped sends zeros);
- **direction**: Li et al.'s cosine attack for C classes; the attacker is given the
  label of ``--known`` samples of each class per epoch (drawn at random with the seed)
  and guesses every other sample of that epoch;
- **cluster**: spherical k-means over the gradients' directions, started at the known
  samples (Liu and Lyu 2022's clustering attack, named by the known samples);
- **norm AUC**, **cosine AUC**: Li et al.'s two attacks as they score them, on the
  binary task only (class 0 of ``--dataset`` against the rest, 1:9, the devices' own
  data: [Note: the norm attack is binary]); the cosine score is the cosine with the
  known positive.

Tasks (``--tasks``): ``classes``, the dataset's ten classes (model accuracy: the run's
test set); ``binary``, the task above (model accuracy: the devices' held-out data,
where predicting "negative" everywhere scores 0.9). A run whose training fails (noise
large enough that the device's head diverges and the coordinator's judge refuses its
activations) is reported as failed, its attacks on what the server saw before; one
that finishes without some devices says so beside its accuracy.

The gradient attacked: in PiPar, the one the server sends each device (with respect to
the device's activation: computed by the server, which has the labels anyway); in
U-shaped, the one the device's tail sends the server (with respect to the middle's
output: the server's only window on the labels), and, in a second row, the one the
server sends down to the device's head. U-shaped runs use the example's parallel
schedule (every device at once, a middle replica each, FedAvg: pipar's concurrency);
``--turns`` adds one in turns (as split learning), ``--tails`` runs whose device keeps
more units after the server's (the tail's gradient then crosses a deeper cut). Chance:
the share of the most common class (accuracy), 0.5 (AUC).

    PYTHONPATH=. .venv/bin/python bench/label_inference.py [--epochs 3] [--devices 2]
        [--samples 512] [--noise 0.3,1,3] [--tails 2] [--no-turns] [--known 1]
        [--tasks classes,binary]
        [--seeds 1,2,3] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy
import torch

from aiopipe import RunConfig, TrainingError, VirtualClock, simulate
from aiopipe.attacks import (
    accuracy,
    auc,
    cluster_attack,
    cosine_scores,
    direction_attack,
    known_examples,
    norm_scores,
    rows,
)
from aiopipe.data import open_dataset
from aiopipe.protocol import Activation, Gradient, to_torch
from aiopipe.runtime import device_route, session, stage_round

REPO = Path(__file__).resolve().parents[1]
#: test samples per device (binary task: held out per device) or of the run
TEST = 500
#: (device, epoch, iteration, micro-batch)
Key = tuple[str, int, int, int]


@dataclasses.dataclass
class Traffic:
    """What one run's coordinator received and sent, by micro-batch, and the truth."""

    #: the labels in the activations the coordinator received
    labels_received: dict[Key, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: the gradients the coordinator received (U-shaped: from the device's tail)
    gradients_received: dict[Key, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: the gradients the coordinator sent (to the device's first stage)
    gradients_sent: dict[Key, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: the true labels, as the devices' first stages sent them
    truth: dict[Key, torch.Tensor] = dataclasses.field(default_factory=dict)


def _key(device: str, message: Activation | Gradient) -> Key:
    return (device, message.epoch, message.iteration, message.micro_batch)


@contextlib.contextmanager
def capture_traffic(ushaped_route: Any = None) -> Iterator[Traffic]:
    """Record a simulation's data path while it runs in this context: the coordinator's
    side (`DeviceSession`'s acceptance of activations and gradients, its route's sends
    to the device), and the devices' side of the first stage's sends (PiPar's route to
    the server; ``ushaped_route``, the U-shaped example's `_ToCoordinator`, before it
    zeroes the labels). Every wrapped method is called as it was; restored on exit."""
    traffic = Traffic()
    patches: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, record: Any) -> None:
        original = getattr(owner, name)

        def wrapped(self: Any, message: Any, *args: Any, **kwargs: Any) -> Any:
            record(self, message)
            return original(self, message, *args, **kwargs)

        patches.append((owner, name, original))
        setattr(owner, name, wrapped)

    def activation_in(self: Any, message: Activation) -> None:
        traffic.labels_received[_key(self.name, message)] = to_torch(message.labels).clone()

    def gradient_in(self: Any, message: Gradient) -> None:
        traffic.gradients_received[_key(self.name, message)] = rows(
            [to_torch(t) for t in message.tensors])

    def sent(self: Any, message: Activation | Gradient) -> None:
        if isinstance(message, Gradient):
            traffic.gradients_sent[_key(self.node, message)] = rows(
                [to_torch(t) for t in message.tensors])

    def truth(self: Any, message: Activation | Gradient) -> None:
        if isinstance(message, Activation):
            node = self.half.node if hasattr(self, "half") else self.owner
            traffic.truth[_key(node.name, message)] = to_torch(message.labels).clone()

    wrap(session.DeviceSession, "_accept_activation", activation_in)
    wrap(session.DeviceSession, "_accept_gradient", gradient_in)
    wrap(device_route.DeviceRoute, "send", sent)
    wrap(stage_round._ServerRoute, "send", truth)
    if ushaped_route is not None:
        wrap(ushaped_route, "send", truth)
    try:
        yield traffic
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


def attack(gradients: dict[Key, torch.Tensor], truth: dict[Key, torch.Tensor],
           known: int, seed: int, binary: bool) -> dict[str, float]:
    """The attacks on ``gradients`` (by micro-batch) against ``truth``: per epoch, the
    attacker given ``known`` labels per class of that epoch; means over epochs."""
    by_epoch: dict[int, list[Key]] = defaultdict(list)
    for key in sorted(gradients):
        by_epoch[key[1]].append(key)
    generator = torch.Generator().manual_seed(seed)
    scores: dict[str, list[float]] = defaultdict(list)
    for keys in by_epoch.values():
        matrix = torch.cat([gradients[k] for k in keys])
        labels = torch.cat([truth[k] for k in keys])
        given = known_examples(labels, known, generator)
        scores["direction"].append(accuracy(direction_attack(matrix, given), labels, given))
        scores["cluster"].append(accuracy(cluster_attack(matrix, given), labels, given))
        if binary:  # Li et al.'s scores, over the samples the attacker was not given
            keep = torch.ones(len(labels), dtype=torch.bool)
            keep[torch.cat(list(given.values()))] = False
            positive = labels[keep] == 1
            scores["norm_auc"].append(auc(norm_scores(matrix)[keep], positive))
            scores["cosine_auc"].append(auc(cosine_scores(matrix, given[1])[keep], positive))
    return {name: sum(v) / len(v) for name, v in scores.items()}


def labels_read(traffic: Traffic) -> float:
    """The share of the true labels found in the activations the server received."""
    right = total = 0
    for key, labels in traffic.truth.items():
        got = traffic.labels_received.get(key)
        total += len(labels)
        right += 0 if got is None else int((got == labels).sum())
    return right / total if total else float("nan")


class Binary:
    """Samples [first, first + count) of ``base`` (an `aiopipe.data.Dataset`), class 0 as
    1 (positive) and every other class as 0: Li et al.'s binary task with rare
    positives (1:9 for a 10-class set)."""

    def __init__(self, base: Any, first: int, count: int) -> None:
        self.base, self.first, self.count = base, first, count

    @property
    def name(self) -> str:
        return f"{self.base.name}-binary"

    @property
    def num_classes(self) -> int:
        return 2

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.base.in_shape)

    def __len__(self) -> int:
        return self.count

    def labels(self) -> numpy.ndarray:
        labels = self.base.labels()[self.first:self.first + self.count]
        return (labels == 0).astype(numpy.int64)

    def batch(self, indices: Sequence[int]) -> tuple[Any, torch.Tensor]:
        x, y = self.base.batch(numpy.asarray(indices, dtype=numpy.int64) + self.first)
        return x, (y == 0).to(torch.int64)


async def one_run(config: RunConfig, route: Any, binary: bool
                  ) -> tuple[Traffic, float, str]:
    """One simulation, recorded; its traffic, final accuracy (on the run's test set, or,
    ``binary``, on the devices' held-out binary data: the coordinator's test set has ten
    classes) and what went wrong: for a run that failed, why (its accuracy NaN, its
    traffic what came before); for one that lost devices on the way, which ("": none)."""
    own: dict[str, Any] = {}
    if binary:
        count, devices = int(config.samples_per_device), config.devices  # type: ignore[call-overload]
        train = open_dataset(config.dataset, size=count * devices, seed=config.seed)
        test = open_dataset(config.dataset, split="test", size=TEST * devices,
                            seed=config.seed)
        own = {"datasets": [Binary(train, k * count, count) for k in range(devices)],
               "held_out": [Binary(test, k * TEST, TEST) for k in range(devices)]}
    with capture_traffic(route) as traffic:
        try:
            result = await simulate(config, clock=VirtualClock(), **own)
        except TrainingError as error:
            return traffic, math.nan, str(error)
    last = result.epochs[-1]
    lost = sorted({k for epoch in result.epochs for k in epoch.devices_lost})
    return (traffic, last.held_out_accuracy if binary else last.accuracy,
            f"finished without devices {lost} (lost or excluded)" if lost else "")


def _cell(values: Sequence[float]) -> str:
    """A mean, and over several seeds its range."""
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.3f}"
    return f"{mean:.3f} ({min(values):.2f}-{max(values):.2f})"


def _table(title: str, rows_out: Sequence[dict[str, Any]]) -> str:
    """One line per (task, system, gradient): means over the seeds (and their range);
    the model's accuracy over the seeds whose run did not fail."""
    lines = [title, "", "| task | system | gradient attacked | labels read | direction acc | "
             "cluster acc | norm AUC | cosine AUC | model acc | chance acc |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows_out:
        groups.setdefault((row["task"], row["system"], row["gradient"]), []).append(row)
    failures: list[str] = []
    for (task, system, gradient), rows_of in groups.items():
        cells = [_cell([r[k] for r in rows_of if k in r]) for k in (
            "labels_read", "direction", "cluster", "norm_auc", "cosine_auc")]
        finished = [r for r in rows_of if not math.isnan(r["model_accuracy"])]
        model = _cell([r["model_accuracy"] for r in finished])
        for r in rows_of:
            if r["failed"]:
                failure = f"{task}, {system}, seed {r['seed']}: {r['failed']}"
                if failure not in failures:
                    failures.append(failure)
        failed = len(rows_of) - len(finished)
        if failed:
            model += f", failed {failed}/{len(rows_of)}"
        if any(r["failed"] for r in finished):
            model += " (devices lost)"
        lines.append(f"| {task} | {system} | {gradient} | {' | '.join(cells)} | {model} | "
                     f"{_cell([r['chance'] for r in rows_of])} |")
    lines += ["", "Runs that failed or lost devices:", *failures] if failures else []
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Run every system on every task, attack what its server saw, print (and write)
    the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--dataset", default="synthetic-cifar10")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--noise", default="0.3,1,3")
    parser.add_argument("--tails", default="2")
    parser.add_argument("--turns", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--known", type=int, default=1)
    parser.add_argument("--tasks", default="classes,binary")
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "examples"))
    import ushaped  # (the example: examples/ushaped.py)

    base = RunConfig(model=args.model, dataset=args.dataset, devices=args.devices,
                     samples_per_device=args.samples, batch_size=args.batch,
                     epochs=args.epochs, split_point=2, parallel_batches=args.parallel,
                     test_samples=TEST, network="wifi")
    def ushaped_run(**options: object) -> RunConfig:
        return base.replace(mode="ushaped:UShaped", options={"schedule": "parallel", **options})

    systems: list[tuple[str, RunConfig]] = [("pipar", base.replace(mode="pipar")),
                                            ("u-shaped", ushaped_run())]
    if args.turns:
        systems.append(("u-shaped, turns", ushaped_run(schedule="turns")))
    for tail in [int(t) for t in args.tails.split(",") if t]:
        systems.append((f"u-shaped, tail {tail}", ushaped_run(tail_units=tail)))
    for sigma in [float(s) for s in args.noise.split(",") if s]:
        systems.append((f"u-shaped, noise {sigma:g}", ushaped_run(gradient_noise=sigma)))
    rows_out = []
    for seed, task, (name, config) in itertools.product(
            [int(s) for s in args.seeds.split(",")], args.tasks.split(","), systems):
        binary = task == "binary"
        began = time.monotonic()
        traffic, model_accuracy, failed = asyncio.run(
            one_run(config.replace(seed=seed), ushaped._ToCoordinator, binary))
        all_labels = torch.cat(list(traffic.truth.values()))
        chance = float(torch.bincount(all_labels).max()) / len(all_labels)
        targets = [("sent", traffic.gradients_sent)]
        if traffic.gradients_received:
            targets.insert(0, ("received", traffic.gradients_received))
        for which, gradients in targets:
            row = {"seed": seed, "task": task, "system": name, "gradient": which,
                   "labels_read": labels_read(traffic),
                   **attack(gradients, traffic.truth, args.known, seed, binary),
                   "model_accuracy": model_accuracy, "failed": failed, "chance": chance,
                   "samples": len(all_labels), "wall_s": time.monotonic() - began}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    title = (f"{args.model}, {args.dataset}, {args.devices} devices x {args.samples} "
             f"samples, B = {args.batch}, N = {args.parallel}, {args.epochs} epochs, split "
             f"point 2 (U-shaped: the device keeps the last unit, or the last --tails), "
             f"{args.known} known "
             f"label(s) per class per epoch, seeds {args.seeds}")
    text = _table(title, rows_out)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows_out, indent=1) + "\n")
        (args.out / "table.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
