"""A device's side of HADFL against hostile or broken peers: every ring message and
average is checked against the rounds it knows ([Note: HADFL rounds]), and what breaks
them is the sender's protocol error (its link is then closed, and the ring bypasses it),
never a corrupted model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aiopipe import RunConfig, VirtualClock
from aiopipe.errors import RemoteProtocolError
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import (
    Plan,
    RingBypass,
    RingChunk,
    RingHandshake,
    RoundStart,
    SyncedModel,
    state_to_wire,
    to_tensor_data,
)
from aiopipe.runtime.compute import Compute
from aiopipe.runtime.holdings import Holdings
from aiopipe.runtime.systems.hadfl.gossip import chunk_bounds
from aiopipe.runtime.systems.hadfl.partial_sync import PartialSync, SyncPlan, flat_state, load_flat

RUN = 77
CONFIG = RunConfig(mode="hadfl", model="vgg5", devices=4, batch_size=16,
                   samples_per_device=32, test_samples=0)


def _device(me: int = 1) -> PartialSync:
    """Device ``me`` in round 0 of a ring 0 -> 1 -> 2 (device 3 left out)."""
    plan = Plan(me, "hadfl", CONFIG.to_mapping(), RUN, inputs=(("float32", (3, 32, 32)),),
                num_classes=10)
    holdings = Holdings.open(CONFIG, plan, None, torch.device("cpu"))
    clock = VirtualClock()
    sync = PartialSync(me=me, holdings=holdings, compute=Compute(clock, Recorder(), "c"),
                       clock=clock, costs=None, config=CONFIG, run_id=RUN)
    sync._round, sync._rings[0] = 0, (0, 1, 2)
    sync._ring = (0, 1, 2)  # averaging
    return sync


def _chunk(sync: PartialSync, *, ring: tuple[int, ...] = (0, 1, 2), step: int = 0,
           chunk: int | None = None, size: int | None = None, round_no: int = 0,
           run: int = RUN) -> RingChunk:
    n = len(ring)
    k = (ring.index(1) - 1) % n if chunk is None else chunk  # what device 1 gets at step 0
    a, b = chunk_bounds(sync._flat_size, n)[k]
    return RingChunk(run, round_no, ring, step, k, to_tensor_data(torch.zeros(size or b - a)))


def test_an_honest_upstream_s_chunk_is_kept() -> None:
    sync = _device()
    sync.deliver("device0", _chunk(sync))
    assert (0, (0, 1, 2), 0) in sync._chunks


@pytest.mark.parametrize(("sender", "changes", "error"), [
    ("device2", {}, "not our upstream"),
    ("device0", {"run": 5}, "another run"),
    ("device0", {"size": 3}, "expected chunk"),
    ("device0", {"chunk": 2}, "expected chunk"),
    ("device0", {"step": 4}, "ring step 4 of a ring of 3"),
    # (the protocol's round 0 is the log's round 1)
    ("device0", {"ring": (0, 1, 3)}, "not part of round 1"),
    ("device0", {"ring": (1, 0, 2)}, "not part of round 1"),
    ("nobody", {}, "another run"),
])
def test_chunks_that_break_the_round_are_refused(sender: str, changes: dict[str, Any],
                                                 error: str) -> None:
    sync = _device()
    with pytest.raises(RemoteProtocolError, match=error):
        sync.deliver(sender, _chunk(sync, **changes))


def test_a_chunk_sent_twice_is_refused_and_an_old_round_s_ignored() -> None:
    sync = _device()
    sync.deliver("device0", _chunk(sync))
    with pytest.raises(RemoteProtocolError, match="twice"):
        sync.deliver("device0", _chunk(sync))
    sync._round = 1
    sync.deliver("device0", _chunk(sync))  # round 0 is over: dropped
    assert not [k for k in sync._chunks if k[0] == 1]


def test_a_shorter_ring_is_news_and_a_longer_one_an_old_attempt() -> None:
    sync = _device()
    sync.deliver("device2", RingBypass(RUN, 0, (1, 2)))
    assert sync._ring == (1, 2)
    assert 0 in sync._dead
    sync.deliver("device0", _chunk(sync))  # of the attempt given up on: dropped
    assert not sync._chunks
    with pytest.raises(RemoteProtocolError, match="not part of round 1"):
        sync.deliver("device2", RingBypass(RUN, 0, (2, 3)))


def test_a_bypassed_member_asking_is_told_the_shorter_ring() -> None:
    sync = _device()
    sent: list[tuple[int, Any]] = []
    sync._send = lambda device, message, name, background=False: sent.append(  # type: ignore[method-assign]
        (device, message))
    sync.deliver("device2", RingBypass(RUN, 0, (1, 2)))  # device 0 is out
    sync.deliver("device0", RingHandshake(RUN, 0, 0))
    assert sent == [(0, RingBypass(RUN, 0, (1, 2)))]
    sync.deliver("device2", RingHandshake(RUN, 0, 0))
    assert sent[-1] == (2, RingHandshake(RUN, 0, 1))


def _average(sync: PartialSync, **changes: Any) -> SyncedModel:
    state = {k: v.clone() for k, v in sync.work.module.state_dict().items()
             if v.is_floating_point()}
    state.update(changes)
    return SyncedModel(RUN, 0, 2.0, state_to_wire(state))


def test_an_average_is_taken_only_from_the_ring_by_a_device_left_out() -> None:
    sync = _device(me=3)
    sync._ring = ()
    sync.deliver("device2", _average(sync))
    assert sync._synced is not None
    assert sync._synced[0] == 0
    member = _device(me=1)
    with pytest.raises(RemoteProtocolError, match="does not send to us"):
        member.deliver("device2", _average(member))
    with pytest.raises(RemoteProtocolError, match="does not send to us"):
        sync.deliver("device3", _average(sync))
    early = _average(sync)
    sync.deliver("device2", SyncedModel(RUN, 5, 2.0, early.tensors))  # not begun: ignored
    assert sync._synced[0] == 0


@pytest.mark.parametrize(("changes", "error"), [
    ({"0.0.weight": torch.zeros(2)}, "synced model"),
    ({"extra": torch.zeros(2)}, "synced model"),
    ({"0.0.weight": None}, "NaN or Inf"),
])
def test_an_average_that_is_not_the_model_is_refused(changes: dict[str, Any], error: str
                                                     ) -> None:
    sync = _device(me=3)
    sync._ring = ()
    if changes.get("0.0.weight", 1) is None:
        weight = sync.work.module.state_dict()["0.0.weight"].clone()
        weight.view(-1)[0] = float("nan")
        changes = {"0.0.weight": weight}
    with pytest.raises(RemoteProtocolError, match=error):
        sync.deliver("device2", _average(sync, **changes))
    assert sync._synced is None


def test_a_round_s_sync_must_be_a_ring_of_the_run() -> None:
    good = {"ring": [0, 1], "sender": 0, "receivers": [2], "learning_rate": 0.1,
            "backup": False, "version": 0.0}
    start = RoundStart(0, 0, 0, 1, {}, 0, 1, 0, 5, 1, 16, 0, "", sync=good)
    assert SyncPlan.of(start, 4).ring == (0, 1)
    for bad in ({"ring": [0, 0]}, {"ring": [0, 9]}, {"sender": 2}, {"receivers": [1]},
                {"learning_rate": -1.0}, {"version": float("nan")}, {"ring": []}):
        with pytest.raises(RemoteProtocolError, match="sync"):
            SyncPlan.of(RoundStart(0, 0, 0, 1, {}, 0, 1, 0, 5, 1, 16, 0, "",
                                   sync={**good, **bad}), 4)
    with pytest.raises(RemoteProtocolError, match="not HADFL's"):
        SyncPlan.of(start.__class__(0, 0, 0, 1, {}, 0, 1, 0, 5, 1, 16, 0, ""), 4)


def test_the_flat_state_holds_every_float_tensor_and_the_version() -> None:
    sync = _device()
    model = sync.work.module
    vector = flat_state(model, 2.5)
    assert vector.numel() == sync._flat_size
    assert load_flat(model, vector * 0 + 1) == 1.0
    assert all(bool((v == 1).all()) for v in model.state_dict().values()
               if v.is_floating_point())
