"""Per-device tokens and TLS over real websockets (DESIGN §7, the last row): a client
without valid credentials, or one claiming another device's id, is refused at the
handshake; the run goes on; ``wss://`` works end to end and a device that cannot verify
the server refuses to talk to it."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from aiopipe import (
    AuthenticationError,
    ConfigError,
    Device,
    LinkBrokenError,
    RunConfig,
    RunResult,
    Server,
    TrainingError,
)
from aiopipe.auth import (
    Revocations,
    client_ssl_context,
    mint_token,
    server_ssl_context,
    token_id_of,
)
from aiopipe.clock import SystemClock
from aiopipe.transport import open_websocket_link

SECRET = b"runtime-auth-test-secret-32bytes"
OTHER_SECRET = b"another-servers-secret-32-bytes!"
CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=40, batch_size=20, epochs=1,
                   split_point=2, parallel_batches=2, test_samples=20, seed=3)


async def _device(url: str, k: int, *, token_for: int | None = None,
                  tls: ssl.SSLContext | None = None) -> None:
    token = mint_token(SECRET, k if token_for is None else token_for)
    async with Device(url, k, token=token, ssl=tls) as device:
        await device.run()


async def _train(server: Server, tls: ssl.SSLContext | None = None) -> RunResult:
    async with asyncio.TaskGroup() as tasks:
        for k in range(CONFIG.devices):
            tasks.create_task(_device(server.url, k, tls=tls))
        return await server.run()


async def _handshake(url: str, token: str | None) -> None:
    async with open_websocket_link(url, clock=SystemClock(), token=token,
                                   max_frame_bytes=1 << 20):
        pass


@pytest.mark.parametrize(
    "token",
    [None, mint_token(OTHER_SECRET, 0), "v2.0.0.not-a-mac", "a-shared-password"],
    ids=["no-token", "wrong-secret", "malformed", "not-a-device-token"],
)
async def test_a_device_without_a_valid_token_is_refused(token: str | None) -> None:
    async with Server(CONFIG, token_secret=SECRET, join_timeout=5) as server:
        with pytest.raises(AuthenticationError, match="HTTP 401"):
            await _handshake(server.url, token)
        assert server.node.connected == set()


async def test_the_401_says_why_in_one_line_and_comes_before_the_upgrade() -> None:
    async with Server(CONFIG, token_secret=SECRET, join_timeout=5) as server:
        http_url = server.url.replace("ws://", "http://", 1)
        answers = {}
        async with aiohttp.ClientSession() as http:
            for name, header in [
                ("none", None),
                ("basic", "Basic dXNlcjpwYXNz"),
                ("wrong", f"Bearer {mint_token(OTHER_SECRET, 1)}"),
                ("valid", f"Bearer {mint_token(SECRET, 1)}"),
            ]:
                headers = {"Authorization": header} if header else {}
                async with http.get(http_url, headers=headers) as response:
                    answers[name] = (response.status, await response.text(),
                                     response.headers.get("WWW-Authenticate"))
    assert answers["none"] == (401, "no device token (send Authorization: Bearer <token>)\n",
                               "Bearer")
    assert answers["basic"][:2] == (401, "the Authorization header is not 'Bearer <token>'\n")
    assert answers["wrong"][0] == 401
    assert answers["wrong"][1].startswith("token for device 1 has a bad mac")
    assert answers["wrong"][1].count("\n") == 1
    # a valid token gets past authentication; a plain GET is then no websocket upgrade
    assert answers["valid"][0] == 400


async def test_a_token_for_another_device_is_refused_and_the_run_goes_on() -> None:
    async with Server(CONFIG, token_secret=SECRET, join_timeout=60) as server:
        # before anyone joined: device 1's token cannot say hello as device 0
        with pytest.raises(TrainingError, match="token is for device 1, not device 0"):
            await _device(server.url, 0, token_for=1)
        async with asyncio.TaskGroup() as tasks:
            for k in range(CONFIG.devices):
                tasks.create_task(_device(server.url, k))
            training = tasks.create_task(server.run())
            await server.node.joined.wait()
            # while training: nor can it take over device 0's place
            with pytest.raises(TrainingError, match="token is for device 1, not device 0"):
                await _device(server.url, 0, token_for=1)
            result = await training
    assert [e.samples for e in result.epochs] == [CONFIG.devices * CONFIG.samples_per_device]


def test_bad_security_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="at least 16"):
        Server(CONFIG, token_secret=b"short")
    with pytest.raises(ConfigError, match="wss://"):
        Device("ws://127.0.0.1:1/ws", 0, ssl=client_ssl_context())
    with pytest.raises(ConfigError, match="ssl needs host"):
        Server(CONFIG, host=None, ssl=client_ssl_context())


# -- TLS ------------------------------------------------------------------------------------


async def test_a_run_over_wss_with_tokens(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    async with Server(CONFIG, token_secret=SECRET, ssl=server_ssl_context(cert, key),
                      join_timeout=60) as server:
        assert server.url.startswith("wss://127.0.0.1:")
        result = await _train(server, tls=client_ssl_context(cert))
    assert [e.samples for e in result.epochs] == [CONFIG.devices * CONFIG.samples_per_device]
    assert result.epochs[0].bytes_up > 0


async def _refused_by_device(certificate: tuple[Path, Path], url_of: Callable[[str], str],
                             tls: ssl.SSLContext | None) -> LinkBrokenError:
    """The device's error connecting to a TLS server at ``url_of(its url)``.

    A certificate failure needs transport/websocket.py to translate aiohttp's
    ClientSSLError to LinkBrokenError before its ValueError clause (a ClientSSLError for
    a bad certificate is also a ValueError, which it reports as an invalid URL).
    """
    cert, key = certificate
    async with Server(CONFIG, token_secret=SECRET, ssl=server_ssl_context(cert, key),
                      join_timeout=5) as server:
        with pytest.raises(LinkBrokenError) as info:
            async with Device(url_of(server.url), 0, token=mint_token(SECRET, 0),
                              ssl=tls):
                pass
        assert server.node.connected == set()
    return info.value


async def test_a_device_without_the_ca_refuses_the_server(
    certificate: tuple[Path, Path],
) -> None:
    # the system's authorities do not know a self-signed certificate
    error = await _refused_by_device(certificate, lambda url: url, None)
    assert "certificate verify failed" in str(error)


async def test_a_device_checks_the_servers_name(certificate: tuple[Path, Path]) -> None:
    # the right CA, the wrong name: the certificate is for 127.0.0.1, not localhost
    error = await _refused_by_device(
        certificate, lambda url: url.replace("127.0.0.1", "localhost", 1),
        client_ssl_context(certificate[0]))
    assert "certificate verify failed" in str(error)
    assert "localhost" in str(error)


async def test_plain_ws_to_a_tls_server_gets_no_websocket(
    certificate: tuple[Path, Path],
) -> None:
    await _refused_by_device(certificate, lambda url: url.replace("wss://", "ws://", 1), None)


@pytest.mark.slow
async def test_a_token_revoked_mid_run_cuts_its_device_and_the_run_goes_on(
        tmp_path: Path) -> None:
    """Revoke device 1's token while it trains: its connection closes within a second,
    it cannot reconnect with that token, the server gives up on it after the grace and
    device 0 finishes the run; device 0's token (same secret) stays good."""
    revoked = tmp_path / "revoked.txt"
    config = CONFIG.replace(epochs=30, reconnect_grace=1.0)
    tokens = [mint_token(SECRET, k) for k in range(2)]

    async def device(k: int) -> BaseException | None:
        try:
            async with Device(server.url, k, token=tokens[k]) as node:
                await node.run()
        except (AuthenticationError, TrainingError) as exc:
            return exc
        return None

    first_epoch = asyncio.Event()
    async with (Server(config, token_secret=SECRET, join_timeout=60, revoked=revoked,
                       progress=lambda _: first_epoch.set()) as server,
                asyncio.TaskGroup() as tasks):
        devices = [tasks.create_task(device(k)) for k in range(2)]
        training = tasks.create_task(server.run())
        await first_epoch.wait()
        Revocations.add(revoked, token_id_of(tokens[1]))
        result = await training
    cut = devices[1].result()
    assert isinstance(cut, AuthenticationError), cut
    assert "HTTP 401" in str(cut)
    assert devices[0].result() is None
    assert 1 in {k for e in result.epochs for k in e.devices_lost}
    assert result.epochs[-1].samples == 40  # device 0 alone


def test_revoked_needs_a_token_secret(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="revoked needs token_secret"):
        Server(CONFIG, revoked=tmp_path / "revoked.txt")
