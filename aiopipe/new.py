"""``python -m aiopipe new DIR``: a project to start from, that runs and passes its test as
written: a model, data, a config, a test written against `aiopipe.testing`, a
pyproject.toml that asks for ``aiopipe[testing]``, and a README with the two commands.

The files are package data (aiopipe/templates/new, each ``NAME.tmpl``); ``{{key}}`` in
them is filled in here. The config's table of the mode's options is written from the
system's own declarations (`aiopipe.runtime.systems.registry.options_of`), each at its
default with what it means, so that it says what the code takes.
"""

from __future__ import annotations

import keyword
import re
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import NoReturn

from aiopipe._version import __version__
from aiopipe.cli import ArgumentParser
from aiopipe.config_toml import toml_document
from aiopipe.errors import ConfigError
from aiopipe.runtime.systems.registry import BUILT_IN, options_of

__all__ = ["MODE_KEYS", "Project", "main", "project_name", "write_project"]

#: The run keys a mode needs beyond the template's common ones, as TOML lines: where
#: the model is split (the split modes) and how many micro-batches (PiPar, auto).
MODE_KEYS: dict[str, str] = {
    "sl": "split_point = 1             # units on the device; the rest on the server",
    "sfl": "split_point = 1             # units on the device; the rest on the server",
    "pipar": "split_point = 1             # units on the device; the rest on the server\n"
             "parallel_batches = 4        # micro-batches in flight per iteration",
    "auto": 'split_point = "auto"        # the planner picks, per device\n'
            'parallel_batches = "auto"',
}

# template files' names as written (a name of "{{package}}" is the project's)
_NAMES = {"package": "{{package}}", "test_package.py": "test_{{package}}.py",
          "gitignore": ".gitignore"}

# names a project's package must not take: they would hide what it imports
_TAKEN = frozenset({"aiopipe", "torch", "numpy", "tests", "test", "conftest"})


@dataclass(frozen=True, slots=True)
class Project:
    """What `write_project` wrote: the directory, its files (relative), its package's
    name and its mode."""

    root: Path
    files: tuple[Path, ...]
    package: str
    mode: str


def project_name(directory: Path) -> str:
    """The Python package name of a project in ``directory``: its name, lower case, with
    what is not a letter, digit or underscore as ``_``; ``_project`` added where that is
    no name or would hide a module the project imports (``torch``, ``tests``...)."""
    name = re.sub(r"[^a-z0-9_]", "_", directory.resolve().name.lower()).strip("_") or "project"
    if (not name.isidentifier() or keyword.iskeyword(name) or name in _TAKEN
            or name in sys.stdlib_module_names):
        name = f"{name}_project" if name.isidentifier() else f"project_{name}"
    return name


def write_project(directory: str | Path, *, mode: str = "pipar", force: bool = False
                  ) -> Project:
    """Write the project template into ``directory`` (made if missing) for a run of
    ``mode``, a built-in mode.

    Raises:
        ConfigError: ``mode`` is not a built-in mode; ``directory`` is a file, or holds
            files and ``force`` is false (with ``force`` the template's files replace
            those of the same names; others are left).
    """
    if mode not in BUILT_IN:
        raise ConfigError(f"mode {mode!r}: a project is written for one of "
                          f"{', '.join(BUILT_IN)}")
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{str(root)!r} is a file, not a directory")
    if root.is_dir() and any(root.iterdir()) and not force:
        raise ConfigError(f"directory {str(root)!r} is not empty (--force writes the "
                          f"project into it, replacing files of the same names)")
    package = project_name(root)
    values = {
        "name": root.resolve().name,
        "package": package,
        "mode": mode,
        "table": options_of(mode).table,
        "mode_keys": MODE_KEYS.get(mode, ""),
        "mode_options": mode_options(mode),
        "aiopipe_version": __version__,
    }
    written = []
    for source, relative in _templates(files("aiopipe") / "templates" / "new", Path()):
        target = Path(*(_NAMES.get(part, part).replace("{{package}}", package)
                        for part in relative.parts))
        text = source.read_text(encoding="utf-8")
        for key, value in values.items():
            text = text.replace("{{" + key + "}}", value)
        (root / target).parent.mkdir(parents=True, exist_ok=True)
        (root / target).write_text(text, encoding="utf-8")
        written.append(target)
    return Project(root, tuple(sorted(written)), package, mode)


def _templates(folder: Traversable, relative: Path) -> list[tuple[Traversable, Path]]:
    """Every ``*.tmpl`` file under ``folder``, with its path as written (no suffix)."""
    found = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.is_dir():
            found += _templates(entry, relative / entry.name)
        elif entry.name.endswith(".tmpl"):
            found.append((entry, relative / entry.name.removesuffix(".tmpl")))
    return found


def mode_options(mode: str) -> str:
    """The lines of config.toml's table of ``mode``'s options: each commented out, at
    its default, after what it means (the system's own words)."""
    options = options_of(mode)
    defaults = options.defaults()
    lines = []
    for key, meaning in options.keys.items():
        lines += textwrap.wrap(meaning, 86, initial_indent="# ", subsequent_indent="#   ")
        lines += ["# " + toml_document({key: defaults[key]}).strip(), ""]
    return "\n".join(lines).strip()


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``python -m aiopipe new`` (and ``python -m aiopipe.new``)."""
    parser = ArgumentParser(
        prog="python -m aiopipe new",
        description="Write a project to start from into DIR: a model, data, config.toml, "
                    "a test written with aiopipe.testing, pyproject.toml and a README. "
                    "It runs (python -m aiopipe --config config.toml) and its test "
                    "passes (python -m pytest) as written.")
    parser.add_argument("dir", metavar="DIR", type=Path, help="where (made if missing)")
    parser.add_argument("--system", "--mode", dest="mode", default="pipar",
                        choices=list(BUILT_IN), metavar="MODE",
                        help=f"the run's mode: {', '.join(BUILT_IN)} (default pipar)")
    parser.add_argument("--force", action="store_true",
                        help="write into a directory that holds files (the template's "
                             "replace files of the same names)")
    args = parser.parse_args(argv)
    try:
        project = write_project(args.dir, mode=args.mode, force=args.force)
    except ConfigError as exc:
        parser.error(str(exc))
    print(f"aiopipe new: wrote {project.root}/, a project of mode {project.mode}:")
    for path in project.files:
        print(f"  {path}")
    print(textwrap.dedent(f"""
        next:
          cd {project.root}
          python -m aiopipe --config config.toml   # run it: a server and 2 devices
          python -m pytest                         # test it: the run in virtual time"""))
    sys.exit(0)


if __name__ == "__main__":
    main()
