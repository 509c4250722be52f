"""GPT-2 from Hugging Face `transformers` (random weights from a config, nothing
downloaded), split at its blocks and trained by aiopipe on the standard library's text
for a few steps, as plain PyTorch trains `GPT2LMHeadModel` itself (issue 44, item 5).
Skipped where `transformers` is not installed (`pip install -e ".[hf]"`)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
transformers.GPT2LMHeadModel  # noqa: B018  (its lazy import, at collection, not in a test)

import torch  # noqa: E402
from plain_training import train_in_turns  # noqa: E402
from torch import nn  # noqa: E402

from aiopipe import RunConfig, VirtualClock, simulate  # noqa: E402
from aiopipe.models import unit_count  # noqa: E402
from aiopipe.models.hf_gpt2 import gpt2_lm_head_model, gpt2_units  # noqa: E402
from aiopipe.runtime.plan import build_model, train_dataset  # noqa: E402
from aiopipe.scheduler.costs import CostTable  # noqa: E402

SIZE = {"n_embd": 32, "n_layer": 2, "n_head": 2}
BATCH = 8


def gpt2(num_classes: int, in_shape: tuple[int, ...]) -> nn.Module:
    """The run's model factory: a two-block GPT-2 over bytes."""
    return gpt2_units(vocab_size=num_classes, n_positions=in_shape[0], **SIZE)


class Logits(nn.Module):
    """``GPT2LMHeadModel`` as plain PyTorch calls it: token ids to ``.logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("changes", [
    {"split_point": 2},
    {"mode": "pipeline", "devices": 2, "options": {"partition": [2], "schedule": "1f1b"}},
], ids=["pipar", "pipeline-1f1b"])
async def test_gpt2_split_at_its_blocks_trains_as_plain_pytorch_trains_it(
        changes: dict[str, object]) -> None:
    config = RunConfig(mode="pipar", model=gpt2, dataset="stdlib-text", devices=1,
                       samples_per_device=3 * BATCH, batch_size=BATCH, epochs=1,
                       parallel_batches=1, learning_rate=0.1, momentum=0.0, test_samples=0,
                       seed=5).replace(**changes)
    units = build_model(config, num_classes=256, in_shape=(64,))
    assert unit_count(units) == SIZE["n_layer"] + 3  # embeddings, each block, ln_f, lm_head
    costs = CostTable.uniform(unit_count(units), forward=0.001, backward=0.002, step=0.001,
                              batch=BATCH)
    result = await simulate(config, clock=VirtualClock(), cost_table=costs)
    torch.manual_seed(config.seed)
    plain = Logits(gpt2_lm_head_model(vocab_size=256, n_positions=64, **SIZE))
    initial = [p.detach().clone() for p in plain.parameters()]
    train_in_turns(plain, torch.optim.SGD(plain.parameters(), lr=config.learning_rate),
                   config, [0], BATCH)
    want = [p.detach() for p in plain.parameters()]
    got = [p.detach() for p in result.model.parameters()]
    assert len(got) == len(want)
    assert len(train_dataset(config)) >= 3 * BATCH
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert all(not torch.equal(a, b) for a, b in zip(got, initial, strict=True))  # trained
