"""Label inference from the gradients at a cut: what a party of split learning that
holds no labels learns of them from the gradients it is sent.

Theory of operation. With softmax cross-entropy, the gradient of one sample's loss with
respect to its logits is ``p - e_y`` (its predicted probabilities less the one-hot of
its label), and the gradient at a cut further down is that vector pulled back through
the layers above the cut: ``J(x)^T (p - e_y)``. Its only large negative entry sits at
the label, so

- its **direction** clusters by label: two samples of one class have gradients at a
  positive angle, two of different classes mostly not (Li et al., "Label Leakage and
  Protection in Two-party Split Learning", ICLR 2022, §4.2, the *cosine* or direction
  attack: in a binary task, a sample whose gradient has positive cosine with that of a
  sample known to be positive is positive);
- in a binary task where the positive class is rare, the model soon predicts a small
  ``p`` for every sample, and ``|p - 1|`` of a positive exceeds ``|p|`` of a negative:
  the gradient's **norm** ranks the positives first (Li et al. §4.1, the *norm*
  attack, scored by the AUC of the norm as a positive score). [Note: the norm attack is
  binary]

Implemented here, as pure functions of a matrix of per-sample gradients (one row each;
a cut's tensor flattened per row):

- `norm_scores` and `auc`: the norm attack, as Li et al. score it;
- `cosine_scores`: the cosine attack of a binary task as Li et al. score it (by AUC):
  each sample's cosine with the gradient of a sample known to be positive;
- `direction_attack`: the cosine attack generalised to C classes: the attacker knows the
  label of a few samples per class (Li et al. give it one positive sample; we give it
  ``known`` samples of every class), and labels every other sample with the class of
  the known gradients its own has the largest mean cosine with. With two classes and a
  known sample of each this is Li et al.'s rule up to where the boundary falls;
- `cluster_attack`: spherical k-means over the gradients' directions, with one centroid
  per class started at that class's known gradients, so the clusters are named by the
  known labels: a clustering label inference in the manner of Liu and Lyu,
  "Clustering Label Inference Attack against Practical Split Learning" (2022), who
  cluster the gradients at the cut with k-means; the known samples name the clusters
  here instead of a count of the classes' sizes.

[Note: the norm attack is binary] The norm is one score per sample. In a task of C
classes, the AUCs of "class c against the rest" scored by any one score average, weighted
by the pairs each counts, to exactly 0.5 (each pair of samples of different classes is
counted once for each of the two classes, and ranked right for exactly one): a single
norm cannot rank every class first. Li et al.'s attack is for binary tasks, and is
measured on one here (`bench/label_inference.py`'s binary task).

Nothing here does I/O or reads a clock; every choice at random takes a
`torch.Generator`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.nn import functional

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


def rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One row per sample: each tensor's entries after its first (batch) dimension,
    flattened and joined in order, as float64 (a cut with several leaves, such as a
    skip connection, gives all of them).

    Raises:
        ValueError: no tensors, or tensors with different numbers of rows.
    """
    if not tensors:
        raise ValueError("no tensors to take rows of")
    count = tensors[0].shape[0]
    if any(t.shape[0] != count for t in tensors):
        raise ValueError(f"tensors of different row counts: {[t.shape[0] for t in tensors]}")
    return torch.cat([t.detach().reshape(count, -1).to(torch.float64) for t in tensors],
                     dim=1)


def norm_scores(gradients: torch.Tensor) -> torch.Tensor:
    """Li et al.'s norm attack: each row's L2 norm, a score for "the positive class"."""
    norms: torch.Tensor = torch.linalg.vector_norm(gradients.to(torch.float64), dim=1)
    return norms


def auc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """The area under the ROC curve of ``scores`` for the boolean ``positive``: the
    chance that a positive sample scores above a negative one, ties counting half
    (the Mann-Whitney statistic).

    Raises:
        ValueError: the shapes differ, or one of the two classes is absent.
    """
    if scores.shape != positive.shape or scores.dim() != 1:
        raise ValueError(f"scores {tuple(scores.shape)} and positives "
                         f"{tuple(positive.shape)} must be one equal 1-D shape")
    positive = positive.to(torch.bool)
    pos, neg = scores[positive].to(torch.float64), scores[~positive].to(torch.float64)
    if not len(pos) or not len(neg):
        raise ValueError("the AUC needs samples of both classes")
    above = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(above) / (len(pos) * len(neg))


