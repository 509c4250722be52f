"""What the star coordinator decides between rounds: the plans of a sampled round's
devices ([Note: plans per round]), re-planning from a round's trace (``replan``,
aiopipe.runtime.systems.star.replan) and mode auto's second choice of the system
([Note: re-choosing the system] in aiopipe.runtime.systems.star.rechoose). Every
change takes effect between rounds, when no work is in flight ([Note: switching])."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError
from aiopipe.metrics.trace import Slice
from aiopipe.runtime.plan import DevicePlan
from aiopipe.runtime.plan_text import change_lines, log_lines
from aiopipe.runtime.systems.base import Rounds
from aiopipe.runtime.systems.star.options import star_options
from aiopipe.runtime.systems.star.planning import choose_plans, system_config, with_plans
from aiopipe.runtime.systems.star.rechoose import (
    CLOSE_MARGIN,
    TRIAL_MARGIN,
    Measured,
    close_calls,
    fastest_measured,
    pooled,
    steady_epoch,
    to_try,
)
from aiopipe.runtime.systems.star.replan import Replan, live_profiles, reselect
from aiopipe.scheduler.auto import SystemEstimate, explain
from aiopipe.scheduler.estimate import DeviceProfile, ModelProfile
from aiopipe.scheduler.placement import Placement, star

__all__ = ["BetweenRounds", "SecondLook"]

log = logging.getLogger("aiopipe.server")


@dataclass(frozen=True, slots=True)
class SecondLook:
    """Mode auto's pending second look: its config (mode "auto") and candidates; once
    trials have begun, the rounds measured so far and the systems still to try (each with
    its plans and predicted epoch, or measured epoch in a close call's second round);
    whether the close call's rounds have been queued."""

    auto: RunConfig
    candidates: tuple[str, ...]
    measured: tuple[Measured, ...] = ()
    queue: tuple[Measured, ...] = ()
    rematched: bool = False


class BetweenRounds:
    """The star coordinator's decisions between rounds (module docstring)."""

    config: RunConfig
    #: the run's config with its "auto" plan fields (None: plans as configured, or fl)
    auto_config: RunConfig | None
    #: mode auto's second look, until the first round has ended
    second_look: SecondLook | None
    planning: ModelProfile | None
    live: list[DeviceProfile]
    replans: list[Replan]
    plans: list[DevicePlan]
    placement: Placement
    serves_stages: bool
    units: int
    #: when the round under way began (the coordinator's clock)
    round_began: float = 0.0

    def plan_entries(self) -> list[dict[str, Any]]:
        """(P_k, N_k) per device."""
        return [{"device": p.device_id, "split_point": p.split_point,
                 "parallel_batches": p.parallel_batches} for p in self.plans]

    async def plan_round(self, rounds: Rounds, participants: Sequence[int]) -> None:
        """[Note: plans per round] With "auto" plans and devices sampled per round, plan
        the round's devices as the fleet that shares the server in it.

        [Note: plans per round] The planner's estimate of an epoch weighs the devices
        that share the server at once. Sampled per round, those are the round's draw,
        not the fleet: planning the fleet would plan for a server K / n times busier
        than it is. So before each round the round's devices are planned alone (from the
        same profiles), and take their plans with their `RoundStart`; a device's
        iterations per epoch stay as they were ([Note: switching]). The plan that each
        epoch reports is the plans as that epoch's last round left them. The trace-based
        re-planning (`replan`) is not used with sampling: each round is planned anew.
        """
        if (self.auto_config is None or self.planning is None
                or not self.config.devices_per_round):
            return
        auto, planning, live = self.auto_config, self.planning, self.live
        members = sorted(participants)

        def decide() -> list[tuple[int, int]]:
            return choose_plans(auto, planning, [live[k] for k in members], members=members)

        try:
            with rounds.clock.hold():  # selection runs off the loop; time stands still
                chosen = await asyncio.to_thread(decide)
        except ConfigError as exc:
            log.warning("planning round %s failed, keeping the plans: %s", members, exc)
            return
        plans = [(p.split_point, p.parallel_batches) for p in self.plans]
        batch = self.config.batch_size
        for k, (p, n) in zip(members, chosen, strict=True):
            if (batch // n) * n == self.plans[k].samples_per_iteration:
                plans[k] = (p, n)
        if plans != [(p.split_point, p.parallel_batches) for p in self.plans]:
            await rounds.compute.call(partial(self._switch_plans, plans))

    async def after_round(self, rounds: Rounds, round_no: int, epoch: int,
                          slices: Sequence[Slice], served: Sequence[int],
                          paced: Sequence[bool]) -> dict[str, Any] | None:
        """Mode auto's second look after the first round ([Note: re-choosing the
        system]); else, with ``replan``, re-estimate from the round's trace and switch
        plans when a fresh selection is estimated to be better by more than
        ``replan_threshold``."""
        if self.second_look is not None:
            look, self.second_look = self.second_look, None  # (set again to try one)
            return await self._look_again(rounds, look, round_no, epoch, slices, served,
                                          paced)
        config = self.config
        if (self.auto_config is None or self.planning is None or not star_options(config).replan
                or config.mode not in ("sfl", "pipar") or config.devices_per_round):
            return None  # (sampled: each round is planned anew, `plan_round`)
        planning, auto = self.planning, self.auto_config
        plans, current = list(self.plans), [(p.split_point, p.parallel_batches)
                                            for p in self.plans]
        batch = config.batch_size

        def decide() -> tuple[list[DeviceProfile], list[tuple[int, int]], float, float]:
            profile, live = live_profiles(list(slices), plans, list(served), planning,
                                          self.live, paced=list(paced))
            return live, *reselect(auto, profile, live, current)

        try:
            # off the event loop (selection over many devices takes a while), time held
            # still meanwhile in virtual time
            with rounds.clock.hold():
                self.live, chosen, before, after = await asyncio.to_thread(decide)
        except ConfigError as exc:
            log.warning("re-planning after round %d failed, keeping the plans: %s",
                        round_no + 1, exc)
            return None
        if chosen == current:
            return None
        if any((batch // n) * n != plan.samples_per_iteration
               for (_, n), plan in zip(chosen, self.plans, strict=True)):
            return None  # see [Note: switching]: iterations per epoch must stay the same
        was = self.plan_entries()
        await rounds.compute.call(partial(self._switch_plans, chosen))
        event = Replan(round_no, epoch, before, after, tuple(chosen))
        self.replans.append(event)
        log_lines(log, logging.WARNING, f"re-planned after round {round_no + 1}: estimated "
                  f"epoch {before:.3g} s -> {after:.3g} s:",
                  change_lines(was, self.plan_entries()))
        return event.to_mapping()

    async def _look_again(self, rounds: Rounds, look: SecondLook, round_no: int, epoch: int,
                          slices: Sequence[Slice], served: Sequence[int],
                          paced: Sequence[bool]) -> dict[str, Any] | None:
        """[Note: re-choosing the system]: after the first round, try each candidate
        that may be faster for a round; after the last trial, run on with the fastest."""
        measured = steady_epoch(rounds.clock.now() - self.round_began, slices, self.plans)
        if self.planning is None or measured is None:
            return None
        ran = Measured(self.config.mode, tuple((p.split_point, p.parallel_batches)
                                               for p in self.plans), measured)
        if look.measured:  # a trial round has ended
            tried = (*look.measured, ran)
            if look.queue:
                self.second_look = dataclasses.replace(look, measured=tried,
                                                       queue=look.queue[1:])
                if look.rematched:
                    return await self._again(rounds, look, round_no, epoch, look.queue[0],
                                             ran, tried)
                return await self._try(rounds, look, round_no, epoch, look.queue[0], ran)
            close = () if look.rematched else close_calls(tried, ran.mode)
            if close:
                self.second_look = dataclasses.replace(look, measured=tried, queue=close[1:],
                                                       rematched=True)
                return await self._again(rounds, look, round_no, epoch, close[0], ran, tried)
            best = fastest_measured(tried)
            figures = ", ".join(f"{m.mode} {m.epoch_s:.2f} s" for m in pooled(tried))
            if best.mode == ran.mode:
                log.info("auto keeps %s after trying it: measured per epoch %s", ran.mode,
                         figures)
                return None
            return await self._switch_to(
                rounds, look, round_no, epoch, best, ran.epoch_s,
                f"auto goes back to {best.mode} after trying "
                f"{', '.join(dict.fromkeys(m.mode for m in tried if m.mode != best.mode))}: "
                f"measured per epoch {figures}")
        planning, plans = self.planning, list(self.plans)

        def decide() -> tuple[list[DeviceProfile], list[SystemEstimate],
                              list[SystemEstimate]]:
            profile, live = live_profiles(list(slices), plans, list(served), planning,
                                          self.live, paced=list(paced))
            return live, *to_try(look.auto, look.candidates, ran, profile, live)

        try:
            with rounds.clock.hold():
                self.live, trying, estimates = await asyncio.to_thread(decide)
        except ConfigError as exc:
            log.warning("auto's second look after round %d failed, keeping %s: %s",
                        round_no + 1, ran.mode, exc)
            return None
        table = explain(estimates, trying[0] if trying else None)
        if not trying:
            self.serves_stages = ran.mode != "fl"  # (True for the look until now)
            log.info("auto keeps %s after the first round: it measured %.2f s per epoch; "
                     "no other candidate is predicted at most %g times that from the round's "
                     "speeds\n%s", ran.mode, ran.epoch_s, 1 + TRIAL_MARGIN, table)
            return None
        queue = tuple(Measured(t.mode, t.plans, t.epoch_s or 0.0) for t in trying)
        self.second_look = dataclasses.replace(look, measured=(ran,), queue=queue[1:])
        return await self._try(rounds, look, round_no, epoch, queue[0], ran, table)

    async def _try(self, rounds: Rounds, look: SecondLook, round_no: int, epoch: int,
                   trial: Measured, ran: Measured, table: str = "") -> dict[str, Any]:
        """Run candidate ``trial`` (its predicted epoch) for the next round."""
        plans = ", ".join(f"P{p}N{n}" for p, n in trial.plans)
        return await self._switch_to(
            rounds, look, round_no, epoch, trial, ran.epoch_s,
            f"auto tries {trial.mode} ({plans}) for round {round_no + 2}: predicted "
            f"{trial.epoch_s:.2f} s per epoch from round 1's speeds, {ran.mode} measured "
            f"{ran.epoch_s:.2f} s", table)

    async def _again(self, rounds: Rounds, look: SecondLook, round_no: int, epoch: int,
                     close: Measured, ran: Measured, tried: Sequence[Measured]
                     ) -> dict[str, Any] | None:
        """Run ``close`` (a close call's system, its pooled measured epoch) one more
        round; ``ran``: the round that just ended, ``tried``: every measured round."""
        figures = ", ".join(f"{m.mode} {m.epoch_s:.2f} s" for m in pooled(tried))
        line = (f"auto runs {close.mode} one more round (round {round_no + 2}): measured "
                f"per epoch {figures}, within {CLOSE_MARGIN:.0%} of the fastest: closer "
                "than one round each tells apart")
        if (close.mode == self.config.mode
                and close.plans == tuple((p.split_point, p.parallel_batches)
                                         for p in self.plans)):
            log.info("%s", line)
            return None
        return await self._switch_to(rounds, look, round_no, epoch, close, ran.epoch_s, line)

    async def _switch_to(self, rounds: Rounds, look: SecondLook, round_no: int, epoch: int,
                         to: Measured, before_s: float, line: str, table: str = ""
                         ) -> dict[str, Any]:
        """Run system ``to`` from the next round; log ``line`` with the plans' changes."""
        was = self.plan_entries()
        await rounds.compute.call(partial(self._switch_system, look.auto, to.mode,
                                          list(to.plans)))
        event = Replan(round_no, epoch, before_s, to.epoch_s, to.plans, mode=to.mode)
        self.replans.append(event)
        log_lines(log, logging.WARNING, f"{line}:",
                  [*change_lines(was, self.plan_entries()), *table.splitlines()])
        return event.to_mapping()

    def _switch_system(self, auto: RunConfig, mode: str,
                       chosen: list[tuple[int, int]]) -> None:
        """Run ``mode`` with plans ``chosen`` from the next round (compute thread)."""
        resolved = system_config(auto, mode)
        self.auto_config = resolved if mode != "fl" else None
        self.serves_stages = mode != "fl"
        self.config = resolved
        self._switch_plans(chosen)

    def _switch_plans(self, chosen: list[tuple[int, int]]) -> None:
        """Adopt new (P_k, N_k) (between rounds; in the compute thread, which owns the
        replicas: each is made at its device's new split point when its next round
        starts, with the momentum of the parameters it kept). Devices get theirs with the
        next RoundStart."""
        batch = self.config.batch_size
        for k, (p, n) in enumerate(chosen):
            old = self.plans[k]
            if (p, n) == (old.split_point, old.parallel_batches):
                continue
            self.plans[k] = DevicePlan(k, p, n, batch // n, old.iterations_per_epoch)
        if self.config.mode != "fl":
            self.config = with_plans(self.config, chosen)
        self.placement = star([p.split_point for p in self.plans], self.units)
