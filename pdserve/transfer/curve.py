"""Optional ZeroMQ CURVE on the transfer channels: encryption plus authentication.

One cluster keypair, shared by every prefill and decode of a deployment (a secret
like an API key). Every server socket (the prefill's bootstrap ROUTER, the decode's
data PULL) uses it as its server key, every client connects with it, and a ZAP
authenticator admits only clients proving they hold the cluster secret key. So a
peer without the secret can neither connect nor read the KV.

Keys come from a file made by `zmq.auth.create_certificates` (the `.key_secret`
file holds both) or from the environment:
    PDSERVE_CURVE_PUBLIC, PDSERVE_CURVE_SECRET   Z85 keys (40 characters each)
"""

from __future__ import annotations

import os
import threading

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from pdserve.envs import ENV
from pdserve.transfer.zmq_io import CurveKeys, context

_lock = threading.Lock()
_auth: ThreadAuthenticator | None = None
_allowed: set[bytes] = set()


class CurveKeyError(ValueError):
    """A CURVE key or key file that cannot be used; the message names the problem."""


Z85_KEY_CHARS = 40  # a 32-byte key in Z85 text


def load_keys(secret_file: str | None = None) -> CurveKeys | None:
    """The cluster keypair from `secret_file`, else from the environment, else None (off).

    Raises CurveKeyError naming the file or variable and what is wrong with it, so a
    bad key fails at start rather than as a bare ZMQError at the first bind."""
    if secret_file:
        return _from_file(secret_file)
    env_public, env_secret = ENV.CURVE_PUBLIC.get(), ENV.CURVE_SECRET.get()
    if not env_public and not env_secret:
        return None
    if not (env_public and env_secret):
        raise CurveKeyError(
            f"set both {ENV.CURVE_PUBLIC.name} and {ENV.CURVE_SECRET.name}, or neither"
        )
    public = check_key(env_public.strip().encode(), ENV.CURVE_PUBLIC.name)
    secret = check_key(env_secret.strip().encode(), ENV.CURVE_SECRET.name)
    return _pair(public, secret, f"{ENV.CURVE_PUBLIC.name} and {ENV.CURVE_SECRET.name}")


def _from_file(path: str) -> CurveKeys:
    if not os.path.isfile(path):
        raise CurveKeyError(f"CURVE key file {path}: no such file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CurveKeyError(f"CURVE key file {path}: unreadable ({e})") from e
    if not public:
        raise CurveKeyError(f"CURVE key file {path}: no public-key line")
    if secret is None:
        raise CurveKeyError(
            f"CURVE key file {path}: holds no secret key (use the .key_secret file)"
        )
    where = f"CURVE key file {path}"
    return _pair(
        check_key(public, f"{where} public-key"), check_key(secret, f"{where} secret-key"), where
    )


def check_key(key: bytes, name: str) -> bytes:
    """`key` if it is a Z85 CURVE key (40 characters decoding to 32 bytes), else CurveKeyError."""
    if len(key) != Z85_KEY_CHARS:
        raise CurveKeyError(
            f"{name}: a CURVE key is {Z85_KEY_CHARS} Z85 characters, got {len(key)}"
        )
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, KeyError, TypeError) as e:
        raise CurveKeyError(f"{name}: not Z85 text (a character outside the Z85 alphabet)") from e
    return key


def _pair(public: bytes, secret: bytes, where: str) -> CurveKeys:
    if zmq.curve_public(secret) != public:
        raise CurveKeyError(f"{where}: the public key is not the secret key's public half")
    return CurveKeys(public, secret)


class _Allowed:
    def callback(self, domain: str, key: bytes) -> bool:
        # ZAP hands the client's key in Z85 text or raw 32 bytes, depending on version
        z85 = key if len(key) == 40 else zmq.utils.z85.encode(key)
        return z85 in _allowed


def authorize(keys: CurveKeys) -> None:
    """Start (once per process) the ZAP authenticator and admit clients holding `keys`."""
    global _auth
    with _lock:
        _allowed.add(keys.public)
        if _auth is None:
            _auth = ThreadAuthenticator(context())
            _auth.start()
            _auth.configure_curve_callback("*", _Allowed())
