"""GPT-2 from Hugging Face ``transformers`` as a model aiopipe can split at its blocks.

`gpt2_units` builds a small GPT-2 (``GPT2LMHeadModel``) from a config, with random
weights and nothing downloaded, and returns it as a `GPT2Units`: a module whose
top-level children are the model's own modules (shared, not copied): ``embed`` (token and
position embeddings), ``h`` (the ``nn.ModuleList`` of ``GPT2Block``), ``ln_f`` and
``lm_head``. ``aiopipe.models.split_units(units, several=True)`` traces it and cuts
before each child and each block: ``n_layer + 3`` units (the embeddings, each block,
``ln_f``, ``lm_head``), and one tensor, the hidden states or logits, crosses each cut;
``at=[...]`` merges units (``ln_f`` alone is small). `as_gpt2_units` wraps a
``GPT2LMHeadModel`` made elsewhere.

``transformers`` is an optional dependency (``pip install 'aiopipe[hf]'``); it is imported
only when a function here is called, so ``import aiopipe`` works without it.

[Note: causal attention without a mask] The blocks are called with no attention mask:
under the ``"sdpa"`` attention implementation a missing mask makes HF's attention call
``scaled_dot_product_attention(..., is_causal=True)``, and ``GPT2Model`` itself passes no
mask there when there is no padding, so the units take the very code path of
``GPT2LMHeadModel(input_ids)`` and only the hidden states cross a cut. Under ``"eager"`` a
missing mask means *no* masking (each token would see the future), and the (B, 1, T, T)
mask would have to cross every cut, so `as_gpt2_units` refuses it. A padding mask is not
supported: `split_units` splits a forward of one input; right-padded batches can be
trained by ignoring the padded targets in the loss, as causal attention never lets a real
token see the padding after it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aiopipe.errors import ConfigError

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel

__all__ = ["GPT2Embeddings", "GPT2Units", "as_gpt2_units", "gpt2_lm_head_model",
           "gpt2_units"]

_INSTALL_HINT = "pip install 'aiopipe[hf]' (or: pip install 'transformers>=5.24,<6')"
#: The oldest transformers checked: its ``GPT2Block`` returns the hidden states as a
#: tensor (5.0 still returned a tuple, which would cross a cut as such).
_MIN_TRANSFORMERS = (5, 24)


class GPT2Embeddings(nn.Module):
    """Token plus position embeddings, then dropout: the start of ``GPT2Model.forward``
    for ``input_ids`` with no cache, as one module so it is one leaf for the tracer (its
    ``torch.arange`` of the sequence length is computed at run time, not traced)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, T, n_embd) of int64 token ids (B, T)."""
        inputs_embeds = self.wte(input_ids)
        positions = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
        hidden: torch.Tensor = inputs_embeds + self.wpe(positions.unsqueeze(0))
        return self.drop(hidden)  # type: ignore[no-any-return]


class GPT2Units(nn.Module):
    """A ``GPT2LMHeadModel``'s modules as children that `split_units` cuts between:
    ``embed``, each entry of ``h``, ``ln_f``, ``lm_head``. ``forward(input_ids)`` computes
    exactly ``GPT2LMHeadModel(input_ids).logits`` (see [Note: causal attention without a
    mask] in the module docstring). Make one with `as_gpt2_units` or `gpt2_units`."""

    def __init__(self, embed: GPT2Embeddings, h: nn.ModuleList, ln_f: nn.LayerNorm,
                 lm_head: nn.Linear) -> None:
        super().__init__()
        self.embed, self.h, self.ln_f, self.lm_head = embed, h, ln_f, lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab_size) of int64 token ids (B, T)."""
        hidden = self.embed(input_ids)
        for block in self.h:
            hidden = block(hidden)  # no cache, no mask: causal sdpa
        return self.lm_head(self.ln_f(hidden))  # type: ignore[no-any-return]


