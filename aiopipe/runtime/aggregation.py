"""Aggregating the devices' whole models into the next global model.

- `fedavg`: M = sum_k |D_k| / sum_j |D_j| * M_k (PiPar Eq. 3), weighted by samples;
- `fedmedian`: the coordinate-wise median (Yin et al. 2018; Flower's FedMedian),
  unweighted;
- `trimmed_mean`: per coordinate, drop the ``trim`` fraction of highest and of lowest
  values and average the rest (Yin et al. 2018; Flower's FedTrimmedAvg), unweighted;
- `krum`: the one model whose summed squared distance to its n - f - 2 nearest others is
  least, for at most f Byzantine devices (Blanchard et al. 2017; Flower's Krum).

`UpdateJudge` judges every update (a device's model minus the round's starting model)
whatever the options, and the aggregate before it is installed ([Note: judging updates]).
`screen_updates` then applies the run's ``outliers``: an update whose norm is more than
``limit`` times the round's median is clipped to the median's norm or dropped.
`aggregate` applies an aggregator by name; a run's aggregation is its strategy
(aiopipe.strategies), whose built-ins call these functions, handed to `judged_aggregate`
as ``combine``.

The robust three bound what a few devices can do to the result, whatever they send:
the median and the trimmed mean per coordinate, Krum by picking a model that many
others are close to. Each takes the devices' states (identical keys and shapes) and
returns a state of the same dtypes; integer entries (batch norm's
``num_batches_tracked``) are computed in float64 and rounded.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from aiopipe.errors import ConfigError, TrainingError
from aiopipe.models.crossing import Value

__all__ = ["LOSS_RISE_LIMIT", "UPDATE_SCALE_LIMIT", "Combine", "Probe", "UpdateJudge",
           "aggregate", "evaluation_probe", "fedavg", "fedmedian", "judged_aggregate", "krum",
           "screen_updates", "trimmed_mean", "update_norms"]

#: How many times the run's own scale an update's norm may be before it is refused,
#: whatever the options (the default of ``scale_limit``; [Note: judging updates]):
#: honest updates of a round differ by a few times; a model scaled by 1e6 is ~1e6 times
#: its own norm away.
UPDATE_SCALE_LIMIT = 1000.0
#: The accepted update norms whose median is the run's scale (when a round has fewer
#: than three updates to take a median of).
RECENT_NORMS = 64
#: How many times the round's starting loss (or a blank model's, if higher) an aggregate's
#: loss on the coordinator's evaluation batch may be before it is not installed.
LOSS_RISE_LIMIT = 10.0

#: A state's loss on the coordinator's evaluation batch, and a blank prediction's (zero
#: logits: ln C for cross-entropy), as `evaluation_probe` makes it.
Probe = Callable[[Mapping[str, torch.Tensor]], tuple[float, float]]
#: The next global state from some devices' states (`judged_aggregate`).
Combine = Callable[[Mapping[int, Mapping[str, torch.Tensor]]], dict[str, torch.Tensor]]


def fedavg(states: Sequence[Mapping[str, torch.Tensor]],
           weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """Weighted average of state dicts with identical keys and shapes.

    Floating tensors are averaged in float64 and cast back to their dtype. Integer
    tensors (batch norm's ``num_batches_tracked``) are averaged and rounded.

    Raises:
        TrainingError: no states, mismatched keys or shapes, or weights that do not sum
            to a positive number.
    """
    if not states or len(states) != len(weights):
        raise TrainingError(f"fedavg needs one weight per state, got {len(states)} states "
                            f"and {len(weights)} weights")
    total = float(sum(weights))
    if not total > 0 or any(w < 0 for w in weights):
        raise TrainingError(f"fedavg weights must be >= 0 with a positive sum, got {list(weights)}")
    keys = list(states[0])
    for state in states[1:]:
        if list(state) != keys:
            raise TrainingError("fedavg: the models do not have the same parameters")
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        first = states[0][key]
        for state in states[1:]:
            if state[key].shape != first.shape:
                raise TrainingError(f"fedavg: {key} has shape {tuple(state[key].shape)} and "
                                    f"{tuple(first.shape)}")
        # in place: one float64 buffer per tensor, no temporaries (faster on big models)
        acc = first.detach().to(torch.float64, copy=True).mul_(weights[0] / total)
        for state, weight in zip(states[1:], weights[1:], strict=True):
            acc.add_(state[key].detach(), alpha=weight / total)
        out[key] = (acc if first.is_floating_point() else acc.round_()).to(first.dtype)
    return out


def fedmedian(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The coordinate-wise median of ``states`` (the mean of the two middle values when
    their number is even).

    Raises:
        TrainingError: no states, or mismatched keys or shapes.
    """
    n = len(states)
    out: dict[str, torch.Tensor] = {}
    for key, stack, like in _stacks(states, "fedmedian"):
        ordered = stack.sort(dim=0).values
        middle = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        out[key] = _cast(middle, like)
    return out


def trimmed_mean(states: Sequence[Mapping[str, torch.Tensor]], trim: float
                 ) -> dict[str, torch.Tensor]:
    """Per coordinate, the mean of the values left when the floor(trim x n) highest and
    as many lowest are dropped.

    Raises:
        TrainingError: no states, mismatched keys or shapes, or a ``trim`` outside
            [0, 0.5) (or one that would drop every value).
    """
    n = len(states)
    if not 0 <= trim < 0.5:
        raise TrainingError(f"trimmed_mean: trim must be in [0, 0.5), got {trim!r}")
    cut = math.floor(trim * n)
    out: dict[str, torch.Tensor] = {}
    for key, stack, like in _stacks(states, "trimmed_mean"):
        ordered = stack.sort(dim=0).values
        out[key] = _cast(ordered[cut:n - cut].mean(dim=0), like)
    return out


def krum(states: Sequence[Mapping[str, torch.Tensor]], byzantine: int, *,
         keep: int = 1) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Krum (``keep = 1``) or Multi-Krum: each model's score is the sum of its squared
    distances (over every floating entry) to its n - f - 2 nearest other models; the
    result is the mean of the ``keep`` lowest-scored models; with the indices chosen.

    Raises:
        TrainingError: no states, mismatched keys or shapes, or fewer than f + 3 states
            (Krum needs n > f + 2), or ``keep`` outside 1..n.
    """
    n = len(states)
    if byzantine < 0 or n < byzantine + 3:
        raise TrainingError(f"krum: {n} models cannot tolerate {byzantine} Byzantine "
                            f"ones (it needs n >= f + 3)")
    if not 1 <= keep <= n:
        raise TrainingError(f"krum: keep must be in 1..{n}, got {keep}")
    stacks = _stacks(states, "krum")
    flat = torch.cat([stack.reshape(n, -1) for _, stack, like in stacks
                      if like.is_floating_point()], dim=1)
    distances = torch.cdist(flat, flat).square()
    nearest = n - byzantine - 2
    scores = [float(row[[j for j in range(n) if j != i]].sort().values[:nearest].sum())
              for i, row in enumerate(distances)]
    chosen = sorted(range(n), key=lambda i: (scores[i], i))[:keep]
    return {key: _cast(stack[chosen].mean(dim=0), like) for key, stack, like in stacks}, chosen


def _stacks(states: Sequence[Mapping[str, torch.Tensor]], what: str
            ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Per key: the states' values stacked along a new first dimension (float64), and
    the first state's value (for its dtype).

    Raises:
        TrainingError: no states, mismatched keys or shapes.
    """
    if not states:
        raise TrainingError(f"{what} needs at least one model")
    keys = list(states[0])
    if any(list(state) != keys for state in states[1:]):
        raise TrainingError(f"{what}: the models do not have the same parameters")
    out = []
    for key in keys:
        first = states[0][key]
        if any(state[key].shape != first.shape for state in states[1:]):
            raise TrainingError(f"{what}: {key} has different shapes")
        out.append((key, torch.stack([state[key].detach().to(torch.float64)
                                      for state in states]), first))
    return out


def _cast(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return (value if like.is_floating_point() else value.round()).to(like.dtype)


def screen_updates(states: Mapping[int, Mapping[str, torch.Tensor]],
                   start: Mapping[str, torch.Tensor], *, action: str, limit: float,
                   norms: Mapping[int, float] | None = None
                   ) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, float]]:
    """The devices' ``states`` with outliers handled, and the outliers (device: its
    update's norm over the round's median).

    An update is a state minus ``start`` over the floating entries (weights and batch
    norm's statistics alike); its norm is compared with the median of the round's: more
    than ``limit`` times it is an outlier. With fewer than three devices no median tells
    an outlier from the rest, and nothing is screened. ``action``: "keep"; "clip": an
    outlier is scaled down to the median's norm, so that it moves the aggregate no
    further than a typical update of the round does (its direction is kept: a steady
    attacker still pulls, as far as one honest device pushes); "drop": left out.
    A non-finite update is dropped either way. ``norms``: the updates' norms when they
    are known (`update_norms`).
    """
    kept = {k: dict(state) for k, state in states.items()}
    if action == "keep" or len(states) < 3:
        return kept, {}
    if norms is None:
        norms = update_norms(states, start)
    norms = {k: norms[k] for k in states}
    ordered = sorted(norms.values())
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    if not median > 0:
        return kept, {}
    outliers = {k: norm / median for k, norm in norms.items()
                if not norm <= limit * median}  # NaN and inf norms are outliers too
    for k, ratio in outliers.items():
        if action == "drop" or not math.isfinite(ratio):
            del kept[k]
        else:
            scale = 1 / ratio  # to the median's norm
            kept[k] = {key: start[key] + (value - start[key]) * scale
                       if value.is_floating_point() else value
                       for key, value in states[k].items()}
    return kept, outliers


