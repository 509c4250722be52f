"""Attacks on what crosses a cut, for measuring what a system leaks.

`aiopipe.attacks.label_inference`: the norm and direction (cosine) label inference
attacks of Li et al. (ICLR 2022) and a clustering one, on the per-sample gradients a
party without the labels is sent (`bench/label_inference.py` runs them on what a
simulated server receives).
"""

from aiopipe.attacks.label_inference import (
    accuracy,
    auc,
    cluster_attack,
    cosine_scores,
    direction_attack,
    known_examples,
    norm_scores,
    rows,
)

__all__ = [
    "accuracy",
    "auc",
    "cluster_attack",
    "cosine_scores",
    "direction_attack",
    "known_examples",
    "norm_scores",
    "rows",
]
