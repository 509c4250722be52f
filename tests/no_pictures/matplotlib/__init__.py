"""Stands in for matplotlib in the processes of the process tests (tests/real_processes.py,
``NO_PICTURES``): importing it fails as it does where matplotlib is not installed, so
a run's results directory gets no ``timeline.png`` or ``overview.png`` and the server
says so in one line (aiopipe/metrics/results.py). Importing matplotlib and drawing the
two pictures takes a process seconds (more on a loaded machine), and these tests check
other things; the pictures of a real run: tests/test_cli.py."""

raise ImportError("matplotlib is kept out of the process tests' processes "
                  "(tests/no_pictures)")
