"""Every config file the README and the docs site show (README.md, docs/**/*.md) is one
`RunConfig.from_toml` reads: the docs and the code agree on the keys, the tables and the
values."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aiopipe.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent
SHOWN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [(path.relative_to(ROOT).as_posix(), block) for path in SHOWN
          for block in re.findall(r"```toml\n(.*?)```", path.read_text(encoding="utf-8"),
                                  re.S)]


def test_the_docs_show_config_files() -> None:
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize(("where", "block"), BLOCKS,
                         ids=[f"{where}-{i}" for i, (where, _) in enumerate(BLOCKS)])
def test_each_config_file_in_the_docs_loads(tmp_path: Path, where: str, block: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(block, encoding="utf-8")
    RunConfig.from_toml(path)
