"""Pipelining in virtual time: an iteration takes its critical path, not the sum.

With memory links and a known cost table, the clock only moves by charged compute and
wire time, so the iteration's duration must equal the longest path through the stage
dependencies of DESIGN §4 (pipar.txt Table 1), computed here independently.
"""

from __future__ import annotations

import pytest
import torch

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.metrics.trace import Slice
from aiopipe.protocol import Activation, Gradient, TensorData, encode
from aiopipe.runtime.plan import build_model
from aiopipe.scheduler.actions import Action
from aiopipe.scheduler.critical_path import Executor, pipeline_executors
from aiopipe.scheduler.critical_path import simulate as simulate_actions
from aiopipe.scheduler.schedule import pipar, with_transfers

UP_MBPS, DOWN_MBPS, LATENCY_MS = 10.0, 25.0, 5.0
N, BATCH, P = 4, 20, 2
MICRO = BATCH // N
COSTS = CostTable.uniform(5, forward=0.04, backward=0.03, step=0.001, batch=MICRO)


def _frame_bytes(shape: tuple[int, ...]) -> tuple[int, int]:
    """Sizes of one activation frame and one gradient frame of this shape."""
    numel = 1
    for d in shape:
        numel *= d
    tensor = TensorData("float32", shape, bytes(numel * 4))
    labels = TensorData("int64", (shape[0],), bytes(shape[0] * 8))
    return (len(encode(Activation(2**62 - 1, 0, 0, 0, 0, 0, "device0", "server", (tensor,),
                                  labels))),
            len(encode(Gradient(2**62 - 1, 1, 0, 0, 0, 0, "server", "device0", (tensor,)))))


def _critical_path(f: float, u: float, s: float, d: float, b: float, step: float,
                   latency: float) -> float:
    """Longest path through PiPar's stage DAG for one device, from f_1's start."""
    f_end, u_end, s_end, d_end, b_end = [0.0] * N, [0.0] * N, [0.0] * N, [0.0] * N, [0.0] * N
    for n in range(N):
        f_end[n] = (f_end[n - 1] if n else 0.0) + f
        u_end[n] = max(f_end[n], u_end[n - 1] if n else 0.0) + u
        s_end[n] = max(u_end[n] + latency, s_end[n - 1] if n else 0.0) + s
        d_end[n] = max(s_end[n], d_end[n - 1] if n else 0.0) + d
    for n in range(N):
        b_end[n] = max(d_end[n] + latency, b_end[n - 1] if n else f_end[-1]) + b
    return b_end[-1] + step


def _generic_critical_path(f: float, u: float, s: float, d: float, b: float, step: float,
                           server_step: float, latency: float) -> float:
    """The device's step end by `aiopipe.scheduler.critical_path` over `pipar`'s lists."""
    executors = pipeline_executors(with_transfers(pipar(N)), ["device0", "server"])
    times = {"F": f, "B": b, "FB": s}

    def compute(executor: Executor, action: Action) -> float:
        if action.kind == "STEP":
            return step if executor.stage == 0 else server_step
        return times[action.kind]

    timeline = simulate_actions(executors, compute_time=compute,
                                transfer_time=lambda e, a: (u if a.kind == "SEND_F" else d,
                                                            latency))
    (device_end,) = timeline.step_ends[(0, 0)]
    return device_end


