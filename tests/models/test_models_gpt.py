"""gpt-tiny: split units equal to the model (two tensors across each cut between blocks),
padding that never empties an attention row, zoo checks, and that it learns stdlib-text."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from aiopipe.data import open_dataset
from aiopipe.errors import ConfigError
from aiopipe.models import MODEL_NAMES, as_units, build, split_units
from aiopipe.models.gpt import GPT, PAD, attention_mask, build_gpt_tiny
from aiopipe.models.initialisers import parameters_not_reset

VOCAB, T, WIDTH = 256, 64, 128


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return build_gpt_tiny(VOCAB, (T,))


def _tokens(batch: int = 3) -> torch.Tensor:
    """Random bytes, with left padding in row 0 and a padding token inside row 1."""
    tokens = torch.randint(1, VOCAB, (batch, T), generator=torch.Generator().manual_seed(1))
    tokens[0, :5] = PAD
    tokens[1, 17] = PAD
    return tokens


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_gpt_tiny_is_in_the_zoo_as_the_units_of_a_module_with_four_named_children(
        ) -> None:
    assert "gpt-tiny" in MODEL_NAMES
    torch.manual_seed(0)
    units = build("gpt-tiny", num_classes=VOCAB, in_shape=(T,))
    assert isinstance(units, nn.Sequential)
    assert len(units) == 7
    tokens = _tokens()
    assert torch.equal(units(tokens), _model()(tokens))  # the same draws, the same model
    model = _model()
    assert not isinstance(model, nn.Sequential)
    assert [name for name, _ in model.named_children()] == ["embed", "blocks", "norm", "head"]
    assert len(model.blocks) == 4


def test_parameter_count_is_under_a_million() -> None:
    count = sum(p.numel() for p in _model().parameters())
    block = 4 * WIDTH * WIDTH + 4 * WIDTH + 8 * WIDTH * WIDTH + 5 * WIDTH + 4 * WIDTH
    expected = (VOCAB + T) * WIDTH + 4 * block + 2 * WIDTH + WIDTH * VOCAB + VOCAB
    assert count == expected
    assert 800_000 < count < 1_000_000


def test_units_are_embed_each_block_norm_and_head() -> None:
    units = split_units(_model())
    owners = [sorted({name.rsplit(".", 2)[0] if name.startswith("blocks") else
                      name.split(".")[0] for name, _ in unit.named_parameters()})
              for unit in units]
    assert owners == [["embed"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3"],
                      ["norm"], ["head"]]


def test_cuts_between_blocks_carry_the_mask_and_the_residual_stream() -> None:
    units = split_units(_model())
    tokens = _tokens()
    value: object = tokens
    crossing = []
    with torch.no_grad():
        for unit in units:
            value = unit(value)
            crossing.append(value)
    for value in crossing[:4]:  # after embed and after each block but the last
        assert isinstance(value, tuple)
        mask, x = value
        assert mask.dtype == torch.bool
        assert mask.shape == tokens.shape
        assert torch.equal(mask, tokens != PAD)
        assert x.dtype == torch.float32
        assert x.shape == (*tokens.shape, WIDTH)
    # The last block is the mask's last user: one tensor crosses from there on.
    assert all(isinstance(v, torch.Tensor) for v in crossing[4:])
    assert crossing[4].shape == (*tokens.shape, WIDTH)  # type: ignore[attr-defined]


def test_split_units_equal_the_model_bit_for_bit_with_gradients() -> None:
    model = _model()
    units = split_units(model)
    tokens = _tokens()
    target = torch.randint(0, VOCAB, tokens.shape, generator=torch.Generator().manual_seed(2))
    whole = model(tokens)
    torch.autograd.backward(nn.functional.cross_entropy(whole.flatten(0, 1), target.flatten()))
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    value: object = tokens
    for unit in units:
        value = unit(value)
    assert isinstance(value, torch.Tensor)
    assert torch.equal(value, whole)
    torch.autograd.backward(nn.functional.cross_entropy(value.flatten(0, 1), target.flatten()))
    got = _grads(model)
    assert got.keys() == expected.keys() == {n for n, _ in model.named_parameters()}
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_the_runtime_takes_it_cut_between_blocks_and_one_tensor_cuts_merge_them() -> None:
    assert len(as_units(_model())) == 7
    assert len(split_units(_model(), several=False)) == 3


def test_attention_mask_is_causal_hides_padding_and_keeps_the_diagonal() -> None:
    mask = torch.tensor([[False, True, False, True], [False, False, False, False]])
    allowed = attention_mask(mask)
    assert allowed.shape == (2, 1, 4, 4)
    assert allowed.any(dim=-1).all()  # no query is left without a key
    assert torch.equal(allowed[0, 0], torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0],
                                                    [0, 1, 1, 0], [0, 1, 0, 1]]).bool())
    assert torch.equal(allowed[1, 0], torch.eye(4, dtype=torch.bool))


def test_padding_keys_do_not_reach_real_tokens_and_all_padding_is_finite() -> None:
    model = _model().eval()
    tokens = _tokens()
    tokens[2] = PAD
    with torch.no_grad():
        before = model(tokens)
        model.embed.tokens[PAD].add_(1.0)  # a different padding embedding
        after = model(tokens)
    assert torch.isfinite(before).all()
    real = tokens != PAD
    assert torch.allclose(before[real], after[real], rtol=0, atol=1e-6)
    assert not torch.allclose(before[~real], after[~real])


def test_causal_earlier_outputs_ignore_later_tokens() -> None:
    model = _model().eval()
    tokens = _tokens()
    changed = tokens.clone()
    changed[:, 40:] = (changed[:, 40:] % (VOCAB - 1)) + 1
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :40], b[:, :40], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 40:], b[:, 40:])


def test_init_is_deterministic_under_manual_seed_and_fully_resettable() -> None:
    states = [_model(seed).state_dict() for seed in (7, 7, 8)]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not any(torch.equal(states[0][k], states[2][k]) for k in ("embed.tokens",
                                                                       "head.weight"))
    assert parameters_not_reset(_model()) == []


def test_train_mode_is_deterministic_without_dropout() -> None:
    model = _model()
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(model.train()(tokens), model.eval()(tokens))


def test_shorter_windows_than_the_context_work() -> None:
    with torch.no_grad():
        assert _model()(_tokens()[:, :10]).shape == (3, 10, VOCAB)


@pytest.mark.parametrize("in_shape", [(3, 32, 32), (1,), (1025,), (64.0,), (True,), "64", 64])
def test_gpt_tiny_refuses_other_shapes(in_shape: object) -> None:
    with pytest.raises(ConfigError, match=r"in_shape must be \(T,\)"):
        build("gpt-tiny", num_classes=VOCAB, in_shape=in_shape)  # type: ignore[arg-type]


def test_gpt_tiny_takes_the_extreme_contexts_and_image_models_refuse_windows() -> None:
    for context in (2, 1024):
        build("gpt-tiny", num_classes=VOCAB, in_shape=[context])
    with pytest.raises(ConfigError, match="channels, height, width"):
        build("vgg5", num_classes=10, in_shape=(T,))


@pytest.mark.slow
def test_plain_pytorch_training_on_stdlib_text_lowers_the_loss() -> None:
    data = open_dataset("stdlib-text", split="train")
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    order = np.random.default_rng(0).integers(0, len(data), (60, 16))
    losses = []
    for indices in order:
        x, y = data.batch(indices)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(VOCAB)) < 0.2
    assert np.mean(losses[-10:]) < 3.5
