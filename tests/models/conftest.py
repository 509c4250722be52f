"""Shared fixtures for the model tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run torch on one thread: on a shared, loaded machine more threads only spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
