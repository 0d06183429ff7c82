"""`pdserve up` and `pdserve demo` (the router's own command is in `pdserve.router.cli`;
what they print once ready and `demo`'s question are in demo.py).

`up` runs every server as a child process in its own process group:

    up ─┬─ prefill i  (pdserve prefill --port P_i --bootstrap-port B_i)   ─ its engine
        ├─ decode j   (pdserve decode --port D_j)                         ─ its engine
        └─ router     (pdserve router --prefill http://H:P_i B_i ... --decode http://H:D_j ...)

Once every server answers /health, a server that exits is restarted (same command,
same ports) after a backoff, and the rest serve on: only a signal to `up` (Ctrl-C,
SIGTERM) or a failure at start-up stops the stack (launch_children.supervise).

Invariant: when `up` returns, every child's process group is gone: each server got
SIGTERM (its frontend stops its own engine), what was left of a group once its
leader exited got SIGTERM too, and anything alive after the grace period SIGKILL;
so no server outlives it and its ports are free again.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import types
from collections.abc import Mapping
from typing import Any

from pdserve.config import ROUTER_FAULT_FLAGS, ROUTER_POLICIES, add_router_fault_flags
from pdserve.envs import ENV
from pdserve.server.demo import print_ready, stream_demo
from pdserve.server.launch_children import (
    Child,
    RestartPolicy,
    free_port,
    start,
    stop_all,
    supervise,
    wait_healthy,
)
from pdserve.server.serve_flags import DECODE_ONLY_FLAGS


def worker_argv(
    role: str, model: str, host: str, port: int, bootstrap_port: int | None, extra: list[str]
) -> list[str]:
    """The command line of one prefill or decode server."""
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        role,
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
    ]
    if bootstrap_port is not None:
        argv += ["--bootstrap-port", str(bootstrap_port)]
    return argv + extra


def router_argv(args: argparse.Namespace, prefills: list[Child], decodes: list[Child]) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "router",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--policy",
        args.policy,
    ]
    for flag, (dest, _) in ROUTER_FAULT_FLAGS.items():
        if getattr(args, dest, None) is not None:
            argv += [flag, str(getattr(args, dest))]
    for p in prefills:
        argv += ["--prefill", p.url, str(p.bootstrap_port)]
    for d in decodes:
        argv += ["--decode", d.url]
    if getattr(args, "no_web_ui", False):
        argv.append("--no-web-ui")
    return argv


def _thread_plan(engine_args: list[str], engines: int, state_dir: str) -> list[list[str]]:
    """Each engine's arguments. Unless --num-threads was given, each engine owns its share
    of the host's cores (engines that each use every core slow each other down badly)
    and borrows the shares of idle peers through a core-share file in `state_dir`."""
    if any(a.startswith("--num-threads") for a in engine_args):
        return [engine_args] * engines
    share = max(1, (os.cpu_count() or 1) // max(engines, 1))
    path = os.path.join(state_dir, "core-share")  # made by the engines (kernels/core_share)
    base = [*engine_args, "--num-threads", str(share)]
    return [[*base, "--core-share", f"{path}:{i}:{engines}"] for i in range(engines)]


def split_decode_flags(engine_args: list[str]) -> tuple[list[str], list[str]]:
    """(flags for every server, flags only decodes take: serve_flags.DECODE_ONLY_FLAGS,
    each with its value)."""
    shared: list[str] = []
    decode: list[str] = []
    i = 0
    while i < len(engine_args):
        a = engine_args[i]
        only = a.split("=", 1)[0] in DECODE_ONLY_FLAGS
        takes = 2 if only and "=" not in a else 1  # the flag, and its value unless =VALUE
        (decode if only else shared).extend(engine_args[i : i + takes])
        i += takes
    return shared, decode


# A decode sharing its host with a prefill runs at this niceness: when both compute (and
# the router, the HTTP servers and clients want CPU too) the prefill wins the contended
# core. Its step is on every waiting request's first token, while a decode step that
# runs later delays each stream by a step: first tokens come sooner, tokens/s and TPOT
# stay (compare.py --pdserve-args "--nice 0" against the default, taking turns).
DECODE_NICE = 10


def _decode_nice(engine_args: list[str], prefills: int) -> list[str]:
    """A decode's arguments with --nice DECODE_NICE, when it shares the host's cores with
    a prefill (--core-share) and the user gave no --nice."""
    shared = any(a.startswith("--core-share") for a in engine_args)
    if not shared or prefills == 0 or any(a.startswith("--nice") for a in engine_args):
        return engine_args
    return [*engine_args, "--nice", str(DECODE_NICE)]


def child_env(base: Mapping[str, str], api_key: str | None) -> dict[str, str]:
    """The children's environment: `base`, and the API key. (The engines these servers
    start get their OpenMP policy where every engine gets it: envs.engine_env, in
    server/engine_client.py.)"""
    env = dict(base)
    if api_key:
        env[ENV.API_KEY.name] = api_key
    return env


def plan(args: argparse.Namespace, state_dir: str) -> list[Child]:
    """Children in start order: prefills, decodes, router (stopped in reverse)."""
    model = _prepare_model(args.model)
    shared, decode_only = split_decode_flags(args.engine_args)
    draft = flag_value(decode_only, "--draft-model")
    if draft:  # resolved (converted, built) once here, as --model is, before any server
        try:
            _prepare_model(draft)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"--draft-model {draft}: {e}") from None
    per_engine = _thread_plan(shared, args.num_prefill + args.num_decode, state_dir)
    prefills, decodes = [], []
    for i in range(args.num_prefill):
        port, boot = free_port(args.host), free_port(args.host)
        argv = worker_argv("prefill", model, args.host, port, boot, per_engine[i])
        prefills.append(Child(f"prefill{i}", argv, args.host, port, boot))
    for j in range(args.num_decode):
        port = free_port(args.host)
        engine = _decode_nice(per_engine[args.num_prefill + j], args.num_prefill) + decode_only
        argv = worker_argv("decode", model, args.host, port, None, engine)
        decodes.append(Child(f"decode{j}", argv, args.host, port))
    router = Child("router", router_argv(args, prefills, decodes), args.host, args.port)
    return [*prefills, *decodes, router]


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value `argv` gives `flag` (`--flag V` or `--flag=V`; the last one wins)."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _prepare_model(spec: str | None) -> str:
    """The --model every server gets. It is resolved here first, so a model that is not
    there fails at once, before any server starts, and the servers find a short name or
    a GGUF converted (once, under a lock); they get the spec itself, so they serve it
    under its short name."""
    from pdserve.checkpoints.resolve import DEFAULT_MODEL, resolve_model

    spec = spec or DEFAULT_MODEL
    resolve_model(spec)
    return spec


class _Stop:
    """Set by SIGINT/SIGTERM; `supervise` polls it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def __call__(self) -> bool:
        return self.signum is not None


