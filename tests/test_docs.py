"""The docs site (mkdocs.yml, docs/) matches the code: every system has a page whose
options table is built from its declarations, and the site builds with ``--strict`` (no
broken link, anchor, reference or docstring). The tutorial's commands run as written:
tests/test_tutorial_processes.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from aiopipe.config import RunConfig
from aiopipe.runtime.systems.registry import BUILT_IN, BUILT_IN_OPTIONS, options_of

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _hooks() -> ModuleType:
    """docs/hooks.py, the site's build hooks (not a package module)."""
    spec = importlib.util.spec_from_file_location("aiopipe_docs_hooks", DOCS / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOKS = _hooks()


def _pages() -> dict[str, str]:
    return {path.relative_to(DOCS).as_posix(): path.read_text(encoding="utf-8")
            for path in sorted(DOCS.rglob("*.md"))}


def test_every_registered_mode_has_a_page_with_its_options_table() -> None:
    marked: dict[str, str] = {}
    for page, text in _pages().items():
        for mode in HOOKS.marked_modes(text):
            marked.setdefault(mode, page)
    missing = [mode for mode in BUILT_IN if mode not in marked]
    assert not missing, f"no docs page has <!-- options: MODE --> for {missing}"
    assert all(page.startswith("systems/") for page in marked.values()), marked


def test_each_page_named_in_the_nav_exists() -> None:
    nav = re.findall(r":\s+(\S+\.md)\s*$|^\s+-\s+(\S+\.md)\s*$",
                     (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M)
    pages = _pages()
    named = {a or b for a, b in nav}
    assert named, "mkdocs.yml names no page"
    assert named <= set(pages), sorted(named - set(pages))
    left_out = {page for page in pages if page not in named}
    assert not left_out, f"pages not in mkdocs.yml's nav: {sorted(left_out)}"


@pytest.mark.parametrize("mode", sorted(BUILT_IN_OPTIONS))
def test_each_options_table_lists_the_declared_keys_and_defaults(mode: str) -> None:
    table = HOOKS.options_table([mode])
    options = options_of(mode)
    for key, default in options.defaults().items():
        assert f"| `{key}` | `{HOOKS.toml_value(default)}` |" in table, (mode, key)
    assert f"`[{options.table}]`" in table


def test_the_run_keys_table_describes_every_field_of_run_config() -> None:
    table = HOOKS.run_keys_table()
    for field in dataclasses.fields(RunConfig):
        if field.name != "options":
            assert f"| `{field.name}` |" in table, field.name


def test_the_schedule_marker_draws_the_executors_schedule() -> None:
    page = HOOKS.on_page_markdown("<!-- schedule: 1f1b 2 2 -->", page=None, config=None,
                                  files=None)
    assert page.startswith("```text\nstep  stage 0  stage 1\n")
    assert "FB0" in page
    assert "STEP" in page
    passes = HOOKS.on_page_markdown("<!-- schedule: ftpipehd 3 6 -->", page=None,
                                    config=None, files=None)
    assert "stage 1:  F0·v0  F1·v0  B0·v0" in passes
    grouped = HOOKS.on_page_markdown("<!-- schedule: 1f1b 2 4 reduce 0 -->", page=None,
                                     config=None, files=None)
    assert "REDUCE" in grouped


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """What .ci/run runs: ``mkdocs build --strict`` (about 10-20 s)."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' "
                        "(CI installs it)")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed: pip install "
                        "-e '.[docs]' (CI installs it)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
         str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "systems" / "pipar.html").is_file()
    assert (tmp_path / "site" / "bench" / "results" / "SUMMARY.md").is_file()
