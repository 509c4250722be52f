"""FTPipeHD's recovery between real processes over real websockets (paper §IV-E): a
server and four device processes linked device to device; workers are SIGKILLed
mid-round. Training resumes on the devices left (the round under way is played again,
re-partitioned among them, from its latest chain replica that survived whole or else
from its start), every epoch trains each of device 0's batches once, and the recovery
is in ``metrics.jsonl`` and on the timeline."""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
from collections import Counter
from typing import Any

import pytest
from real_processes import Process, ProcessFleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = {"mode": "ftpipehd", "devices": 4, "model": "vgg5", "samples_per_device": 1600,
       "batch_size": 20, "epochs": 3, "momentum": 0.5, "learning_rate": 0.02,
       "global_replication_every": 20, "chain_replication_every": 5, "test_samples": 200,
       "heartbeat_interval": 0.5,
       "device_timeout": 5.0, "reconnect_grace": 2.0}


async def _run(tmp_path: Any, killed: tuple[int, ...], *, restart: bool = False
               ) -> tuple[list[dict[str, Any]], ProcessFleet]:
    """Train, killing ``killed`` in epoch 2 (and starting them again at once:
    ``restart``); the epochs' metrics."""
    async with ProcessFleet(tmp_path, RUN) as fleet:
        server = await fleet.start_server()
        devices = [await fleet.start_device(k, "--listen", "127.0.0.1:0") for k in range(4)]
        await server.output.wait_for(r"^\s+1\s", within=120)  # epoch 1's row: epoch 2 runs
        await asyncio.sleep(0.3)
        for k in killed:
            devices[k].send_signal(signal.SIGKILL)
        for k in killed:
            assert await devices[k].wait(30) == -signal.SIGKILL
        left: list[Process] = [d for k, d in enumerate(devices) if k not in killed]
        if restart:
            left += [await fleet.start_device(k, "--listen", "127.0.0.1:0") for k in killed]
        await fleet.finish(server, left, within=240)
    epochs = fleet.metrics()
    assert [e["samples"] for e in epochs] == [1600] * 3  # each batch once, every epoch
    _each_batch_committed_once(fleet, epochs)
    assert all(math.isfinite(e["loss"]) for e in epochs)
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    return epochs, fleet


def _each_batch_committed_once(fleet: ProcessFleet, epochs: list[dict[str, Any]]) -> None:
    """The committed ids: every batch's backward on the first stage (its update is then
    applied everywhere) is in the trace exactly once, but for the batches a recovery kept
    from the attempt it gave up on (``committed``). The first stage's backwards of a
    round's batches from before a recovery noticed its fault are not counted: they are
    of an attempt given up on (which reports its trace when the first stage finished its
    part before a later stage died), and ``committed`` counts what was kept of it."""
    trace = json.loads((fleet.out_dir / "trace.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("name") == "thread_name"}
    batches = RUN["samples_per_device"] // RUN["batch_size"]
    for epoch, metrics in enumerate(epochs):
        backwards = [(e["ts"] / 1e6, e["args"]["iteration"] + e["args"]["micro_batch"])
                     for e in trace["traceEvents"] if e.get("ph") == "X"
                     and names[e["tid"]] == "device0/compute" and e["cat"] == "b"
                     and e["args"]["epoch"] == epoch]
        given_up = [(change["noticed_s"], change["committed"][0], change["batches"][1])
                    for change in metrics["changes"] if "noticed_s" in change]
        committed = Counter(batch for at, batch in backwards if not any(
            at < noticed and first <= batch < stop for noticed, first, stop in given_up))
        for change in metrics["changes"]:
            first, stop = change.get("committed", (0, 0))
            committed.update(range(first, stop))
        assert committed == Counter(range(batches)), (epoch, sorted(
            b for b, n in (Counter(range(batches)) - committed).items() if n), sorted(
            b for b, n in (committed - Counter(range(batches))).items() if n))


def _recovery(epochs: list[dict[str, Any]]) -> dict[str, Any]:
    recoveries = [c for e in epochs for c in e["changes"] if "lost" in c]
    assert recoveries, epochs
    return recoveries[-1]


async def test_a_sigkilled_worker_s_round_is_played_again_by_the_others(tmp_path: Any
                                                                       ) -> None:
    epochs, _ = await _run(tmp_path, (2,))
    recovery = _recovery(epochs)
    assert recovery["workers"] == [0, 1, 3]
    assert epochs[1]["devices_lost"] == [2]
    assert [p["device"] for p in epochs[2]["plan"]] == [0, 1, 3]
    assert len(recovery["after"]) == 2
    # from a chain point (every 5 batches) or, before the first, the round's start
    assert recovery["batches"][0] % RUN["chain_replication_every"] == 0
    # a neighbour said its round stopped (its link to device 2 broke, or could not be
    # made if the kill fell between rounds); the round was played again once the
    # coordinator had given device 2 up, at most reconnect_grace later
    assert re.search(r"device ?2", recovery["stopped"]), recovery
    grace = RUN["reconnect_grace"]
    assert 0 <= recovery["resumed_s"] - recovery["noticed_s"] < grace + 1.5


# The last stage SIGKILLed: tests/test_launcher_faults_processes.py (through the
# launcher, the same recovery).


async def test_two_workers_sigkilled_at_once(tmp_path: Any) -> None:
    epochs, _ = await _run(tmp_path, (1, 2))
    recovery = _recovery(epochs)
    assert recovery["workers"] == [0, 3]
    # stage 1's chain replicas were on devices 1 and 2: the round starts again
    assert recovery["from_chain"] is False
    assert recovery["batches"][0] % RUN["global_replication_every"] == 0
    assert [p["device"] for p in epochs[2]["plan"]] == [0, 3]


async def test_a_worker_restarted_at_once_takes_part_again(tmp_path: Any) -> None:
    """The new process knows nothing of the round. If it said hello before the old one
    was given up, it takes its stage in the replay; if not, the round is played again
    without it and it takes its place again from a later round."""
    epochs, _ = await _run(tmp_path, (2,), restart=True)
    recovery = _recovery(epochs)
    assert re.search(r"device ?2", recovery["stopped"]), recovery
    assert recovery["lost"] in ([], [2])
    assert [p["device"] for p in epochs[2]["plan"]] == [0, 1, 2, 3]
    rejoined = [c for e in epochs for c in e["changes"] if c.get("workers") == [0, 1, 2, 3]]
    assert rejoined, epochs
