"""aiopipe.secagg without a transport: fixed-point bound, Shamir sharing, the graph, and
whole SecAgg+ rounds driven in memory with clients dropping out at each step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("cryptography")

from aiopipe.errors import RemoteProtocolError, SecureAggregationError
from aiopipe.secagg import Client, FixedPoint, RoundSetup, Server, keys, shamir
from aiopipe.secagg.graph import degree_for, neighbours, threshold_for
from aiopipe.secagg.protocol import PublicKeys, UnmaskRequest

# -- fixed point -------------------------------------------------------------------------


@pytest.mark.parametrize(("clip", "n"), [(1.0, 4), (10.0, 100), (1000.0, 3)])
def test_decoded_sum_is_within_the_stated_bound(clip: float, n: int) -> None:
    rng = np.random.default_rng(0)
    code = FixedPoint.for_sum(clip, n)
    xs = rng.uniform(-clip, clip, size=(n, 5000))
    xs[0, :10] = clip  # the extremes too
    xs[1 % n, 10:20] = -clip
    total = np.zeros(5000, dtype=np.uint32)
    for x in xs:
        total += code.encode(x)
    error = np.abs(code.decode_sum(total) - xs.sum(axis=0))
    assert error.max() <= code.error_bound
    assert code.error_bound == n / (2 * code.scale)


def test_sum_of_extremes_never_wraps() -> None:
    code = FixedPoint.for_sum(3.0, 7)
    total = np.zeros(2, dtype=np.uint32)
    for _ in range(7):
        total += code.encode([3.0, -3.0])
    assert code.decode_sum(total) == pytest.approx([21.0, -21.0], abs=code.error_bound)


def test_values_beyond_clip_are_clipped_and_counted() -> None:
    code = FixedPoint.for_sum(1.0, 2)
    assert code.clipped([0.5, 2.0, -3.0]) == 2
    assert code.decode_sum(code.encode([5.0, -5.0])) == pytest.approx([1.0, -1.0], abs=1e-6)


def test_a_scale_that_can_wrap_is_refused() -> None:
    with pytest.raises(ValueError, match="overflow"):
        FixedPoint(1.0, 2.0**31, 2)


# -- Shamir --------------------------------------------------------------------------------


def test_any_threshold_shares_give_the_secret_back() -> None:
    secret = bytes(range(32))
    shares = shamir.split(secret, 3, [1, 2, 3, 4, 5])
    assert shamir.combine({k: shares[k] for k in (2, 4, 5)}, 3, 32) == secret
    assert shamir.combine({k: shares[k] for k in (1, 3, 5)}, 3, 32) == secret
    with pytest.raises(shamir.ShamirError, match="2 shares, 3 needed"):
        shamir.combine({k: shares[k] for k in (1, 2)}, 3, 32)


def test_fewer_than_threshold_shares_give_something_else() -> None:
    secret = b"\x01" * 32
    shares = shamir.split(secret, 3, [1, 2, 3])
    # interpolating two shares as if the threshold were 2 is a different line
    with pytest.raises(shamir.ShamirError):
        assert shamir.combine({1: shares[1], 2: shares[2]}, 2, 32) != secret


# -- graph ---------------------------------------------------------------------------------


def test_small_rounds_use_the_complete_graph() -> None:
    graph = neighbours([0, 1, 2, 3], degree_for(4), seed=1)
    assert graph == {c: frozenset({0, 1, 2, 3} - {c}) for c in range(4)}
    assert threshold_for(degree_for(4)) == 3  # more than half of 4 holders
    assert threshold_for(degree_for(5)) == 3


def test_large_rounds_use_a_sparse_regular_symmetric_graph() -> None:
    k = degree_for(100)
    assert k == 2 * 14  # 2 ceil(2 log2 100)
    graph = neighbours(range(100), k, seed=7)
    assert {len(v) for v in graph.values()} == {k}
    assert all(u in graph[v] for u in graph for v in graph[u])
    assert graph == neighbours(range(100), k, seed=7)
    assert graph != neighbours(range(100), k, seed=8)
    assert threshold_for(k) == 15


# -- whole rounds in memory ---------------------------------------------------------------

Drop = Callable[[int], Iterable[int]]  # step -> clients that drop out after it


def run_round(inputs: dict[int, np.ndarray], drop: dict[int, set[int]] | None = None,
              *, seed: int = 3, round_no: int = 0, setup: RoundSetup | None = None,
              tamper: dict[int, set[int]] | None = None
              ) -> tuple[np.ndarray, Server, dict[int, Client]]:
    """A round among ``inputs``' clients; ``drop[s]``: who sends nothing at step s;
    ``tamper[u]``: the clients u's sealed shares reach with a byte flipped."""
    drop, tamper = drop or {}, tamper or {}
    length = len(next(iter(inputs.values())))
    setup = setup or RoundSetup(round_no, seed, tuple(inputs), length)
    server = Server(setup)
    clients = {c: Client(setup, c) for c in inputs}
    alive = set(clients)

    def answering(step: int) -> list[int]:
        alive.difference_update(drop.get(step, set()))
        return sorted(alive)

    for c in answering(0):
        server.take_keys(c, clients[c].advertise())
    lists = server.close_keys()
    for c in answering(1):
        sealed = clients[c].share(lists[c])
        for v in tamper.get(c, set()) & set(sealed):
            sealed[v] = sealed[v][:-1] + bytes([sealed[v][-1] ^ 1])
        server.take_shares(c, sealed)
    boxes = server.close_shares()
    for c in answering(2):
        masked = clients[c].masked_input(boxes[c], inputs[c])
        server.take_masked(c, masked, clients[c].blamed)
    requests = server.close_masked()
    for c in answering(3):
        if c in requests:  # (not a client left out at step 2)
            server.take_unmasking(c, clients[c].unmask(requests[c]))
    return server.result(), server, clients


