"""Codec cost vs one plain memory copy, for a PiPar-sized activation.

Encodes and decodes an `Activation` carrying a 100×32×32×32 float32 tensor (12.5 MiB) and
its 100 int64 labels, and compares it, side by side in one run, with copying the same
bytes once (``bytes(memoryview)`` — a fresh buffer, as encode makes — and ``numpy.copy``).
The codec's floor is one copy (encode builds the frame; decode copies nothing), so the
ratio copy_time / codec_time approaches 1; the goal is >= 0.5.

Run: ``.venv/bin/python bench/codec.py [--repeat N]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from aiopipe.protocol import Activation, decode, encode, to_tensor_data, to_torch


def time_once(fn: Callable[[], object], results: list[float]) -> None:
    start = time.perf_counter()
    fn()
    results.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)

    activation = torch.randn(100, 32, 32, 32)
    labels = torch.randint(0, 10, (100,))
    message = Activation(0, 0, 3, 7, 1, 0, "device0", "server", (to_tensor_data(activation),),
                         to_tensor_data(labels))
    raw = activation.numpy().data.cast("B")
    array = activation.numpy()
    frame = encode(message)
    received = decode(frame)
    if not isinstance(received, Activation) or not torch.equal(
        to_torch(received.tensors[0]), activation
    ):
        raise SystemExit("round trip failed")

    def codec() -> object:
        return decode(encode(message))

    def full_path() -> object:
        wire = Activation(0, 0, 3, 7, 1, 0, "device0", "server",
                          (to_tensor_data(activation),), to_tensor_data(labels))
        received = decode(encode(wire))
        if not isinstance(received, Activation):
            raise SystemExit("round trip failed")
        return to_torch(received.tensors[0]), to_torch(received.labels)

    cases: dict[str, Callable[[], object]] = {
        "copy: bytes(memoryview)": lambda: bytes(raw),
        "copy: numpy.copy": lambda: np.copy(array),
        "codec: encode+decode": codec,
        "full: to_tensor_data+encode+decode+to_torch": full_path,
        "encode only": lambda: encode(message),
        "decode only": lambda: decode(frame),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm up
        fn()
    for _ in range(args.repeat):  # interleaved, so load changes hit every case alike
        for name, fn in cases.items():
            time_once(fn, times[name])

    print(
        f"activation {tuple(activation.shape)} float32 + labels: {len(frame):,} frame bytes, "
        f"{len(frame) - activation.nbytes - labels.nbytes} non-tensor bytes; "
        f"median of {args.repeat}"
    )
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"  {name:<46} {value * 1e3:8.3f} ms")
    copy_time = medians["copy: bytes(memoryview)"]
    for name in ("codec: encode+decode", "full: to_tensor_data+encode+decode+to_torch"):
        print(
            f"ratio copy_time / {name.split(':')[0]}_time = {copy_time / medians[name]:.2f}"
            f"  (copy = bytes(memoryview); goal >= 0.5)"
        )
    print(
        f"ratio numpy.copy / codec = "
        f"{medians['copy: numpy.copy'] / medians['codec: encode+decode']:.2f}"
    )


if __name__ == "__main__":
    main()
