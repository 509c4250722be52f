"""Shared test settings: one torch thread so tests do not fight over the two cores; the
measured cost tables kept in this session's own directory, not the user's cache; a
self-signed TLS certificate for the tests that need one."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def session_cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """[Note: cost cache] for the whole session (processes the tests start inherit it)."""
    directory = tmp_path_factory.mktemp("cost-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIOPIPE_COST_CACHE", str(directory))
        yield directory


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 only (no DNS names): (cert, key)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
         "-subj", "/CN=aiopipe test", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first, the real-process ones (``*_processes.py``) first of them (a
    stable sort: each group keeps its order): pytest-xdist hands each worker a
    contiguous share and the idle ones steal from the others' ends, so the long tests
    start early and the run ends on short ones, not with one worker finishing a
    minute-long test while the other waits."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None,
                                 not item.path.stem.endswith("_processes")))
