"""A device's data path: the activations, gradients and group gradients that arrive
from its neighbours (peer devices, or the coordinator's stage), judged before they
reach the stage.

Each message is first asked of the system's `ArrivalRules` (aiopipe.runtime.arrivals):
deliver, hold, drop or refuse. What is delivered is checked against the plan (ids,
shapes, labels: `check_data_message`), its values judged against the cut's priors
(`ArrivalJudge`, [Note: judging arrivals]), checked to come once, joined with the other
pieces of its micro-batch when a group sends it (`Pieces`), and handed to the stage's
`Inbox`.

[Note: early activations] The coordinator starts a round on every device at once, but
the `RoundStart`s travel separate links: the previous stage may start, and send its
first activations, before this device has its own `RoundStart`. Such activations,
ahead of the round this device knows, wait and are checked when their round starts. A
stage sends at most N of them before it must wait for a gradient, so more than the
batch size of them from one peer is a protocol error.
"""

from __future__ import annotations

from collections.abc import Callable

from aiopipe.errors import NeighbourFaultError, RemoteProtocolError
from aiopipe.protocol import Activation, Gradient, GroupGradient
from aiopipe.runtime.arrivals import ArrivalRules, Verdict
from aiopipe.runtime.assignment import Assignment, check_data_message
from aiopipe.runtime.executor import Inbox, Key
from aiopipe.runtime.groups import Pieces, check_group_gradient
from aiopipe.runtime.judge import ArrivalJudge
from aiopipe.runtime.peer_links import PeerLinks
from aiopipe.runtime.stage import Expected

__all__ = ["DataMessage", "Delivery"]

#: What travels the data path.
DataMessage = Activation | Gradient | GroupGradient


class Delivery:
    """The data path of one device (module docstring).

    ``coordinator``: the coordinator's node name; ``rules``: the system's arrival
    rules; ``running``: whether a round is under way; ``judge``: the node's current
    judge (it is replaced once the run's config is known).
    """

    def __init__(self, inbox: Inbox, *, coordinator: str, rules: ArrivalRules,
                 batch_size: int, running: Callable[[], bool],
                 judge: Callable[[], ArrivalJudge]) -> None:
        self.inbox = inbox
        self.coordinator = coordinator
        self.rules = rules
        self.batch_size = batch_size
        self.running = running
        self.judge = judge
        self.run_id = 0
        self.assignment: Assignment | None = None
        #: what the round's messages from a data-parallel group are joined by, and the
        #: stage's parameters (names, dtypes, shapes) its group gradients must hold
        self.pieces: Pieces | None = None
        self.parameters: Expected = {}
        #: activations sent to the coordinator's stage, until their gradient arrives
        self.sent_activations: dict[tuple[int, int, int], Activation] = {}
        #: activations (and group gradients) from peers ahead of the round
        self._early: dict[str, list[Activation | GroupGradient]] = {}

    def start_round(self, assignment: Assignment, pieces: Pieces | None = None,
                    parameters: Expected | None = None) -> None:
        """The round ``assignment`` begins: its messages are joined by ``pieces`` (by
        default, the assignment's); its group gradients hold ``parameters`` (none by
        default: a stage in no data-parallel group)."""
        self.assignment = assignment
        self.pieces = pieces if pieces is not None else Pieces(assignment)
        self.parameters = parameters if parameters is not None else {}

    def end_round(self) -> None:
        """Between rounds, hold nothing of the last (a device that has trained holds
        its round's pieces and parameter shapes otherwise, ~2 KB, for as long as it
        waits: a population of 100,000 devices gains that with every device that has
        trained). A late gradient is dropped, and anything else refused, as in a round
        that is over."""
        self.assignment, self.pieces, self.parameters = None, None, {}

    def sent(self, activation: Activation) -> None:
        """``activation`` went to the coordinator's stage (re-sent after a reconnection
        until its gradient comes)."""
        self.sent_activations[_key(activation)] = activation

    def iteration_done(self) -> None:
        """Every gradient of the iteration has arrived."""
        self.sent_activations.clear()

    def forget(self, *, early: bool = False) -> None:
        """Forget the activations sent (the round was dropped or the run ended); with
        ``early``, the ones held ahead of the round too (a new session)."""
        self.sent_activations.clear()
        if early:
            self._early.clear()

    def deliver(self, sender: str, message: DataMessage) -> None:
        """Check a data message from ``sender`` against the round and hand it to the
        stage ([Note: early activations]).

        Raises:
            RemoteProtocolError: it breaks the plan.
        """
        assignment = self.assignment
        if isinstance(message, Gradient) and sender == self.coordinator:
            if _key(message) not in self.sent_activations:
                return  # a gradient sent again after a reconnection; we have it already
            del self.sent_activations[_key(message)]
        verdict = self.rules.verdict(message, assignment, running=self.running(),
                                     from_peer=sender != self.coordinator)
        if verdict is Verdict.DROP:
            return
        if verdict is Verdict.HOLD:
            assert isinstance(message, Activation | GroupGradient)
            early = self._early.setdefault(sender, [])
            if len(early) >= self.batch_size:
                raise RemoteProtocolError(f"{sender} sent more activations ahead of the "
                                          "round than a round can have")
            early.append(message)
            return
        if verdict is Verdict.REFUSE or assignment is None:
            raise RemoteProtocolError(f"{sender} sent an activation outside a round")
        key: Key
        whole: Activation | Gradient | dict[str, GroupGradient] | None
        assert self.pieces is not None  # (set with the assignment)
        if isinstance(message, GroupGradient):
            check_group_gradient(message, assignment, self.parameters, sender=sender,
                                 run_id=self.run_id)
            key = ("R", message.epoch, message.iteration, 0)
            self._check_once(sender, key)
            whole = self.pieces.gather(key, sender, message)
        else:
            check_data_message(message, assignment, sender=sender, run_id=self.run_id)
            if sender != self.coordinator:
                self.judge().judge_data(sender, message, first_unit=assignment.first_unit,
                                        stop_unit=assignment.stop_unit)
            key = ("F" if isinstance(message, Activation) else "B", *_key(message))
            self._check_once(sender, key)
            whole = self.pieces.join(key, sender, message)
        if whole is None:
            return  # more pieces to come
        if ArrivalRules.too_far_ahead(self.inbox.held(), assignment, slack=2):
            # an honest neighbour is never more than an iteration ahead of us
            raise RemoteProtocolError(f"{sender} sent more than two iterations' messages "
                                      "ahead of the schedule")
        self.inbox.put(key, whole)

    def _check_once(self, sender: str, key: Key) -> None:
        """A peer sends each message once.

        Raises:
            RemoteProtocolError: ``sender`` sent ``key``'s again.
        """
        if sender != self.coordinator and self.inbox.seen(key):
            raise RemoteProtocolError(f"{sender} sent {key[0]} {key[1:]} twice")

    async def deliver_early(self, peers: PeerLinks | None) -> None:
        """Hand over the activations that came before this round started
        ([Note: early activations]); those for a later round wait on. One that breaks
        the plan is its sender's protocol error (which fails the round)."""
        early, self._early = self._early, {}
        for sender, messages in early.items():
            for message in messages:
                try:
                    self.deliver(sender, message)
                except RemoteProtocolError as exc:
                    if peers is not None:
                        await peers.reject(sender, exc)
                    raise NeighbourFaultError(sender, exc) from None


def _key(message: Activation | Gradient) -> tuple[int, int, int]:
    return (message.epoch, message.iteration, message.micro_batch)
