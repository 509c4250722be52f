"""Schedules as data: what each stage of a pipeline does in one iteration.

Pure: no I/O, no clock, no torch. As in torch's ``torch/distributed/pipelining/
schedules.py``, making a schedule is four separate steps:

- *generate*: `pipar`, `gpipe` and `one_f_one_b` return the compute actions of each
  stage (`Action`\\ s: F, B, FB, STEP);
- *add transfers and reductions*: `with_transfers` puts the SEND/RECV actions between
  them, `with_reductions` a data-parallel group's REDUCE right before its STEP;
- *validate*: `check_schedule` names the first broken rule, and dry-runs the schedule to
  prove that it cannot deadlock;
- *print*: `format_grid` shows the dry run as a grid, one row per time step.

Executors (the device runtime, `aiopipe.scheduler.critical_path`) run whatever
schedule they are given. A schedule without transfers means the transfers
`with_transfers` would add: each forward's activation goes to the next stage as soon as
it exists and each backward waits for its gradient.

[Note: warm-up] 1F1B (Asteroid §3.2) lets stage p run K_p forwards before its first
backward, then alternate one backward and one forward, so it holds at most K_p
activations where GPipe and PiPar's device hold all N. The default K_p =
min(2 (S - p) - 1, N) keeps every stage busy while the first micro-batch's gradient
travels back: with F and B one time step each, 2 (S - p) - 1 steps pass from stage p's
first forward to its first gradient's arrival (fewer when the last stage fuses them
into FB). A warm-up
must not grow towards the last stage: if K_p < K_{p+1} < ... then stage p waits for
gradient 0 after K_p forwards while stage p + 1 waits for activation K_p, a deadlock.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import zip_longest

from aiopipe.errors import ConfigError
from aiopipe.scheduler.actions import Action, Schedule
from aiopipe.scheduler.critical_path import Timeline, pipeline_executors, simulate

__all__ = [
    "Schedule",
    "check_schedule",
    "check_stage_actions",
    "format_grid",
    "gpipe",
    "one_f_one_b",
    "peak_live_activations",
    "pipar",
    "with_reductions",
    "with_transfers",
]


# -- generators ----------------------------------------------------------------------------


def pipar(micro_batches: int) -> Schedule:
    """PiPar (pipar.txt Fig. 2b), two stages. Stage 0, the device: all N forwards, then
    the N backwards in order, then STEP. Stage 1, the server: one FB (forward, loss and
    backward) per micro-batch in order, then STEP.

    Raises:
        ConfigError: ``micro_batches`` is not an int >= 1.
    """
    n = _check_count(micro_batches, "micro-batch")
    device = (*_forwards(0, range(n)), *_backwards(0, range(n)), Action(0, "STEP"))
    server = (*(Action(1, "FB", i) for i in range(n)), Action(1, "STEP"))
    return Schedule("pipar", n, (device, server))


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """GPipe: every stage runs all N forwards, then all N backwards in increasing order,
    then STEP (the last stage too: F's then B's, no FB).

    Raises:
        ConfigError: ``stages`` or ``micro_batches`` is not an int >= 1.
    """
    s = _check_count(stages, "stage")
    n = _check_count(micro_batches, "micro-batch")
    return Schedule("gpipe", n, tuple(
        (*_forwards(p, range(n)), *_backwards(p, range(n)), Action(p, "STEP"))
        for p in range(s)))


def one_f_one_b(stages: int, micro_batches: int, warmup: Sequence[int] | None = None
                ) -> Schedule:
    """1F1B ([Note: warm-up]): stage p runs K_p forwards, then alternates B_i and
    F_{K_p + i} (while K_p + i < N), then STEP. ``warmup`` gives K_p per stage; the
    default is min(2 (S - p) - 1, N). On the last stage, when its K is 1, each forward
    is followed at once by its backward, and each such pair is one FB.

    Raises:
        ConfigError: ``stages`` or ``micro_batches`` is not an int >= 1, or ``warmup``
            does not hold one int in 1..N per stage, never growing from a stage to the
            next (a growing warm-up deadlocks, [Note: warm-up]).
    """
    s = _check_count(stages, "stage")
    n = _check_count(micro_batches, "micro-batch")
    ks = [min(2 * (s - p) - 1, n) for p in range(s)] if warmup is None else list(warmup)
    if len(ks) != s:
        raise ConfigError(f"1F1B warm-up needs one value per stage ({s}), got {len(ks)}")
    for p, k in enumerate(ks):
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise ConfigError(f"1F1B warm-up of stage {p} must be an int in 1..{n}, got {k!r}")
        if p > 0 and k > ks[p - 1]:
            raise ConfigError(
                f"1F1B warm-up grows from stage {p - 1} ({ks[p - 1]}) to stage {p} ({k}): "
                f"stage {p - 1} would wait for a gradient while stage {p} waits for an "
                "activation (a deadlock)"
            )
    return Schedule("1f1b", n, tuple(_one_f_one_b_stage(p, s, n, ks[p]) for p in range(s)))


def _one_f_one_b_stage(p: int, stages: int, n: int, k: int) -> tuple[Action, ...]:
    actions = list(_forwards(p, range(k)))
    for i in range(n):
        actions.append(Action(p, "B", i))
        if k + i < n:
            actions.append(Action(p, "F", k + i))
    if p == stages - 1 and k == 1:
        # K = 1 gives F0 B0 F1 B1 ...: every forward is followed by its backward
        actions = [Action(p, "FB", a.micro_batch) for a in actions if a.kind == "F"]
    return (*actions, Action(p, "STEP"))


def with_transfers(schedule: Schedule) -> Schedule:
    """Add the transfers between consecutive stages: on stage p > 0, RECV_F(n) right
    before F(n) or FB(n), and SEND_B(n) right after B(n) or FB(n); on stage p < S - 1,
    SEND_F(n) right after F(n), and RECV_B(n) right before B(n).

    Raises:
        ConfigError: the schedule already has transfers.
    """
    if schedule.has_transfers():
        raise ConfigError(f"schedule {schedule.name!r} already has transfers")
    last = schedule.stages - 1
    stages = []
    for p, actions in enumerate(schedule.actions):
        out: list[Action] = []
        for a in actions:
            mb = a.micro_batch
            if p > 0 and a.kind in ("F", "FB"):
                out.append(Action(p, "RECV_F", mb))
            if p < last and a.kind == "B":
                out.append(Action(p, "RECV_B", mb))
            out.append(a)
            if p < last and a.kind == "F":
                out.append(Action(p, "SEND_F", mb))
            if p > 0 and a.kind in ("B", "FB"):
                out.append(Action(p, "SEND_B", mb))
        stages.append(tuple(out))
    return Schedule(schedule.name, schedule.micro_batches, tuple(stages))


def with_reductions(schedule: Schedule, grouped: Collection[int]) -> Schedule:
    """Add the data-parallel reductions: on each stage of ``grouped`` (the stages whose
    group has more than one member), REDUCE right before STEP, so that the group's
    members all-reduce their gradients before each steps. Other stages are unchanged, as
    are the name, micro-batches and transfers.

    Raises:
        ConfigError: a stage of ``grouped`` is not one of the schedule's, or already
            has a REDUCE.
    """
    stages = set(grouped)
    outside = sorted(p for p in stages if not 0 <= p < schedule.stages)
    if outside:
        raise ConfigError(f"schedule {schedule.name!r} has stages 0..{schedule.stages - 1}, "
                          f"not {outside}")
    for p in sorted(stages):
        if any(a.kind == "REDUCE" for a in schedule.actions[p]):
            raise ConfigError(f"schedule {schedule.name!r} stage {p} already has a REDUCE")
    return Schedule(schedule.name, schedule.micro_batches, tuple(
        tuple(out for a in actions for out in (
            (Action(p, "REDUCE"), a) if a.kind == "STEP" and p in stages else (a,)))
        for p, actions in enumerate(schedule.actions)))


# -- validation ----------------------------------------------------------------------------


def check_schedule(schedule: Schedule) -> None:
    """Check every rule of a schedule, in this order:

    - every action's stage is its stage's index, and its micro-batch is in 0..N-1;
    - per stage: each micro-batch is forwarded exactly once (F, or FB) and backwarded
      exactly once after its forward (B, or FB, which counts as both; FB only on the
      last stage); STEP exactly once and last; REDUCE at most once, right before STEP;
    - if it has transfers, they are exactly those `with_transfers` adds (so each send has
      its receive on the neighbour, each RECV_F is right before the forward that needs it,
      each SEND_F right after the forward that makes it, and so on);
    - it cannot deadlock: a dry run (`simulate` with one second per compute action and
      instant transfers; `with_transfers` first if it has none) finishes.

    Raises:
        ConfigError: naming the first broken rule with its stage and position; for a
            deadlock, each stuck stage's waiting action.
    """
    last = schedule.stages - 1
    for p, actions in enumerate(schedule.actions):
        _check_stage(schedule, p, actions, last)
    if schedule.has_transfers():
        _check_transfers(schedule)
    try:
        _dry_run(schedule)
    except ConfigError as error:
        added = "" if schedule.has_transfers() else "; positions count the transfers added"
        raise ConfigError(
            f"schedule {schedule.name!r} deadlocks in a dry run (one step per compute "
            f"action, instant transfers{added}): {error}"
        ) from None


def _check_stage(schedule: Schedule, p: int, actions: tuple[Action, ...], last: int) -> None:
    n = schedule.micro_batches
    forwarded: set[int] = set()
    backwarded: set[int] = set()
    for pos, a in enumerate(actions):
        where = f"schedule {schedule.name!r} stage {p} position {pos} ({a})"
        if a.stage != p:
            raise ConfigError(f"{where}: an action of stage {a.stage} in stage {p}'s list")
        mb = a.micro_batch
        if a.kind not in ("STEP", "REDUCE") and not 0 <= mb < n:
            raise ConfigError(f"{where}: micro-batch {mb} outside 0..{n - 1}")
        if a.kind in ("F", "FB"):
            if a.kind == "FB" and p != last:
                raise ConfigError(f"{where}: FB only on the last stage ({last})")
            if mb in forwarded:
                raise ConfigError(f"{where}: micro-batch {mb} is forwarded twice")
            forwarded.add(mb)
            if a.kind == "FB":
                backwarded.add(mb)
        elif a.kind == "B":
            if mb not in forwarded:
                raise ConfigError(f"{where}: backward of micro-batch {mb} before its forward")
            if mb in backwarded:
                raise ConfigError(f"{where}: micro-batch {mb} is backwarded twice")
            backwarded.add(mb)
        elif a.kind == "STEP" and pos != len(actions) - 1:
            raise ConfigError(f"{where}: STEP is not the last action")
        elif a.kind == "REDUCE" and (pos + 1 >= len(actions) or actions[pos + 1].kind != "STEP"):
            # with STEP once and last, this also keeps REDUCE to at most once
            raise ConfigError(f"{where}: REDUCE is not right before STEP")
    where = f"schedule {schedule.name!r} stage {p}"
    for done, what in ((forwarded, "forwarded"), (backwarded, "backwarded")):
        missing = sorted(set(range(n)) - done)
        if missing:
            raise ConfigError(f"{where}: micro-batches {missing} are never {what}")
    if not actions or actions[-1].kind != "STEP":
        raise ConfigError(f"{where}: does not end with STEP")


def check_stage_actions(actions: tuple[Action, ...], stage: int, stages: int,
                        micro_batches: int) -> None:
    """Check one stage's action list on its own: what a node can check of the list it is
    sent. The per-stage rules of `check_schedule`, and exactly the transfers
    `with_transfers` puts around its compute actions (a multi-stage list without them is
    refused: a node runs what it is sent). That the neighbours' lists match and that the
    whole cannot deadlock needs the whole schedule: the sender checks that.

    Raises:
        ConfigError: naming the first broken rule with its position.
    """
    if not 0 <= stage < stages:
        raise ConfigError(f"stage {stage} is not in 0..{stages - 1}")
    schedule = Schedule("sent", micro_batches,
                        tuple(actions if p == stage else () for p in range(stages)))
    _check_stage(schedule, stage, actions, stages - 1)
    expected = with_transfers(schedule.compute_only()).actions[stage]
    for pos, (a, e) in enumerate(zip_longest(actions, expected)):
        if a != e:
            rule = _TRANSFER_RULES[(e or a).kind] if (e or a).is_transfer else "compute order"
            raise ConfigError(f"stage {stage} position {pos}: found "
                              f"{'the end' if a is None else a}, expected "
                              f"{'the end' if e is None else e} ({rule})")


#: Where `with_transfers` puts each transfer kind.
_TRANSFER_RULES = {
    "RECV_F": "a RECV_F goes right before the forward (F or FB) that needs it, on every "
              "stage but the first",
    "SEND_F": "a SEND_F goes right after the F that makes the activation, on every stage "
              "but the last",
    "RECV_B": "a RECV_B goes right before the B that needs it, on every stage but the last",
    "SEND_B": "a SEND_B goes right after the backward (B or FB), on every stage but the first",
}


def _check_transfers(schedule: Schedule) -> None:
    """Compare each stage with what `with_transfers` makes of its compute actions (the
    compute actions already passed `_check_stage`)."""
    last = schedule.stages - 1
    expected = with_transfers(schedule.compute_only())
    for p, (have, want) in enumerate(zip(schedule.actions, expected.actions, strict=True)):
        for pos, (a, e) in enumerate(zip_longest(have, want)):
            if a == e:
                continue
            where = f"schedule {schedule.name!r} stage {p} position {pos}"
            # a transfer that the expected list has later is not wrong, only early: the
            # one expected here is missing
            if e is not None and e.is_transfer and (
                    a is None or a.is_compute or a in want[pos + 1:]):
                raise ConfigError(
                    f"{where}: {e} is missing, found {'the end' if a is None else a} "
                    f"({_TRANSFER_RULES[e.kind]}; the neighbour's matching transfer would "
                    "wait forever)"
                )
            if a is not None:
                if a.kind in ("RECV_F", "SEND_B") and p == 0:
                    problem = "stage 0 is the first stage: there is no stage -1"
                elif a.kind in ("SEND_F", "RECV_B") and p == last:
                    problem = f"stage {p} is the last stage: there is no stage {p + 1}"
                else:
                    problem = (f"{a} is misplaced or repeated; expected "
                               f"{'the end' if e is None else e}")
                raise ConfigError(f"{where} ({a}): {problem} ({_TRANSFER_RULES[a.kind]})")


def _dry_run(schedule: Schedule) -> Timeline:
    """`simulate` ``schedule`` with one second per compute action and instant transfers,
    stage p on node ``stage{p}``.

    Raises:
        ConfigError: it deadlocks (see `simulate`).
    """
    if not schedule.has_transfers():
        schedule = with_transfers(schedule)
    executors = pipeline_executors(schedule, [f"stage{p}" for p in range(schedule.stages)])
    return simulate(executors, compute_time=lambda e, a: 1.0,
                    transfer_time=lambda e, a: (0.0, 0.0))


# -- printing and measuring ----------------------------------------------------------------


def format_grid(schedule: Schedule) -> str:
    """The dry run of `check_schedule` as a text grid: one row per time step, one column
    per stage; a cell is the compute action that starts at that step, without its stage
    (``F0``, ``B3``, ``FB2``, ``STEP``), or ``.`` when the stage is idle.

    The rules of `check_schedule` other than deadlock are not checked here, so that a
    broken schedule can be shown.

    Raises:
        ConfigError: the schedule deadlocks (see `check_schedule`), or an action sits in
            another stage's list.
    """
    timeline = _dry_run(schedule)
    steps = round(timeline.makespan)
    cells = [["."] * schedule.stages for _ in range(steps)]
    for span in timeline.spans:
        if span.action.is_compute:
            text = str(span.action)
            cells[round(span.start)][span.stage] = text[len(str(span.stage)):]
    header = ["step", *(f"stage {p}" for p in range(schedule.stages))]
    rows = [header, *([str(t), *row] for t, row in enumerate(cells))]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = []
    for row in rows:
        first = row[0].rjust(widths[0]) if row is not header else row[0].ljust(widths[0])
        rest = (cell.ljust(width) for cell, width in zip(row[1:], widths[1:], strict=True))
        lines.append("  ".join((first, *rest)).rstrip())
    return "\n".join(lines) + "\n"


def peak_live_activations(actions: Sequence[Action]) -> int:
    """The most micro-batches forwarded and not yet backwarded at any point of one
    stage's list (an FB holds one for its own duration; transfers do not count)."""
    live: set[int] = set()
    peak = 0
    for a in actions:
        if a.kind == "F":
            live.add(a.micro_batch)
            peak = max(peak, len(live))
        elif a.kind == "B":
            live.discard(a.micro_batch)
        elif a.kind == "FB":
            peak = max(peak, len(live) + 1)
    return peak


def _forwards(p: int, micro_batches: range) -> tuple[Action, ...]:
    return tuple(Action(p, "F", i) for i in micro_batches)


def _backwards(p: int, micro_batches: range) -> tuple[Action, ...]:
    return tuple(Action(p, "B", i) for i in micro_batches)


def _check_count(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"a schedule needs at least one {what}, got {value!r}")
    return value
