"""The redactor against a corpus of real-shaped secrets and of harmless runner log lines."""

from __future__ import annotations

import base64
import os
import time

import pytest

from fleet_min.controlplane.redact import MARK, redact, redact_lines

PEM = """-----BEGIN RSA PRIVATE KEY-----
MIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM9Oi4ZbCv8cXBBdqh3XV1vaB7w2zT
Ak5n9fHCZUmJHjCszPNH8mFVUXLWvHGWTg8DCwZ4fiQmPXVczPQvFAsRz7sUvG4L
-----END RSA PRIVATE KEY-----"""

BLOB = base64.b64encode(bytes(range(7, 67))).decode()

# Each entry: (line containing a secret, the secret that must not survive).
SECRETS = [
    ("token=ghp_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8", "ghp_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"),
    ("using gho_16C7e42F292c6912E7710c838347Ae178B4a now",
     "gho_16C7e42F292c6912E7710c838347Ae178B4a"),
    ("ghu_abcdefghijklmnopqrstuvwxyzABCDEF0123", "ghu_abcdefghijklmnopqrstuvwxyzABCDEF0123"),
    ("install token ghs_0123456789abcdefghijABCDEFGHIJklmnop used",
     "ghs_0123456789abcdefghijABCDEFGHIJklmnop"),
    ("refresh ghr_1B4a2e77838347a7E420ce178F2E7c6912E169246c34E1ccbF66C46812d16D5B1A9Dc86A1498",
     "ghr_1B4a2e77838347a7E420ce178F2E7c6912E169246c34E1ccbF66C46812d16D5B1A9Dc86A1498"),
    ("PAT github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234",
     "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234"),
    ("Authorization: Bearer eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJydW5uZXIifQ.c2lnbmF0dXJl",
     "eyJhbGciOiJSUzI1NiJ9"),
    ("curl -H 'Authorization: token 0123456789abcdef0123456789abcdef01234567'",
     "0123456789abcdef0123456789abcdef01234567"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZDEyMw==", "dXNlcjpwYXNzd29yZDEyMw=="),
    ("sent header bearer abcDEF123456ghiJKL789", "abcDEF123456ghiJKL789"),
    ('{"token": "AABBCCDDEEFF0011", "name": "runner-1"}', "AABBCCDDEEFF0011"),
    ('{"client_secret":"s3cr3t-value-here"}', "s3cr3t-value-here"),
    ('  "password" : "hunter2hunter2"', "hunter2hunter2"),
    ("DB_PASSWORD=correct-horse-battery", "correct-horse-battery"),
    ("export API_KEY='k-live-9d8f7g6h'", "k-live-9d8f7g6h"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "wJalrXUtnFEMI"),
    ("AKIAIOSFODNN7EXAMPLE is the key id", "AKIAIOSFODNN7EXAMPLE"),
    ("slack xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", "xoxb-123456789012"),
    ("clone https://x-access-token:ghs_secretsecret@github.com/o/r.git", "ghs_secretsecret"),
    ("clone https://deploy:pa55word@git.example.com/o/r.git", "pa55word"),
    ("jwt eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpM",
     "SflKxwRJSMeKKF2QT4fwpM"),
    ("blob " + BLOB, BLOB[:30]),
    ("session_id: 8f14e45fceea167a5a36dedd4bea2543", "8f14e45fceea167a5a36dedd4bea2543"),
    ("old v1.0123456789abcdef0123456789abcdef01234567 token",
     "v1.0123456789abcdef0123456789abcdef01234567"),
    ("registration --token AAOEXAMPLEQWERTY1234567ABCDEFGH", "AAOEXAMPLEQWERTY1234567ABCDEFGH"),
]

HARMLESS = [
    "[2024-05-01 10:00:00Z INFO Runner] Listening for Jobs",
    "[2024-05-01 10:00:02Z INFO JobDispatcher] Job build completed with result: Succeeded",
    "Current runner version: '2.311.0'",
    "Checking out 1f2e3d4c5b6a79881f2e3d4c5b6a79881f2e3d4c on refs/heads/main",
    "/home/runner/actions-runner/_work/app/app/node_modules/.bin/webpack-cli --mode production",
    "Download action 'actions/checkout@v4' (SHA:b4ffde65f46336ab88eb53be808477a3936bae11)",
    "Token refresh: none",
    "Runner reconnected.",
    "2024-05-01T10:00:00.0000000Z ##[group]Run npm ci",
    "password: ***",
    "Authentication succeeded for octo/app",
    "Settings: labels=self-hosted,Linux,X64 work=_work",
    "sha256:3f5a1c0f2b9d8e7a6c5b4a3928171605f4e3d2c1b0a9f8e7d6c5b4a392817160",
]


@pytest.mark.parametrize("line, secret", SECRETS)
def test_no_secret_survives(line: str, secret: str) -> None:
    out = redact(line)
    assert secret not in out, out
    assert MARK in out


@pytest.mark.parametrize("line", HARMLESS)
def test_harmless_lines_are_untouched(line: str) -> None:
    assert redact(line) == line


def test_pem_private_key_block_is_removed_whole() -> None:
    text = f"before\n{PEM}\nafter"
    out = redact(text)
    assert "MIIEpAIBAAKCAQEA" not in out and "Ak5n9f" not in out
    assert out.startswith("before\n") and out.endswith("\nafter")


def test_pem_cut_off_by_a_tail_is_removed_to_the_end() -> None:
    cut = "\n".join(PEM.splitlines()[:2])
    assert "MIIEpAIBAAKCAQEA" not in redact("x\n" + cut)


def test_redact_lines_keeps_a_multiline_block_together() -> None:
    lines = ["a", *PEM.splitlines(), "b"]
    out = redact_lines(lines)
    assert out[0] == "a" and out[-1] == "b"
    assert not any("MIIE" in line for line in out)


def test_random_base64_runs_are_caught_but_hex_digests_are_not() -> None:
    for _ in range(50):
        blob = base64.b64encode(os.urandom(48)).decode()
        assert blob not in redact(f"data {blob}")
        digest = os.urandom(32).hex()
        assert redact(f"sha {digest}") == f"sha {digest}"


def test_hostile_input_does_not_stall() -> None:
    hostile = "token=" + "a" * 200_000 + " " + "=" * 100_000 + "Bearer " * 20_000
    started = time.monotonic()
    redact(hostile)
    assert time.monotonic() - started < 2.0
