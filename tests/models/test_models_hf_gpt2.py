"""Hugging Face GPT-2 as split units: the units compute exactly ``GPT2LMHeadModel``, its
logits, gradients and SGD steps bit for bit, cut at every block, sharing its parameters.
Skipped where the optional ``transformers`` (``aiopipe[hf]``) is not installed."""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections.abc import Callable

import pytest

transformers = pytest.importorskip("transformers")
transformers.GPT2LMHeadModel  # noqa: B018  (its lazy import, ~2 s, at collection, not in a test)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from aiopipe.errors import ConfigError  # noqa: E402
from aiopipe.models import hf_gpt2  # noqa: E402
from aiopipe.models.hf_gpt2 import (  # noqa: E402
    GPT2Units,
    as_gpt2_units,
    gpt2_lm_head_model,
    gpt2_units,
)
from aiopipe.models.trace import as_units, split_units  # noqa: E402

TINY = {"vocab_size": 64, "n_positions": 16, "n_embd": 32, "n_layer": 3, "n_head": 4}
BATCH, LENGTH = 4, 16


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return gpt2_lm_head_model(**TINY)


def tiny_config(**options: object) -> object:
    """A config of these sizes made directly, not by `gpt2_lm_head_model`."""
    end = TINY["vocab_size"] - 1  # HF logs a warning for GPT-2's 50256 in a small vocabulary
    return transformers.GPT2Config(**TINY, bos_token_id=end, eos_token_id=end, **options)


def tokens(seed: int = 1) -> Tensor:
    return torch.randint(0, TINY["vocab_size"], (BATCH, LENGTH),
                         generator=torch.Generator().manual_seed(seed))


