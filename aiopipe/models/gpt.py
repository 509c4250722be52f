"""``gpt-tiny``: a small decoder-only transformer over bytes, the zoo's language model.

Unlike the image models it is not an ``nn.Sequential``: `GPT.forward` computes the
padding mask once and hands it to every block beside the residual stream, so a cut
between two blocks passes two tensors, ``mask`` (bool ``[B, T]``) and ``x`` (float32
``[B, T, d]``), in that order (`aiopipe.models.split_units` orders the values that cross
a cut as the model made them). `aiopipe.models.as_units` cuts it into ``embed`` (with
the mask), one unit per block, ``norm`` and ``head``, and the runtime carries both
tensors across each cut.

[Note: padding] Token `PAD` (byte 0, which source text barely contains) marks padding:
no query attends to a padding key, except that every position attends to itself, so no
row of the attention mask is empty and no softmax sees only ``-inf`` (no NaN), even for
a padding query or a window of padding alone. Leaving padding positions out of the loss
is the caller's business.

Initialization draws only from torch's global generator, as GPT-2 does (normal with
std 0.02, biases zero); every module that holds parameters has ``reset_parameters``
(see `aiopipe.models.initialisers`), so re-drawing them from a seed covers them all.
Head and embedding are not tied: a tensor used by two units would forbid every cut
between them.
"""

from __future__ import annotations

import math
from typing import Final

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "PAD", "Block", "Embedding", "attention_mask", "build_gpt_tiny"]

PAD: Final = 0
"""The padding token: a byte value that source text barely contains ([Note: padding])."""

_WIDTH: Final = 128
_DEPTH: Final = 4
_HEADS: Final = 4
_MLP_RATIO: Final = 4
_INIT_STD: Final = 0.02


class Embedding(nn.Module):
    """Token embedding plus a learned embedding per position, ``[B, T] -> [B, T, d]``.

    Both tables live in one module, so one unit owns them both.
    """

    def __init__(self, vocab: int, context: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Parameter(torch.empty(vocab, width))
        self.positions = nn.Parameter(torch.empty(context, width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw both tables normal with std 0.02."""
        nn.init.normal_(self.tokens, std=_INIT_STD)
        nn.init.normal_(self.positions, std=_INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.tokens) + self.positions[: tokens.shape[1]]


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP, each
    added to the residual stream. ``forward(x, mask)`` returns the new ``x``; ``mask``
    (bool ``[B, T]``, True for a real token) hides padding keys (`attention_mask`)."""

    def __init__(self, width: int, heads: int, mlp_ratio: int, *, dropout: float = 0.0,
                 residual_scale: float = 1.0) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.dropout = dropout
        self.residual_scale = residual_scale
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, mlp_ratio * width)
        self.out = nn.Linear(mlp_ratio * width, width)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Linear weights normal with std 0.02, biases zero; the two that write into the
        residual stream (``proj``, ``out``) scaled by ``residual_scale`` (GPT-2:
        ``1 / sqrt(2 * depth)``, so the stream's variance does not grow with depth).
        Overrides the linears' own initialisers, which run first."""
        for linear, std in ((self.qkv, _INIT_STD), (self.fc, _INIT_STD),
                            (self.proj, _INIT_STD * self.residual_scale),
                            (self.out, _INIT_STD * self.residual_scale)):
            nn.init.normal_(linear.weight, std=std)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = (self.qkv(self.norm1(x)).view(b, t, 3, self.heads, width // self.heads)
                   .permute(2, 0, 3, 1, 4).unbind(0))
        a = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask(mask),
            dropout_p=self.dropout if self.training else 0.0)
        a = a.transpose(1, 2).reshape(b, t, width)
        x = x + F.dropout(self.proj(a), self.dropout, self.training)
        h = self.out(F.gelu(self.fc(self.norm2(x))))
        return x + F.dropout(h, self.dropout, self.training)


def attention_mask(mask: torch.Tensor) -> torch.Tensor:
    """Which keys each query may attend to, bool ``[B, 1, T, T]``, from the key mask
    ``[B, T]`` (True: a real token): earlier or equal positions holding real tokens, and
    always the query's own position ([Note: padding])."""
    t = mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=mask.device).tril()
    itself = torch.eye(t, dtype=torch.bool, device=mask.device)
    return (causal & mask[:, None, None, :]) | itself


class GPT(nn.Module):
    """A decoder-only transformer: int64 tokens ``[B, T]`` to logits ``[B, T, vocab]``.

    Top-level children, in the order ``forward`` calls them: ``embed``, ``blocks`` (an
    ``nn.ModuleList``), ``norm``, ``head``: the candidate cuts of
    `aiopipe.models.split_units`. ``T`` may be anything up to ``context``.
    """

    def __init__(self, vocab: int, context: int, *, width: int = _WIDTH, depth: int = _DEPTH,
                 heads: int = _HEADS, mlp_ratio: int = _MLP_RATIO, dropout: float = 0.0
                 ) -> None:
        super().__init__()
        self.context = context
        self.embed = Embedding(vocab, context, width)
        scale = 1.0 / math.sqrt(2 * depth)
        self.blocks = nn.ModuleList(
            Block(width, heads, mlp_ratio, dropout=dropout, residual_scale=scale)
            for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The head's weight normal with std 0.02, its bias zero (the embedding and the
        blocks draw their own)."""
        nn.init.normal_(self.head.weight, std=_INIT_STD)
        nn.init.zeros_(self.head.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = tokens != PAD
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def build_gpt_tiny(num_classes: int, in_shape: tuple[int]) -> GPT:
    """``gpt-tiny`` for a vocabulary of ``num_classes`` tokens (256: bytes) and windows of
    ``in_shape == (T,)`` tokens: width 128, 4 blocks of 4 heads, MLP 4x, no dropout."""
    return GPT(num_classes, in_shape[0])
