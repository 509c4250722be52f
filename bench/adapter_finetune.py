"""Low-rank adapters against full fine-tuning of a pretrained gpt-tiny, on text it has not
seen: bytes per round, optimizer state, parameters, and the loss of both after the same
steps (issue 44: "Adapter fine-tuning: bytes per round and optimizer memory against full
fine-tuning, with the loss of both after the same steps").

`bench/frozen_bases.py` compares LoRA with full fine-tuning on a randomly initialised
MLP, whose losses say nothing of LoRA's quality. Here the base is a language model:

1. *Pretrain* gpt-tiny (`aiopipe.models.gpt.build_gpt_tiny`) in plain PyTorch with Adam
   on ``stdlib-text`` (Python source), seeded, for ``--pretrain-steps`` steps.
2. *A new task*: `ByteWindows`, 64-byte windows of the English documentation in
   ``pydoc_data/topics.py`` (the text ``help()`` shows: the language reference's prose),
   which every CPython install carries and ``stdlib-text`` never reads (it stops long
   before ``pydoc_data/``: checked at start). Same bytes, another language: prose, not
   code. Split as ``stdlib-text`` is (pages of 16 windows, 18/1/1 to train/val/test).
3. *Fine-tune with aiopipe* in virtual time (`simulate`, `VirtualClock`, a uniform
   `CostTable` of the 7 units), two devices, per mode, from the pretrained weights
   (``initial_weights="given"``), twice with the same config and steps: *full* (every
   parameter trains) and *LoRA* (`add_lora` on every block's ``qkv``, ``proj``, ``fc``
   and ``out``, everything else frozen, applied before the module goes into the
   `RunConfig`). Each is run at each of its learning rates (``--lrs-full``,
   ``--lrs-lora``; SGD with momentum 0.9, the runtime's optimizer) and the one with the
   lowest loss on the new task's *val* windows is reported, its loss on the *test*
   windows beside the base's.

Per mode and method: the last round's bytes up, down and between devices, the optimizer
state held for the trainable tensors (measured from a stepped optimizer over one model
copy: SGD's momentum, as the runs use, and Adam's two moments for comparison), trainable
and total parameters, and the test loss and perplexity on the new task (and on
``stdlib-text``'s val windows: what the fine-tune forgot).

    PYTHONPATH=. .venv/bin/python bench/adapter_finetune.py [--modes pipar fl]
        [--pretrain-steps 400] [--lrs-full 0.01 0.03 0.1] [--lrs-lora 0.1 0.3 1]
        [--state FILE]
    PYTHONPATH=. .venv/bin/python bench/adapter_finetune.py --quick   # a check, about half a minute
"""

from __future__ import annotations

import argparse
import asyncio
import math
import pydoc_data.topics
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from aiopipe import CostTable, RunConfig, RunResult, VirtualClock, simulate
from aiopipe.data import open_dataset
from aiopipe.data.dataset import SPLITS, check_indices
from aiopipe.data.text import CONTEXT, MAX_BYTES, VOCAB, ByteWindows, stdlib_files
from aiopipe.models import add_lora
from aiopipe.models.gpt import build_gpt_tiny
from aiopipe.runtime.factories import cross_entropy, make_optimizer

#: gpt-tiny's units: embed, four blocks, norm, head
UNITS = 7
COSTS = CostTable.uniform(UNITS, forward=0.001, backward=0.002)
#: the Linear layers that get adapters: attention (qkv, proj) and MLP (fc, out) of each
#: block; the embedding, the LayerNorms and the head stay frozen
TARGETS = ("blocks.*.qkv", "blocks.*.proj", "blocks.*.fc", "blocks.*.out")
RANK = 8
ALPHA = 8.0  # scale alpha / rank = 1
SEED = 0

#: each mode's own settings: pipar's devices hold the embedding and the first block
MODES: dict[str, dict[str, Any]] = {"pipar": {"split_point": 2}, "fl": {},
                                    "sfl": {"split_point": 2}}

