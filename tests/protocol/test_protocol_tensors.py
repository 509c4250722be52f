"""torch ⇄ TensorData conversions: dtypes, shapes, and that no bytes are copied."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from aiopipe.errors import LocalProtocolError
from aiopipe.protocol import (
    DTYPE_SIZES,
    TORCH_DTYPES,
    Activation,
    EvalRequest,
    Gradient,
    RoundResult,
    RoundStart,
    TensorData,
    decode,
    encode,
    leaves_from_wire,
    leaves_to_wire,
    state_from_wire,
    state_to_wire,
    to_tensor_data,
    to_torch,
)


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=torch.int64).to(
        dtype
    )


def address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def test_dtype_table_matches_the_wire() -> None:
    assert set(TORCH_DTYPES) == set(DTYPE_SIZES)
    for name, dtype in TORCH_DTYPES.items():
        assert torch.empty((), dtype=dtype).element_size() == DTYPE_SIZES[name]


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES.values()), ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (2, 0, 4), (0,), (2, 3, 4, 5)], ids=str)
def test_round_trip_through_a_frame(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Any shape, 0-d included, through a message whose tensors may have any shape."""
    tensor = sample(dtype, shape)
    message = EvalRequest(0, {"t": to_tensor_data(tensor)})
    decoded = decode(encode(message))
    assert isinstance(decoded, EvalRequest)
    back = to_torch(decoded.tensors["t"])
    assert back.dtype == dtype
    assert back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_contiguous_cpu_tensor_is_not_copied() -> None:
    tensor = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    data = to_tensor_data(tensor)
    assert address(data.data) == tensor.data_ptr()
    assert data.nbytes == 24 * 4
    del tensor
    gc.collect()
    assert bytes(data.data)[:8] == np.array([0.0, 1.0], dtype=np.float32).tobytes()  # kept alive


def test_bfloat16_and_bool_are_not_copied() -> None:
    for tensor in (sample(torch.bfloat16, (4, 4)), sample(torch.bool, (7,))):
        assert address(to_tensor_data(tensor).data) == tensor.data_ptr()


def test_non_contiguous_and_grad_tensors_are_made_contiguous() -> None:
    base = torch.randn(4, 6, requires_grad=True)
    view = base.t()[1:3]
    assert not view.is_contiguous()
    data = to_tensor_data(view)
    assert data.shape == (2, 4)
    assert torch.equal(to_torch(data), view.detach())


def test_unsupported_dtype_is_refused() -> None:
    with pytest.raises(LocalProtocolError, match="complex64 cannot travel"):
        to_tensor_data(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(LocalProtocolError, match="cannot travel"):
        to_tensor_data(torch.zeros(2, dtype=torch.uint16))


def test_decoded_tensor_views_the_frame() -> None:
    activation = torch.randn(8, 4, 5, 5)
    labels = torch.arange(8)
    frame = encode(Activation(0, 0, 0, 0, 0, 0, "device0", "server",
                              (to_tensor_data(activation),), to_tensor_data(labels)))
    decoded = decode(frame)
    assert isinstance(decoded, Activation)
    (x,) = leaves_from_wire(decoded.tensors)
    y = to_torch(decoded.labels)
    low, high = address(frame), address(frame) + len(frame)
    for tensor in (x, y):
        assert low < tensor.data_ptr()
        assert tensor.data_ptr() + tensor.nbytes <= high
        assert tensor.data_ptr() % 8 == 0  # naturally aligned
    assert torch.equal(x, activation)
    assert torch.equal(y, labels)
    del frame, decoded
    gc.collect()
    assert torch.equal(x, activation)  # the tensor keeps the frame alive


def test_writable_buffers_share_memory() -> None:
    buffer = bytearray(np.arange(4, dtype=np.int32).tobytes())
    tensor = to_torch(TensorData("int32", (2, 2), buffer))
    buffer[0] = 9
    assert tensor[0, 0].item() == 9


def test_zero_element_and_scalar_tensors() -> None:
    empty = to_torch(TensorData("bfloat16", (3, 0), b""))
    assert empty.shape == (3, 0)
    assert empty.dtype == torch.bfloat16
    scalar = to_torch(TensorData("int64", (), np.array(7, dtype=np.int64).tobytes()))
    assert scalar.shape == ()
    assert scalar.item() == 7


@pytest.mark.slow
def test_read_only_buffer_warning_is_handled() -> None:
    """In a fresh process (torch warns once per process), -W error and a read-only frame."""
    code = textwrap.dedent(
        """
        import torch
        from aiopipe.protocol import Gradient, decode, encode, to_tensor_data, to_torch
        frame = encode(Gradient(0, 1, 0, 0, 0, 0, "server", "device0",
                                (to_tensor_data(torch.ones(3)),)))
        assert isinstance(frame, bytes)
        print(to_torch(decode(frame).tensors[0]).sum().item())
        """
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3.0"


def test_read_only_buffer_in_this_process() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = to_torch(TensorData("float32", (2,), bytes(8)))
    assert tensor.tolist() == [0.0, 0.0]


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4, 2)
    )


