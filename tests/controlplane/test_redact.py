"""The redactor against a corpus of real-shaped secrets and of harmless runner log lines."""

from __future__ import annotations

import base64
import os
import time

import pytest

from fleet_min.controlplane.runners.redact import MARK, redact, redact_lines

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

PGP = """-----BEGIN PGP PRIVATE KEY BLOCK-----

lQOYBGXk3nABCADq7f4wzr9lYh0Ew2m4qPvD1XnR8sT6uV0bG3kJ5mL7oN9pQ2rS
=Ab3d
-----END PGP PRIVATE KEY BLOCK-----"""

# Shapes and names the redactor once missed (issue 17), and the rest of the common kinds.
MORE_SECRETS = [
    # by name, every form
    ("DB_PASS=s3cr3t-Pa55", "s3cr3t-Pa55"),
    ("REDIS_AUTH=fooBarBaz123", "fooBarBaz123"),
    ("mysqladmin -u root password correcthorse", "correcthorse"),
    ("--password hunter2hunter2", "hunter2hunter2"),
    ("--password=hunter2hunter2", "hunter2hunter2"),
    ("run --db-pass 'pa55 word'", "pa55 word"),
    ("--api-key=abc123def456", "abc123def456"),
    ("PGPASSWORD=abc123xyz psql", "abc123xyz"),
    ("MYSQL_PWD=abc123 mysql", "abc123"),
    ('clientSecret: "cl13nt-s3cret"', "cl13nt-s3cret"),
    ("'password' => 'php-s3cret'", "php-s3cret"),
    ('password := "go-s3cret"', "go-s3cret"),
    ("token: abcdef123456", "abcdef123456"),
    ('{"auth": "dXNlcjpwYXNzd29yZA"}', "dXNlcjpwYXNzd29yZA"),
    ("x-api-key: abcdef0123456789", "abcdef0123456789"),
    ("Cookie: session=abc123def456", "abc123def456"),
    ("TWILIO_AUTH_TOKEN=0123456789abcdef0123456789abcdef", "0123456789abcdef0123456789abcdef"),
    ("HEROKU_API_KEY=01234567-89ab-cdef-0123-456789abcdef", "01234567-89ab-cdef-0123"),
    ("SECRET_KEY_BASE=9f8e7d6c5b4a", "9f8e7d6c5b4a"),
    ("https://example.com/api?user=me&access_token=q1w2e3r4t5", "q1w2e3r4t5"),
    ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=Zm9vYmFyYmF6cXV4MTIz==;"
     "EndpointSuffix=core.windows.net", "Zm9vYmFyYmF6cXV4MTIz"),
    ("https://acct.blob.core.windows.net/c/b?sv=2020-08-04&sig=abcDEF123%2Bxyz&se=2030",
     "abcDEF123%2Bxyz"),
    # by shape
    ("charge with sk_live_4eC39HqLyjWDarjtT1zdp7dc", "sk_live_4eC39HqLyjWDarjtT1zdp7dc"),
    ("sk_test_51H8abcdefghijklmnop in tests", "sk_test_51H8abcdefghijklmnop"),
    ("restricted rk_live_51H8abcdefghijklmnopqr", "rk_live_51H8abcdefghijklmnopqr"),
    ("webhook whsec_abcdefghijklmnopqrstuvwxyz012345", "whsec_abcdefghijklmnopqrstuvwxyz012345"),
    ("notify https://hooks.slack.com/services/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",
     "q1W2e3R4t5Y6u7I8o9P0a1S2"),
    ("post to https://discord.com/api/webhooks/123456789012345678/AbCdEf-GhIjKl_MnOpQr",
     "AbCdEf-GhIjKl_MnOpQr"),
    ("maps AIzaSyDaGmWKa4JsXZ-HjGw7ISLn_3namBGewQe", "AIzaSyDaGmWKa4JsXZ-HjGw7ISLn_3namBGewQe"),
    ("temporary ASIAY34FZKBOKMUTVV7A id", "ASIAY34FZKBOKMUTVV7A"),
    ("xoxp-123456789012-123456789012-abcdef", "xoxp-123456789012"),
    ("xoxa-2-123456789012-abcdef0123", "xoxa-2-123456789012"),
    ("xoxr-123456789012-abcdefghijkl", "xoxr-123456789012"),
    ("//registry.npmjs.org/:_authToken=npm_abcdefghijklmnopqrstuvwxyz0123456789",
     "npm_abcdefghijklmnopqrstuvwxyz0123456789"),
    ("gitlab glpat-abcdefghij0123456789 used", "glpat-abcdefghij0123456789"),
    ("runner glrt-abcdefghij0123456789xy", "glrt-abcdefghij0123456789xy"),
    ("twilio SK0123456789abcdef0123456789abcdef", "SK0123456789abcdef0123456789abcdef"),
    ("SG.abcdefghijklmnopqrstuv.abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQ sent",
     "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQ"),
    ("heroku HRKU-abcdefghijklmnopqrstuvwxyz0123456789", "HRKU-abcdefghijklmnopqrstuvwxyz"),
    ("docker dckr_pat_abcdefghijklmnopqrstuvwx", "dckr_pat_abcdefghijklmnopqrstuvwx"),
    ("pypi-AgEIcHlwaS5vcmcCJGFiY2RlZmdoLWlqa2wtbW5vcC1xcnN0LXV2d3h5ejAxMjM0NQ upload",
     "pypi-AgEIcHlwaS5vcmcCJGFiY2RlZmdo"),
    ("vault hvs.CAESIJabcdefghijklmnopqrstuvwxyz0123", "hvs.CAESIJabcdefghijklmnopqrstuvwxyz"),
    ("do dop_v1_" + "0123456789abcdef" * 4, "0123456789abcdef" * 4),
    ("shopify shpat_0123456789abcdef0123456789abcdef", "shpat_0123456789abcdef0123456789abcdef"),
    ("openai sk-proj-abcdefghijklmnopqrstuvwxyz0123", "sk-proj-abcdefghijklmnopqrstuvwxyz"),
    ("Proxy-Authorization: Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpwYXNzd29yZA=="),
    ("REDIS_URL=redis://:hunter2hunter2@cache:6379/0", "hunter2hunter2"),
    ("postgres://app:s3cretpw@db.internal/app", "s3cretpw"),
    ("ghs_abcdefghijABCDEFGHIJ0123456789klmn install token",
     "ghs_abcdefghijABCDEFGHIJ0123456789klmn"),
]

