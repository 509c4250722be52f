"""Secure aggregation's messages (aiopipe.protocol.secagg) refuse, on construction, any
tensor their step does not hold, and round-trip through the codec at 100 devices."""

from __future__ import annotations

import pytest

from aiopipe.errors import LocalProtocolError
from aiopipe.protocol import SecAggReply, SecAggRequest, TensorData, decode, encode


def td(dtype: str, shape: tuple[int, ...]) -> TensorData:
    size = {"uint8": 1, "int32": 4, "int64": 8, "float32": 4}[dtype]
    n = 1
    for d in shape:
        n *= d
    return TensorData(dtype, shape, bytes(n * size))


@pytest.mark.parametrize(("make", "error"), [
    (lambda: SecAggReply(0, 0, {"cipher": td("uint8", (32,))}), "not \\['cipher', 'mask'\\]"),
    (lambda: SecAggReply(0, 0, {"cipher": td("uint8", (31,)), "mask": td("uint8", (32,))}),
     "tensor 'cipher'"),
    (lambda: SecAggReply(0, 2, {"masked": td("float32", (4,))}), "tensor 'masked'"),
    (lambda: SecAggReply(0, 2, {}), "not \\['masked'\\]"),
    (lambda: SecAggReply(0, 2, {"blamed": td("int64", (1,))}), "not \\['masked'\\]"),
    (lambda: SecAggReply(0, 2, {"masked": td("int32", (4,)), "blamed": td("int32", (1,))}),
     "tensor 'blamed'"),
    (lambda: SecAggReply(0, 0, {"cipher": td("uint8", (32,)), "mask": td("uint8", (32,)),
                                "blamed": td("int64", (1,))}), "tensor 'blamed'"),
    (lambda: SecAggReply(0, 3, {"x": td("uint8", (66,))}), "tensor 'x'"),
    (lambda: SecAggReply(0, 3, {"1": td("uint8", (65,))}), "tensor '1'"),
    (lambda: SecAggReply(0, 1, {"01": td("uint8", (100,))}), "tensor '01'"),
    (lambda: SecAggReply(0, 1, {"1": td("uint8", (257,))}), "tensor '1'"),
    (lambda: SecAggReply(0, 4, {}), "step must be 0 to 3"),
    (lambda: SecAggRequest(0, 1, (), (), 0, {"key:1": td("uint8", (32,))}), "tensor 'key:1'"),
    (lambda: SecAggRequest(0, 0, (), (), 5, {"clients": td("int32", (3,))}),
     "tensor 'clients'"),
    (lambda: SecAggRequest(0, 3, (1, 2), (2,), 0, {}), "both among the survivors"),
    (lambda: SecAggRequest(0, 3, (1, 1), (), 0, {}), "twice"),
    (lambda: SecAggRequest(0, 3, (-1,), (), 0, {}), "non-negative"),
    (lambda: SecAggRequest(0, 3, (), (), 0, {"1": td("uint8", (66,))}), "tensor '1'"),
])
def test_what_a_step_does_not_hold_is_refused(make: object, error: str) -> None:
    with pytest.raises(LocalProtocolError, match=error):
        make()  # type: ignore[operator]


def test_a_round_of_100_devices_travels() -> None:
    request = SecAggRequest(7, 0, (), (), 20491, {"clients": td("int64", (100,))})
    back = decode(encode(request))
    assert isinstance(back, SecAggRequest)
    assert back.tensors["clients"].shape == (100,)
    survivors = tuple(range(29))
    assert decode(encode(SecAggRequest(7, 3, survivors, (40,), 0, {}))) == SecAggRequest(
        7, 3, survivors, (40,), 0, {})


def test_a_masked_input_may_blame_neighbours() -> None:
    """Step 2's reply may name the neighbours whose shares did not open ([Note: secagg
    blame] in aiopipe.secagg.client)."""
    reply = SecAggReply(0, 2, {"masked": td("int32", (4,)), "blamed": td("int64", (2,))})
    assert decode(encode(reply)) == reply
