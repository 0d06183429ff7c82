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

import threading

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from pdserve.envs import ENV
from pdserve.transfer.zmq_io import CurveKeys, context

_lock = threading.Lock()
_auth: ThreadAuthenticator | None = None
_allowed: set[bytes] = set()


def load_keys(secret_file: str | None = None) -> CurveKeys | None:
    """The cluster keypair from `secret_file`, else from the environment, else None (off)."""
    if secret_file:
        public, secret = zmq.auth.load_certificate(secret_file)
        if secret is None:
            raise ValueError(f"{secret_file} holds no secret key")
        return CurveKeys(public, secret)
    env_public, env_secret = ENV.CURVE_PUBLIC.get(), ENV.CURVE_SECRET.get()
    if not env_public and not env_secret:
        return None
    if not (env_public and env_secret):
        raise ValueError(
            f"set both {ENV.CURVE_PUBLIC.name} and {ENV.CURVE_SECRET.name}, or neither"
        )
    return CurveKeys(env_public.encode(), env_secret.encode())


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
