"""bench/checkpoint.py runs against the server's checkpoint methods as they are."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_bench


def test_the_checkpoint_bench_prints_the_copy_and_the_write(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_bench("checkpoint")
    threads = torch.get_num_threads()
    monkeypatch.setattr("sys.argv", ["checkpoint.py", "--model", "vgg5", "--devices", "2",
                                     "--repeat", "1", "--batch-size", "4"])
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "model vgg5, 2 devices, split point 1, checkpoint" in out
    assert "copy, as the next round starts" in out
    assert "write, while training goes on" in out
