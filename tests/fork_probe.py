"""What a forked node sees (tests/test_forkserver.py): one JSON line of its argv, working
directory, sys.path[0], an environment variable and signal dispositions; then it sleeps
``PROBE_SLEEP`` seconds and exits with ``PROBE_EXIT``."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

if __name__ == "__main__":
    print(json.dumps({
        "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
        "probe": os.environ.get("PROBE"), "torch_loaded": "torch" in sys.modules,
        "sigpipe_ignored": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
        "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    }), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    time.sleep(float(os.environ.get("PROBE_SLEEP", "0")))
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
