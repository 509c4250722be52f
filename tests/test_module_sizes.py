"""Every module of the package stays small enough to read in one sitting: under 600
lines (docs/design.md, "Systems as pairs"); the device shell under 400."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "aiopipe"


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_is_over_600_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): _lines(p) for p in PACKAGE.rglob("*.py")
            if _lines(p) > 600}
    assert long == {}


def test_the_device_shell_is_under_400_lines() -> None:
    assert _lines(PACKAGE / "runtime" / "device_node.py") < 400
