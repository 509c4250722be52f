"""What ``python -m aiopipe`` does when one of its device processes dies mid-run
(`aiopipe.__main__._device_exited`), without processes; between real processes:
tests/test_launcher_faults_processes.py."""

from __future__ import annotations

import logging

import pytest

from aiopipe.__main__ import _device_exited
from aiopipe.config import MODES
from aiopipe.errors import TrainingError
from aiopipe.runtime.systems.base import system_class


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_s_system_says_whether_it_recovers(mode: str) -> None:
    assert system_class(mode).recovers_lost_devices is True


def test_a_dead_device_process_is_logged_and_the_run_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="aiopipe.launcher"):
        again = _device_exited(2, -9, recovers=True, running=2, restarts=0)
    assert again is False
    assert caplog.messages == ["device process 2 exited with code -9; the run goes on "
                               "without it"]


def test_a_dead_device_process_is_started_again_while_it_has_restarts(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="aiopipe.launcher"):
        assert _device_exited(1, -9, recovers=True, running=0, restarts=2) is True
    assert caplog.messages == ["device process 1 exited with code -9; starting it again "
                               "(1 more restart allowed)"]


def test_the_run_fails_when_it_cannot_go_on() -> None:
    with pytest.raises(TrainingError, match=r"^device process 0 exited with code 1$"):
        _device_exited(0, 1, recovers=False, running=2, restarts=3)  # (before every join)
    with pytest.raises(TrainingError, match="every device process has exited"):
        _device_exited(0, -9, recovers=True, running=0, restarts=0)
