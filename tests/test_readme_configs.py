"""Every config file the README shows is one `RunConfig.from_toml` reads: the docs and
the code agree on the keys, the tables and the values."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aiopipe.config import RunConfig

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```toml\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_the_readme_shows_config_files() -> None:
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_each_config_file_in_the_readme_loads(tmp_path: Path, block: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(block, encoding="utf-8")
    RunConfig.from_toml(path)
