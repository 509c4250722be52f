"""Which weights each batch uses in FTPipeHD's asynchronous pipeline (paper §III-C), pure.

n stages train one model, stage 0 first. Each stage keeps ``k_i = n − i`` batches in
flight (PipeDream's 1F1B: ``k_i`` forwards, then a backward and a forward in turn), so a
stage's weights change while the batches it forwarded are still on their way. Three
rules decide what a batch computes with:

- **weight stashing**: a batch's backward at a stage uses the weights its forward used
  there;
- **vertical sync**: batch b uses, at every stage, the weights that stage had just after
  applying the update of batch ``b − n`` (the initial weights while ``b < n``): the same
  set of updates everywhere, so the batch sees one consistent model;
- **weight aggregation** (FTPipeHD): at stage i, before the update of batch j is applied
  whenever j is a positive multiple of ``m × k_i`` (``m``: `aggregate_every`), the
  weights after updates ``j − k_i, ..., j − 1`` (the ``k_i`` versions the stage's
  in-flight batches were forwarded with) are averaged, and update j is applied to that
  average. The last stage (``k = 1``) has one version in flight: nothing to average.

Together: ``W_i(j) = base_i(j) − step(grad of batch j at W_i(j − n))``, where
``base_i(j)`` is ``W_i(j − 1)`` or the aggregate. Nothing depends on timing, so what an
asynchronous run computes is defined without a clock (and can be checked against one
process that applies these rules in batch order).

Version numbers are the paper's (Fig. 2): each stage counts its weight changes, one per
applied update and one per aggregation, from 0. With 3 stages: stage 0 forwards batch 3
with version 1 and backwards batch 1 with version 0; after backwarding batch 2 (version
3) it aggregates versions 1–3 into version 4, applies batch 3's update (version 5) and
forwards batch 6 with version 5; stage 2 forwards batch 1 with version 0 although its
weights are at version 1 by then. docs/design.md (FTPipeHD) records these choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from aiopipe.errors import ConfigError

__all__ = ["PassVersion", "aggregates_before", "forward_weights", "one_f_one_b",
           "version_of", "version_table"]


def _check(stages: int, stage: int, aggregate_every: int) -> int:
    if stages < 1 or not 0 <= stage < stages:
        raise ConfigError(f"stage {stage} is not in 0..{stages - 1}")
    if aggregate_every < 0:
        raise ConfigError(f"aggregate_every must be >= 0 (0: never), got {aggregate_every}")
    return stages - stage  # k_i: batches in flight at this stage


def one_f_one_b(stages: int, stage: int, batches: int) -> list[tuple[Literal["F", "B"], int]]:
    """The order of stage ``stage``'s passes over ``batches`` batches: ``k`` forwards,
    then a backward and a forward in turn, then the last backwards (no flush between
    batches: the pipeline runs on).

    Raises:
        ConfigError: the stage is not in the pipeline.
    """
    k = _check(stages, stage, 0)
    order: list[tuple[Literal["F", "B"], int]] = [("F", b) for b in range(min(k, batches))]
    for j in range(batches):
        order.append(("B", j))
        if j + k < batches:
            order.append(("F", j + k))
    return order


def aggregates_before(stages: int, stage: int, update: int, aggregate_every: int) -> bool:
    """Whether stage ``stage`` aggregates its last ``k`` versions just before applying
    the update of batch ``update`` (``aggregate_every`` = m: every ``m × k`` updates; 0:
    never)."""
    k = _check(stages, stage, aggregate_every)
    period = aggregate_every * k
    return k > 1 and period > 0 and update > 0 and update % period == 0


def version_of(stages: int, stage: int, update: int, aggregate_every: int) -> int:
    """The paper's version number of the stage's weights just after applying the update of
    batch ``update`` (−1: the initial weights, version 0)."""
    k = _check(stages, stage, aggregate_every)
    if update < 0:
        return 0
    period = aggregate_every * k
    aggregations = update // period if period > 0 and k > 1 else 0  # before 1..update
    return update + 1 + aggregations


def forward_weights(stages: int, batch: int) -> int:
    """Which update's weights batch ``batch`` uses at every stage (vertical sync): those
    just after the update of batch ``batch − n`` (−1: the initial weights)."""
    return max(batch - stages, -1)


@dataclass(frozen=True, slots=True)
class PassVersion:
    """One pass of a stage and the weights it computes with.

    Attributes:
        kind: "F" (forward) or "B" (backward).
        batch: the batch.
        version: the paper's version number of the weights used (stashed for "B").
        after_update: those weights are the stage's just after this batch's update (−1:
            the initial weights).
    """

    kind: Literal["F", "B"]
    batch: int
    version: int
    after_update: int


def version_table(stages: int, batches: int, aggregate_every: int = 1
                  ) -> list[list[PassVersion]]:
    """Per stage, its passes in order with the weight version each uses (Fig. 2 of the
    paper for ``stages = 3``): what a run's trace must show.

    Raises:
        ConfigError: fewer than one stage, or a negative ``aggregate_every``.
    """
    table = []
    for stage in range(stages):
        row = []
        for kind, batch in one_f_one_b(stages, stage, batches):
            used = forward_weights(stages, batch)
            row.append(PassVersion(kind, batch,
                                   version_of(stages, stage, used, aggregate_every), used))
        table.append(row)
    return table