def gpt2_lm_head_model(*, vocab_size: int = 256, n_positions: int = 128, n_embd: int = 128,
                       n_layer: int = 4, n_head: int = 4) -> GPT2LMHeadModel:
    """A ``transformers.GPT2LMHeadModel`` of this shape with random weights (HF's own
    initialisation, from torch's global generator: seed it with ``torch.manual_seed``).
    Nothing is downloaded.

    The defaults are a small byte-level model (256 ids); GPT-2 small is
    ``vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12``.
    Set so that it splits and computes reproducibly:

    - ``tie_word_embeddings=False``: tied, ``lm_head`` would use ``wte``'s very weight,
      a parameter in the first and the last unit; a tensor lives in one unit, so
      `split_units` would drop every cut and leave one unit.
    - dropout probabilities 0: the units and the HF model then compute the same values
      in train mode too (two dropout masks would differ even with one seed).
    - ``attn_implementation="sdpa"`` and ``use_cache=False``: see [Note: causal
      attention without a mask].
    - ``bos_token_id = eos_token_id = vocab_size - 1``: GPT-2's convention (its
      ``<|endoftext|>`` is the last id), in range for a small vocabulary.

    Raises:
        ConfigError: ``transformers`` is not installed (with the install command), or
            ``n_embd`` is not a multiple of ``n_head``, or a size is not positive.
    """
    transformers = _import_transformers()
    sizes = {"vocab_size": vocab_size, "n_positions": n_positions, "n_embd": n_embd,
             "n_layer": n_layer, "n_head": n_head}
    bad = [f"{key}={value}" for key, value in sizes.items() if value < 1]
    if bad:
        raise ConfigError(f"GPT-2 sizes must be positive; got {', '.join(bad)}")
    if n_embd % n_head:
        raise ConfigError(f"GPT-2's n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    config = transformers.GPT2Config(
        **sizes, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=False, use_cache=False,
        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    model: GPT2LMHeadModel = transformers.GPT2LMHeadModel._from_config(
        config, attn_implementation="sdpa")
    return model


def as_gpt2_units(model: GPT2LMHeadModel) -> GPT2Units:
    """``model``'s modules as a `GPT2Units` (shared: training one trains the other).

    Raises:
        ConfigError: ``model`` is not a ``GPT2LMHeadModel``; its ``lm_head`` is tied to
            the token embedding (no cut could be made); its attention is not ``"sdpa"``
            (see [Note: causal attention without a mask]); it has cross-attention.
    """
    transformers = _import_transformers()
    if not isinstance(model, transformers.GPT2LMHeadModel):
        raise ConfigError(f"expected a transformers GPT2LMHeadModel; got {type(model).__name__}")
    body = model.transformer
    if model.lm_head.weight is body.wte.weight:
        raise ConfigError("this GPT2LMHeadModel ties lm_head to the token embedding, so "
                          "no cut could be made (a tensor lives in one unit); build it "
                          "with tie_word_embeddings=False")
    implementation = model.config._attn_implementation
    if implementation != "sdpa":
        raise ConfigError(f"GPT-2's blocks are called without a mask, which is causal "
                          f"only under attn_implementation='sdpa'; this model uses "
                          f"{implementation!r}")
    if model.config.add_cross_attention:
        raise ConfigError("a GPT-2 with cross-attention takes encoder states as a second "
                          "input; aiopipe splits models of one input")
    return GPT2Units(GPT2Embeddings(body.wte, body.wpe, body.drop), body.h, body.ln_f,
                     model.lm_head)


def gpt2_units(*, vocab_size: int = 256, n_positions: int = 128, n_embd: int = 128,
               n_layer: int = 4, n_head: int = 4) -> GPT2Units:
    """A small GPT-2 with random weights (`gpt2_lm_head_model`) as a `GPT2Units`, ready
    for ``split_units(units, several=True)``.

    Raises:
        ConfigError: see `gpt2_lm_head_model`.
    """
    return as_gpt2_units(gpt2_lm_head_model(vocab_size=vocab_size, n_positions=n_positions,
                                            n_embd=n_embd, n_layer=n_layer, n_head=n_head))


def _import_transformers() -> Any:
    """The ``transformers`` module (as ``Any``: the package has no complete type hints).

    Raises:
        ConfigError: it is not installed, or older than ``_MIN_TRANSFORMERS``.
    """
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"a Hugging Face GPT-2 needs the transformers package, which is "
                          f"not installed: {_INSTALL_HINT}") from exc
    version = str(transformers.__version__)
    major_minor = re.match(r"(\d+)\.(\d+)", version)  # "5.24.0", "5.25.0.dev0", "6.0rc1"
    if major_minor is None or tuple(map(int, major_minor.groups())) < _MIN_TRANSFORMERS:
        raise ConfigError(f"a Hugging Face GPT-2 needs transformers >= "
                          f"{'.'.join(map(str, _MIN_TRANSFORMERS))}; {version} is installed: "
                          f"{_INSTALL_HINT}")
    return transformers
