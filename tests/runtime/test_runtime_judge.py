"""The arrival judge and the exclusion rule, alone (aiopipe.runtime.judge,
aiopipe.runtime.exclusion; [Note: judging arrivals], [Note: whose word excludes])."""

from __future__ import annotations

import pickle
import statistics

import pytest
import torch

from aiopipe.errors import ConfigError, NeighbourFaultError, PoisonedValueError
from aiopipe.protocol import Activation, Gradient, to_tensor_data
from aiopipe.runtime.exclusion import Exclusions
from aiopipe.runtime.judge import RECENT, ArrivalJudge, scale_of


def _activation(tensor: torch.Tensor, micro_batch: int = 0) -> Activation:
    return Activation(1, 0, 0, 0, micro_batch, 0, "device0", "device1",
                      (to_tensor_data(tensor),), to_tensor_data(torch.zeros(len(tensor),
                                                                         dtype=torch.int64)))


def test_scale_is_the_largest_magnitude_and_shows_nan_and_inf() -> None:
    assert scale_of(torch.tensor([0.5, -3.0, 2.0])) == 3.0
    assert scale_of(torch.empty(0)) == 0.0
    assert scale_of(torch.tensor([1.0, float("inf")])) == float("inf")
    assert scale_of(torch.tensor([1.0, float("nan")])) != scale_of(torch.tensor([1.0]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused_naming_the_sender(bad: float) -> None:
    judge = ArrivalJudge()
    tensor = torch.ones(4, 3)
    tensor[2, 1] = bad
    with pytest.raises(PoisonedValueError, match=r"device0 sent values out of range: .*NaN"):
        judge.judge("device0", "activation@2", tensor, what="activation (0, 0, 0)")


def test_a_stream_is_judged_against_its_own_recent_scales() -> None:
    judge = ArrivalJudge(limit=1000)
    scales = [1.3 ** step for step in range(40)]  # honest drift: 36,000x over the run
    for scale in scales:
        judge.judge("device0", "activation@2", torch.full((3,), scale), what="a")
    median = statistics.median(scales[-RECENT:])
    judge.judge("device0", "activation@2", torch.full((3,), median * 900), what="a")
    with pytest.raises(PoisonedValueError, match="times the scale of its earlier ones"):
        judge.judge("device0", "activation@2", torch.full((3,), median * 1e6), what="a")
    # one sender's history is its own: another sender's stream starts afresh
    judge.judge("device3", "activation@2", torch.full((3,), 1e9), what="a")


def test_the_first_tensors_of_a_stream_are_judged_against_the_prior() -> None:
    judge = ArrivalJudge(limit=1000)
    judge.set_cut_priors([(1.0, 0.01), (2.0, 0.02)])
    assert judge.priors == {"activation@0": 1.0, "gradient@0": 0.01, "activation@1": 2.0,
                            "gradient@1": 0.02}
    with pytest.raises(PoisonedValueError, match="this cut's in the initial model"):
        judge.judge_data("device0", _activation(torch.full((2, 3), 2.0e6)), first_unit=1,
                         stop_unit=3)
    judge.judge_data("device0", _activation(torch.full((2, 3), 50.0)), first_unit=1,
                     stop_unit=3)
    gradient = Gradient(1, 2, 0, 0, 0, 0, "device2", "device1",
                        (to_tensor_data(torch.full((2, 3), 1e6)),))
    judge.judge_data("device2", gradient, first_unit=1, stop_unit=3)  # no prior at cut 3


def test_zeros_set_no_reference() -> None:
    judge = ArrivalJudge()
    judge.judge("device0", "g", torch.zeros(5), what="g")
    judge.judge("device0", "g", torch.full((5,), 1e-3), what="g")
    judge.judge("device0", "g", torch.full((5,), 0.9), what="g")
    with pytest.raises(PoisonedValueError):
        judge.judge("device0", "g", torch.full((5,), 1e3), what="g")


def test_named_tensors_are_judged_against_the_receivers_own_as_a_whole() -> None:
    judge = ArrivalJudge(limit=1000)
    own = {"w": torch.full((4,), 0.5), "b": torch.full((2,), 1e-9)}
    honest = {"w": to_tensor_data(torch.full((4,), 0.7)),
              "b": to_tensor_data(torch.full((2,), 1e-3))}  # tiny in one copy: no matter
    judge.judge_tensors("device1", "weights", honest, what="average", own=own)
    scaled = dict(honest, w=to_tensor_data(torch.full((4,), 0.7e6)))
    with pytest.raises(PoisonedValueError, match="the receiver's own"):
        judge.judge_tensors("device1", "weights", scaled, what="average", own=own)
    nan = dict(honest, b=to_tensor_data(torch.tensor([0.0, float("nan")])))
    with pytest.raises(PoisonedValueError, match="average: b holds NaN"):
        judge.judge_tensors("device1", "weights", nan, what="average", own=own)
    ints = {"n": to_tensor_data(torch.tensor([10 ** 12]))}  # counters are not values
    judge.judge_tensors("device1", "weights", ints, what="average", own=own)


def test_against_a_scale() -> None:
    judge = ArrivalJudge(limit=10)
    judge.judge_against("device1", torch.full((3,), 9.0), 1.0, what="chunk")
    with pytest.raises(PoisonedValueError, match="11 times"):
        judge.judge_against("device1", torch.full((3,), 11.0), 1.0, what="chunk")


@pytest.mark.parametrize("limit", [1, 0.5, True, "10"])
def test_a_limit_must_be_above_one(limit: object) -> None:
    with pytest.raises(ConfigError):
        ArrivalJudge(limit=limit)  # type: ignore[arg-type]


def test_the_errors_name_the_sender_and_survive_pickling() -> None:
    poisoned = PoisonedValueError("device4", "x holds NaN or Inf")
    fault = NeighbourFaultError("device4", poisoned)
    assert str(fault) == "device4 sent values out of range: x holds NaN or Inf"
    assert str(NeighbourFaultError("device2", "sent F (0, 0, 0) twice")) == (
        "device2 broke the protocol: sent F (0, 0, 0) twice")
    for error in (poisoned, fault):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)
    assert pickle.loads(pickle.dumps(fault)).culprit == "device4"


def test_the_accused_is_excluded_and_a_device_that_names_too_many_is() -> None:
    exclusions = Exclusions(tolerated=1)
    assert exclusions.accuse(2, 1, "values") == (1, "device 2 refused what it sent: values")
    assert exclusions.refusal(1).startswith("device 1 was excluded from the run: device 2")
    assert exclusions.refusal(2) == ""
    assert exclusions.accuse(3, 1, "again") is None  # excluded already
    assert exclusions.accuse(1, 2, "revenge") is None  # the excluded have no word
    liar = Exclusions(tolerated=1)
    assert liar.accuse(0, 1, "lie")[0] == 1  # type: ignore[index]
    verdict = liar.accuse(0, 2, "another lie")
    assert verdict is not None
    assert verdict[0] == 0
    assert "more than the 1 faulty device(s)" in verdict[1]
    assert liar.accuse(0, 2, "lie") is None
    two = Exclusions(tolerated=2)  # byzantine_devices = 2: two culprits may be named
    assert two.accuse(0, 1, "a")[0] == 1  # type: ignore[index]
    assert two.accuse(0, 2, "b")[0] == 2  # type: ignore[index]
    assert two.accuse(0, 3, "c")[0] == 0  # type: ignore[index]


def test_without_a_prior_the_coordinator_judges_a_first_tensor_by_the_other_senders() -> None:
    """The coordinator's judge (``others_as_prior``) with no measure of a cut: a device's
    first tensor there is judged against the other devices' streams of that cut."""
    judge = ArrivalJudge(limit=1000, others_as_prior=True)
    for scale in (1.0, 1.2, 0.9):
        judge.judge("device0", "activation@2", torch.full((3,), scale), what="a")
    judge.judge("device1", "activation@2", torch.full((3,), 500.0), what="a")
    with pytest.raises(PoisonedValueError, match="the other senders' ones"):
        judge.judge("device2", "activation@2", torch.full((3,), 1e6), what="a")
    judge.judge("device2", "activation@3", torch.full((3,), 1e6), what="a")  # no one else's