def aggregate(states: Mapping[int, Mapping[str, torch.Tensor]], weights: Mapping[int, float],
              *, method: str, trim: float = 0.2, byzantine: int = 1) -> dict[str, torch.Tensor]:
    """The next global model from the devices' ``states`` by ``method`` ("fedavg",
    weighted by ``weights``; "fedmedian"; "trimmed-mean" with ``trim``; "krum" with at
    most ``byzantine`` bad devices, falling back to the median when too few devices are
    left for it).

    Raises:
        TrainingError: no states, mismatched states, or an unknown method.
    """
    ids = sorted(states)
    models = [states[k] for k in ids]
    if method == "fedavg":
        return fedavg(models, [weights[k] for k in ids])
    if method == "fedmedian" or (method == "krum" and len(models) < byzantine + 3):
        return fedmedian(models)
    if method == "trimmed-mean":
        return trimmed_mean(models, trim)
    if method == "krum":
        return krum(models, byzantine)[0]
    raise TrainingError(f"unknown aggregation {method!r}")


def _update_norm(state: Mapping[str, torch.Tensor],
                 start: Mapping[str, torch.Tensor] | None) -> float:
    """The norm of ``state`` minus ``start`` (None: of ``state`` itself) over the floating
    entries, in float64."""
    total = 0.0
    for key, value in state.items():
        if value.is_floating_point():
            step = value.double() if start is None else value.double() - start[key].double()
            total += float(step.square().sum())
    return math.sqrt(total)


