"""A process started again, warm: ``python -m warm_start MODULE ARGS`` imports what
aiopipe's nodes import and does torch's first-use imports
(`aiopipe.runtime.compute.warm_up_torch`), says ``warm``, and waits for SIGUSR1; then it
runs ``python -m MODULE ARGS`` (``aiopipe.device``, ``aiopipe.server``;
tests/real_processes.py, `ProcessFleet.start_warm`).

The node then starts from nothing, as a new process would: no session, no model, no
data, no socket; only its interpreter had the seconds (tens of them on a loaded machine)
that importing torch takes behind it, so that a test of a node started again after a
fault need not wait, nor train on, for those seconds.
"""

from __future__ import annotations

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # before the slow imports

import runpy  # noqa: E402
import sys  # noqa: E402

import aiopipe.api  # noqa: E402, F401  (torch)
from aiopipe.runtime.compute import warm_up_torch  # noqa: E402

warm_up_torch()
print("warm", flush=True)
signal.sigwait({signal.SIGUSR1})
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
module, sys.argv = sys.argv[1], sys.argv[1:]
sys.modules.pop(module, None)  # run afresh as __main__, as -m does
runpy.run_module(module, run_name="__main__", alter_sys=True)
