"""A refused device says the server's reason and what to do (issue 42, item 4); secrets
are str or bytes alike (item 6); ``python -m aiopipe.server`` ends on its accuracy as
``python -m aiopipe`` does (item 6).

The server's HTTP 401 says why in RFC 6750's ``WWW-Authenticate`` (a fixed phrase,
never the token); a device dialing a real in-process server reads it and raises one
line with the reason and the command that mints a new token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from aiopipe import AuthenticationError, Device, LinkBrokenError, RunConfig, Server
from aiopipe.auth import (
    REFUSAL_REASONS,
    Revocations,
    TokenRefused,
    bearer_challenge,
    explain_refusal,
    generate_secret,
    mint_token,
    token_id_of,
    unverified_token,
    verify_token,
)
from aiopipe.auth.refusals import read_challenge
from aiopipe.cli import done_line
from aiopipe.errors import AuthenticationError as PlainAuthenticationError
from aiopipe.metrics.results import EpochMetrics, RunResult
from aiopipe.runtime.guard import ConnectionLimits

REPO = Path(__file__).resolve().parents[1]
SECRET = b"refusal-test-secret-of-32-bytes!"
OTHER_SECRET = b"another-servers-secret-32-bytes!"
CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=40, batch_size=20, epochs=1,
                   split_point=2, parallel_batches=2, test_samples=20, seed=3)
MINT = "python -m aiopipe.auth mint --secret file:server.secret --device-id"
PASS = "pass it with --token or AIOPIPE_TOKEN"


async def _refusal(server: Server, token: str | None, k: int = 0) -> str:
    """What device ``k`` says when ``server`` refuses ``token`` at the handshake."""
    with pytest.raises(AuthenticationError) as info:
        async with Device(server.url, k, token=token, connect_timeout=0):
            pytest.fail("the device was admitted")
    assert server.node.connected == set()
    message = str(info.value)
    assert "\n" not in message
    assert "HTTP 401" in message
    return message


async def test_no_token_says_the_server_requires_one_and_how_to_pass_it() -> None:
    async with Server(CONFIG, token_secret=SECRET, join_timeout=5) as server:
        message = await _refusal(server, None)
    assert message.startswith(f"the server at {server.url} requires a device token and "
                              "none was sent")
    assert "pass --token or set AIOPIPE_TOKEN" in message
    assert f"`{MINT} ID`" in message
    assert "docs/howto/security.md" in message


async def test_an_expired_token_says_when_and_to_mint_a_new_one() -> None:
    expired = mint_token(SECRET, 1, lifetime_s=60, now=time.time() - 3600)
    claims = unverified_token(expired)
    assert claims is not None
    assert claims.expires_at is not None
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(claims.expires_at))
    async with Server(CONFIG, token_secret=SECRET, join_timeout=5) as server:
        message = await _refusal(server, expired, k=1)
    assert message.startswith(f"the server at {server.url} refused device 1's token "
                              f"(HTTP 401): expired at {when}; ")
    assert f"mint a new one with `{MINT} 1`" in message
    assert PASS in message


async def test_a_token_of_another_secret_says_so() -> None:
    async with Server(CONFIG, token_secret=SECRET, join_timeout=5) as server:
        message = await _refusal(server, mint_token(OTHER_SECRET, 0))
    assert "refused device 0's token (HTTP 401): not minted under this server's secret" \
        in message
    assert "the secret the server was started with (its --token-secret)" in message
    assert f"`{MINT} 0`" in message
    assert PASS in message


async def test_a_revoked_token_says_so(tmp_path: Path) -> None:
    revoked = tmp_path / "revoked.txt"
    token = mint_token(SECRET, 0)
    Revocations.add(revoked, token_id_of(token))
    async with Server(CONFIG, token_secret=SECRET, join_timeout=5, revoked=revoked) as server:
        message = await _refusal(server, token)
    assert "refused device 0's token (HTTP 401): revoked; " in message
    assert f"mint a new one with `{MINT} 0`" in message
    assert PASS in message


async def test_a_malformed_token_says_to_pass_it_whole() -> None:
    token = mint_token(SECRET, 0)
    async with Server(CONFIG, token_secret=SECRET, join_timeout=5) as server:
        cut = await _refusal(server, token[:-5])
        garbled = await _refusal(server, "a-password-not-a-token")
    assert "refused device 0's token (HTTP 401): malformed; pass the whole token" in cut
    assert "refused the token it was sent (HTTP 401): malformed; pass the whole token" \
        in garbled


async def test_the_401_carries_the_reason_the_rfc_6750_way() -> None:
    token = mint_token(SECRET, 2)
    cases = {
        "none": (None, "Bearer"),
        "basic": ("Basic dXNlcjpwYXNz",
                  'Bearer error="invalid_request", error_description="not a bearer token"'),
        "wrong": (f"Bearer {mint_token(OTHER_SECRET, 2)}",
                  'Bearer error="invalid_token", '
                  'error_description="not minted under this server\'s secret"'),
        "expired": (f"Bearer {mint_token(SECRET, 2, lifetime_s=1, now=1e9)}",
                    'Bearer error="invalid_token", error_description="expired"'),
        "old": ("Bearer v1.2." + "A" * 43,
                'Bearer error="invalid_token", error_description="old token version"'),
    }
    async with Server(CONFIG, token_secret=SECRET, join_timeout=5) as server:
        http_url = server.url.replace("ws://", "http://", 1)
        async with aiohttp.ClientSession() as http:
            for name, (header, challenge) in cases.items():
                headers = {"Authorization": header} if header else {}
                async with http.get(http_url, headers=headers) as response:
                    assert response.status == 401, name
                    assert response.headers.getall("WWW-Authenticate") == [challenge], name
                    assert token not in str(response.headers)


def test_every_reason_is_a_fixed_phrase_fit_for_a_quoted_string() -> None:
    for reason in REFUSAL_REASONS:
        assert reason, reason
        assert all(" " <= c <= "~" and c not in '"\\' for c in reason), reason
        challenge = bearer_challenge(TokenRefused("a log line", reason))
        assert read_challenge([challenge])[1] == (None if reason == "no token" else reason)
    # a refusal without a fixed reason says only invalid_token: its text is for the log
    assert bearer_challenge(PlainAuthenticationError("free text")) == \
        'Bearer error="invalid_token"'


def test_verify_token_refusals_carry_their_reason() -> None:
    with pytest.raises(TokenRefused) as info:
        verify_token(SECRET, mint_token(SECRET, 0, lifetime_s=1, now=1e9))
    assert info.value.reason == "expired"
    with pytest.raises(TokenRefused) as info:
        verify_token(SECRET, mint_token(OTHER_SECRET, 0))
    assert info.value.reason == "not minted under this server's secret"


def test_a_foreign_servers_description_is_shown_cleaned_and_bounded() -> None:
    said = explain_refusal("ws://h/ws", 401, ['Basic realm="x"',
                                              'Bearer error="invalid_token", '
                                              'error_description="odd\\"\x07' + "z" * 300 + '"'],
                           mint_token(SECRET, 0))
    assert said.startswith('ws://h/ws refused the handshake with HTTP 401 (a token was sent: '
                           'odd"zzz')
    assert "\x07" not in said
    assert len(said) < 250
    assert "the server's log says why" in said


def test_a_429_says_another_connection_holds_the_tokens_places() -> None:
    said = explain_refusal("ws://h/ws", 429, [], mint_token(SECRET, 3))
    assert said.startswith("the server at ws://h/ws turned device 3's token away (HTTP 429)")
    assert "--max-per-device" in said


async def test_a_429_reaches_the_device_as_said() -> None:
    """With one place per device (``max_per_device=1``) held by device 0's connection, a
    second connection with its token gets HTTP 429, and the device's error says why."""
    token = mint_token(SECRET, 0)
    config = CONFIG.replace(reconnect_grace=0.2)  # the server's exit waits for it
    async with (Server(config, token_secret=SECRET, join_timeout=30,
                       limits=ConnectionLimits(max_per_device=1)) as server,
                Device(server.url, 0, token=token) as first):
        running = asyncio.ensure_future(first.run())
        # its hello taken (its place held before it counts as arrived)
        await asyncio.wait_for(server.node.admission.wait_for_someone(), 30)
        with pytest.raises(LinkBrokenError) as info:
            async with Device(server.url, 0, token=token, connect_timeout=0):
                pytest.fail("a second connection was admitted")
        running.cancel()
        with contextlib.suppress(BaseException):
            await running
    assert str(info.value).startswith(
        f"the server at {server.url} turned device 0's token away (HTTP 429)")