def judged_aggregate(states: Mapping[int, Mapping[str, torch.Tensor]],
                     weights: Mapping[int, float], norms: Mapping[int, float],
                     start: Mapping[str, torch.Tensor], *, judge: UpdateJudge, scale: float,
                     method: str = "fedavg", trim: float = 0.2, byzantine: int = 1,
                     combine: Combine | None = None
                     ) -> tuple[dict[str, torch.Tensor] | None, dict[int, str]]:
    """The aggregate of ``states`` (``combine``, a run's strategy: aiopipe.strategies;
    without it `aggregate` by ``method``) that ``judge`` lets be installed, and the
    devices left out to get it, with why; None when none passes (the round's start
    stays). ``combine`` may be called several times, on subsets of ``states``; the
    aggregate returned is always that of its last call. While the aggregate has a
    problem (`UpdateJudge.aggregate_problem`), the device whose leaving out fixes it is
    left out, the largest update tried first (one trial when that is the culprit); when
    no single one does, the largest is left out and the rest tried again.

    Raises:
        TrainingError: see `aggregate`.
    """
    ceiling = judge.loss_ceiling(start)

    def judged(ids: Sequence[int]) -> tuple[dict[str, torch.Tensor], str]:
        chosen = {k: states[k] for k in ids}
        state = (combine(chosen) if combine is not None else
                 aggregate(chosen, weights, method=method, trim=trim, byzantine=byzantine))
        return state, judge.aggregate_problem(state, start, scale, ceiling)

    ids = sorted(states)
    state, problem = judged(ids)
    left_out: dict[int, str] = {}
    while problem and len(ids) > 1:
        by_size = sorted(ids, key=lambda k: (-norms[k], k))
        culprit, fixed = by_size[0], None
        for k in by_size:
            rest = [j for j in ids if j != k]
            if sum(weights[j] for j in rest) > 0 and not (trial := judged(rest))[1]:
                culprit, fixed = k, trial
                break
        left_out[culprit] = f"the round's aggregate with it was refused: {problem}"
        ids = [j for j in ids if j != culprit]
        if not sum(weights[j] for j in ids) > 0:
            return None, left_out
        state, problem = fixed or judged(ids)
    return (None if problem else state), left_out