def run_up(args: argparse.Namespace, after_ready: Any = None) -> int:
    """Start, wait healthy, serve until a signal (0); a child that exits once all were
    healthy is restarted (supervise). A failure at start-up stops everything (1)."""
    from pdserve.edge.listen import bind

    bind(args.host, args.port, "pdserve up").close()  # the router's port, before any child
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per health poll
    stop = _Stop()
    log_dir = _log_dir(args.log_dir)
    try:
        children = plan(args, log_dir)
    except (FileNotFoundError, ValueError) as e:  # a model that cannot be found or served
        print(f"pdserve up: {e}", file=sys.stderr)
        return 1
    env = child_env(os.environ, args.api_key)
    try:
        for c in children:
            start(c, log_dir, env)
        wait_healthy(children, args.startup_timeout, stop)
        if stop():
            return 0
        print_ready(args, children, log_dir)
        if after_ready is not None:
            after_ready(args)
        policy = RestartPolicy(args.restart_backoff, args.restart_backoff_max)
        supervise(children, stop, lambda c: start(c, log_dir, env), policy)
        return 0
    except RuntimeError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 1
    finally:
        stop_all(children, args.grace_period)


def _temp_log_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="pdserve-up-")


def _log_dir(arg: str | None) -> str:
    if not arg:
        return _temp_log_dir()
    os.makedirs(arg, exist_ok=True)
    return arg


# ---- CLI ----------------------------------------------------------------------------------


def _keep_unknown(parser: argparse.ArgumentParser) -> None:
    """Flags `up` does not know go, in order, to every prefill and decode server."""
    plain = parser.parse_known_args

    def parse_known_args(self: Any, args: Any = None, namespace: Any = None) -> Any:
        ns, extra = plain(args, namespace)
        ns.engine_args = [a for a in extra if a != "--"]
        return ns, []

    parser.parse_known_args = types.MethodType(parse_known_args, parser)  # type: ignore[method-assign]


def _add_up(sub: Any, name: str, help_: str, func: Any) -> None:
    p = sub.add_parser(
        name,
        help=help_,
        epilog="Any other flag goes to every prefill and decode server (`pdserve decode "
        "--help` lists them), e.g. --weights quantized|float32, --quant-activations "
        "float|int8 (int8: 8-bit activations and integer dots on a GGUF's blocks, not "
        "equal to the float path; docs/models.md).",
    )
    p.add_argument("--model", default=None,
                   help="Hugging Face folder, FILE.gguf, or a short name: smollm2 (default), "
                   "tiny, bench, ... (random presets)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--policy", choices=ROUTER_POLICIES, default="round_robin")
    p.add_argument(
        "--api-key", default=ENV.API_KEY.get(), help=f"bearer key (else ${ENV.API_KEY.name})"
    )
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")
    p.add_argument("--grace-period", type=float, default=10.0, help="SIGTERM -> SIGKILL, seconds")
    p.add_argument("--restart-backoff", type=float, default=RestartPolicy.first_s,
                   help="seconds before a server that exited is restarted (doubling while it "
                   "keeps exiting)")  # fmt: skip
    p.add_argument("--restart-backoff-max", type=float, default=RestartPolicy.max_s,
                   help="longest wait before a restart, seconds")  # fmt: skip
    p.add_argument("--log-dir", default=None, help="child logs (default: a new temp folder)")
    p.add_argument("--no-web-ui", action="store_true", help="the router serves no web console")
    add_router_fault_flags(p)  # the router's
    _keep_unknown(p)  # any other flag goes to every prefill and decode server
    p.set_defaults(func=func)


def add_cli(sub: Any) -> None:
    _add_up(sub, "up", "start router + prefill + decode servers and wait", run_up)
    _add_up(
        sub,
        "demo",
        "`up`, then ask one question through the chat API and stream the answer",
        lambda a: run_up(a, after_ready=stream_demo),
    )