def _inputs(n: int, length: int = 64, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {c: rng.integers(0, 2**32, size=length, dtype=np.uint32) for c in range(n)}


def _sum(vectors: Iterable[np.ndarray]) -> np.ndarray:
    total = np.zeros_like(next(iter(vectors := list(vectors))))
    for v in vectors:
        total += v
    return total


@pytest.mark.parametrize("n", [2, 4, 10, 40])
def test_the_sum_is_exact_with_everyone(n: int) -> None:
    inputs = _inputs(n)
    total, server, _ = run_round(inputs)
    assert np.array_equal(total, _sum(inputs.values()))
    assert server.survivors == list(range(n))


def test_real_vectors_sum_within_the_fixed_point_bound() -> None:
    rng = np.random.default_rng(1)
    reals = {c: rng.normal(size=200) for c in range(10)}
    code = FixedPoint.for_sum(8.0, 10)
    total, _, _ = run_round({c: code.encode(x) for c, x in reals.items()})
    assert np.abs(code.decode_sum(total) - sum(reals.values())).max() <= code.error_bound


@pytest.mark.parametrize("step", [0, 1])
def test_clients_lost_before_masking_are_left_out(step: int) -> None:
    inputs = _inputs(6)
    total, server, _ = run_round(inputs, {step: {1, 4}})
    assert np.array_equal(total, _sum(inputs[c] for c in (0, 2, 3, 5)))
    assert server.survivors == [0, 2, 3, 5]


def test_two_clients_dropped_after_sharing_are_unmasked_from_shares() -> None:
    """Two of five drop after step 1 (their pairwise masks are in the others' inputs):
    the round still completes with the three survivors' sum."""
    inputs = _inputs(5)
    total, server, _ = run_round(inputs, {2: {0, 3}})
    assert server.survivors == [1, 2, 4]
    assert np.array_equal(total, inputs[1] + inputs[2] + inputs[4])


def test_dropouts_at_every_step_of_a_sparse_round() -> None:
    inputs = _inputs(40, length=16)
    drop = {0: {5}, 1: {6, 7}, 2: {8, 9, 10}, 3: {11, 12}}
    total, server, _ = run_round(inputs, drop)
    lost_before_input = {5, 6, 7, 8, 9, 10}
    assert server.survivors == [c for c in range(40) if c not in lost_before_input]
    # clients lost in step 3 had sent their inputs: the sum holds them
    assert np.array_equal(total, _sum(inputs[c] for c in server.survivors))


def test_too_few_survivors_is_a_clear_error() -> None:
    inputs = _inputs(4)
    with pytest.raises(SecureAggregationError, match="2 clients sent a masked input, the "
                                                     "threshold is 3"):
        run_round(inputs, {2: {0, 1}})


def test_too_few_answers_to_unmask_is_a_clear_error() -> None:
    inputs = _inputs(4)
    with pytest.raises(SecureAggregationError, match=r"has 2 shares .* threshold is 3"):
        run_round(inputs, {3: {0, 1}})


def test_a_client_refuses_to_unmask_when_its_neighbours_are_gone() -> None:
    """With 10 clients (complete graph, threshold 6), 6 dropped after sharing: each
    survivor has 3 surviving neighbours, fewer than threshold - 1 = 5, so its input
    would be exposed by its seed: step 2's close refuses first (4 < 6 masked inputs)."""
    inputs = _inputs(10)
    with pytest.raises(SecureAggregationError, match="threshold is 6"):
        run_round(inputs, {2: {0, 1, 2, 3, 4, 5}})
    client = Client(RoundSetup(0, 3, tuple(range(10)), 4), 0)
    client._step, client._held = 3, {c: (b"", b"") for c in range(10)}
    from aiopipe.secagg import UnmaskRequest

    with pytest.raises(SecureAggregationError, match="cannot unmask: 4 of its"):
        client.unmask(UnmaskRequest(frozenset({0, 1, 2, 3}), frozenset(range(4, 10))))


def test_a_coordinator_telling_two_stories_cannot_get_both_secrets_of_a_client() -> None:
    """The holders of client 0's shares (all 4 clients) are split: two are told 0
    dropped (they reveal shares of its mask key), the other two that it survived (shares
    of its seed). Would fail with a threshold of half the holders (2 of 4): each half
    then rebuilds one secret, and the two unmask client 0's input."""
    setup = RoundSetup(0, 3, (0, 1, 2, 3), 8)
    clients = {c: Client(setup, c) for c in range(4)}
    server = Server(setup)
    for c in range(4):
        server.take_keys(c, clients[c].advertise())
    lists = server.close_keys()
    for c in range(4):
        server.take_shares(c, clients[c].share(lists[c]))
    boxes = server.close_shares()
    for c in range(4):
        clients[c].masked_input(boxes[c], _inputs(4, length=8)[c])
    everyone = frozenset(range(4))
    dropped_story = UnmaskRequest(everyone - {0}, frozenset({0}))
    survived_story = UnmaskRequest(everyone, frozenset())
    key_shares = {c + 1: clients[c].unmask(dropped_story)[0] for c in (1, 2)}
    seed_shares = {c + 1: clients[c].unmask(survived_story)[0] for c in (0, 3)}
    assert min(len(key_shares), len(seed_shares)) < setup.threshold


def test_the_server_never_holds_an_unmasked_input() -> None:
    """Every vector the server holds differs from the client's input; and even with
    every seed the unmasking reveals (the survivors'), a survivor's input is still
    hidden by its pairwise masks; the server's fields hold no input.

    Would fail if masks were skipped: the masked input would equal the input, or equal
    it once the revealed seed's mask is taken away."""
    inputs = _inputs(6, length=256)
    total, server, clients = run_round(inputs, {2: {5}})
    for c, masked in server.masked.items():
        assert np.count_nonzero(masked == inputs[c]) < 5  # ~256 / 2^32 expected
        seed = shamir.combine(server._seed_shares[c], server.setup.threshold, 32)
        assert seed == clients[c]._seed  # what the server learns of c...
        only_pairs = masked - keys.mask(seed, 256)
        assert np.count_nonzero(only_pairs == inputs[c]) < 5  # ...does not unmask c
    held = [v for v in vars(server).values() if isinstance(v, np.ndarray)]
    held += [v for d in vars(server).values() if isinstance(d, dict)
             for v in d.values() if isinstance(v, np.ndarray)]
    assert held
    assert all(not np.array_equal(v, inputs[c]) for v in held for c in inputs)
    assert np.array_equal(total, _sum(inputs[c] for c in range(5)))


def test_a_client_that_skips_its_masks_is_caught_by_the_check() -> None:
    """The check above is not vacuous: an input sent unmasked equals the input."""
    inputs = _inputs(4, length=256)
    setup = RoundSetup(0, 3, tuple(inputs), 256)
    server = Server(setup)
    for c in inputs:
        server.take_keys(c, Client(setup, c).advertise())
    server._step = 2
    server._sealed = {c: {} for c in inputs}
    server.take_masked(0, inputs[0])  # unmasked
    assert np.count_nonzero(server.masked[0] == inputs[0]) == 256


def test_steps_out_of_order_or_from_strangers_are_refused() -> None:
    setup = RoundSetup(0, 3, (0, 1, 2), 8)
    server = Server(setup)
    client = Client(setup, 0)
    with pytest.raises(RemoteProtocolError, match="step 2 out of order"):
        client.masked_input({}, np.zeros(8, dtype=np.uint32))
    advertised = client.advertise()
    with pytest.raises(RemoteProtocolError, match="not in step 0"):
        server.take_keys(9, advertised)
    server.take_keys(0, advertised)
    with pytest.raises(RemoteProtocolError, match="not in step 0"):
        server.take_keys(0, advertised)  # twice
    with pytest.raises(RemoteProtocolError, match="step-1 message at step 0"):
        server.take_shares(0, {})


def test_a_client_whose_shares_do_not_open_is_left_out_and_costs_nobody_else() -> None:
    """[Note: secagg blame]: client 1's shares for client 0 are changed on their way.
    Client 0 masks without client 1 and blames it; the server leaves client 1 out; the
    sum is the other clients' exactly, and client 0 is in it."""
    inputs = _inputs(5)
    total, server, clients = run_round(inputs, tamper={1: {0}})
    assert clients[0].blamed == {1}
    assert all(not clients[c].blamed for c in (2, 3, 4))
    assert server.left_out == [1]
    assert server.survivors == [0, 2, 3, 4]
    assert np.array_equal(total, _sum(inputs[c] for c in (0, 2, 3, 4)))


def test_broken_shares_to_everyone_in_a_sparse_round_with_dropouts() -> None:
    """Two of 40 clients seal garbage for every neighbour, and two others drop after
    sharing: the sum is the other 36's."""
    inputs = _inputs(40, length=16)
    setup = RoundSetup(0, 3, tuple(inputs), 16)
    graph = setup.graph()
    total, server, _ = run_round(inputs, {2: {5, 9}}, setup=setup,
                                 tamper={7: set(graph[7]), 30: set(graph[30])})
    assert server.left_out == [7, 30]
    kept = sorted(set(inputs) - {5, 7, 9, 30})
    assert server.survivors == kept
    assert np.array_equal(total, _sum(inputs[c] for c in kept))


def _advertised(n: int, length: int) -> tuple[Server, dict[int, Client], dict[int, Any]]:
    """A round of ``n`` clients past step 0: the server, the clients, each one's
    neighbours' keys."""
    setup = RoundSetup(0, 3, tuple(range(n)), length)
    server = Server(setup)
    clients = {c: Client(setup, c) for c in range(n)}
    for c in range(n):
        server.take_keys(c, clients[c].advertise())
    return server, clients, server.close_keys()


def test_a_key_no_one_can_agree_with_leaves_out_its_sender_only() -> None:
    """Client 2 advertises the all-zero point (of small order: every exchange with it
    fails). Would fail unchecked: the server passed it on and every neighbour's step 1
    raised a ValueError. The server refuses it; the round goes on without client 2; a
    client handed it anyway refuses it as a protocol error."""
    inputs = _inputs(5)
    setup = RoundSetup(0, 3, tuple(inputs), 64)
    server = Server(setup)
    clients = {c: Client(setup, c) for c in inputs}
    zero = PublicKeys(bytes(32), clients[2].advertise().mask)
    with pytest.raises(RemoteProtocolError, match="client 2's public keys"):
        server.take_keys(2, zero)
    for c in (0, 1, 3, 4):
        server.take_keys(c, clients[c].advertise())
    lists = server.close_keys()
    assert all(2 not in neighbours for neighbours in lists.values())
    with pytest.raises(RemoteProtocolError, match="client 2's advertised keys are "
                                                  "malformed"):
        clients[0].share({**lists[0], 2: zero})


def test_blame_of_a_client_that_sealed_nothing_is_refused() -> None:
    server, clients, lists = _advertised(3, 8)
    for c in (0, 1):
        server.take_shares(c, clients[c].share(lists[c]))
    boxes = server.close_shares()
    masked = clients[0].masked_input(boxes[0], np.zeros(8, dtype=np.uint32))
    with pytest.raises(RemoteProtocolError, match="blames"):
        server.take_masked(0, masked, frozenset({2}))


def test_shares_for_the_wrong_clients_are_refused() -> None:
    server, clients, lists = _advertised(3, 8)
    sealed = clients[0].share(lists[0])
    with pytest.raises(RemoteProtocolError, match="sealed shares for"):
        server.take_shares(0, {1: sealed[1]})


def test_an_unmasking_request_asking_for_both_secrets_is_refused() -> None:
    inputs = _inputs(3)
    setup = RoundSetup(0, 3, tuple(inputs), 64)
    server, clients = Server(setup), {c: Client(setup, c) for c in inputs}
    for c in inputs:
        server.take_keys(c, clients[c].advertise())
    lists = server.close_keys()
    for c in inputs:
        server.take_shares(c, clients[c].share(lists[c]))
    boxes = server.close_shares()
    for c in inputs:
        server.take_masked(c, clients[c].masked_input(boxes[c], inputs[c]))
    from aiopipe.secagg import UnmaskRequest

    with pytest.raises(RemoteProtocolError, match="does not split"):
        clients[0].unmask(UnmaskRequest(frozenset({0, 1, 2}), frozenset({1})))
