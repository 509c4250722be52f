"""Measuring a `CostTable`: `measure_costs` times each split unit's forward, backward
and optimizer step with torch.

The table itself is plain data, in `aiopipe.scheduler.cost_table` (re-exported here).

[Note: per-stage costs] The runtime runs each stage as one work item on its node's
compute thread: a device's forward of units 1..P (after making the micro-batch), its
backward, its step; the server's pass (forward, loss, backward of units P+1..Q) and its
step. Besides the units' own passes an item pays fixed costs: the hand-over to the
compute thread and back, making the micro-batch (device forwards), the loss (server
passes), the optimizer's per-call overhead (steps). Each micro-batch also costs the nodes'
event loops its messages: the device encodes and posts its activation, the server
receives and decodes it, and the gradient goes back the same way. The table stays per
unit and every stage sums its units, so each fixed cost is charged to a unit that every
such stage holds (P is in 1..Q-1): unit 0 (the first) for the device's forward, backward
and step; the last unit for the server's pass and step. A micro-batch's messages are
charged a quarter to the device's forward, a quarter to its backward and half to the
server's pass. Summed per stage this charges each item once, whatever P is, and the
virtual-time runtime, which charges ``forward_time(0, P)`` & co., charges the same as the
estimator. (FL runs the whole model in two items and is charged two hand-overs, an
optimizer overhead and one micro-batch's messages too many: well under a millisecond.)
A slowed device's items, fixed costs included, take ``slowdown`` times as long, as on a
real slower machine; this is also how the runtime emulates a slower device on real time
(aiopipe/runtime/compute.py), though there the emulated device's hand-overs and loop are
not slowed: they share one interpreter lock with every node's compute in the process
instead, which costs about as much (bench/planner_accuracy.py measures what is left).

The hand-over and the messages are the runtime's, so the runtime measures them, through
its own parts (`aiopipe.runtime.overheads`), and `measure_costs` charges what it is
given. They are part of what makes many small micro-batches cost more than their
compute: a bare thread pool round trip is a small part of a hand-over, and charged
instead it made plans with many micro-batches look as good as plans with fewer that ran
faster (evidence: bench/results/2026-11-22-s8-planner). Timing the batch sizes in turns
([Note: units in sequence]) is the other part of the remedy.

A unit that cannot run at a batch size costs ``math.inf`` there ([Note: infeasible
sizes]).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from aiopipe.errors import ConfigError
from aiopipe.models.crossing import Crossing, Value, as_crossing, example, joined, leaves
from aiopipe.scheduler.cost_table import CostTable

__all__ = ["CostTable", "measure_costs"]


def measure_costs(model: nn.Sequential, in_shape: Crossing | Sequence[int],
                  batch_sizes: Sequence[int], *,
                  repeats: int = 5, warmup: int = 2, learning_rate: float = 0.01,
                  momentum: float = 0.9, threads: int | None = None,
                  load_batch: Callable[[int], Value] | None = None,
                  aggregate: Callable[[int], object] | None = None,
                  handover: float = 0.0, message: float = 0.0,
                  stage_overheads: bool = True, clock: str = "auto") -> CostTable:
    """Time each unit's forward and backward at each batch size, and each unit's step,
    where the model's parameters are (the CPU or a CUDA GPU).

    Every figure is the median of ``repeats`` timed runs after ``warmup`` untimed ones
    (the first calls at a new shape are slow: allocator, kernel selection). The last
    unit's forward and backward include the cross-entropy loss, as the server's pass
    does. With ``stage_overheads`` the fixed costs of the runtime's work items are
    charged too ([Note: per-stage costs]): ``handover`` seconds per work item and
    ``message`` seconds per micro-batch, as given (what the runtime measures,
    `aiopipe.runtime.overheads.measure_runtime_overheads`; 0 charges nothing), the
    optimizer's own overhead per step, and ``load_batch(b)`` (a callable making one
    micro-batch of ``b`` samples, as a device does before its forward, and returning
    its input tensor; unit 0's forward is then timed on freshly loaded batches, loading
    included, as a device's forward runs; when None, loading is not charged), and the
    units' times are scaled to the whole model's passes and step timed in sequence
    ([Note: units in sequence]). ``aggregate(k)``, when given, does what the server
    does to aggregate a round of ``k`` devices' models; it is timed at k = 1 and 2
    (`CostTable.aggregate`, fixed and per device seconds; not measured: zero). A unit
    that cannot run at a batch size (e.g. batch norm over one value per channel at
    batch size 1) costs ``math.inf`` there, and so do the units after it
    ([Note: infeasible sizes]).

    ``clock`` ([Note: profiling clock]): "wall" times the work by elapsed time; "cpu" by
    the calling thread's CPU time (its cost with a core to itself); "shared" by CPU time
    divided by the share of a core the profiling thread got over all the timed work
    (total CPU / total elapsed seconds); "auto" (the default) is "shared" when torch
    runs on one thread, else "wall". On a GPU every figure is elapsed time with the
    device synchronised at each mark ("auto" is "wall"; "cpu" and "shared" are
    refused: the work is not the calling thread's).

    Runs on the calling thread, with ``threads`` torch intra-op threads when given (the
    previous setting is restored) or the current setting. The model is left as it was:
    weights, buffers (batch-norm statistics), gradients and training mode.

    Raises:
        ConfigError: ``batch_sizes`` is empty or holds a size < 1, ``repeats`` < 1,
            ``warmup`` < 0, ``threads`` < 1, ``handover`` or ``message`` < 0 or an
            unknown ``clock``.
    """
    if not batch_sizes or min(batch_sizes) < 1:
        raise ConfigError(f"batch sizes to profile must be >= 1, got {list(batch_sizes)}")
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"profiling needs repeats >= 1 and warmup >= 0, got {repeats} "
                          f"and {warmup}")
    if threads is not None and threads < 1:
        raise ConfigError(f"torch threads to profile with must be >= 1, got {threads}")
    if not (handover >= 0 and message >= 0):
        raise ConfigError(f"hand-over and message seconds must be >= 0, got {handover!r} "
                          f"and {message!r}")
    if clock not in ("auto", "cpu", "shared", "wall"):
        raise ConfigError(f'profiling clock must be "auto", "cpu", "shared" or "wall", '
                          f"got {clock!r}")
    device = next(model.parameters(), torch.empty(0)).device
    if device.type != "cpu" and clock not in ("auto", "wall"):
        raise ConfigError(f"profiling on {device} times elapsed seconds: clock must be "
                          f'"auto" or "wall", got {clock!r}')
    units = list(model.children())
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    was_training, previous_threads = model.training, torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    model.train()
    if clock == "auto":
        clock = ("shared" if torch.get_num_threads() == 1 and device.type == "cpu"
                 else "wall")
    timer = _Timer(warmup, repeats, cpu=clock != "wall", device=device)
    if load_batch is not None and device.type != "cpu":
        on_cpu = load_batch
        load_batch = lambda size: _on(on_cpu(size), device)  # noqa: E731 (as a stage loads)
    try:
        forward, backward = _unit_times(units, in_shape, sorted(set(batch_sizes)), timer,
                                        load_batch if stage_overheads else None)
        step, step_overhead = _step_times(units, timer, learning_rate, momentum)
        accumulate = _accumulate_times(units, timer)
        if stage_overheads:
            _in_sequence(units, in_shape, timer, load_batch, forward, backward, step,
                         step_overhead, learning_rate, momentum)
        rounds = _aggregate_times(aggregate, timer) if aggregate is not None else (0.0, 0.0)
        if clock == "shared":
            share = timer.share()
            forward, backward = _scaled(forward, 1 / share), _scaled(backward, 1 / share)
            step = {u: t / share for u, t in step.items()}
            accumulate = {u: t / share for u, t in accumulate.items()}
            step_overhead /= share
            rounds = (rounds[0] / share, rounds[1] / share)
        if stage_overheads:
            last = len(units) - 1
            # a device's forward posts the activation, its backward takes the gradient
            # (half the messages' cost between them); the server's pass does both
            for b in forward[0]:
                forward[0][b] += handover + message / 4
                backward[0][b] += handover + message / 4
                if last > 0:
                    backward[last][b] += handover + message / 2
            for u in {0, last}:  # unit 0: every device stage; the last: the server's
                step[u] += handover + step_overhead
    finally:
        with torch.no_grad():
            model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        torch.set_num_threads(previous_threads)
    return CostTable(forward, backward, step, rounds, accumulate)


class _Timer:
    """Medians of timed calls after untimed warm-up calls; totals of both clocks.

    [Note: profiling clock] On a machine shared with other work, elapsed time measures
    the load as much as the work: a neighbour's burst can double one batch size's
    figures and not the next one's, and the planner then picks by noise. With one torch
    thread the work runs in the calling thread (autograd's CPU backward too), so that
    thread's CPU time is the work's cost with a core to itself, and it hardly moves with
    the load. The load still matters: a busy machine runs every stage slower. "shared"
    keeps the CPU times' shape and scales them all by one figure, the share of a core
    the profiler got over all of its timed work (hundreds of calls, so one burst moves
    it little): the work as it would run under the load seen while profiling. With
    several torch threads the work spreads over a pool whose CPU time the calling
    thread does not see, so elapsed time it is. What no clock here sees: the run's own
    threads competing with each other when nodes are emulated on one machine (a
    server and devices in one process, or processes on the same cores), which slows
    each of them further.
    """

    def __init__(self, warmup: int, repeats: int, *, cpu: bool,
                 device: torch.device | None = None) -> None:
        self.warmup, self.repeats, self.cpu = warmup, repeats, cpu
        self.device = device or torch.device("cpu")
        self.wall_total = self.cpu_total = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def mark(self) -> tuple[float, float]:
        """Both clocks now (on a GPU, once the work queued so far is done)."""
        self._sync()
        return time.perf_counter(), time.thread_time()

    def since(self, mark: tuple[float, float]) -> float:
        """Seconds since ``mark`` on this timer's clock (both clocks are totalled; on a
        GPU, once the work queued since is done)."""
        self._sync()
        wall, cpu = time.perf_counter() - mark[0], time.thread_time() - mark[1]
        self.wall_total += wall
        self.cpu_total += cpu
        return cpu if self.cpu else wall

    def share(self) -> float:
        """The share of a core the timed work got (1 when nothing was timed)."""
        if self.cpu_total <= 0 or self.wall_total <= 0:
            return 1.0
        return min(1.0, self.cpu_total / self.wall_total)

    def median(self, work: Callable[[], object], *, runs: int | None = None) -> float:
        """Median seconds of ``work`` over ``runs`` (default: repeats) timed calls."""
        for _ in range(self.warmup):
            work()
        times = []
        for _ in range(runs or self.repeats):
            mark = self.mark()
            work()
            times.append(self.since(mark))
        return statistics.median(times)


def _scaled(table: dict[int, dict[int, float]], factor: float) -> dict[int, dict[int, float]]:
    return {u: {b: t * factor for b, t in row.items()} for u, row in table.items()}


def _unit_times(units: Sequence[nn.Module], in_shape: Crossing | Sequence[int],
                sizes: Sequence[int], timer: _Timer, load_batch: Callable[[int], Value] | None,
                ) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, float]]]:
    """Forward and backward seconds per unit and batch size (the last unit with the loss).

    With ``load_batch``, unit 0's forward is timed on a freshly loaded batch each time,
    loading included: a device's forward makes its micro-batch and runs on new memory,
    which costs more than loading and a forward on a cache-warm tensor timed apart.

    [Note: infeasible sizes] Some models cannot train at some batch sizes: batch norm
    needs more than one value per channel, so a unit whose map is 1x1 fails at batch
    size 1. Such a unit costs ``math.inf`` at that size, as do the units after it (they
    get no input). Every plan runs every unit on one side or the other, so every plan
    at that micro-batch size is estimated to take forever and the planner avoids it.
    """
    forward: dict[int, dict[int, float]] = {u: {} for u in range(len(units))}
    backward: dict[int, dict[int, float]] = {u: {} for u in range(len(units))}
    last = len(units) - 1
    for batch in sizes:
        x = _on(example(as_crossing(in_shape), batch, random=True), timer.device)
        for u, unit in enumerate(units):
            try:
                load = partial(load_batch, batch) if load_batch is not None and u == 0 else None
                fwd, bwd, x = _pass_times(unit, x, timer, grad_input=u > 0, loss=u == last,
                                          load=load)
            except (RuntimeError, ValueError):
                for v in range(u, len(units)):
                    forward[v][batch] = backward[v][batch] = math.inf
                break
            finally:
                unit.zero_grad(set_to_none=True)
            forward[u][batch], backward[u][batch] = fwd, bwd
    return forward, backward


def _in_sequence(units: Sequence[nn.Module], in_shape: Crossing | Sequence[int],
                 timer: _Timer, load_batch: Callable[[int], Value] | None,
                 forward: dict[int, dict[int, float]], backward: dict[int, dict[int, float]],
                 step: dict[int, float], step_overhead: float, learning_rate: float,
                 momentum: float) -> None:
    """Scale the unit times, in place, to the whole model's passes and step run in
    sequence.

    [Note: units in sequence] A unit timed alone, over and over, runs on warm caches: its
    weights, input and gradients were touched a moment ago. In a run a stage passes
    through its units one after another, and a step updates every parameter right after
    a backward has written the gradients, so each touches memory the others have pushed
    out. The difference is not small: a whole model's step can take well above the sum
    of its units' steps, and a whole backward (one autograd call) less than the sum of
    its units' (each unit's own call). So the whole model's forward (with loading and the
    loss), backward and step are timed as the runtime runs them, at every batch size,
    and each batch size's forward and backward units, and the step's units, are scaled
    by one factor each to sum to them. How the time divides among the units still comes
    from the units alone. (The device and server halves of a split model are the two
    ends of the same sequence: each is a prefix or suffix of it.)

    The batch sizes take turns, one timed pass of each per round, rather than each
    running its passes in a block: a neighbour's burst of load then lands on every size
    alike (or, when short, on one pass of each, which the median drops) instead of on
    one size, whose plans it would make look slower than the others' (evidence:
    bench/results/2026-11-22-s10-planner). Each timed pass follows ``warmup`` untimed
    ones at its size, as a run's passes follow passes of the same shape: right after a
    pass at another size a pass takes more CPU than in a block of its own size (a change
    of shape has a cost of its own), and a couple of passes at its size in between take
    the difference away.
    """
    model = nn.Sequential(*units)  # the same modules, run one after another
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=learning_rate, momentum=momentum) if params else None
    steps: list[float] = []
    sizes = [b for b in sorted(forward[0])
             if all(math.isfinite(forward[u][b]) for u in forward)]
    f_times: dict[int, list[float]] = {b: [] for b in sizes}
    b_times: dict[int, list[float]] = {b: [] for b in sizes}

    def one_pass(batch: int) -> tuple[float, float, float]:
        mark = timer.mark()
        x = (load_batch(batch) if load_batch is not None
             else _on(example(as_crossing(in_shape), batch, random=True), timer.device))
        out = model(x)
        root = _root(out, loss=True)
        f = timer.since(mark)
        mark = timer.mark()
        _backward(root, out)
        b = timer.since(mark)
        mark = timer.mark()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return f, b, timer.since(mark)

    for _ in range(timer.repeats):
        for batch in sizes:
            for _ in range(timer.warmup):
                one_pass(batch)
            f, b, s = one_pass(batch)
            f_times[batch].append(f)
            b_times[batch].append(b)
            steps.append(s)
    for batch in sizes:
        for table, times in ((forward, f_times[batch]), (backward, b_times[batch])):
            alone = sum(table[u][batch] for u in table)
            if alone > 0:
                factor = statistics.median(times) / alone
                for u in table:
                    table[u][batch] *= factor
    if not steps:
        return
    whole = max(0.0, statistics.median(steps) - step_overhead)
    alone = sum(step.values())
    # units too small to time apart (each step at or below the optimizer's overhead)
    # share the whole step by their parameter counts
    weights = step if alone > 0 else {
        u: float(sum(p.numel() for p in unit.parameters() if p.requires_grad))
        for u, unit in enumerate(units)}
    total = sum(weights.values())
    if total > 0:
        for u in step:
            step[u] = whole * weights[u] / total


def _pass_times(unit: nn.Module, x: Value, timer: _Timer, *, grad_input: bool,
                loss: bool, load: Callable[[], Value] | None = None,
                ) -> tuple[float, float, Value]:
    """Median forward and backward seconds of ``unit`` on ``x``, and its output.

    With ``load``, each timed forward runs on ``load()`` instead of ``x``, its call timed
    as part of the forward.

    Forward and backward alternate (a backward needs its forward's graph). With ``loss``
    (the model's last unit) the forward includes cross-entropy on random labels and the
    backward starts from the loss, as the server's pass does; otherwise the backward
    starts from a gradient of ones, as a device's does.
    """
    f_times, b_times = [], []
    out = x
    for _ in range(timer.warmup):
        out = _train_pass(unit, x, grad_input=grad_input, loss=loss)
    for _ in range(timer.repeats):
        mark = timer.mark()
        out = unit(_taken(x if load is None else load(), grad_input))
        root = _root(out, loss=loss)
        f_times.append(timer.since(mark))
        mark = timer.mark()
        _backward(root, out)
        b_times.append(timer.since(mark))
    return statistics.median(f_times), statistics.median(b_times), _detached(out)


def _train_pass(unit: nn.Module, x: Value, *, grad_input: bool, loss: bool) -> Value:
    """One untimed forward and backward, as `_pass_times` times them."""
    out: Value = unit(_taken(x, grad_input))
    _backward(_root(out, loss=loss), out)
    return out


def _taken(x: Value, grad_input: bool) -> Value:
    """``x`` detached as a stage takes it: its floating leaves require grad with
    ``grad_input``."""
    return joined([t.detach().requires_grad_(grad_input and t.is_floating_point())
                   for t in leaves(x)])


def _detached(x: Value) -> Value:
    return joined([t.detach() for t in leaves(x)])


def _on(x: Value, device: torch.device) -> Value:
    return joined([t.to(device) for t in leaves(x)])


def _root(out: Value, *, loss: bool) -> Value:
    """Where a timed backward starts: with ``loss`` and scores over the last dimension
    (a class per sample, or per token), cross-entropy on random labels, as the server's
    pass does; otherwise ``out`` itself."""
    if loss and isinstance(out, torch.Tensor) and out.dim() >= 2 and out.is_floating_point():
        scores = out.flatten(0, -2)
        return nn.functional.cross_entropy(
            scores, torch.randint(scores.shape[1], (len(scores),), device=out.device))
    return out


def _backward(root: Value, out: Value) -> None:
    """Backward from ``root``: from the loss, or from a gradient of ones on each of
    ``out``'s floating leaves that require grad, as a device's backward starts from the
    server's gradient."""
    if root is not out:
        assert isinstance(root, torch.Tensor)
        if root.requires_grad:
            torch.autograd.backward(root)
        return
    started = [t for t in leaves(out) if t.requires_grad]
    if started:
        torch.autograd.backward(started, [torch.ones_like(t) for t in started])


def _step_times(units: Sequence[nn.Module], timer: _Timer, learning_rate: float,
                momentum: float) -> tuple[dict[int, float], float]:
    """Per unit, the optimizer step's seconds beyond its fixed overhead; and that overhead.

    A step is ``step()`` then ``zero_grad(set_to_none=True)`` with SGD, as the runtime
    does. One optimizer over a unit's parameters costs a fixed overhead (Python, per
    call) plus time per parameter; a stage steps all its units in one call, so the
    overhead is counted once per stage ([Note: per-stage costs]), not once per unit.
    """

    def median_step(params: list[nn.Parameter]) -> float:
        opt = torch.optim.SGD(params, lr=learning_rate, momentum=momentum)
        times = []
        for r in range(timer.warmup + timer.repeats):
            for p in params:  # fresh gradients, as a backward leaves them
                p.grad = torch.zeros_like(p)
            mark = timer.mark()
            opt.step()
            opt.zero_grad(set_to_none=True)
            spent = timer.since(mark)
            if r >= timer.warmup:
                times.append(spent)
        return statistics.median(times)

    overhead = median_step([nn.Parameter(torch.zeros(1, device=timer.device))])
    step: dict[int, float] = {}
    for u, unit in enumerate(units):
        params = [p for p in unit.parameters() if p.requires_grad]
        step[u] = max(0.0, median_step(params) - overhead) if params else 0.0
    return step, overhead


def _accumulate_times(units: Sequence[nn.Module], timer: _Timer) -> dict[int, float]:
    """Per unit, what a backward adds when its gradients already hold an earlier
    micro-batch's: adding the new gradient of every parameter into the held one.

    [Note: accumulated gradients] Of an iteration's N micro-batches, the first backward
    of a stage writes fresh gradients (the step before set them to None) and the other
    N - 1 add theirs into them, one more pass over every parameter's gradient. The units'
    backward times are measured with fresh gradients, so the table charges this apart,
    to every backward but an iteration's first (micro-batch 0: every schedule runs a
    stage's backwards in micro-batch order), in the runtime's virtual time and, as
    (N - 1) / N of it per micro-batch, in the planner's estimate. It is a cost of the
    parameters, not of the batch, so it weighs most on a model with many parameters cut
    into small micro-batches, and left out it made plans with many micro-batches look
    cheaper than they run (evidence: bench/results/2026-11-27-s20-planner). Each unit
    is timed alone, then the whole model's adds in sequence and the units scaled to sum
    to that, as the steps are ([Note: units in sequence]).
    """
    held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for u, unit in enumerate(units):
        params = [p for p in unit.parameters() if p.requires_grad]
        held[u] = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]

    def add(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for total, new in pairs:
            total.add_(new)

    alone = {u: timer.median(partial(add, pairs)) if pairs else 0.0
             for u, pairs in held.items()}
    whole = timer.median(partial(add, [pair for pairs in held.values() for pair in pairs]))
    total = sum(alone.values())
    if total <= 0:
        return {u: 0.0 for u in held}
    return {u: whole * t / total for u, t in alone.items()}


def _aggregate_times(aggregate: Callable[[int], object], timer: _Timer) -> tuple[float, float]:
    """Fixed and per-device seconds of ``aggregate(k)``, from its medians at k = 1 and 2
    (three timed calls each after one untimed, whatever the unit timings use: on a large
    model one call takes a fraction of a second)."""
    quick = _Timer(1, 3, cpu=timer.cpu, device=timer.device)
    one = quick.median(partial(aggregate, 1))
    two = quick.median(partial(aggregate, 2))
    timer.wall_total += quick.wall_total
    timer.cpu_total += quick.cpu_total
    per_device = max(0.0, two - one)
    return max(0.0, one - per_device), per_device