def known_examples(labels: torch.Tensor, per_class: int,
                   generator: torch.Generator) -> dict[int, torch.Tensor]:
    """What the attacker is given: the indices of ``per_class`` samples of each class
    present in ``labels``, drawn at random (fewer where a class has fewer).

    Raises:
        ValueError: ``per_class`` is below 1.
    """
    if per_class < 1:
        raise ValueError(f"per_class must be at least 1, got {per_class}")
    known = {}
    for label in torch.unique(labels).tolist():
        members = torch.nonzero(labels == label).flatten()
        order = torch.randperm(len(members), generator=generator)
        known[int(label)] = members[order[:per_class]]
    return known


def _directions(gradients: torch.Tensor) -> torch.Tensor:
    """Unit rows (a zero row stays zero)."""
    return functional.normalize(gradients.to(torch.float64), dim=1)


def _check_known(gradients: torch.Tensor, known: Mapping[int, torch.Tensor]) -> list[int]:
    """The known classes, sorted.

    Raises:
        ValueError: no known samples, a class without any, or an index out of range.
    """
    if gradients.dim() != 2:
        raise ValueError(f"gradients must be one row per sample, got {tuple(gradients.shape)}")
    if not known or any(len(v) == 0 for v in known.values()):
        raise ValueError("the attack needs at least one known sample of each class it names")
    for indices in known.values():
        if int(indices.min()) < 0 or int(indices.max()) >= gradients.shape[0]:
            raise ValueError(f"a known index is outside the {gradients.shape[0]} rows")
    return sorted(known)


def cosine_scores(gradients: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Li et al.'s cosine attack as a score: each row's mean cosine with the rows at
    ``indices`` (in a binary task, samples known to be positive; scored by `auc`).

    Raises:
        ValueError: no indices, or one out of range; ``gradients`` not 2-D.
    """
    _check_known(gradients, {1: indices})
    unit = _directions(gradients)
    return unit @ unit[indices].mean(dim=0)


def direction_attack(gradients: torch.Tensor,
                     known: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """The cosine attack for C classes: each row's label guessed as the class whose
    known rows' directions its own direction has the largest mean cosine with
    (``known``: class -> indices of rows whose label the attacker knows).

    Raises:
        ValueError: see `known_examples`' output: ``known`` empty, a class without rows,
            an index out of range; ``gradients`` not 2-D.
    """
    classes = _check_known(gradients, known)
    unit = _directions(gradients)
    references = torch.stack([unit[known[c]].mean(dim=0) for c in classes])
    best = (unit @ references.T).argmax(dim=1)
    return torch.tensor(classes, dtype=torch.int64)[best]


def cluster_attack(gradients: torch.Tensor, known: Mapping[int, torch.Tensor], *,
                   iterations: int = 20) -> torch.Tensor:
    """Spherical k-means over the rows' directions, one cluster per known class, started
    at the mean direction of that class's known rows; each row's label guessed as its
    cluster's class. The known rows stay in their own class's cluster (the attacker
    knows them). Stops early when no row changes cluster.

    Raises:
        ValueError: as `direction_attack`, or ``iterations`` below 1.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")
    classes = _check_known(gradients, known)
    unit = _directions(gradients)
    centroids = torch.stack([unit[known[c]].mean(dim=0) for c in classes])
    assigned = torch.full((unit.shape[0],), -1, dtype=torch.int64)
    for _ in range(iterations):
        new = (unit @ _directions(centroids).T).argmax(dim=1)
        for slot, c in enumerate(classes):
            new[known[c]] = slot
        if torch.equal(new, assigned):
            break
        assigned = new
        for slot in range(len(classes)):
            members = unit[assigned == slot]
            if len(members):  # an empty cluster keeps its centroid
                centroids[slot] = members.mean(dim=0)
    return torch.tensor(classes, dtype=torch.int64)[assigned]


def accuracy(guessed: torch.Tensor, labels: torch.Tensor,
             leave_out: Mapping[int, torch.Tensor] | None = None) -> float:
    """The share of rows whose guessed label is right, leaving out the rows whose label
    the attacker was given (``leave_out``, as `known_examples` returns).

    Raises:
        ValueError: the shapes differ, or no row is left.
    """
    if guessed.shape != labels.shape:
        raise ValueError(f"guessed {tuple(guessed.shape)} and labels {tuple(labels.shape)} "
                         "differ in shape")
    keep = torch.ones(labels.shape[0], dtype=torch.bool)
    for indices in (leave_out or {}).values():
        keep[indices] = False
    if not bool(keep.any()):
        raise ValueError("no row left to score")
    return float((guessed[keep] == labels[keep]).to(torch.float64).mean())