def topics_bytes() -> npt.NDArray[np.uint8]:
    """The documentation text of ``pydoc_data.topics`` (what ``help("TOPIC")`` prints),
    topic by topic in sorted order, UTF-8, read-only.

    Raises:
        RuntimeError: ``stdlib-text`` reads ``pydoc_data/topics.py`` on this install
            (then the base would have seen the new task).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in stdlib_files(root):
        if path.relative_to(root).as_posix() == "pydoc_data/topics.py":
            raise RuntimeError("stdlib-text reads pydoc_data/topics.py on this install")
        total += path.stat().st_size
        if total >= MAX_BYTES:
            break
    topics = pydoc_data.topics.topics
    text = "\n".join(topics[key] for key in sorted(topics)).encode()
    stream = np.frombuffer(text, dtype=np.uint8)
    stream.flags.writeable = False
    return stream


def pretrain(steps: int, *, batch: int = 32, lr: float = 3e-3) -> dict[str, torch.Tensor]:
    """gpt-tiny trained ``steps`` steps of Adam on ``stdlib-text``'s train windows, seeded
    (`SEED`), batches drawn at random; its state dict."""
    torch.manual_seed(SEED)
    model = build_gpt_tiny(VOCAB, (CONTEXT,))
    data = open_dataset("stdlib-text", split="train")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(SEED)
    model.train()
    for _ in range(steps):
        x, y = data.batch(torch.randint(len(data), (batch,), generator=generator).numpy())
        loss = cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def pretrained(state: dict[str, torch.Tensor], *, lora: bool) -> nn.Module:
    """gpt-tiny with the pretrained weights; with ``lora``, adapters added after loading
    (A drawn under `SEED`, B zero: the same function as the base)."""
    model = build_gpt_tiny(VOCAB, (CONTEXT,))
    model.load_state_dict(state)
    if lora:
        torch.manual_seed(SEED)
        add_lora(model, rank=RANK, alpha=ALPHA, targets=TARGETS)
    return model


@torch.no_grad()
def mean_loss(model: nn.Module, data: Any, *, batch: int = 128) -> float:
    """Mean per-token cross-entropy of ``model`` over every window of ``data``."""
    model.eval()
    total = 0.0
    for start in range(0, len(data), batch):
        x, y = data.batch(range(start, min(start + batch, len(data))))
        total += float(cross_entropy(model(x), y)) * len(y)
    return total / len(data)


def optimizer_bytes(model: nn.Module, optimizer: torch.optim.Optimizer,
                    data: ByteWindows) -> int:
    """Bytes of ``optimizer``'s state after one step on one batch of ``data``: what a
    model copy holds besides its weights, for the tensors that had a gradient."""
    x, y = data.batch(range(8))
    cross_entropy(model(x), y).backward()
    optimizer.step()
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))


@dataclass
class Run:
    """One fine-tune: its learning rate, result and losses."""

    lr: float
    result: RunResult
    val: float
    test: float
    source: float

    @property
    def lost(self) -> list[int]:
        """Devices the run lost or refused an update of, any round (such a run is not
        picked: it did not train as configured)."""
        return sorted({d for epoch in self.result.epochs
                       for d in (*epoch.devices_lost, *epoch.updates_refused)})


def config(mode: str, model: nn.Module, lr: float, args: argparse.Namespace) -> RunConfig:
    """The fine-tune's run: two devices of ``args.samples`` windows each, batch 16,
    ``args.epochs`` epochs, SGD (momentum 0.9), from ``model``'s own weights; no server
    evaluation (the new task's windows are evaluated here)."""
    made = RunConfig(mode=mode, model=model, initial_weights="given",  # type: ignore[arg-type]
                     dataset="stdlib-text", devices=2, samples_per_device=args.samples,
                     batch_size=16, epochs=args.epochs, parallel_batches=2,
                     learning_rate=lr, momentum=0.9, test_samples=0, seed=SEED)
    return made.replace(**MODES[mode])


async def finetune(mode: str, model: nn.Module, lr: float, args: argparse.Namespace,
                   splits: dict[str, Any]) -> Run:
    """Fine-tune ``model`` in ``mode`` on the new task's train windows, shared between the
    two devices in halves; its val and test losses after."""
    train = splits["train"]
    shares = [Subset(train, range(i * args.samples, (i + 1) * args.samples))
              for i in range(2)]
    result = await simulate(config(mode, model, lr, args), clock=VirtualClock(),
                            cost_table=COSTS, datasets=shares)
    tuned = result.model
    return Run(lr, result, mean_loss(tuned, splits["val"]), mean_loss(tuned, splits["test"]),
               mean_loss(tuned, splits["source"]))


class Subset:
    """``indices`` of a `ByteWindows`, as a dataset of its own (a device's share)."""

    def __init__(self, data: ByteWindows, indices: range) -> None:
        self._data = data
        self._indices = np.asarray(indices, dtype=np.int64)

    name = property(lambda self: self._data.name)
    num_classes = property(lambda self: self._data.num_classes)
    in_shape = property(lambda self: self._data.in_shape)

    def __len__(self) -> int:
        """The number of windows."""
        return int(self._indices.size)

    def labels(self) -> npt.NDArray[np.int64]:
        """Each window's last target byte."""
        return self._data.labels()[self._indices]

    def batch(self, indices: Sequence[int] | npt.NDArray[np.integer]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows at ``indices`` of this share."""
        return self._data.batch(self._indices[check_indices(indices, len(self))])


def _bytes(result: RunResult) -> tuple[int, int, int]:
    last = result.epochs[-1]
    return last.bytes_up, last.bytes_down, sum(last.peer_bytes)


def _ppl(loss: float) -> str:
    return f"{loss:.3f} ({math.exp(loss):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="*", choices=list(MODES), default=["pipar", "fl"])
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument("--state", type=Path, default=None,
                        help="keep the pretrained weights in this file: loaded if it "
                             "exists (from the same --pretrain-steps), else written")
    parser.add_argument("--samples", type=int, default=256,
                        help="new-task windows per device (two devices)")
    parser.add_argument("--epochs", type=int, default=3, help="rounds (FedAvg each)")
    parser.add_argument("--lrs-full", type=float, nargs="+", default=[0.01, 0.03, 0.1])
    parser.add_argument("--lrs-lora", type=float, nargs="+", default=[0.1, 0.3, 1.0])
    parser.add_argument("--quick", action="store_true",
                        help="a check (about half a minute): 20 pretraining steps, 32 windows a "
                             "device, one epoch, one learning rate each")
    args = parser.parse_args()
    if args.quick:
        args.pretrain_steps, args.samples, args.epochs = 20, 32, 1
        args.lrs_full, args.lrs_lora = args.lrs_full[:1], args.lrs_lora[:1]
    began = time.monotonic()
    stream = topics_bytes()
    splits: dict[str, Any] = {s: ByteWindows(stream, name="pydoc-topics", split=s)
                              for s in SPLITS}
    splits["source"] = open_dataset("stdlib-text", split="val", size=512)
    print(f"new task: {stream.size} bytes of pydoc_data.topics; windows train/val/test "
          f"{len(splits['train'])}/{len(splits['val'])}/{len(splits['test'])}; "
          f"fine-tuned on the first {2 * args.samples} train windows")
    if args.state is not None and args.state.exists():
        state = torch.load(args.state)
    else:
        state = pretrain(args.pretrain_steps)
        if args.state is not None:
            torch.save(state, args.state)
    base = pretrained(state, lora=False)
    print(f"pretrained {args.pretrain_steps} steps, {time.monotonic() - began:.0f} s: "
          f"loss on stdlib-text val {_ppl(mean_loss(base, splits['source']))}, on the new "
          f"task's test {_ppl(mean_loss(base, splits['test']))}", flush=True)
    before = mean_loss(base, splits["test"])
    source_before = mean_loss(base, splits["source"])
    steps = args.epochs * args.samples // 16
    rows = []
    for mode in args.modes:
        best: dict[str, Run] = {}
        for method, lrs in (("full", args.lrs_full), ("LoRA", args.lrs_lora)):
            runs = [asyncio.run(finetune(mode, pretrained(state, lora=method == "LoRA"),
                                         lr, args, splits)) for lr in lrs]
            for run in runs:
                print(f"{mode} {method} lr {run.lr:g}: val {run.val:.4f}, test "
                      f"{run.test:.4f}, stdlib-text val {run.source:.4f}"
                      + (f"; devices lost or refused: {run.lost}" if run.lost else ""),
                      flush=True)
            best[method] = min(runs, key=lambda run: run.val if math.isfinite(run.val)
                               and not run.lost else math.inf)
        for method, run in best.items():
            model = pretrained(state, lora=method == "LoRA")
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            sgd = optimizer_bytes(model, make_optimizer(
                model, config(mode, model, run.lr, args)), splits["train"])
            model = pretrained(state, lora=method == "LoRA")
            adam = optimizer_bytes(model, torch.optim.Adam(
                [p for p in model.parameters() if p.requires_grad]), splits["train"])
            up, down, peer = _bytes(run.result)
            rows.append(f"| {mode} | {method} | {run.lr:g} | {up:,} | {down:,} | {peer:,} | "
                        f"{sgd:,} | {adam:,} | {trainable:,} / {total:,} | "
                        f"{_ppl(before)} | {_ppl(run.test)} | "
                        f"{_ppl(source_before)} -> {_ppl(run.source)} |")
    print(f"\nsteps per device: {steps} ({args.epochs} rounds of {args.samples // 16})\n")
    print("| mode | method | lr | up B / round | down B / round | peer B / round | "
          "SGD momentum B | Adam state B | trainable / total params | new-task test "
          "loss (ppl), before | after | stdlib-text val loss (ppl), before -> after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nwall clock {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
