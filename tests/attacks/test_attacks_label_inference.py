"""`aiopipe.attacks.label_inference` on gradients whose labels are known: those of a
softmax cross-entropy layer (and of a small network's top) in plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional

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


def _cut_gradients(top: nn.Module, features: torch.Tensor, labels: torch.Tensor
                   ) -> torch.Tensor:
    """The gradient of the batch's mean cross-entropy with respect to ``features`` (what
    the party below the cut is sent), one row per sample."""
    features = features.clone().requires_grad_(True)
    functional.cross_entropy(top(features), labels).backward()
    assert features.grad is not None
    return rows([features.grad])


def _batch(classes: int, n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=generator).relu(),
            torch.randint(classes, (n,), generator=generator))


def test_the_direction_attack_reads_the_labels_off_a_softmax_layers_gradients() -> None:
    torch.manual_seed(0)
    top = nn.Linear(32, 10)
    features, labels = _batch(10, 400, 32, seed=1)
    gradients = _cut_gradients(top, features, labels)
    known = known_examples(labels, 1, torch.Generator().manual_seed(2))
    assert sorted(known) == list(range(10))
    guessed = direction_attack(gradients, known)
    assert accuracy(guessed, labels, leave_out=known) > 0.95


def test_the_direction_attack_through_a_deeper_top() -> None:
    """Through two layers above the cut the directions still cluster by label."""
    torch.manual_seed(0)
    top = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    features, labels = _batch(10, 400, 32, seed=3)
    gradients = _cut_gradients(top, features, labels)
    known = known_examples(labels, 3, torch.Generator().manual_seed(4))
    assert accuracy(direction_attack(gradients, known), labels, leave_out=known) > 0.8


def test_the_cluster_attack_is_at_least_as_good_as_its_start() -> None:
    torch.manual_seed(0)
    top = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    features, labels = _batch(10, 400, 32, seed=3)
    gradients = _cut_gradients(top, features, labels)
    known = known_examples(labels, 1, torch.Generator().manual_seed(5))
    direction = accuracy(direction_attack(gradients, known), labels, leave_out=known)
    clustered = accuracy(cluster_attack(gradients, known), labels, leave_out=known)
    assert clustered >= direction - 0.02
    assert clustered > 0.8


def test_attacks_on_gradients_without_label_information_are_at_chance() -> None:
    generator = torch.Generator().manual_seed(6)
    labels = torch.randint(10, (2000,), generator=generator)
    gradients = torch.randn(2000, 32, generator=generator, dtype=torch.float64)
    known = known_examples(labels, 1, generator)
    for attack in (direction_attack, cluster_attack):
        assert abs(accuracy(attack(gradients, known), labels, leave_out=known) - 0.1) < 0.04


def test_the_norm_attack_ranks_the_rare_positives_first() -> None:
    """Li et al.'s setting: a binary task, positives rare, a model that predicts a small
    positive probability for every sample: positives' gradients are the larger."""
    torch.manual_seed(0)
    top = nn.Linear(16, 2)
    with torch.no_grad():
        top.bias.copy_(torch.tensor([3.0, -3.0]))  # p(positive) ~ 0.0025 for every sample
    features, _ = _batch(2, 500, 16, seed=7)
    labels = (torch.rand(500, generator=torch.Generator().manual_seed(8)) < 0.1).long()
    gradients = _cut_gradients(top, features, labels)
    assert auc(norm_scores(gradients), labels == 1) > 0.99
    # and the cosine attack, given one positive, as Li et al. score it
    positive = torch.nonzero(labels == 1).flatten()[:1]
    assert auc(cosine_scores(gradients, positive), labels == 1) > 0.99


def test_one_vs_rest_aucs_of_one_score_average_to_a_half() -> None:
    """[Note: the norm attack is binary]: weighted by the pairs each counts."""
    generator = torch.Generator().manual_seed(9)
    labels = torch.randint(5, (300,), generator=generator)
    scores = torch.randn(300, generator=generator) + labels.float()  # ranks class 4 first
    weights = [int((labels == c).sum()) * int((labels != c).sum()) for c in range(5)]
    aucs = [auc(scores, labels == c) for c in range(5)]
    assert aucs[4] > 0.9
    assert sum(w * a for w, a in zip(weights, aucs, strict=True)) / sum(weights) == (
        pytest.approx(0.5))


def test_auc_by_hand() -> None:
    scores = torch.tensor([0.9, 0.1, 0.5, 0.5, 0.3])
    positive = torch.tensor([True, False, True, False, False])
    # positive 0.9 beats all 3 negatives; positive 0.5 beats 0.1 and 0.3, ties 0.5
    assert auc(scores, positive) == pytest.approx((3 + 2.5) / 6)
    with pytest.raises(ValueError, match="both classes"):
        auc(scores, torch.ones(5, dtype=torch.bool))


def test_known_examples_are_drawn_from_their_class_and_reproducible() -> None:
    labels = torch.tensor([0, 1, 1, 2, 2, 2, 1, 0])
    first = known_examples(labels, 2, torch.Generator().manual_seed(1))
    again = known_examples(labels, 2, torch.Generator().manual_seed(1))
    assert {c: v.tolist() for c, v in first.items()} == {c: v.tolist() for c, v in again.items()}
    assert all(bool((labels[v] == c).all()) and len(v) == 2 for c, v in first.items())
    with pytest.raises(ValueError, match="at least 1"):
        known_examples(labels, 0, torch.Generator())


def test_accuracy_leaves_the_known_rows_out() -> None:
    labels = torch.tensor([0, 1, 2, 3])
    guessed = torch.tensor([0, 1, 0, 0])
    assert accuracy(guessed, labels) == 0.5
    assert accuracy(guessed, labels, leave_out={0: torch.tensor([0]),
                                               1: torch.tensor([1])}) == 0.0
    with pytest.raises(ValueError, match="no row left"):
        accuracy(guessed[:1], labels[:1], leave_out={0: torch.tensor([0])})


def test_rows_flattens_and_joins_the_leaves() -> None:
    joined = rows([torch.ones(3, 2, 2), torch.zeros(3, 5)])
    assert joined.shape == (3, 9)
    assert joined.dtype == torch.float64
    with pytest.raises(ValueError, match="row counts"):
        rows([torch.ones(3, 2), torch.ones(4, 2)])


def test_attacks_refuse_what_they_cannot_use() -> None:
    gradients = torch.randn(4, 3)
    with pytest.raises(ValueError, match="known sample"):
        direction_attack(gradients, {})
    with pytest.raises(ValueError, match="outside"):
        direction_attack(gradients, {0: torch.tensor([4])})
    with pytest.raises(ValueError, match="iterations"):
        cluster_attack(gradients, {0: torch.tensor([0])}, iterations=0)
