"""The three commands: ``--help``, one-line errors with exit code 2, and one real run.

Every command imports torch (about a second each), so the quick cases run as
subprocesses side by side, once per module, and each test reads its own outcome.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from aiopipe.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
_SECURITY_VARIABLES = ("AIOPIPE_TOKEN", "AIOPIPE_TOKEN_SECRET")
SECRET = "cli-test-secret-of-32-characters"
MAIN, SERVER, DEVICE = "aiopipe", "aiopipe.server", "aiopipe.device"


@dataclass(frozen=True, slots=True)
class Outcome:
    code: int
    stdout: str
    stderr: str


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SECURITY_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _run(module: str, *args: str, cwd: Path, timeout: float = 60.0) -> Outcome:
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Outcome(done.returncode, done.stdout, done.stderr)


HELP_CASES: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "main": (MAIN, ("--config", "--mode", "--devices", "--epochs", "--out-dir", "--network")),
    "server": (
        SERVER,
        ("--config", "--mode", "--devices", "--host", "--port", "--token-secret", "--tls-cert",
         "--tls-key", "--insecure"),
    ),
    "device": (DEVICE, ("--server", "--device-id", "--token", "--tls-ca")),
}

# case id -> (module, arguments, text the one error line must hold). Each runs as a real
# ``python -m`` subprocess: one per command, so that each entry point's exit status and
# one-line error are seen from outside; the other cases run in this process below.
ERROR_CASES: Mapping[str, tuple[str, tuple[str, ...], str]] = {
    "main-unknown-option": (MAIN, ("--bogus",), "--bogus"),
    # Binding beyond loopback needs a token secret or --insecure. The run config is bad as well,
    # so a broken check could not start listening: it would fail on the config instead.
    "server-public-host-without-token": (
        SERVER,
        ("--host", "0.0.0.0", "--devices", "0"),
        "--insecure",
    ),
    "device-http-url": (DEVICE, ("--server", "http://x", "--device-id", "0"), "ws://"),
}

# More cases of the same kind, run in this process through each command's ``main(argv)``
# (a subprocess costs a second of importing torch).
IN_PROCESS_CASES: Mapping[str, tuple[str, tuple[str, ...], str]] = {
    **{
        f"{name}-{case}": (module, args, expected)
        for name, module in (("main", MAIN), ("server", SERVER))
        for case, args, expected in (
            ("unknown-option", ("--bogus",), "--bogus"),
            ("devices-0", ("--devices", "0"), "'devices'"),
            ("mode-nope", ("--mode", "nope"), "nope"),
            ("missing-config", ("--config", "missing.toml"), "missing.toml"),
            ("unknown-key", ("--config", "unknown_key.toml"), "'bogus_key'"),
            ("invalid-toml", ("--config", "invalid.toml"), "invalid.toml"),
            ("devices-not-int", ("--devices", "two"), "--devices"),
            ("devices-negative", ("--devices", "-3"), "'devices'"),
            ("bad-value-in-file", ("--config", "bad_value.toml"), "'epochs'"),
            ("unknown-key-in-run-table", ("--config", "run_table.toml"), "'bogus_key'"),
            ("bad-override", ("--config", "good.toml", "--learning-rate", "-1"), "'learning_rate'"),
            ("split-point-wrong-length", ("--split-point", "1,2,3"), "'split_point'"),
            ("split-point-not-int", ("--split-point", "x"), "--split-point"),
            ("slowdown-below-1", ("--device-slowdown", "0.5"), "'device_slowdown'"),
            ("config-is-a-directory", ("--config", "."), "cannot read"),
            ("out-dir-holds-results", ("--out-dir", "earlier"),
             "earlier already holds a run's results (metrics.jsonl)"),
            ("untrainable-micro-batch",
             ("--model", "mobilenetv3-small", "--batch-size", "8", "--parallel-batches", "8",
              "--split-point", "3", "--samples-per-device", "16"),
             "cannot train on 1 sample per micro-batch"),
        )
    },
    "device-unknown-option": (
        DEVICE,
        ("--server", "ws://x/ws", "--device-id", "0", "--bogus"),
        "--bogus",
    ),
    "server-public-host-insecure": (
        SERVER,
        ("--host", "0.0.0.0", "--insecure", "--devices", "0"),
        "'devices'",
    ),
    "server-public-host-with-secret": (
        SERVER,
        ("--host", "0.0.0.0", "--token-secret", SECRET, "--devices", "0"),
        "'devices'",
    ),
    "server-public-host-with-secret-file": (
        SERVER,
        ("--host", "0.0.0.0", "--token-secret", "file:secret.txt", "--devices", "0"),
        "'devices'",
    ),
    # security options are checked before the (bad) run config
    "server-short-secret": (
        SERVER,
        ("--token-secret", "s3cret", "--devices", "0"),
        "at least 16 are needed",
    ),
    "server-missing-secret-file": (
        SERVER,
        ("--token-secret", "file:missing.txt", "--devices", "0"),
        "cannot read token secret file missing.txt",
    ),
    "server-shared-token-is-gone": (SERVER, ("--token", SECRET), "--token"),
    "server-tls-cert-without-key": (
        SERVER,
        ("--tls-cert", "cert.pem", "--devices", "0"),
        "--tls-cert and --tls-key go together",
    ),
    "server-tls-missing-files": (
        SERVER,
        ("--tls-cert", "missing.pem", "--tls-key", "missing.key", "--devices", "0"),
        "no such file",
    ),
    "device-tls-ca-for-ws": (
        DEVICE,
        ("--server", "ws://x/ws", "--device-id", "0", "--tls-ca", "good.toml"),
        "--tls-ca needs a wss://",
    ),
    "device-tls-ca-missing": (
        DEVICE,
        ("--server", "wss://x/ws", "--device-id", "0", "--tls-ca", "missing.pem"),
        "cannot read TLS CA file missing.pem",
    ),
    "device-missing-server": (DEVICE, ("--device-id", "0"), "--server"),
    "device-unknown-data": (DEVICE, ("--server", "ws://x/ws", "--device-id", "0", "--data",
                                     "nosuch-set"), "unknown 'nosuch-set'"),
    "device-data-module-missing": (DEVICE, ("--server", "ws://x/ws", "--device-id", "0",
                                            "--data", "nolab:data"), "cannot import nolab"),
    "device-data-dir-missing": (DEVICE, ("--server", "ws://x/ws", "--device-id", "0",
                                         "--data", "mnist:missing-dir"), "is not a directory"),
    "device-samples-without-data": (DEVICE, ("--server", "ws://x/ws", "--device-id", "0",
                                             "--samples", "5"), "--samples needs --data"),
    "device-torch-device-missing": (DEVICE, ("--server", "ws://x/ws", "--device-id", "0",
                                             "--torch-device", "cuda:7"), "cuda:7"),
    "server-torch-device-unknown": (SERVER, ("--torch-device", "tpu"), "unknown 'tpu'"),
    "server-model-malformed": (SERVER, ("--model", "my lab:net"), "'model'"),
    "server-test-samples-negative": (SERVER, ("--test-samples", "-1"), "'test_samples'"),
    "device-negative-id": (DEVICE, ("--server", "ws://x/ws", "--device-id", "-1"), "--device-id"),
    "device-id-not-int": (DEVICE, ("--server", "ws://x/ws", "--device-id", "one"), "--device-id"),
    "device-config-option": (
        DEVICE,
        ("--server", "ws://x/ws", "--device-id", "0", "--config", "good.toml"),
        "--config",
    ),
}


def _write_config_files(directory: Path) -> None:
    (directory / "unknown_key.toml").write_text('mode = "pipar"\nbogus_key = 1\n')
    (directory / "run_table.toml").write_text('[run]\nmode = "pipar"\nbogus_key = 1\n')
    (directory / "invalid.toml").write_text('mode = "pipar\n')
    (directory / "bad_value.toml").write_text("epochs = 0\n")
    (directory / "good.toml").write_text('mode = "pipar"\n')
    (directory / "secret.txt").write_text(SECRET + "\n")
    (directory / "earlier").mkdir(exist_ok=True)  # an earlier run's results directory
    (directory / "earlier" / "metrics.jsonl").write_text("{}\n")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    cwd = tmp_path_factory.mktemp("cli")
    _write_config_files(cwd)
    jobs: dict[str, tuple[str, tuple[str, ...]]] = {
        f"help-{name}": (module, ("--help",)) for name, (module, _) in HELP_CASES.items()
    }
    jobs.update({case: (module, args) for case, (module, args, _) in ERROR_CASES.items()})
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            case: pool.submit(_run, module, *args, cwd=cwd) for case, (module, args) in jobs.items()
        }
        results = {case: future.result() for case, future in futures.items()}
    assert not list(cwd.glob("runs")), "a failed command wrote a results directory"
    return results


@pytest.mark.parametrize("name", list(HELP_CASES))
def test_help_exits_0_and_names_the_options(outcomes: dict[str, Outcome], name: str) -> None:
    outcome = outcomes[f"help-{name}"]
    assert outcome.code == 0, outcome.stderr
    assert outcome.stderr == ""
    assert outcome.stdout.startswith("usage:")
    for option in HELP_CASES[name][1]:
        assert option in outcome.stdout


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_arguments_exit_2_with_one_line(outcomes: dict[str, Outcome], case: str) -> None:
    outcome = outcomes[case]
    _, _, expected = ERROR_CASES[case]
    assert outcome.code == 2, (outcome.stdout, outcome.stderr)
    assert "Traceback" not in outcome.stderr
    lines = outcome.stderr.splitlines()
    assert len(lines) == 1, outcome.stderr
    assert "error" in lines[0]
    assert expected in lines[0]


@pytest.mark.parametrize("case", list(IN_PROCESS_CASES))
def test_bad_arguments_in_process(
    case: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module_name, args, expected = IN_PROCESS_CASES[case]
    _write_config_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    for variable in _SECURITY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    module = importlib.import_module(
        f"{module_name}.__main__" if module_name == MAIN else module_name
    )
    with pytest.raises(SystemExit) as info:
        module.main(list(args))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "error" in lines[0]
    assert expected in lines[0]
    assert not (tmp_path / "runs").exists()


def test_the_server_reads_its_secret_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AIOPIPE_TOKEN_SECRET", "short")
    server = importlib.import_module(SERVER)
    with pytest.raises(SystemExit) as info:
        server.main(["--devices", "0"])
    assert info.value.code == 2
    assert "at least 16 are needed" in capsys.readouterr().err


# -- the end-to-end run ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_main_trains_and_writes_the_results_directory(tmp_path: Path) -> None:
    out = tmp_path / "results"
    epochs, samples = 2, 1000
    outcome = _run(
        MAIN,
        "--epochs",
        str(epochs),
        "--samples-per-device",
        str(samples),
        "--out-dir",
        str(out),
        cwd=tmp_path,
        timeout=200.0,
    )
    assert outcome.code == 0, outcome.stderr[-3000:]
    assert "Traceback" not in outcome.stderr

    # The per-epoch table: a header, then one row per epoch.
    lines = outcome.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["epoch"])
    rows = [line.split() for line in lines[header + 1 :] if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(len(row) == 9 for row in rows)
    table_loss = [float(row[2]) for row in rows]
    assert table_loss[1] < table_loss[0]

    # metrics.jsonl: one object per epoch with the RunResult fields.
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == epochs
    kinds = {"device", "uplink", "server", "downlink"}
    for i, m in enumerate(metrics):
        assert {
            "time_s",
            "busy_s",
            "idle_s",
            "loss",
            "accuracy",
            "bytes_up",
            "bytes_down",
            "plan",
        } <= set(m)
        assert m["epoch"] == i + 1  # for people, as the table
        assert set(m["busy_s"]) == kinds
        assert set(m["idle_s"]) == kinds
        assert m["time_s"] > 0
        assert all(v >= 0 for v in (*m["busy_s"].values(), *m["idle_s"].values()))
        assert m["bytes_up"] > 0
        assert m["bytes_down"] > 0
        assert [p["device"] for p in m["plan"]] == [0, 1]
        assert m["loss"] == pytest.approx(table_loss[i], abs=1e-4)
    assert metrics[1]["loss"] < metrics[0]["loss"]
    # Synthetic CIFAR-10 is learnable: 0.44 measured after 2 epochs; chance is 0.1.
    assert metrics[-1]["accuracy"] >= 0.3

    # trace.json: one track per resource, one slice per stage per micro-batch.
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    slices: dict[tuple[str, str], int] = {}
    for e in events:
        if e["ph"] == "X":
            key = (tracks[e["tid"]], e["cat"])
            slices[key] = slices.get(key, 0) + 1
            assert e["dur"] >= 0
    micro_batches = epochs * (samples // RunConfig().batch_size) * 4  # N = 4 by default
    assert slices[("device0/compute", "f")] == micro_batches
    assert slices[("device0/uplink", "u")] == micro_batches
    assert slices[("server/compute", "s")] == 2 * micro_batches  # both devices
    assert slices[("device0/downlink", "d")] == micro_batches
    assert slices[("device0/compute", "b")] == micro_batches

    config = RunConfig.from_toml(out / "config.toml")
    assert (config.epochs, config.samples_per_device, config.devices) == (epochs, samples, 2)
    assert config.out_dir == str(out)

    from safetensors.torch import load_file

    state = load_file(out / "model.safetensors")
    assert state
    assert all(math.isfinite(float(t.float().abs().sum())) for t in state.values())

    assert (out / "timeline.png").read_bytes().startswith(b"\x89PNG")


def test_replanning_is_off_unless_asked_for() -> None:
    import argparse

    from aiopipe.cli import add_run_options, config_from_args

    parser = argparse.ArgumentParser()
    add_run_options(parser)
    assert config_from_args(parser.parse_args([])).options.replan is False
    assert config_from_args(parser.parse_args(["--replan"])).options.replan is True


_WITHOUT_TORCH = """
import runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print("torch imported" if "torch" in sys.modules else "no torch", file=sys.stderr)
"""


@pytest.mark.slow
@pytest.mark.parametrize("command", [(MAIN, "--help"), (SERVER, "--help"), (DEVICE, "--help"),
                                     (MAIN, "--help", "hadfl"), (MAIN, "new", "--help"),
                                     ("aiopipe.auth", "secret"), ("aiopipe.timeline", "--help")])
def test_help_and_auth_start_without_importing_torch(command: tuple[str, ...]) -> None:
    """Torch takes seconds to import on a loaded machine; these answer at once."""
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *command], env=_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.stderr.strip().endswith("no torch"), done.stderr


def test_a_port_in_use_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    from aiopipe import server

    monkeypatch.chdir(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            server.main(["--port", str(port), "--devices", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"python -m aiopipe.server: error: cannot listen on "
                                f"127.0.0.1:{port}: Address already in use"], err
    assert not (tmp_path / "runs").exists()