def next_token_loss(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def hf_logits(model: nn.Module) -> Callable[[Tensor], Tensor]:
    return lambda ids: model(ids).logits


@pytest.mark.parametrize("train", [True, False])
def test_the_wrapper_computes_the_hf_models_logits_exactly(train: bool) -> None:
    model = tiny_model()
    units = as_gpt2_units(model)
    model.train(train)
    ids = tokens()
    want = model(ids).logits
    assert want.shape == (BATCH, LENGTH, TINY["vocab_size"])
    assert torch.equal(units(ids), want)


def test_the_wrapper_holds_the_hf_models_own_modules() -> None:
    model = tiny_model()
    units = as_gpt2_units(model)
    body = model.transformer
    assert list(units._modules) == ["embed", "h", "ln_f", "lm_head"]
    assert units.embed.wte is body.wte
    assert units.embed.wpe is body.wpe
    assert units.h is body.h
    assert units.ln_f is body.ln_f
    assert units.lm_head is model.lm_head
    assert {id(p) for p in units.parameters()} == {id(p) for p in model.parameters()}


def test_the_logits_are_causal() -> None:
    """Changing a later token leaves the earlier positions' logits as they were: the
    blocks, called without a mask, attend causally."""
    units = as_gpt2_units(tiny_model())
    ids = tokens()
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % TINY["vocab_size"]
    before, after = units(ids), units(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.equal(before[:, 10:], after[:, 10:])


def test_split_units_cuts_at_every_block_and_the_units_compute_the_model() -> None:
    model = tiny_model()
    units = split_units(as_gpt2_units(model), several=True)
    called = [[str(node.target) for node in unit.graph.nodes if node.op == "call_module"]
              for unit in units]
    assert called == [["embed"], ["h.0"], ["h.1"], ["h.2"], ["ln_f"], ["lm_head"]]
    ids = tokens()
    assert torch.equal(units(ids), model(ids).logits)
    assert {id(p) for p in units.parameters()} == {id(p) for p in model.parameters()}
    assert len(as_units(as_gpt2_units(model))) == len(units)  # one tensor crosses each cut


def test_the_units_gradients_are_the_hf_models() -> None:
    model = tiny_model()
    units = split_units(as_gpt2_units(model), several=True)
    ids = tokens()
    grads = []
    for forward in (hf_logits(model), units):
        model.zero_grad(set_to_none=True)
        next_token_loss(forward(ids), ids).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()
                      if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() == dict(model.named_parameters()).keys()
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name


def test_the_loss_is_hfs_own_loss() -> None:
    """The next-token loss these tests train on is the one HF computes from ``labels``."""
    model = tiny_model()
    ids = tokens()
    out = model(ids, labels=ids)
    assert torch.allclose(next_token_loss(out.logits, ids), out.loss, rtol=0, atol=1e-6)


def test_sgd_steps_on_the_units_train_the_weights_the_hf_model_would() -> None:
    model = tiny_model()
    twin = copy.deepcopy(model)
    units = split_units(as_gpt2_units(twin), several=True)
    for forward, params in ((hf_logits(model), model.parameters()),
                            (units, twin.parameters())):
        optimiser = torch.optim.SGD(params, lr=0.5, momentum=0.9)
        for step in range(3):
            ids = tokens(seed=10 + step)
            optimiser.zero_grad()
            next_token_loss(forward(ids), ids).backward()
            optimiser.step()
    trained, start = model.state_dict(), tiny_model().state_dict()
    for name, tensor in twin.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    assert not torch.equal(trained["lm_head.weight"], start["lm_head.weight"])


def test_gpt2_units_builds_an_untied_dropout_free_sdpa_model() -> None:
    torch.manual_seed(0)
    units = gpt2_units(**TINY)
    assert isinstance(units, GPT2Units)
    assert len(units.h) == TINY["n_layer"]
    assert units.lm_head.weight is not units.embed.wte.weight
    assert all(m.p == 0 for m in units.modules() if isinstance(m, nn.Dropout))
    assert units.h[0].attn.config._attn_implementation == "sdpa"
    torch.manual_seed(0)
    again = gpt2_units(**TINY)  # seeded from torch's global generator
    assert all(torch.equal(a, b) for a, b in zip(units.parameters(), again.parameters(),
                                                 strict=True))


def test_a_tied_model_is_refused() -> None:
    config = tiny_config(tie_word_embeddings=True)
    tied = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    with pytest.raises(ConfigError, match="tie_word_embeddings=False"):
        as_gpt2_units(tied)


def test_eager_attention_is_refused() -> None:
    """Eager attention without a mask attends to the future: not GPT-2 any more."""
    config = tiny_config(tie_word_embeddings=False)
    eager = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager")
    with pytest.raises(ConfigError, match=r"attn_implementation='sdpa'.*'eager'"):
        as_gpt2_units(eager)


@pytest.mark.parametrize(("sizes", "message"), [
    ({"n_embd": 30, "n_head": 4}, r"n_embd \(30\) must be a multiple of n_head \(4\)"),
    ({"n_layer": 0}, "must be positive; got n_layer=0"),
])
def test_bad_sizes_are_config_errors(sizes: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        gpt2_units(**{**TINY, **sizes})


def test_not_a_gpt2_is_refused() -> None:
    with pytest.raises(ConfigError, match="expected a transformers GPT2LMHeadModel; got Linear"):
        as_gpt2_units(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_without_transformers_the_module_imports_and_gpt2_units_says_how_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh copy of the module, loaded while ``import transformers`` fails (None in
    ``sys.modules``): importing it needs no transformers; building a model does."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    spec = importlib.util.spec_from_file_location("hf_gpt2_without_transformers",
                                                  hf_gpt2.__file__)
    assert spec is not None
    assert spec.loader is not None
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    with pytest.raises(ConfigError, match=r"needs the transformers package, which is not "
                                          r"installed: pip install 'aiopipe\[hf\]'"):
        fresh.gpt2_units(**TINY)


def test_an_old_transformers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # the module as imported now: building a model reloads transformers' top module
    # (transformers.utils.import_utils), so the one imported above may be stale
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.0.0")  # tuple blocks
    with pytest.raises(ConfigError, match=r"needs transformers >= 5\.24; 5\.0\.0 is installed"):
        gpt2_units(**TINY)
