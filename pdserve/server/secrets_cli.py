"""`pdserve secrets`: a fresh API key and CURVE keypair for one deployment, printed
where a deployment reads them.

    eval "$(pdserve secrets)"                       # shell: the three PDSERVE_* variables
    pdserve secrets --k8s | kubectl apply -f -      # Kubernetes: the Secret deploy/k8s reads

The API key guards every HTTP route but /health; the CURVE keypair is the cluster key
of the KV channel (transfer/curve.py): every prefill and decode of the deployment
holds the same one. Running it again makes new ones (a rotation: apply, then restart
the pods).
"""

from __future__ import annotations

import argparse
import json
import secrets
import shlex

import zmq

from pdserve.envs import ENV

K8S_SECRET = "pdserve-secrets"  # the name deploy/k8s refers to
K8S_KEYS = {"api-key": ENV.API_KEY, "curve-public": ENV.CURVE_PUBLIC, "curve-secret": ENV.CURVE_SECRET}  # fmt: skip


def make() -> dict[str, str]:
    """{PDSERVE_API_KEY, PDSERVE_CURVE_PUBLIC, PDSERVE_CURVE_SECRET}: fresh, from the OS's CSPRNG."""
    public, secret = zmq.curve_keypair()
    return {
        ENV.API_KEY.name: secrets.token_urlsafe(32),
        ENV.CURVE_PUBLIC.name: public.decode(),
        ENV.CURVE_SECRET.name: secret.decode(),
    }


def shell_lines(values: dict[str, str]) -> str:
    # NOTE: quoted: Z85 uses shell characters ($ & < > ( ) ! # ...)
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in values.items())


def k8s_secret(values: dict[str, str], namespace: str) -> str:
    """A Secret manifest (YAML; each value a JSON string, which YAML reads as is)."""
    data = "".join(f"  {key}: {json.dumps(values[var.name])}\n" for key, var in K8S_KEYS.items())
    return (
        "apiVersion: v1\nkind: Secret\n"
        f"metadata:\n  name: {K8S_SECRET}\n  namespace: {namespace}\n"
        "  labels: {app.kubernetes.io/name: pdserve}\n"
        f"type: Opaque\nstringData:\n{data}"
    )


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "secrets",
        help="print a fresh API key and CURVE keypair (shell exports, or a Kubernetes Secret)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--k8s", action="store_true", help=f"a Secret named {K8S_SECRET} instead")
    p.add_argument("--namespace", default="pdserve", help="the Secret's namespace (--k8s)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    values = make()
    print(k8s_secret(values, args.namespace) if args.k8s else shell_lines(values), end="")
    return 0