# -- secrets as str or bytes ------------------------------------------------------------


async def test_a_generated_str_secret_serves_a_run_with_tokens_minted_from_it() -> None:
    secret = generate_secret()
    assert isinstance(secret, str)

    async def device(k: int) -> None:
        async with Device(server.url, k, token=mint_token(secret, k)) as node:
            await node.run()

    async with (Server(CONFIG, token_secret=secret, join_timeout=60) as server,
                asyncio.TaskGroup() as tasks):
        for k in range(CONFIG.devices):
            tasks.create_task(device(k))
        result = await server.run()
    assert [e.samples for e in result.epochs] == [CONFIG.devices * CONFIG.samples_per_device]
    # and the bytes form of the same secret is the same secret
    assert verify_token(secret.encode(), mint_token(secret, 1)).device_id == 1


# -- the server's last line ---------------------------------------------------------------


def _metrics(accuracy: float, held_out: float = float("nan")) -> EpochMetrics:
    return EpochMetrics(epoch=1, time_s=1.0, busy_s={}, idle_s={}, loss=0.5,
                        accuracy=accuracy, train_accuracy=0.5, samples=10, bytes_up=0,
                        bytes_down=0, plan=(), held_out_accuracy=held_out)


def test_done_line_says_the_accuracy_and_where_the_results_are() -> None:
    def result(*epochs: EpochMetrics) -> RunResult:
        return RunResult(CONFIG, epochs, model=None, out_dir=Path("runs/x"))  # type: ignore[arg-type]

    assert done_line("aiopipe.server", result(_metrics(0.25), _metrics(0.8125))) == \
        "aiopipe.server: done; test accuracy 0.812; results in runs/x"
    assert done_line("aiopipe", result(_metrics(0.5, held_out=0.75))) == \
        "aiopipe: done; test accuracy 0.500; held-out accuracy 0.750; results in runs/x"
    assert done_line("aiopipe", result(_metrics(float("nan")))) == \
        "aiopipe: done; no test accuracy (no test set); results in runs/x"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
