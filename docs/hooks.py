"""The docs site's build hooks (mkdocs.yml, ``hooks:``): what the pages show of the code
is taken from the code when the site is built, not retyped.

- ``<!-- options: MODE -->`` in a page becomes the table of the options that mode's
  system declares (`aiopipe.runtime.systems.registry.options_of`: each key, its default
  and what it means, as ``--help`` says it); ``<!-- options: fl, sl -->`` lists the
  options of several modes in one table, with a column of which modes take each.
- ``<!-- options: run -->`` becomes the table of the keys every run has: `RunConfig`'s
  fields, their defaults, and what each means from the class docstring's
  ``Attributes:``. A field the docstring does not describe fails the build.
- ``<!-- schedule: 1f1b 3 4 -->`` becomes the dry run of that schedule (``pipar N``,
  ``gpipe S N``, ``1f1b S N``) as the grid `aiopipe.scheduler.schedule.format_grid`
  prints: the schedule the executor runs, drawn by the code that makes it;
  ``... reduce P ...``: the stages P whose groups all-reduce before they step
  (`with_reductions`); ``ftpipehd S B``: each stage's asynchronous passes with their
  weight versions.
- The committed benchmark results (``bench/results/``) and the examples (``examples/``)
  are copied into the site as they are, so that a page links to a result file or an
  example by its path in the repository (``../bench/results/DIR/report.md`` from a page
  one folder down), and ``mkdocs build --strict`` checks every such link.

tests/test_docs.py checks that every registered mode has a page with its marker.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mkdocs.structure.files import Files

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # (mkdocs run from a checkout that is not installed)
    sys.path.insert(0, str(ROOT))

#: Repository folders whose files the site carries as they are (module docstring).
COPIED = ("bench/results", "examples")
#: A marker is a line of its own (one quoted in a sentence, in backticks, is not).
MARKER = re.compile(r"^<!--\s*options:\s*([^>]*?)\s*-->[ \t]*$", re.M)
SCHEDULE = re.compile(r"^<!--\s*schedule:\s*([^>]*?)\s*-->[ \t]*$", re.M)


def on_files(files: Files, config: Any) -> Files:
    """Add the files of `COPIED` to the site as static files (never rendered as pages:
    a result's ``report.md`` is copied as it is)."""
    from mkdocs.structure.files import File  # (mkdocs only here: the tests need none)

    class Static(File):
        def is_documentation_page(self) -> bool:
            return False

    for folder in COPIED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                uri = path.relative_to(ROOT).as_posix()
                files.append(Static.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Replace each options marker of ``markdown`` with its table (module docstring).

    Raises:
        ValueError: a marker names no mode; the build stops, naming the page.
    """
    def table(match: re.Match[str]) -> str:
        names = [name.strip() for name in match.group(1).split(",") if name.strip()]
        try:
            return run_keys_table() if names == ["run"] else options_table(names)
        except Exception as exc:
            raise ValueError(f"{page.file.src_uri}: {match.group(0)}: {exc}") from exc

    def grid(match: re.Match[str]) -> str:
        try:
            return schedule_grid(match.group(1).split())
        except Exception as exc:
            raise ValueError(f"{page.file.src_uri}: {match.group(0)}: {exc}") from exc

    return SCHEDULE.sub(grid, MARKER.sub(table, markdown))


def marked_modes(markdown: str) -> list[str]:
    """The modes whose options tables ``markdown`` asks for (tests/test_docs.py)."""
    return [name.strip() for found in MARKER.findall(markdown)
            for name in found.split(",") if name.strip() and name.strip() != "run"]


def options_table(modes: list[str]) -> str:
    """The table of the options ``modes`` declare: key, default, meaning; with a column of
    which of them take each key when they are several and differ."""
    from aiopipe.runtime.systems.registry import options_of

    declared = {mode: options_of(mode) for mode in modes}
    keys: dict[str, str] = {}
    defaults: dict[str, Any] = {}
    for options in declared.values():
        keys.update(options.keys)
        defaults.update(options.defaults())
    if not keys:
        return f"Mode {', '.join(modes)} takes no options of its own.\n"
    tables = sorted({options.table for options in declared.values()})
    owners = {key: [m for m, o in declared.items() if key in o.keys] for key in keys}
    split = any(len(found) != len(modes) for found in owners.values())
    head = ["option", "default", *(["modes"] if split else []), "what it means"]
    rows = [[f"`{key}`", f"`{toml_value(defaults[key])}`",
             *([", ".join(owners[key])] if split else []), cell(meaning)]
            for key, meaning in keys.items()]
    where = ", ".join(f"`[{table}]`" for table in tables)
    flag = "--" + next(iter(keys)).replace("_", "-")
    return (f"In a config file they go under {where}; on the command line each is its "
            f"name with dashes (`{flag}`; `python -m aiopipe --help`).\n\n"
            + markdown_table(head, rows))


def schedule_grid(words: list[str]) -> str:
    """The grid of the schedule ``words`` name (``pipar N``, ``gpipe S N``, ``1f1b S N``,
    optionally ``reduce P...``; ``ftpipehd S B``) as a fenced text block.

    Raises:
        ValueError: another kind of schedule.
    """
    from aiopipe.scheduler import schedule

    kind, *numbers = words
    if kind == "ftpipehd":
        return "```text\n" + ftpipehd_passes(*(int(n) for n in numbers)) + "```\n"
    makers = {"pipar": schedule.pipar, "gpipe": schedule.gpipe, "1f1b": schedule.one_f_one_b}
    if kind not in makers:
        raise ValueError(f"no schedule {kind!r} (one of {', '.join(makers)}, ftpipehd)")
    grouped: list[int] = []
    if "reduce" in numbers:  # ("1f1b 2 4 reduce 0": stage 0's group all-reduces)
        at = numbers.index("reduce")
        numbers, grouped = numbers[:at], [int(p) for p in numbers[at + 1:]]
    made = makers[kind](*(int(n) for n in numbers))
    if grouped:
        made = schedule.with_reductions(made, grouped)
    return "```text\n" + schedule.format_grid(made) + "```\n"


def ftpipehd_passes(stages: int, batches: int) -> str:
    """FTPipeHD's asynchronous 1F1B as each stage runs it, every pass with the version of
    the weights it uses under the default ``version_aggregation``
    (`aiopipe.scheduler.async_pipeline.version_table`: the paper's Fig. 2 for 3 stages),
    e.g. ``F3·v1``: batch 3's forward on the stage's version 1."""
    from aiopipe.options import FTPipeHDOptions
    from aiopipe.scheduler.async_pipeline import version_table

    rows = version_table(stages, batches, FTPipeHDOptions().version_aggregation)
    return "".join(f"stage {p}:  " + "  ".join(f"{one.kind}{one.batch}·v{one.version}"
                                                for one in row) + "\n"
                   for p, row in enumerate(rows))


def run_keys_table() -> str:
    """The table of the keys every run has: `RunConfig`'s fields (module docstring).

    Raises:
        ValueError: a field the class docstring's ``Attributes:`` does not describe.
    """
    from aiopipe.config import RunConfig

    described = attribute_docs(RunConfig.__doc__ or "")
    rows = []
    for field in dataclasses.fields(RunConfig):
        if field.name == "options":
            continue  # (the system's table: each system page lists them)
        if field.name not in described:
            raise ValueError(f"RunConfig.{field.name} is not described in its docstring")
        rows.append([f"`{field.name}`", f"`{toml_value(field.default)}`",
                     cell(described[field.name])])
    return markdown_table(["key", "default", "what it means"], rows)


def attribute_docs(docstring: str) -> dict[str, str]:
    """Each attribute's text in a Google-style docstring's ``Attributes:`` section (an
    entry ``a, b: text`` describes both)."""
    found: dict[str, str] = {}
    current: list[str] = []
    lines = inspect.cleandoc(docstring).splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
    if start is None:
        return found
    for line in lines[start + 1:]:
        if line.strip() and not line.startswith("    "):
            break  # (the section ends at the next unindented paragraph)
        entry = re.match(r"^    (\w+(?:, \w+)*): (.*)$", line)
        if entry:
            current = [name.strip() for name in entry.group(1).split(",")]
            for name in current:
                found[name] = entry.group(2)
        elif line.strip():
            for name in current:
                found[name] += " " + line.strip()
    return found


def toml_value(value: Any) -> str:
    """``value`` as a config file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def cell(text: str) -> str:
    """``text`` safe in a Markdown table's cell."""
    return " ".join(text.split()).replace("|", "\\|")


def markdown_table(head: list[str], rows: Iterable[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