def test_state_round_trip_loads_into_a_model() -> None:
    source = model()
    source(torch.randn(2, 3, 3, 3))  # move the batch-norm statistics
    state = source.state_dict()
    frame = encode(RoundResult(0, 2, 1.0, 1, state_to_wire(state)))
    decoded = decode(frame)
    assert isinstance(decoded, RoundResult)
    received = state_from_wire(decoded.tensors)
    assert list(received) == list(state)
    target = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4, 2)
    )
    target.load_state_dict(received)
    for name, value in target.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert received["1.num_batches_tracked"].dtype == torch.int64


def test_state_to_wire_refuses_bad_entries() -> None:
    with pytest.raises(LocalProtocolError, match="state key 1 is not a str"):
        state_to_wire({1: torch.zeros(1)})  # type: ignore[dict-item]
    with pytest.raises(LocalProtocolError, match=r"state\['a'\] is a list, not a tensor"):
        state_to_wire({"a": [1.0]})  # type: ignore[dict-item]


def test_state_from_wire_of_nothing() -> None:
    decoded = decode(encode(RoundStart(0, 0, 0, 0, state_to_wire({}), 0, 2, 0, 2, 1, 1, 0,
                                       "0F0 0SEND_F0 0RECV_B0 0B0 0STEP")))
    assert isinstance(decoded, RoundStart)
    assert state_from_wire(decoded.tensors) == {}


def test_leaves_round_trip_through_an_activation_and_a_gradient() -> None:
    """Leaves of mixed dtypes, each with the rows first: bit-exact, and views of the frame."""
    leaves = (sample(torch.float32, (4, 3, 2)), sample(torch.bool, (4, 7), 1),
              sample(torch.int64, (4,), 2), sample(torch.bfloat16, (4, 1), 3))
    labels = sample(torch.float32, (4, 5), 4)
    wire = leaves_to_wire(leaves)
    assert isinstance(wire, tuple)
    assert [t.dtype for t in wire] == ["float32", "bool", "int64", "bfloat16"]
    assert all(address(t.data) == leaf.data_ptr() for t, leaf in zip(wire, leaves, strict=True))
    frame = encode(Activation(0, 0, 0, 0, 0, 0, "device0", "device1", wire,
                              to_tensor_data(labels)))
    decoded = decode(frame)
    assert isinstance(decoded, Activation)
    back = leaves_from_wire(decoded.tensors)
    assert isinstance(back, tuple)
    low, high = address(frame), address(frame) + len(frame)
    for sent, received in zip(leaves, back, strict=True):
        assert received.dtype == sent.dtype
        assert torch.equal(received, sent)
        assert low < received.data_ptr()
        assert received.data_ptr() + received.nbytes <= high
    assert torch.equal(to_torch(decoded.labels), labels)
    floating = tuple(t for t in leaves if t.is_floating_point())
    gradient = decode(encode(Gradient(0, 1, 0, 0, 0, 0, "device1", "device0",
                                      leaves_to_wire(floating))))
    assert isinstance(gradient, Gradient)
    assert all(torch.equal(a, b) for a, b in zip(leaves_from_wire(gradient.tensors), floating,
                                                 strict=True))


def test_leaves_to_wire_refuses_what_cannot_travel() -> None:
    with pytest.raises(LocalProtocolError, match="complex64 cannot travel"):
        leaves_to_wire((torch.zeros(2), torch.zeros(2, dtype=torch.complex64)))
    assert leaves_to_wire(()) == ()
    assert leaves_from_wire(()) == ()
