"""A bad CURVE key fails at load with the variable or file and the problem named."""

from __future__ import annotations

import pytest
import zmq
import zmq.auth

from pdserve.envs import ENV
from pdserve.transfer.curve import CurveKeyError, load_keys

ENV_PUBLIC, ENV_SECRET = ENV.CURVE_PUBLIC.name, ENV.CURVE_SECRET.name


@pytest.fixture
def keypair() -> tuple[str, str]:
    pub, sec = zmq.curve_keypair()
    return pub.decode(), sec.decode()


def set_env(monkeypatch, public: str, secret: str) -> None:
    monkeypatch.setenv(ENV_PUBLIC, public)
    monkeypatch.setenv(ENV_SECRET, secret)


def test_good_keys_load(monkeypatch, keypair):
    set_env(monkeypatch, *keypair)
    keys = load_keys()
    assert keys is not None and keys.public == keypair[0].encode()


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda pub, sec: (pub[:-1], sec), f"{ENV_PUBLIC}: a CURVE key is 40 Z85 characters, got 39"),
        (lambda pub, sec: (pub, sec + "x"), f"{ENV_SECRET}: a CURVE key is 40 Z85 characters, got 41"),
        (lambda pub, sec: ('"' * 40, sec), f"{ENV_PUBLIC}: not Z85 text"),
        (lambda pub, sec: ("${PDSERVE_CURVE_PUBLIC:-}", sec), f"{ENV_PUBLIC}: a CURVE key is 40"),
        (lambda pub, sec: (zmq.curve_keypair()[0].decode(), sec), "not the secret key's public half"),
    ],
)  # fmt: skip
def test_bad_env_keys_are_named(monkeypatch, keypair, mangle, message):
    set_env(monkeypatch, *mangle(*keypair))
    with pytest.raises(CurveKeyError, match=message.replace("$", r"\$").replace("{", r"\{")):
        load_keys()


def test_one_of_two_env_keys(monkeypatch, keypair):
    monkeypatch.setenv(ENV_PUBLIC, keypair[0])
    monkeypatch.delenv(ENV_SECRET, raising=False)
    with pytest.raises(ValueError, match="set both"):
        load_keys()


def test_key_files(tmp_path):
    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "cluster")
    assert load_keys(secret_file) is not None
    with pytest.raises(CurveKeyError, match="no such file"):
        load_keys(str(tmp_path / "missing.key_secret"))
    with pytest.raises(CurveKeyError, match="holds no secret key"):
        load_keys(public_file)
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text("this is not a certificate\n")
    with pytest.raises(CurveKeyError, match=f"CURVE key file {garbage}"):
        load_keys(str(garbage))
    short = tmp_path / "short.key_secret"
    text = open(secret_file).read()
    short.write_text(text.replace('secret-key = "', 'secret-key = "abc', 1))
    with pytest.raises(CurveKeyError, match="secret-key: a CURVE key is 40 Z85 characters"):
        load_keys(str(short))
