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
- **norm AUC**: Li et al.'s norm attack, on the binary task only (``--binary``: class
  0 against the rest, 1:9; [Note: the norm attack is binary]).

The gradient attacked: in PiPar, the one the server sends each device (with respect to
the device's activation: computed by the server, which has the labels anyway); in
U-shaped, the one the device's tail sends the server (with respect to the middle's
output: the server's only window on the labels), and, in a second row, the one the
server sends down to the device's head. Chance: the share of the most common class
(accuracy), 0.5 (AUC).

    PYTHONPATH=. .venv/bin/python bench/label_inference.py [--epochs 3] [--devices 2]
        [--samples 320] [--noise 1,10,100] [--known 1] [--binary] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.attacks import (
    accuracy,
    auc,
    cluster_attack,
    direction_attack,
    known_examples,
    norm_scores,
    rows,
)
from aiopipe.protocol import Activation, Gradient, to_torch
from aiopipe.runtime import session, stage_round

REPO = Path(__file__).resolve().parents[1]
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
    wrap(session._DeviceRoute, "send", sent)
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
        if binary:
            scores["norm_auc"].append(auc(norm_scores(matrix), labels == 1))
    return {name: sum(v) / len(v) for name, v in scores.items()}


def labels_read(traffic: Traffic) -> float:
    """The share of the true labels found in the activations the server received."""
    right = total = 0
    for key, labels in traffic.truth.items():
        got = traffic.labels_received.get(key)
        total += len(labels)
        right += 0 if got is None else int((got == labels).sum())
    return right / total if total else float("nan")


async def one_run(config: RunConfig, route: Any) -> tuple[Traffic, float]:
    """One simulation, recorded; its traffic and final test accuracy."""
    with capture_traffic(route) as traffic:
        result = await simulate(config, clock=VirtualClock())
    return traffic, result.epochs[-1].accuracy


def main(argv: Sequence[str] | None = None) -> None:
    """Run every system, attack what its server saw, print (and write) the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="vgg5")
    parser.add_argument("--dataset", default="synthetic-cifar10")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--samples", type=int, default=320)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--noise", default="1,10,100")
    parser.add_argument("--known", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "examples"))
    import ushaped  # (the example: examples/ushaped.py)

    base = RunConfig(model=args.model, dataset=args.dataset, devices=args.devices,
                     samples_per_device=args.samples, batch_size=args.batch,
                     epochs=args.epochs, split_point=2, parallel_batches=args.parallel,
                     test_samples=500, seed=args.seed, network="wifi")
    systems: list[tuple[str, RunConfig]] = [("pipar", base.replace(mode="pipar"))]
    systems.append(("u-shaped", base.replace(mode="ushaped:UShaped")))
    for sigma in [float(s) for s in args.noise.split(",") if s]:
        systems.append((f"u-shaped, noise {sigma:g}", base.replace(
            mode="ushaped:UShaped", options={"gradient_noise": sigma})))
    rows_out = []
    for name, config in systems:
        began = time.monotonic()
        traffic, test_accuracy = asyncio.run(one_run(config, ushaped._ToCoordinator))
        all_labels = torch.cat(list(traffic.truth.values()))
        chance = float(torch.bincount(all_labels).max()) / len(all_labels)
        targets = [("sent", traffic.gradients_sent)]
        if traffic.gradients_received:
            targets.insert(0, ("received", traffic.gradients_received))
        for which, gradients in targets:
            row = {"system": name, "gradient": which, "labels_read": labels_read(traffic),
                   **attack(gradients, traffic.truth, args.known, args.seed, binary=False),
                   "test_accuracy": test_accuracy, "chance": chance,
                   "samples": len(all_labels), "wall_s": time.monotonic() - began}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    title = (f"{args.model}, {args.dataset}, {args.devices} devices x {args.samples} "
             f"samples, B = {args.batch}, N = {args.parallel}, {args.epochs} epochs, split "
             f"point 2 (U-shaped: tail = last unit), {args.known} known label(s) per class "
             f"per epoch, seed {args.seed}")
    lines = [title, "", "| system | gradient attacked | labels read | direction acc | "
             "cluster acc | test acc | chance |", "|---|---|---|---|---|---|---|"]
    for row in rows_out:
        lines.append(f"| {row['system']} | {row['gradient']} | {row['labels_read']:.3f} | "
                     f"{row['direction']:.3f} | {row['cluster']:.3f} | "
                     f"{row['test_accuracy']:.3f} | {row['chance']:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows_out, indent=1) + "\n")
        (args.out / "table.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