def test_the_servers_last_line_carries_the_test_accuracy(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m aiopipe.server``'s ``main`` in this process, its one device in a
    thread (which waits for the server to listen)."""
    from aiopipe import server as server_cli

    port = _free_port()
    secret = generate_secret()
    token = mint_token(secret.encode(), 0)
    failures: list[BaseException] = []

    async def device() -> None:
        async with Device(f"ws://127.0.0.1:{port}/ws", 0, token=token,
                          connect_timeout=60) as node:
            await node.run()

    def run_device() -> None:
        try:
            asyncio.run(device())
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    thread = threading.Thread(target=run_device, daemon=True)
    thread.start()
    with pytest.raises(SystemExit) as info:
        server_cli.main(["--port", str(port), "--token-secret", secret, "--devices", "1",
                         "--samples-per-device", "40", "--batch-size", "20", "--epochs", "1",
                         "--test-samples", "20", "--split-point", "2",
                         "--parallel-batches", "2", "--join-timeout", "30",
                         "--out-dir", str(tmp_path / "run")])
    thread.join(30)
    out = capsys.readouterr().out
    assert info.value.code == 0, out
    assert not failures, failures
    last = out.strip().splitlines()[-1]
    assert last.startswith("aiopipe.server: done; test accuracy 0."), last
    assert last.endswith(f"; results in {tmp_path / 'run'}"), last


# -- through a real process -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_python_m_aiopipe_device_prints_the_reason_and_the_hint() -> None:
    """``python -m aiopipe.device`` with an expired token in ``AIOPIPE_TOKEN``: one line on
    stderr with the server's reason and the command to mint a new one; exit 1."""
    expired = mint_token(SECRET, 0, lifetime_s=60, now=time.time() - 3600)
    env = {**os.environ, "AIOPIPE_TOKEN": expired, "AIOPIPE_LOG_LEVEL": "WARNING"}
    async with Server(CONFIG, token_secret=SECRET, join_timeout=30) as server:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aiopipe.device", "--server", server.url, "--device-id", "0",
            "--connect-timeout", "0", cwd=REPO, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(process.communicate(), 50)
    lines = err.decode().strip().splitlines()
    assert process.returncode == 1, lines
    assert lines == [lines[-1]], lines
    assert lines[-1].startswith(
        f"python -m aiopipe.device [device 0]: failed: the server at {server.url} refused "
        "device 0's token (HTTP 401): expired at "), lines
    assert f"`{MINT} 0`" in lines[-1]
    assert PASS in lines[-1]


def test_python_m_aiopipe_device_refuses_another_devices_token_before_dialing(
        capsys: pytest.CaptureFixture[str]) -> None:
    from aiopipe import device as device_cli

    with pytest.raises(SystemExit) as info:
        device_cli.main(["--server", "ws://127.0.0.1:1/ws", "--device-id", "0",
                         "--connect-timeout", "0", "--token", mint_token(SECRET, 1)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "the token (--token or AIOPIPE_TOKEN) is for device 1, not device 0" in err
    assert f"`{MINT} 0`" in err