async def test_iteration_takes_the_critical_path_and_uploads_overlap_forwards() -> None:
    config = RunConfig(mode="pipar", devices=1, samples_per_device=BATCH, batch_size=BATCH,
                       epochs=1, split_point=P, parallel_batches=N, test_samples=20,
                       network={"up_mbps": UP_MBPS, "down_mbps": DOWN_MBPS,
                                "latency_ms": LATENCY_MS})
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)

    model = build_model(config, num_classes=10, in_shape=(3, 32, 32))
    x = torch.zeros(MICRO, 3, 32, 32)
    for unit in list(model.children())[:P]:
        x = unit(x)
    act_bytes, grad_bytes = _frame_bytes(tuple(x.shape))
    f = COSTS.forward_time(0, P, MICRO)
    s = COSTS.forward_time(P, 5, MICRO) + COSTS.backward_time(P, 5, MICRO)
    b = COSTS.backward_time(0, P, MICRO)
    u = act_bytes * 8 / (UP_MBPS * 1e6)
    d = grad_bytes * 8 / (DOWN_MBPS * 1e6)
    expected = _critical_path(f, u, s, d, b, COSTS.step_time(0, P), LATENCY_MS / 1000)

    device = [sl for sl in result.trace if sl.track.startswith("device0/") and sl.iteration == 0]
    compute = [sl for sl in device if sl.track == "device0/compute"]
    start = min(sl.start for sl in compute)
    end = max(sl.end for sl in compute if sl.name == "step")
    assert end - start == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # the generic estimator over PiPar's action lists gives the same critical path
    generic = _generic_critical_path(f, u, s, d, b, COSTS.step_time(0, P),
                                     COSTS.step_time(P, 5), LATENCY_MS / 1000)
    assert generic == pytest.approx(expected, rel=1e-12)
    assert end - start == pytest.approx(generic, rel=1e-9, abs=1e-12)
    sequential = N * (f + u + s + d + b) + 2 * N * LATENCY_MS / 1000
    assert end - start < 0.8 * sequential  # the overlap is real, not a rounding effect

    def one(track: str, name: str, n: int) -> Slice:
        (found,) = [sl for sl in result.trace
                    if sl.track == track and sl.name == name and sl.micro_batch == n]
        return found

    for n in range(N - 1):
        upload, next_forward = one("device0/uplink", "u", n), one("device0/compute", "f", n + 1)
        overlap = min(upload.end, next_forward.end) - max(upload.start, next_forward.start)
        assert overlap > 0, f"u{n + 1} does not overlap f{n + 2}"
    # the server computes micro-batch n as soon as it arrives, before later uploads end
    assert one("server/compute", "s", 0).start < one("device0/uplink", "u", N - 1).end


async def test_device_slowdown_scales_charged_compute() -> None:
    config = RunConfig(mode="pipar", devices=2, samples_per_device=BATCH, batch_size=BATCH,
                       epochs=1, split_point=P, parallel_batches=N, test_samples=20,
                       device_slowdown=[1.0, 3.0], network="lan")
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    f = COSTS.forward_time(0, P, MICRO)
    for k, factor in ((0, 1.0), (1, 3.0)):
        forwards = [sl for sl in result.trace
                    if sl.track == f"device{k}/compute" and sl.name == "f"]
        assert len(forwards) == N
        for sl in forwards:
            assert sl.duration == pytest.approx(f * factor, rel=1e-9)
    # the slow device's idle server time shows up: the fast device finishes first
    ends = [max(sl.end for sl in result.trace if sl.track == f"device{k}/compute")
            for k in range(2)]
    assert ends[0] < ends[1]


async def test_model_uploads_count_as_uplink_busy_time() -> None:
    """FL sends only models: their upload is the uplink's whole busy time."""
    config = RunConfig(mode="fl", devices=1, samples_per_device=BATCH, batch_size=BATCH,
                       epochs=1, test_samples=20, network="4g")
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    (upload,) = [sl for sl in result.trace if sl.track == "device0/uplink"]
    assert upload.name == "m"
    model_bytes = sum(t.numel() * 4 for t in result.model.state_dict().values())
    assert upload.duration == pytest.approx(model_bytes * 8 / 10e6, rel=0.01)
    assert result.final.busy_s["uplink"] == pytest.approx(upload.duration, rel=1e-9)
    assert result.final.busy_s["downlink"] == pytest.approx(model_bytes * 8 / 25e6, rel=0.01)
