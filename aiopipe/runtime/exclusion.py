"""Who is excluded from a run for what it sent a neighbour, and on whose word (issue 41;
[Note: whose word excludes]).

A device that refuses what a neighbour sent (`aiopipe.runtime.judge`: values out of
range; or the plan broken) stops its round and names the neighbour to the coordinator
(`Accusation`). `Exclusions` decides whom that excludes; the coordinator then
ends that device's session like a lost one's and refuses its hellos for the rest of the
run, and its system recovers over the devices left (re-partitioned, its group shrunk,
the round played again).
"""

from __future__ import annotations

__all__ = ["Exclusions"]


class Exclusions:
    """The devices excluded from the run, with why; and who accused whom.

    ``tolerated``: how many distinct neighbours one device may accuse before its own
    word is what excludes it (the run's ``byzantine_devices``).
    """

    def __init__(self, tolerated: int) -> None:
        self.tolerated = max(1, tolerated)
        #: excluded devices and why, in the order they were excluded
        self.excluded: dict[int, str] = {}
        self._accused: dict[int, list[int]] = {}  # accuser -> the neighbours it named

    def accuse(self, accuser: int, culprit: int, reason: str) -> tuple[int, str] | None:
        """Device ``accuser`` refused what ``culprit`` sent (``reason``): the device to
        exclude and why, or None when nobody is (one of them is excluded already, or
        the accusation was made before).
        """
        if accuser in self.excluded or culprit in self.excluded or accuser == culprit:
            return None
        named = self._accused.setdefault(accuser, [])
        if culprit in named:
            return None
        named.append(culprit)
        if len(named) > self.tolerated:
            why = (f"it refused what {len(named)} different neighbours sent (devices "
                   f"{', '.join(map(str, named))}), more than the {self.tolerated} "
                   "faulty device(s) the run tolerates (byzantine_devices): its word "
                   "is what is wrong")
            self.excluded[accuser] = why
            return accuser, why
        why = f"device {accuser} refused what it sent: {reason}"
        self.excluded[culprit] = why
        return culprit, why

    def exclude(self, device: int, why: str) -> bool:
        """The coordinator itself refused what ``device`` sent (``why``): exclude it (its
        own judgement needs no accuser); whether it was not excluded already."""
        if device in self.excluded:
            return False
        self.excluded[device] = why
        return True

    def refusal(self, device: int) -> str:
        """Why ``device`` may not join again ("" when it may)."""
        why = self.excluded.get(device)
        return f"device {device} was excluded from the run: {why}" if why else ""


# Note [whose word excludes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The coordinator cannot check an accusation: a neighbour's frames are authenticated
# per link (a pair key both ends hold), not signed, so the accuser could have made up
# the values it shows. It believes a device's first accusation, and the first
# `byzantine_devices` of them: an honest device refuses only what a faulty neighbour
# sent, and with at most that many faulty devices an honest one never names more. A
# device that names more neighbours than that is the one excluded. So a lying device
# can remove at most `byzantine_devices` honest devices before it removes itself, and
# a faulty sender named by an honest neighbour is removed at once. Chosen over
# excluding both ends of a disputed link (which removes an honest device for every
# faulty one, always) and over asking the accuser for the values (unsigned, they prove
# nothing). Per-device signatures on data messages would make accusations checkable;
# they are not built.
