"""``python -m aiopipe new DIR``: the project it writes, for every mode; its refusals; and
the project as a new user gets it: it runs, and its test passes, from an installed
aiopipe in a fresh virtual environment (the template files must really be packaged).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
from pathlib import Path

import pytest

from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError
from aiopipe.new import main, project_name, write_project
from aiopipe.runtime.systems.registry import BUILT_IN, options_of

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    """The environment of a command: aiopipe importable from this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, **extra}


def test_the_project_s_files(tmp_path: Path) -> None:
    project = write_project(tmp_path / "demo")
    assert [str(p) for p in project.files] == [
        ".gitignore", "README.md", "config.toml", "demo/__init__.py", "demo/data.py",
        "demo/model.py", "pyproject.toml", "tests/test_demo.py"]
    root = tmp_path / "demo"
    for path in project.files:
        assert "{{" not in (root / path).read_text(), path
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert pyproject["project"]["dependencies"] == ["aiopipe[testing]>=0.1.0"]
    assert pyproject["tool"]["pytest"]["ini_options"]["asyncio_mode"] == "auto"
    readme = (root / "README.md").read_text()
    assert "python -m aiopipe --config config.toml" in readme
    assert "python -m pytest" in readme
    assert "from aiopipe.testing import" in (root / "tests" / "test_demo.py").read_text()


@pytest.mark.parametrize("mode", list(BUILT_IN))
def test_each_mode_s_config_is_valid_and_lists_its_options(tmp_path: Path, mode: str,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    write_project(tmp_path / "demo", mode=mode)
    monkeypatch.syspath_prepend(str(tmp_path / "demo"))
    config = RunConfig.from_toml(tmp_path / "demo" / "config.toml")
    assert (config.mode, config.model, config.dataset) == (mode, "demo.model:net",
                                                           "demo.data:strokes")
    text = (tmp_path / "demo" / "config.toml").read_text()
    table = text[text.index(f"[{options_of(mode).table}]"):]
    for key, value in options_of(mode).defaults().items():  # from the declarations
        assert f"\n# {key} = " in table, key
        assert getattr(config.options, key) == value  # the defaults, as written


def test_a_directory_that_holds_files_is_refused_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        write_project(tmp_path)
    project = write_project(tmp_path, force=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"  # left as it was
    assert (tmp_path / "config.toml").exists()
    assert project.package == project_name(tmp_path)
    with pytest.raises(ConfigError, match="one of"):
        write_project(tmp_path / "other", mode="gossip")


@pytest.mark.parametrize(("name", "package"), [
    ("demo", "demo"), ("My-Project", "my_project"), ("2024 lab", "project_2024_lab"),
    ("torch", "torch_project"), ("json", "json_project"), ("class", "class_project"),
    ("café", "caf"), ("-", "project")])
def test_the_package_is_named_after_the_directory(tmp_path: Path, name: str,
                                                  package: str) -> None:
    assert project_name(tmp_path / name) == package


def test_the_command_prints_the_files_and_what_to_run_next(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "demo"), "--system", "fl"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "demo/model.py" in out
    assert "a project of mode fl" in out
    assert "python -m aiopipe --config config.toml" in out
    assert "python -m pytest" in out
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "demo")])
    assert exit_.value.code == 2
    assert "not empty (--force" in capsys.readouterr().err


@pytest.mark.slow
def test_the_project_runs_and_its_test_passes(tmp_path: Path) -> None:
    """As written: ``python -m aiopipe new demo``, its main command (one epoch), its test."""
    subprocess.run([sys.executable, "-m", "aiopipe", "new", "demo"], cwd=tmp_path,
                   env=_env(), check=True, capture_output=True, timeout=60)
    demo = tmp_path / "demo"
    run = subprocess.run([sys.executable, "-m", "aiopipe", "--config", "config.toml",
                          "--epochs", "1", "--test-samples", "64"], cwd=demo, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "aiopipe: done; test accuracy" in run.stdout
    assert list((demo / "runs").glob("*/metrics.jsonl"))
    test = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
                          cwd=demo, env=_env(), capture_output=True, text=True, timeout=120)
    assert test.returncode == 0, test.stdout[-3000:]
    assert "1 passed" in test.stdout


@pytest.mark.slow
def test_the_project_passes_in_a_fresh_venv(tmp_path: Path) -> None:
    """The issue's must-show: ``python -m aiopipe new demo && cd demo && python -m pytest``
    in a fresh venv with aiopipe installed from a wheel of this checkout (not this
    checkout on the path: the templates must be in the wheel). aiopipe's dependencies
    (torch, pytest...) come from this interpreter's site-packages through a ``.pth``
    file, so that nothing is downloaded."""
    started = time.monotonic()
    source = tmp_path / "source"  # built outside the checkout: no build/ left in it
    shutil.copytree(REPO / "aiopipe", source / "aiopipe",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "wheels"), str(source)],
                   check=True, capture_output=True, timeout=120)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel, = (tmp_path / "wheels").glob("aiopipe-*.whl")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=120)
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    where = subprocess.run([python, "-c", "import aiopipe; print(aiopipe.__file__)"],
                           cwd=tmp_path, env=env, check=True, capture_output=True,
                           text=True).stdout
    assert where.startswith(purelib), where  # the installed aiopipe, not this checkout
    shell = (f"{python} -m aiopipe new demo && cd demo && {python} -m pytest "
             f"-p no:cacheprovider")
    done = subprocess.run(["bash", "-c", shell], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
    assert time.monotonic() - started < 90
