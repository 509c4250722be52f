"""bench/report.py --summary: one table over several results directories of bench/shaped.py.

Built from small hand-made raw.json files: the newest finished run of each cell wins, runs
with --replan are left out, and the ratios are the cells' own.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from bench_scripts import load_bench


def _load() -> ModuleType:
    return load_bench("report")


def _run(*times: float, idle: float = 1.0, plan: tuple[int, int] = (2, 4)) -> dict[str, Any]:
    return {"wall_s": 1.0, "epochs": [
        {"epoch": e, "time_s": t, "idle_s": {"server": idle},
         "plan": [{"device": 0, "split_point": plan[0], "parallel_batches": plan[1]}]}
        for e, t in enumerate(times)
    ]}


def _write(root: Path, name: str, started: str, runs: dict[str, Any], *,
           replan: bool = False, network: str = "4g") -> Path:
    out = root / name
    out.mkdir()
    raw = {
        "command": f"bench/shaped.py --out {name}", "started": started,
        "machine": {"git": "abc1234"}, "settings": {"replan": replan},
        "configurations": [
            {"workload": "vgg5", "network": network, "fleet": "homogeneous", "runs": runs}
        ],
    }
    (out / "raw.json").write_text(json.dumps(raw))
    return out


def test_summary_takes_the_newest_finished_run_of_each_cell(tmp_path: Path) -> None:
    report = _load()
    old = _write(tmp_path, "old", "2026-01-01 10:00:00 +0000", {
        "fl": _run(9.0, 8.0), "flower": _run(9.0, 10.0),
        "sfl P=1": _run(9.0, 6.0), "sfl P=2": _run(9.0, 5.0), "pipar": _run(9.0, 7.0),
    })
    new = _write(tmp_path, "new", "2026-01-02 10:00:00 +0000", {
        "pipar": _run(9.0, 4.0, idle=0.5), "fl": {"error": "timed out"},
    })
    replan = _write(tmp_path, "replan", "2026-01-03 10:00:00 +0000",
                    {"pipar": _run(9.0, 1.0)}, replan=True)
    path = report.write_summary([old, new, replan], tmp_path / "SUMMARY.md")
    text = path.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| vgg5 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # FL 8 (the newer FL failed), Flower 10, SFL best P=2 at 5, PiPar 4 from the newer run
    assert cells[3:7] == ["8.00", "10.00", "5.00 (P=2)", "4.00 (P=2 N=4)"]
    assert cells[7:10] == ["2.00×", "1.25×", "1.25×"]
    assert cells[10] == "1.00 / 1.00 / 0.50"
    assert cells[11] == "1,2"  # SFL split points tried
    assert cells[12] == "[1], [2]"
    sources = [line for line in text.splitlines() if line.startswith("- [")]
    assert len(sources) == 2
    assert "`old/`" in sources[0]
    assert "`new/`" in sources[1]


def test_sfl_best_is_over_the_split_points_of_every_directory(tmp_path: Path) -> None:
    report = _load()
    old = _write(tmp_path, "old", "2026-01-01 10:00:00 +0000", {
        "fl": _run(9.0, 8.0), "sfl P=1": _run(9.0, 3.5), "sfl P=3": _run(9.0, 3.0),
        "pipar": _run(9.0, 2.0),
    })
    # a later directory tries other split points, and P=3 again (slower this time)
    new = _write(tmp_path, "new", "2026-01-02 10:00:00 +0000", {
        "sfl P=3": _run(9.0, 5.0), "sfl P=4": _run(9.0, 4.0), "sfl P=5": {"error": "x"},
    })
    text = report.write_summary([old, new], tmp_path / "SUMMARY.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| vgg5 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # the newest run of each split point (P=3: 5.0, not 3.0), the quickest of them
    assert cells[5] == "3.50 (P=1)"
    assert cells[8] == "1.75×"
    assert cells[11] == "1,3,4"
    assert cells[12] == "[1]"


def test_summary_rows_follow_workload_network_and_fleet_order(tmp_path: Path) -> None:
    report = _load()
    wifi = _write(tmp_path, "a", "2026-01-01 10:00:00 +0000", {"fl": _run(1.0)}, network="wifi")
    slow = _write(tmp_path, "b", "2026-01-01 11:00:00 +0000", {"fl": _run(2.0)}, network="4g+")
    half = _write(tmp_path, "c", "2026-01-01 12:00:00 +0000", {"fl": _run(3.0)}, network="4g+")
    raw = json.loads((half / "raw.json").read_text())
    raw["configurations"][0]["fleet"] = "half-slow"
    (half / "raw.json").write_text(json.dumps(raw))
    text = report.write_summary([wifi, half, slow], tmp_path / "s.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| vgg5 ")]
    assert [tuple(c.strip() for c in r.split("|")[2:4]) for r in rows] == [
        ("4g+", "homogeneous"), ("4g+", "half-slow"), ("wifi", "homogeneous")]


def test_summary_command_skips_directories_without_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _load()
    good = _write(tmp_path, "good", "2026-01-01 10:00:00 +0000", {"fl": _run(1.0)})
    (tmp_path / "other").mkdir()
    out = tmp_path / "S.md"
    assert report.main(["--summary", str(good), str(tmp_path / "other"), "--out", str(out)]) == 0
    assert "skipped" in capsys.readouterr().err
    assert out.is_file()
    assert report.main(["--summary", str(tmp_path / "other")]) == 2
    assert report.main([]) == 2