def update_norms(states: Mapping[int, Mapping[str, torch.Tensor]],
                 start: Mapping[str, torch.Tensor]) -> dict[int, float]:
    """Each device's update norm: its state minus ``start`` over the floating entries
    (NaN or inf when the state holds such values, or overflows)."""
    return {k: _update_norm(state, start) for k, state in states.items()}


class UpdateJudge:
    """[Note: judging updates] Every star round, whatever ``outliers`` and
    ``aggregation`` say, each device's update is judged before it is averaged, and the
    aggregate before it is installed:

    - an update that is not finite is refused;
    - an update whose norm is more than ``limit`` times the run's own scale is refused.
      The scale is the median of the round's finite update norms when there are at
      least three (one device cannot move it); with fewer (sl's turns, sampled rounds
      of two), the median of the last `RECENT_NORMS` accepted norms; before any, the
      norm of the round's starting model itself (an honest round does not move a model
      by a thousand times its own size);
    - the aggregate must be finite, move the model by no more than ``limit`` times the
      same scale and, where the coordinator has evaluation data (``probe``), give a
      finite loss on its batch of no more than `LOSS_RISE_LIMIT` times the round's
      start's (or a blank model's, if higher). An update under ``limit`` can still wreck
      FedAvg (x900 took the loss to 1e6, then every device's to NaN): this catches it.
      If the aggregate fails, the device whose leaving out makes it pass is refused
      (`judged_aggregate`); if none does, the round's starting model stays.

    A refused update is left out like a lost device's round (the others reweighted) and
    its device named with the reason; it is judged afresh the next round (nobody is
    excluded for the rest of the run: see docs/design.md). The limits are far above
    honest spread, so honest runs are never touched (`outliers = "keep"` stays PiPar's
    FedAvg, bit for bit); they bound what one update can do to the model, they do not
    tell a subtle attacker from an honest device (the robust options do that).

    Raises:
        ConfigError: ``limit`` is not a number > 1.
    """

    def __init__(self, limit: float = UPDATE_SCALE_LIMIT, *, probe: Probe | None = None
                 ) -> None:
        if not limit > 1:
            raise ConfigError(f"the update scale limit must be a number > 1, got {limit!r}")
        self.limit = float(limit)
        self.probe = probe
        self.recent: deque[float] = deque(maxlen=RECENT_NORMS)
        #: the probe's figures of the model rounds start from (None: not measured yet),
        #: and of the aggregate judged last (`installed` makes it the next start's)
        self._start_figures: tuple[float, float] | None = None
        self._judged_figures: tuple[float, float] | None = None

    def scale(self, norms: Mapping[int, float], start: Mapping[str, torch.Tensor]
              ) -> tuple[float, str]:
        """The round's reference norm and what it is (for the log); 0.0 when nothing
        gives one (a model of zeros before any accepted update)."""
        finite = [n for n in norms.values() if math.isfinite(n)]
        if len(finite) >= 3 and statistics.median(finite) > 0:
            return statistics.median(finite), "the round's median update"
        if self.recent and statistics.median(self.recent) > 0:
            return statistics.median(self.recent), "the run's recent updates"
        own = _update_norm(start, None)
        return (own, "the model's own norm") if math.isfinite(own) else (0.0, "")

    def refusals(self, norms: Mapping[int, float], start: Mapping[str, torch.Tensor]
                 ) -> dict[int, str]:
        """The devices whose update is refused, with why."""
        scale, against = self.scale(norms, start)
        out: dict[int, str] = {}
        for k, norm in sorted(norms.items()):
            if not math.isfinite(norm):
                out[k] = f"its update is not finite (norm {norm})"
            elif scale > 0 and norm > self.limit * scale:
                out[k] = (f"its update's norm {norm:.3g} is {norm / scale:.3g} x "
                          f"{against} ({scale:.3g}; the limit is {self.limit:g} x)")
        return out

    def loss_ceiling(self, start: Mapping[str, torch.Tensor]) -> float:
        """The highest loss on the evaluation batch an aggregate of the round that
        starts from ``start`` may have: `LOSS_RISE_LIMIT` x the start's, or a blank
        model's if higher (so that a well-trained start is no trap for an honest round);
        inf without a probe, or when neither is a positive number."""
        if self.probe is None:
            return math.inf
        if self._start_figures is None:
            self._start_figures = self.probe(start)
        reference = max((v for v in self._start_figures if math.isfinite(v)), default=0.0)
        return LOSS_RISE_LIMIT * reference if reference > 0 else math.inf

    def installed(self) -> None:
        """The aggregate judged last (and passed) is now the model: the next round
        starts from it, and its probe figures need not be measured again."""
        self._start_figures = self._judged_figures

    def forget(self) -> None:
        """The model was replaced some other way (a checkpoint): measure it anew."""
        self._start_figures = None

    def aggregate_problem(self, state: Mapping[str, torch.Tensor],
                          start: Mapping[str, torch.Tensor], scale: float,
                          ceiling: float = math.inf) -> str:
        """Why the aggregate ``state`` must not be installed ("" when it may): not
        finite, its step beyond ``limit`` x ``scale``, or its loss on the evaluation
        batch not finite or above ``ceiling`` (`loss_ceiling`)."""
        self._judged_figures = None
        norm = _update_norm(state, start)
        if not math.isfinite(norm):
            return f"it is not finite (its step's norm is {norm})"
        if scale > 0 and norm > self.limit * scale:
            return f"its step's norm {norm:.3g} is {norm / scale:.3g} x the round's scale"
        if self.probe is not None and math.isfinite(ceiling):
            self._judged_figures = self.probe(state)
            loss = self._judged_figures[0]
            if not loss <= ceiling:
                return (f"its loss on the coordinator's evaluation batch is {loss:.3g}, "
                        f"above {ceiling:.3g} ({LOSS_RISE_LIMIT:g} x the round's start's "
                        "or a blank model's)")
        return ""

    def accept(self, norms: Iterable[float]) -> None:
        """Remember the norms of updates that went into an installed model."""
        self.recent.extend(n for n in norms if math.isfinite(n))


def evaluation_probe(model: nn.Module, loss: Callable[[Any, torch.Tensor], torch.Tensor],
                     batch: tuple[Value, torch.Tensor]) -> Probe:
    """A `Probe`: ``model``'s architecture with a given state, in evaluation mode and
    without gradients, on ``batch`` (the model's own weights, buffers and modes are left
    as they were)."""
    x, y = batch

    def probe(state: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            with torch.no_grad():
                logits = torch.func.functional_call(model, dict(state), (x,))
                return float(loss(logits, y)), _blank_loss(loss, logits, y)
        finally:
            for module, training in modes:
                module.training = training

    return probe


def _blank_loss(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                logits: torch.Tensor, labels: torch.Tensor) -> float:
    """``loss`` of zero logits (ln C for cross-entropy); NaN where a user's loss does
    not take them."""
    try:
        return float(loss(torch.zeros_like(logits), labels))
    except (RuntimeError, ValueError):
        return math.nan