KEY_BLOCKS = [
    PGP,
    "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU\n"
    "-----END OPENSSH PRIVATE KEY-----",
    "-----BEGIN EC PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU\n-----END EC PRIVATE KEY-----",
    "-----BEGIN PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU\n-----END PRIVATE KEY-----",
    "-----BEGIN ENCRYPTED PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU\n"
    "-----END ENCRYPTED PRIVATE KEY-----",
    "-----BEGIN DSA PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU\n"
    "-----END DSA PRIVATE KEY-----",
    "---- BEGIN SSH2 ENCRYPTED PRIVATE KEY ----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU\n"
    "---- END SSH2 ENCRYPTED PRIVATE KEY ----",
    '{"private_key": "-----BEGIN PRIVATE KEY-----\\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU\\n'
    '-----END PRIVATE KEY-----\\n"}',
]

# Lines that name a secret word but carry no secret: they must come out unchanged.
MORE_HARMLESS = [
    "passed 3 tests",
    "token count: 512",
    "keyboard layout: us",
    "keyboard=us",
    "PWD=/home/runner/work/app/app",
    "OLDPWD=/home/runner",
    "Cache restored from key: npm-Linux-x64-1f2e3d4c",
    "max_tokens=512",
    "prompt_tokens: 512, completion_tokens: 128",
    "the token expired, requesting a new one",
    "Author: Jane Doe",
    "tokenizer: bpe",
    "pass: 12 fail: 0",
    "TOKEN_FILE=/etc/fleet/token",
    "FLEET_COORDINATOR_TOKEN_FILE=/var/lib/fleet/coordinator-token",
    "auth_type: oauth",
    "Password for 'https://github.com':",
    "Secret scanning: enabled",
    "monkey=banana",
    "key_count=3",
    "tokens used: 4096",
    "password: ${{ secrets.DB_PASSWORD }}",
    "token: ******",
    "authorized_keys updated",
    "bypass=true",
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


@pytest.mark.parametrize("line, secret", MORE_SECRETS)
def test_more_secret_shapes_and_names_do_not_survive(line: str, secret: str) -> None:
    out = redact(line)
    assert secret not in out, out
    assert MARK in out


@pytest.mark.parametrize("block", KEY_BLOCKS)
def test_private_key_blocks_of_every_kind_are_removed(block: str) -> None:
    out = redact(f"before\n{block}\nafter")
    assert "b3BlbnNzaC1rZXktdjEAAAAABG5vbmU" not in out and "lQOYBGXk3n" not in out, out
    assert out.startswith("before\n") and out.endswith("\nafter")


def test_a_bare_password_argument_is_redacted() -> None:
    assert redact("password x") == f"password {MARK}"
    assert redact("--password x") == f"--password {MARK}"
    assert redact("--password=x") == f"--password={MARK}"


@pytest.mark.parametrize("line", HARMLESS + MORE_HARMLESS)
def test_harmless_lines_are_untouched(line: str) -> None:
    assert redact(line) == line


def test_a_value_after_a_harmless_key_is_still_searched() -> None:
    assert redact("url=https://x.example/cb?token=abc123def") == f"url=https://x.example/cb?token={MARK}"


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


# Forms a review found the redactor missing in real runner logs and files; each line carries
# the secret S, which must not survive (nor any of it).
S = "Zq5e1c9b0d7a"
MISSED_FORMS = [
    # JSON inside a JSON string: the key's closing quote comes after a backslash.
    r'payload {\"password\":\"<S>\"}',
    r'CONFIG_JSON={\"password\":\"<S>\"}',
    r'{"msg": "{\"api_key\": \"<S>\", \"n\": 1}"}',
    # A coloured key: the escapes around it hid it (the key seen was `0m`).
    "\x1b[33mDB_PASSWORD\x1b[0m=<S>",
    "\x1b[1;31mtoken\x1b[0m: <S>",
    "DB_PASSWORD=\x1b[2m<S>\x1b[0m",
    # ... and as a JSON log or a shell writes the escape.
    "\\u001b[33mDB_PASSWORD\\u001b[0m=<S>",
    "\\x1b[33mDB_PASSWORD\\x1b[0m=<S>",
    # An environment listing, tab- or space-separated: a variable's name, then its value.
    "GITHUB_TOKEN\t<S>",
    "X_TOKEN <S>",
    "AWS_SECRET_ACCESS_KEY    <S>",
    "PGPASSWORD\t<S>",
    # A quoted value cut by the end of the line (or of a tail).
    'DEPLOY_SECRET="<S>',
    "DEPLOY_SECRET='<S>",
    'DEPLOY_SECRET="<S>\nnext line',
    # A URL-encoded query, as a redirect or a log of a URL carries it.
    "redirect=https%3A%2F%2Fx%2Fcb%3Faccess_token%3D<S>",
    "next=%2Flogin%3Fuser%3Dme%26password%3D<S>",
    # JSON and Python keys `pass` (only a bare `pass:` is prose or a tally).
    '{"pass":"<S>"}',
    "{'pass': '<S>'}",
]


@pytest.mark.parametrize("form", MISSED_FORMS)
def test_forms_once_missed_are_redacted(form: str) -> None:
    out = redact(form.replace("<S>", S))
    assert S[2:] not in out and MARK in out, repr(out)


def test_what_surrounds_a_redacted_value_is_kept() -> None:
    """The escapes, quotes and the rest of the line stay as they were (the escapes are shown
    as escapes later, by printable())."""
    for form, redacted in [
            (r'x {\"password\":\"<S>\", \"n\": 1}', r'x {\"password\":\"<S>\", \"n\": 1}'),
            ("\x1b[33mDB_PASSWORD\x1b[0m=<S>\x1b[0m done",
             "\x1b[33mDB_PASSWORD\x1b[0m=<S>\x1b[0m done"),
            ("GITHUB_TOKEN\t<S>\nHOME\t/home/runner", "GITHUB_TOKEN\t<S>\nHOME\t/home/runner"),
            ('DEPLOY_SECRET="<S>\nA=1', 'DEPLOY_SECRET="<S>"\nA=1'),
            ("cb%3Faccess_token%3D<S>", "cb%3Faccess_token%3D<S>")]:
        assert redact(form.replace("<S>", S)) == redacted.replace("<S>", MARK)


# Lines near those forms that carry no secret: they must come out unchanged.
NEAR_MISSES = [
    '{"pass": 12, "fail": 0}',
    '{"pass": 12}',
    r'{\"pass\": 3, \"fail\": 0}',
    "GITHUB_TOKEN Permissions",
    "##[group]GITHUB_TOKEN Permissions",
    "GITHUB_TOKEN is set",
    "API_KEY not set",
    "PRIMARY KEY constraint failed",
    "TOKEN_FILE /etc/fleet/token",
    "HOME\t/home/runner",
    "PATH\t/usr/bin:/bin",
    "INFO Worker started",
    "\x1b[32mPASS\x1b[0m test_login (0.2 s)",
    "\x1b[33mtoken\x1b[0m count: 512",
    "next=%2Fhome%3Ftab%3Dsettings",
    'echo "done',
]


@pytest.mark.parametrize("line", NEAR_MISSES)
def test_lines_near_the_new_forms_are_untouched(line: str) -> None:
    assert redact(line) == line


@pytest.mark.timeout(20)
@pytest.mark.parametrize("line", [
    r'\"' * 40000, r'\"a\":' * 20000, r'\"password\":\"' * 10000, "A_" * 40000 + "a x",
    "TOKEN " * 20000, "GITHUB_TOKEN\t" * 20000, "a%3D" * 30000, "token%3D" * 20000,
    "\x1b[0m" * 20000, "\x1b[0mtoken\x1b[0m=" * 10000, "\\u001b[" * 20000,
    'password="' + "x" * 200_000, "password='" * 20000, ('token="' + "\\a" * 10) * 4000])
def test_the_new_forms_stay_linear(line: str) -> None:
    started = time.monotonic()
    assert len(redact(line)) > 0
    assert time.monotonic() - started < 2.0
