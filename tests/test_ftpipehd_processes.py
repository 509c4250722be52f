"""FTPipeHD's recovery between real processes over real websockets (paper §IV-E): a
server and four device processes linked device to device; workers are SIGKILLed
mid-round. Training resumes on the devices left (the round under way is played again,
re-partitioned among them, from its latest chain replica that survived whole or else
from its start), every epoch trains each of device 0's batches once, and the recovery
is in ``metrics.jsonl`` and on the timeline. A worker started again takes its stage
again. (A worker restarted at once, before it was given up, and the last stage killed:
tests/test_launcher_faults_processes.py.)"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import signal
from collections import Counter
from typing import Any

import pytest
from real_processes import ProcessFleet, check_pipeline_figures

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: two rounds of 20 batches an epoch: the three faults below (about 5 s, 4 of it
#: reconnect_grace twice) fall in epochs 2 to 4, with epochs to spare
RUN = {"mode": "ftpipehd", "devices": 4, "model": "vgg5", "samples_per_device": 800,
       "batch_size": 20, "epochs": 6, "momentum": 0.5, "learning_rate": 0.02,
       "global_replication_every": 20, "chain_replication_every": 5, "test_samples": 100,
       "heartbeat_interval": 0.5,
       "device_timeout": 5.0, "reconnect_grace": 2.0}


async def test_sigkilled_workers_rounds_are_played_again_by_the_others(tmp_path: Any
                                                                      ) -> None:
    """One run of four workers. In epoch 1, a pipeline of four processes: every stage and
    every link between neighbours busy, k_p = S - p batches in flight (1F1B). Then:

    1. worker 2 SIGKILLed in epoch 2: its round is played again on workers 0, 1 and 3
       from a chain point, once the coordinator gave it up;
    2. worker 2 started again (a new process, warm: `ProcessFleet.start_spare`): it
       takes its stage again from a later round;
    3. workers 1 and 2 SIGKILLed at once: stage 1's chain replicas were on both, so the
       round is played again from its start, on workers 0 and 3, to the end.
    """
    async with ProcessFleet(tmp_path, RUN) as fleet:
        server = await fleet.start_server()
        devices = [await fleet.start_device(k, "--listen", "127.0.0.1:0") for k in range(4)]
        spare = await fleet.start_spare(2, "--listen", "127.0.0.1:0")
        out = server.output
        await out.wait_for(r"^\s+1\s", within=120)  # epoch 1's row: epoch 2 runs
        await asyncio.sleep(0.3)
        devices[2].send_signal(signal.SIGKILL)
        assert await devices[2].wait(30) == -signal.SIGKILL
        await out.wait_for(r"the pipeline runs on devices \[0, 1, 3\]", within=60)
        devices[2] = await fleet.go(spare)
        await out.wait_for(r"the pipeline runs on devices \[0, 1, 2, 3\]", within=60)
        await out.wait_for(r"device 2 takes part again from round", within=60)
        await asyncio.sleep(0.3)  # in that round
        for k in (1, 2):
            devices[k].send_signal(signal.SIGKILL)
        for k in (1, 2):
            assert await devices[k].wait(30) == -signal.SIGKILL
        await fleet.finish(server, [devices[0], devices[3]], within=240)
    epochs = fleet.metrics()
    assert [e["samples"] for e in epochs] == [RUN["samples_per_device"]] * RUN["epochs"]
    _each_batch_committed_once(fleet, epochs)  # each batch once, every epoch
    assert all(math.isfinite(e["loss"]) for e in epochs)
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    # epoch 1: every stage and link busy, on the timeline; k_p = S - p in flight
    check_pipeline_figures(fleet.out_dir, epochs[:1], 4)
    assert [p["in_flight"] for p in epochs[0]["plan"]] == [4, 3, 2, 1]

    # the worker lists, in turn (a round stalled again on the same ones is played again
    # on them: one more change of the same list)
    changes = [c for e in epochs for c in e["changes"] if "workers" in c]
    turns = [workers for workers, _ in itertools.groupby(c["workers"] for c in changes)]
    assert turns == [[0, 1, 3], [0, 1, 2, 3], [0, 3]], changes
    first, rejoined, both = (next(c for c in changes if c["workers"] == workers)
                             for workers in turns)
    # 1. from a chain point (every 5 batches) or, before the first, the round's start
    assert first["lost"] == [2]
    assert len(first["after"]) == 2  # three stages
    assert first["batches"][0] % RUN["chain_replication_every"] == 0
    # a neighbour said its round stopped (its link to device 2 broke, or could not be
    # made if the kill fell between rounds); the round was played again once the
    # coordinator had given device 2 up, at most reconnect_grace later
    assert re.search(r"device ?2", first["stopped"]), first
    grace = RUN["reconnect_grace"]
    assert 0 <= first["resumed_s"] - first["noticed_s"] < grace + 1.5
    for change in (first, both):  # (the faults may fall in one epoch)
        [struck] = [e for e in epochs if change in e["changes"]]
        assert set(change["lost"]) <= set(struck["devices_lost"]), struck
    # 2. back in the plan at a round's start, nobody lost
    assert rejoined.get("lost", []) == []
    # 3. stage 1's chain replicas were on devices 1 and 2: the round starts again
    assert sorted(both["lost"]) == [1, 2]
    assert both["from_chain"] is False
    assert both["batches"][0] % RUN["global_replication_every"] == 0
    assert [p["device"] for p in epochs[-1]["plan"]] == [0, 3]


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
