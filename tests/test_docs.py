"""The docs site (mkdocs.yml, docs/) matches the code: every system has a page whose
options table is built from its declarations, the site builds with ``--strict`` (no
broken link, anchor, reference or docstring), and the tutorial's commands run as
written."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from aiopipe.config import RunConfig
from aiopipe.runtime.systems.registry import BUILT_IN, BUILT_IN_OPTIONS, options_of

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TUTORIAL = DOCS / "tutorial.md"


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


def tutorial_steps(text: str) -> list[tuple[str, str]]:
    """The tutorial's tested blocks in order: ``("file", NAME)`` with a file's text for a
    ```` ```python ```` block after ``<!-- test: file NAME -->``, ``("run", SCRIPT)`` for
    a ```` ```bash ```` block after ``<!-- test -->``."""
    steps = []
    for marker, kind, body in re.findall(
            r"<!-- test(?::\s*file\s+(\S+))?\s*-->\n```(\w+)\n(.*?)```", text, re.S):
        steps.append((f"file:{marker}", body) if marker else ("run", body))
        assert kind == ("python" if marker else "bash"), (marker, kind)
    return steps


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.slow
def test_the_tutorials_commands_run(tmp_path: Path) -> None:
    """Every block of docs/tutorial.md marked for testing, in order, in an empty folder,
    as a user would type it (with this interpreter as ``python``, and the server's port
    8765 swapped for a free one); each run must finish and leave its results (about a
    minute and a half on 2 cores)."""
    steps = tutorial_steps(TUTORIAL.read_text(encoding="utf-8"))
    assert sum(kind == "run" for kind, _ in steps) >= 5, steps
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"  # (a wrapper: a symlink would lose a venv's packages)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n', encoding="utf-8")
    python.chmod(0o755)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": pythonpath, "AIOPIPE_LOG_LEVEL": "WARNING"}
    work = tmp_path / "work"
    work.mkdir()
    port = str(_free_port())
    for kind, body in steps:
        if kind.startswith("file:"):
            (work / kind.removeprefix("file:")).write_text(body, encoding="utf-8")
            continue
        script = "set -euo pipefail\n" + body.replace("8765", port)
        done = subprocess.run(["bash", "-c", script], cwd=work, env=env,
                              capture_output=True, text=True, timeout=240, check=False)
        assert done.returncode == 0, f"{body}\n---\n{done.stdout}\n{done.stderr}"
    for run in ("first", "mine", "real"):
        results = work / "runs" / run
        assert (results / "metrics.jsonl").is_file(), run
        assert not (results / "unfinished.txt").exists(), run
    assert (work / "demo" / "config.toml").is_file()
