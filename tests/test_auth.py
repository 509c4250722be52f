"""Device tokens, peer pair keys and proofs, secrets and TLS contexts (`aiopipe.auth`), and
``python -m aiopipe.auth``.

Pure functions, no event loop; the websocket handshake is in
tests/runtime/test_runtime_auth.py.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiopipe.auth import (
    DEFAULT_TOKEN_LIFETIME_S,
    MIN_SECRET_BYTES,
    Revocations,
    Token,
    authenticate_bearer,
    check_node_name,
    check_peer_proof,
    check_secret,
    client_ssl_context,
    generate_secret,
    load_secret,
    mint_token,
    new_run_secret,
    pair_key,
    peer_proof,
    server_ssl_context,
    token_id_of,
    verify_token,
)
from aiopipe.auth.__main__ import main as auth_main
from aiopipe.errors import AuthenticationError, ConfigError

REPO = Path(__file__).resolve().parents[1]
SECRET = b"0123456789abcdef-test-secret"
OTHER = b"fedcba9876543210-other-secret"
TOKEN_SHAPE = re.compile(r"v2\.(0|[1-9][0-9]*)\.[0-9]+\.[A-Za-z0-9_-]{16}\.[A-Za-z0-9_-]{43}")
NOW = 1_800_000_000.0


# -- tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("device_id", [0, 1, 7, 12345, 9_999_999_999])
def test_a_minted_token_verifies_as_its_device(device_id: int) -> None:
    token = mint_token(SECRET, device_id, now=NOW)
    assert TOKEN_SHAPE.fullmatch(token), token
    assert token.split(".")[1] == str(device_id)
    verified = verify_token(SECRET, token, now=NOW)
    assert verified == Token(device_id, token.split(".")[3], int(NOW + DEFAULT_TOKEN_LIFETIME_S))
    assert mint_token(SECRET, device_id) != token  # each token has an id of its own


def test_tokens_differ_per_device_and_per_secret() -> None:
    tokens = {mint_token(s, k).split(".")[4] for s in (SECRET, OTHER) for k in range(4)}
    assert len(tokens) == 8


def test_the_mac_is_hmac_sha256_of_the_domain_id_expiry_and_token_id() -> None:
    token = mint_token(SECRET, 3, now=NOW, lifetime_s=60)
    _, _, expires, token_id, mac = token.split(".")
    assert expires == str(int(NOW) + 60)
    message = f"aiopipe-device:v2\0003\000{expires}\000{token_id}".encode()
    digest = hmac.new(SECRET, message, hashlib.sha256).digest()
    assert mac == base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def test_a_token_expires() -> None:
    token = mint_token(SECRET, 2, now=NOW, lifetime_s=3600)
    assert verify_token(SECRET, token, now=NOW + 3600).device_id == 2
    message = _refusal(SECRET, token, now=NOW + 3601)
    assert f"token {token.split('.')[3]} for device 2 expired at" in message
    forever = mint_token(SECRET, 2, lifetime_s=None)
    assert forever.split(".")[2] == "0"
    assert verify_token(SECRET, forever, now=1e11).expires_at is None


def test_an_expiry_cannot_be_moved() -> None:
    version, device, expires, token_id, mac = mint_token(SECRET, 2, now=NOW).split(".")
    later = str(int(expires) + 10**6)
    assert "bad mac" in _refusal(SECRET, ".".join([version, device, later, token_id, mac]))


@pytest.mark.parametrize("lifetime", [0, -1.0, True, "1d", float("inf")])
def test_mint_refuses_a_bad_lifetime(lifetime: object) -> None:
    with pytest.raises(ConfigError, match="lifetime"):
        mint_token(SECRET, 0, lifetime_s=lifetime)  # type: ignore[arg-type]


def _flip(text: str, i: int) -> str:
    return text[:i] + ("A" if text[i] != "A" else "B") + text[i + 1 :]


def _refusal(secret: bytes, token: str, now: float | None = None) -> str:
    with pytest.raises(AuthenticationError) as info:
        verify_token(secret, token, now=now)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_another_secrets_token_is_refused_as_a_bad_mac() -> None:
    assert "bad mac" in _refusal(SECRET, mint_token(OTHER, 1))


def test_a_token_for_one_device_cannot_be_relabelled_for_another() -> None:
    fields = mint_token(SECRET, 1).split(".")
    message = _refusal(SECRET, ".".join([fields[0], "0", *fields[2:]]))
    assert "token for device 0 has a bad mac" in message


@pytest.mark.parametrize("position", [0, 21, 42])
def test_an_altered_mac_is_refused(position: int) -> None:
    *head, mac = mint_token(SECRET, 2).split(".")
    assert "bad mac" in _refusal(SECRET, ".".join([*head, _flip(mac, position)]))


ID = "A" * 16
MAC = "A" * 43


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        ("", "malformed token"),
        ("just-a-password", "malformed token"),
        ("v2.0", "malformed token"),
        ("v2.0.x.y", "malformed token"),
        ("v1.0." + MAC, "token version v1 is not v2 (mint a new one"),
        ("v3.0.0." + ID + "." + MAC, "token version v3 is not v2"),
        ("V2.0.0." + ID + "." + MAC, "token version unknown is not v2"),
        ("v2.-1.0." + ID + "." + MAC, "not a plain decimal"),
        ("v2.01.0." + ID + "." + MAC, "not a plain decimal"),
        ("v2.+1.0." + ID + "." + MAC, "not a plain decimal"),
        ("v2.\u0661.0." + ID + "." + MAC, "malformed token"),  # an Arabic-Indic digit one
        ("v2.99999999999.0." + ID + "." + MAC, "not a plain decimal"),
        ("v2.0.-5." + ID + "." + MAC, "expiry is not a plain decimal"),
        ("v2.0.1e9." + ID + "." + MAC, "expiry is not a plain decimal"),
        ("v2.0.0." + "A" * 15 + "." + MAC, "16 base64url characters"),
        ("v2.0.0." + "+" * 16 + "." + MAC, "16 base64url characters"),
        ("v2.0.0." + ID + "." + "A" * 42, "43 base64url characters"),
        ("v2.0.0." + ID + "." + "A" * 43 + "=", "43 base64url characters"),
        ("v2.0.0." + ID + "." + "+" * 43, "43 base64url characters"),
    ],
)
def test_malformed_tokens_are_refused_with_the_reason(token: str, reason: str) -> None:
    message = _refusal(SECRET, token)
    assert reason in message
    if len(token) > 10:
        assert token not in message  # never echo what was presented


def test_a_token_reason_never_quotes_the_token() -> None:
    token = mint_token(OTHER, 4)
    assert token not in _refusal(SECRET, token)
    assert token.split(".")[4] not in _refusal(SECRET, token)


def test_a_revoked_token_is_refused_and_the_devices_other_tokens_are_not(
        tmp_path: Path) -> None:
    path = tmp_path / "revoked.txt"
    revocations = Revocations(path)  # no file yet: nothing revoked
    first, second = mint_token(SECRET, 1), mint_token(SECRET, 1)
    assert authenticate_bearer(f"Bearer {first}", SECRET, revocations=revocations).device_id == 1
    Revocations.add(path, token_id_of(first), "lost laptop")
    with pytest.raises(AuthenticationError, match=f"token {token_id_of(first)} for device 1 "
                                                  "was revoked"):
        authenticate_bearer(f"Bearer {first}", SECRET, revocations=revocations)
    assert authenticate_bearer(f"Bearer {second}", SECRET, revocations=revocations).device_id == 1
    assert path.read_text().startswith(token_id_of(first) + "  # lost laptop")
    path.write_text("# nothing revoked\n\n")  # taken back: read again once changed
    assert authenticate_bearer(f"Bearer {first}", SECRET, revocations=revocations).device_id == 1


@pytest.mark.parametrize("text", ["", "v2.0.0.short.x", mint_token(SECRET, 0)[:-1] + ".x"],
                         ids=["empty", "short", "six fields"])  # (ids: the same in every worker)
def test_token_id_of_wants_a_token(text: str) -> None:
    with pytest.raises(ConfigError, match="not a token"):
        token_id_of(text)


@pytest.mark.parametrize("device_id", [-1, True, 1.0, "1", 10**10])
def test_mint_refuses_a_bad_device_id(device_id: object) -> None:
    with pytest.raises(ConfigError, match="device id"):
        mint_token(SECRET, device_id)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, "no device token"),
        ("", "no device token"),
        ("Basic dXNlcjpwYXNz", "not 'Bearer <token>'"),
        ("Bearer", "not 'Bearer <token>'"),
        ("Bearer   ", "not 'Bearer <token>'"),
        ("Bearer nonsense", "malformed token"),
    ],
)
def test_bearer_headers_are_checked(header: str | None, reason: str) -> None:
    with pytest.raises(AuthenticationError, match=re.escape(reason)):
        authenticate_bearer(header, SECRET)


def test_a_bearer_header_names_its_device() -> None:
    token = mint_token(SECRET, 5)
    assert authenticate_bearer(f"Bearer {token}", SECRET).device_id == 5
    # the scheme is case-blind
    assert authenticate_bearer(f"bearer {token} ", SECRET).device_id == 5


# -- peer pair keys and proofs ------------------------------------------------------------

RUN = bytes(range(32))
NONCE_D, NONCE_L = b"d" * 32, b"l" * 32


def test_run_secrets_are_32_random_bytes() -> None:
    first, second = new_run_secret(), new_run_secret()
    assert isinstance(first, bytes)
    assert len(first) == 32
    assert first != second


def test_a_pair_key_is_hmac_sha256_of_the_sorted_names() -> None:
    expected = hmac.new(RUN, b"aiopipe-pair:dev-1\0dev-2", hashlib.sha256).digest()
    assert pair_key(RUN, "dev-1", "dev-2") == expected
    assert pair_key(RUN, "dev-2", "dev-1") == expected  # both sides compute the same key


def test_pair_keys_differ_across_runs_and_pairs() -> None:
    other_run = new_run_secret()
    keys = {pair_key(run, a, b) for run in (RUN, other_run)
            for a, b in (("a", "b"), ("a", "c"), ("b", "c"), ("server", "a"))}
    assert len(keys) == 8
    # the separator keeps names apart: "a" + "bc" is not "ab" + "c"
    assert pair_key(RUN, "a", "bc") != pair_key(RUN, "ab", "c")


@pytest.mark.parametrize(
    ("secret", "a", "b", "reason"),
    [
        (RUN, "a", "a", "two different nodes"),
        (RUN, "", "b", "node name"),
        (RUN, "a", "x" * 65, "node name"),
        (RUN, "a b", "c", "node name"),
        (RUN, "a", "b\x00", "node name"),
        (RUN, "ä", "b", "node name"),
        (RUN[:MIN_SECRET_BYTES - 1], "a", "b", f"at least {MIN_SECRET_BYTES} bytes"),
        ("a str secret of enough length", "a", "b", f"at least {MIN_SECRET_BYTES} bytes"),
    ],
)
def test_pair_key_refuses_bad_arguments(secret: bytes, a: str, b: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as info:
        pair_key(secret, a, b)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["a", "dev-0", "stage_1", "host.example:8080", "x" * 64])
def test_node_names_are_printable_ascii(name: str) -> None:
    assert check_node_name(name) == name


def test_a_long_node_name_is_not_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        check_node_name("y" * 1000)
    assert "y" * 65 not in str(info.value)
    assert "1000 characters" in str(info.value)


def _proof(**changes: object) -> bytes:
    arguments: dict[str, object] = {
        "key": pair_key(RUN, "a", "b"), "role": "dialer", "dialer": "a", "listener": "b",
        "dialer_nonce": NONCE_D, "listener_nonce": NONCE_L, **changes}
    return peer_proof(**arguments)  # type: ignore[arg-type]


def test_a_peer_proof_binds_every_input() -> None:
    proof = _proof()
    assert len(proof) == 32
    assert _proof() == proof  # deterministic
    variants = [
        _proof(key=pair_key(new_run_secret(), "a", "b")),
        _proof(role="listener"),  # a listener's proof is no dialer's: no reflection
        _proof(dialer="b", listener="a"),  # nor one for the other direction
        _proof(dialer="c"),
        _proof(listener="c"),
        _proof(dialer_nonce=b"x" * 32),
        _proof(listener_nonce=b"x" * 32),
        _proof(dialer_nonce=NONCE_L, listener_nonce=NONCE_D),
    ]
    assert len({proof, *variants}) == len(variants) + 1


def test_check_peer_proof_accepts_the_right_proof_only() -> None:
    key = pair_key(RUN, "a", "b")
    check_peer_proof(key, "dialer", "a", "b", NONCE_D, NONCE_L, _proof())
    wrong = [_proof(role="listener"), _proof(listener_nonce=b"x" * 32), _proof()[:-1],
             b"", bytes(32)]
    for proof in wrong:
        with pytest.raises(AuthenticationError) as info:
            check_peer_proof(key, "dialer", "a", "b", NONCE_D, NONCE_L, proof)
        message = str(info.value)
        assert message == ("the dialer a of the link a -> b sent a wrong proof "
                           "(it holds another key for the pair, or is not a)")
        for secret in (key, proof, _proof(), NONCE_D, NONCE_L):  # never shown, in any spelling
            if secret:
                assert secret.hex() not in message
                assert repr(secret)[2:-1] not in message
                assert base64.b64encode(secret).decode().rstrip("=") not in message
    with pytest.raises(AuthenticationError, match="the listener b of the link a -> b"):
        check_peer_proof(key, "listener", "a", "b", NONCE_D, NONCE_L, _proof())


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"key": b"short"}, f"at least {MIN_SECRET_BYTES} bytes"),
        ({"role": "server"}, "'dialer' or 'listener'"),
        ({"listener": "a"}, "two different nodes"),
        ({"dialer": "a\n"}, "node name"),
        ({"dialer_nonce": b"d" * 31}, "dialer's nonce must be 32 bytes"),
        ({"listener_nonce": "l" * 32}, "listener's nonce must be 32 bytes"),
    ],
)
def test_peer_proof_refuses_bad_arguments(changes: dict[str, object], reason: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(reason)):
        _proof(**changes)


# -- secrets ----------------------------------------------------------------------------


def test_generated_secrets_are_long_random_and_usable() -> None:
    a, b = generate_secret(), generate_secret()
    assert a != b
    assert len(a) == 43
    assert re.fullmatch(r"[A-Za-z0-9_-]+", a)
    assert load_secret(a) == a.encode()
    assert verify_token(load_secret(a), mint_token(load_secret(a), 0)).device_id == 0


@pytest.mark.parametrize("secret", [b"", b"x", b"x" * (MIN_SECRET_BYTES - 1)])
def test_short_secrets_are_refused(secret: bytes) -> None:
    with pytest.raises(ConfigError, match=f"at least {MIN_SECRET_BYTES}"):
        check_secret(secret)
    with pytest.raises(ConfigError, match=f"at least {MIN_SECRET_BYTES}"):
        mint_token(secret, 0)
    with pytest.raises(ConfigError, match=f"at least {MIN_SECRET_BYTES}"):
        verify_token(secret, "v2.0.0." + "A" * 16 + "." + "A" * 43)
    with pytest.raises(ConfigError, match=f"at least {MIN_SECRET_BYTES}"):
        load_secret(secret.decode())


def test_a_str_secret_is_its_utf8_bytes_and_other_types_are_refused() -> None:
    assert check_secret("a string secret of enough length") == b"a string secret of enough length"
    with pytest.raises(ConfigError, match="must be str or bytes"):
        check_secret(12345678901234567890)  # type: ignore[arg-type]


def test_load_secret_reads_files(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("  " + SECRET.decode() + "\n")  # as `echo` writes it
    assert load_secret(f"file:{path}") == SECRET
    assert load_secret(str(path)) == SECRET
    binary = tmp_path / "binary"
    binary.write_bytes(bytes(range(1, 33)) + b"\x00\xff")
    assert load_secret(f"file:{binary}") == bytes(range(1, 33)) + b"\x00\xff"


def test_load_secret_takes_a_literal() -> None:
    assert load_secret(SECRET.decode()) == SECRET


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: f"file:{d / 'missing'}", "cannot read token secret file"),
        (lambda d: f"file:{d}", "cannot read token secret file"),
        (lambda d: str(d / "missing"), "looks like a path but names no file"),
        (lambda d: f"file:{d / 'empty'}", "is empty"),
        (lambda d: f"file:{d / 'short'}", f"at least {MIN_SECRET_BYTES}"),
    ],
)
def test_load_secret_refusals_are_one_line(tmp_path: Path, make: object, reason: str) -> None:
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "short").write_text("too-short\n")
    with pytest.raises(ConfigError) as info:
        load_secret(make(tmp_path))  # type: ignore[operator]
    assert reason in str(info.value)
    assert "\n" not in str(info.value)


# -- TLS contexts ------------------------------------------------------------------------


def test_the_client_context_verifies_the_server_and_its_name() -> None:
    context = client_ssl_context()
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert context.check_hostname
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2


def test_tls_files_that_cannot_be_read_are_config_errors(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="no such file"):
        client_ssl_context(tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match="cannot load TLS CA file"):
        client_ssl_context(junk)
    with pytest.raises(ConfigError, match="no such file"):
        server_ssl_context(tmp_path / "missing.pem", tmp_path / "missing.key")
    with pytest.raises(ConfigError, match="cannot load TLS certificate"):
        server_ssl_context(junk, junk)


# -- python -m aiopipe.auth ----------------------------------------------------------------


def _auth(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    monkeypatch.delenv("AIOPIPE_TOKEN_SECRET", raising=False)
    with pytest.raises(SystemExit) as info:
        auth_main(argv)
    out, err = capsys.readouterr()
    assert isinstance(info.value.code, int)
    return info.value.code, out, err


def test_cli_secret_prints_a_new_secret(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = _auth(["secret"], capsys, monkeypatch)
    assert (code, err) == (0, "")
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}\n", out)


def test_cli_mint_prints_the_devices_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "secret").write_text(SECRET.decode() + "\n")
    code, out, err = _auth(
        ["mint", "--secret", f"file:{tmp_path / 'secret'}", "--device-id", "3"], capsys, monkeypatch
    )
    assert (code, err) == (0, "")
    assert TOKEN_SHAPE.fullmatch(out.strip())
    token = verify_token(SECRET, out.strip())
    assert token.device_id == 3
    assert token.expires_at is not None
    assert abs(token.expires_at - time.time() - 30 * 86400) < 60  # 30 days by default
    code, out, _ = _auth(["mint", "--secret", SECRET.decode(), "--device-id", "0",
                          "--expires-in", "never"], capsys, monkeypatch)
    assert verify_token(SECRET, out.strip()) == Token(0, out.split(".")[3], None)
    code, out, _ = _auth(["mint", "--secret", SECRET.decode(), "--device-id", "0",
                          "--expires-in", "12h"], capsys, monkeypatch)
    expires_at = verify_token(SECRET, out.strip()).expires_at
    assert expires_at is not None
    assert abs(expires_at - time.time() - 12 * 3600) < 60


def test_cli_mint_reads_the_secret_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOPIPE_TOKEN_SECRET", SECRET.decode())
    with pytest.raises(SystemExit) as info:
        auth_main(["mint", "--device-id", "1"])
    assert info.value.code == 0
    assert verify_token(SECRET, capsys.readouterr().out.strip()).device_id == 1


def test_cli_revoke_writes_the_tokens_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    token, path = mint_token(SECRET, 4), tmp_path / "revoked.txt"
    code, out, err = _auth(["revoke", "--file", str(path), "--token", token], capsys,
                           monkeypatch)
    assert (code, err) == (0, "")
    assert token_id_of(token) in out
    assert token_id_of(token) in Revocations(path).ids()
    code, _, _ = _auth(["revoke", "--file", str(path), "--token-id", "B" * 16], capsys,
                       monkeypatch)
    assert code == 0
    assert Revocations(path).ids() == {token_id_of(token), "B" * 16}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "required"),
        (["bogus"], "bogus"),
        (["mint", "--device-id", "0"], "--secret is required"),
        (["mint", "--secret", SECRET.decode()], "--device-id"),
        (["mint", "--secret", SECRET.decode(), "--device-id", "-1"], "--device-id must be >= 0"),
        (["mint", "--secret", SECRET.decode(), "--device-id", "x"], "--device-id"),
        (["mint", "--secret", "short", "--device-id", "0"], f"at least {MIN_SECRET_BYTES}"),
        (["mint", "--secret", "file:/nonexistent/secret", "--device-id", "0"], "cannot read"),
        (["mint", "--secret", SECRET.decode(), "--device-id", "0", "--expires-in", "soon"],
         "a lifetime is"),
        (["revoke", "--file", "r.txt"], "one of the arguments --token --token-id"),
        (["revoke", "--file", "r.txt", "--token", "nonsense"], "not a token"),
        (["revoke", "--file", "r.txt", "--token-id", "short"], "a token id is"),
    ],
)
def test_cli_errors_are_one_line_with_exit_2(
    argv: list[str],
    expected: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, out, err = _auth(argv, capsys, monkeypatch)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "error" in lines[0]
    assert expected in lines[0]


def test_python_m_aiopipe_auth_runs_cleanly(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIOPIPE_TOKEN_SECRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-m",
            "aiopipe.auth",
            "mint",
            "--secret",
            SECRET.decode(),
            "--device-id",
            "2",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert verify_token(SECRET, done.stdout.strip()).device_id == 2
