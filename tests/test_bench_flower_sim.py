"""bench/flower_sim.py: its pure parts (process tree, PSS sum, round times, the tables),
without Flower installed. The benchmark's figures are never asserted."""

from __future__ import annotations

import argparse
import math
from types import ModuleType

from bench_scripts import load_bench


def _load() -> ModuleType:
    return load_bench("flower_sim")


def _stat(pid: int, comm: str, ppid: int, sid: int, start: int) -> str:
    # fields after the command: state ppid pgrp session tty tpgid flags minflt cminflt
    # majflt cmajflt utime stime cutime cstime priority nice threads itrealvalue starttime
    rest = ["S", ppid, pid, sid, 0, -1, 0, 0, 0, 0, 0, 1, 2, 0, 0, 20, 0, 1, 0, start, 99]
    return f"{pid} ({comm}) " + " ".join(str(x) for x in rest)


def test_parse_stat_reads_past_a_command_with_spaces_and_parentheses() -> None:
    fs = _load()
    assert fs.parse_stat(_stat(42, "ray::Client (x) y", 7, 40, 12345)) == (42, 7, 40, 12345)


def test_cpu_ticks_is_user_plus_system() -> None:
    fs = _load()
    assert fs.cpu_ticks(_stat(42, "a) b", 7, 40, 12345)) == 3


def test_pss_kib_reads_the_pss_line() -> None:
    fs = _load()
    rollup = ("00400000-7fff0000 ---p 00000000 00:00 0 [rollup]\nRss:  2048 kB\n"
              "Pss:  1500 kB\nPss_Anon:  1000 kB\nShared_Clean: 10 kB\n")
    assert fs.pss_kib(rollup) == 1500
    assert fs.pss_kib("Rss: 5 kB\n") == 0


def test_tree_takes_the_session_descendants_and_live_known_processes() -> None:
    fs = _load()
    stats = {
        1: (0, 1, 0),
        100: (1, 100, 10),  # the arm, a session leader
        101: (100, 100, 11),  # its child in its session (Ray's GCS)
        102: (101, 555, 12),  # a worker that made its own session: a descendant
        103: (102, 555, 13),  # and its child
        200: (1, 100, 14),  # reparented to init, still in the session
        300: (1, 300, 15),  # known earlier (same start time): kept
        301: (1, 301, 99),  # a known pid reused by another process: not kept
        400: (1, 400, 16),  # unrelated
    }
    found = fs.tree(stats, 100, known={(300, 15), (301, 17), (999, 1)})
    assert found == {100, 101, 102, 103, 200, 300}


def test_round_seconds_is_round_one_and_the_mean_of_the_rest() -> None:
    fs = _load()
    first, mean = fs.round_seconds([5.0, 6.0, 8.0, 9.0])
    assert first == 5.0
    assert mean == 4.0 / 3
    assert math.isnan(fs.round_seconds([2.0])[1])
    assert all(math.isnan(x) for x in fs.round_seconds([]))


def _rows() -> list[dict[str, object]]:
    common = {"devices": 100, "total_s": 10.0, "round1_s": 1.0, "run_s": 9.0,
              "peak_procs": 1, "samples": [400, 400], "accuracy": 0.15}
    return [
        {**common, "arm": "aiopipe", "repeat": 0, "round_s": 0.5, "peak_pss_kib": 400 * 1024,
         "losses": [2.3, 2.2], "accuracies": [0.1, 0.15]},
        {**common, "arm": "flower", "repeat": 0, "round_s": 1.0, "total_s": 30.0,
         "peak_pss_kib": 1200 * 1024, "peak_procs": 9, "losses": [2.3, 2.25],
         "accuracies": [0.1, 0.15]},
        {**common, "arm": "aiopipe", "repeat": 1, "round_s": 0.7, "peak_pss_kib": 400 * 1024,
         "losses": [2.3, 2.2], "accuracies": [0.1, 0.15]},
        {"devices": 100, "arm": "flower", "repeat": 1, "total_s": 5.0, "peak_pss_kib": 0,
         "error": "no result (exit 1)"},
    ]


def test_table_has_a_row_per_run_with_its_figures() -> None:
    fs = _load()
    text = fs.table(_rows())
    lines = text.splitlines()
    assert len(lines) == 2 + 4
    assert "peak PSS MiB" in lines[0]
    assert lines[3].split()[:9] == ["100", "flower", "0", "1.00", "1.00", "9.0", "30.0",
                                    "nan", "1200"]
    assert lines[5].rstrip().endswith("no result (exit 1)")


def test_summary_averages_runs_without_errors_and_gives_the_ratio() -> None:
    fs = _load()
    lines = fs.summary(_rows()).splitlines()
    assert lines[1].split() == ["100", "aiopipe", "0.60", "10.0", "400"]
    assert lines[2].split() == ["100", "flower", "1.00", "30.0", "1200"]
    assert lines[3].split() == ["100", "fl/aio", "1.67x", "3.00x", "3.00x"]


def test_agreement_is_the_largest_gap_between_the_arms() -> None:
    fs = _load()
    text = fs.agreement(_rows(), 100)
    assert "losses 0.05" in text
    assert "accuracies 0" in text
    assert fs.agreement(_rows(), 7) == "no pair to compare"


def test_both_arms_train_a_tenth_of_the_fleet_per_round() -> None:
    fs = _load()
    ns = argparse.Namespace(samples_per_device=40, batch_size=20, rounds=10, fraction=0.1)
    for k, n in ((10, 1), (100, 10), (1000, 100)):
        args = fs.scale_args(ns, k)
        assert args.devices_per_round == n
        assert (args.mode, args.local_optimizer, args.parallel_batches) == ("fl", "fresh", 1)
