"""llama.cpp's `llama-server` beside pdserve in speculative.py: the same GGUF, its own
n-gram speculation on and off.

    --llama-server PATH   the binary (or --setup-llamacpp DIR, llamacpp_peer.py); without
                          either, speculative.py measures pdserve alone
    --llama-spec-type T   llama.cpp's speculation (default ngram-simple)
    --llama-ngram-n N     its lookup length (default 4)

Two servers run for the whole benchmark, one with speculation and one without (this
version reads no per-request speculation setting: server-schema.cpp compiles those fields
out), each with one slot and as many threads as the machine has cores.

Why ngram-simple: of the draftless kinds this version has, it is prompt lookup. It takes
the last n tokens (the newest sampled one included), finds their most recent earlier
occurrence in the slot's prompt + output, and drafts the m tokens that followed there;
pdserve's proposer (scheduler/ngram.py) does the same with n from 4 down to 2. The others
differ in what they look up: ngram-map-k and ngram-map-k4v count how often a key was
followed by the same m tokens, ngram-mod hashes n-grams into a pool shared by every slot
and chains one token at a time (with lookups of 24 tokens by default), ngram-cache drafts
from n-gram statistics. Its size m is the draft length, so m = pdserve's --spec-k; its
lookup n defaults to pdserve's longest, 4 (llama.cpp's own default, 12, finds fewer
matches). It drafts m whenever it matches; pdserve starts a request at 2 and doubles up
to k as drafts are taken whole.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import llamacpp_peer  # noqa: E402
from test_e2e_pd import free_port, spawn, stop, wait_healthy  # noqa: E402

# each draftless kind's flags: (lookup length, most tokens drafted)
SIZE_FLAGS = {
    "ngram-simple": ("--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m"),
    "ngram-map-k": ("--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m"),
    "ngram-map-k4v": ("--spec-ngram-map-k4v-size-n", "--spec-ngram-map-k4v-size-m"),
    "ngram-mod": ("--spec-ngram-mod-n-match", "--spec-ngram-mod-n-max"),
}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="run llama.cpp's llama-server beside pdserve")  # fmt: skip
    ap.add_argument("--setup-llamacpp", default=None, metavar="DIR",
                    help="build llama-server under DIR first (llamacpp_peer.py), then run it")  # fmt: skip
    ap.add_argument("--gguf", default=None, metavar="FILE",
                    help="the GGUF llama.cpp serves (default: the one --model came from)")  # fmt: skip
    ap.add_argument("--llamacpp-args", default="", help="more llama-server flags")
    ap.add_argument("--llama-spec-type", default="ngram-simple", choices=sorted(SIZE_FLAGS),
                    help="llama.cpp's speculation for its 'on' server")  # fmt: skip
    ap.add_argument("--llama-ngram-n", type=int, default=4,
                    help="llama.cpp's n-gram lookup length")  # fmt: skip
    ap.add_argument("--llama-ctx", type=int, default=4096,
                    help="llama.cpp's context (its one slot): prompt + answer")  # fmt: skip


def wanted(args: argparse.Namespace) -> bool:
    """The llama.cpp side runs only when asked for by name, never from a binary that
    happens to be on PATH."""
    return bool(args.llama_server or args.setup_llamacpp)


def gguf_for(args: argparse.Namespace) -> Path:
    """The file llama.cpp serves: --gguf, else the GGUF pdserve's model folder came from."""
    if args.gguf:
        return Path(args.gguf).resolve()
    from pdserve.checkpoints.resolve import resolve_model
    from pdserve.model.quant_weights import source_gguf

    found = source_gguf(resolve_model(args.model).path)
    if found is None:
        raise SystemExit(f"{args.model} has no GGUF for llama.cpp: pass --gguf FILE")
    return found


def describe(args: argparse.Namespace) -> str:
    binary = llamacpp_peer.find_binary(args)
    version = llamacpp_peer.version(binary) if binary else None
    spec = " ".join(spec_flags(args.llama_spec_type, args.spec_k, args.llama_ngram_n))
    return f"{version or '(version unknown)'}, 'on' with {spec}"


def spec_flags(spec_type: str, k: int, n: int) -> list[str]:
    """llama-server's flags for `spec_type` drafting at most `k` tokens after a lookup of
    `n` (ngram-mod chains one token at a time, so its drafts run 1 to k tokens)."""
    lookup, draft = SIZE_FLAGS[spec_type]
    sizes = [lookup, str(n), draft, str(k)]
    if spec_type == "ngram-mod":  # its default minimum (48) would exceed a short k
        sizes += ["--spec-ngram-mod-n-min", "1"]
    return ["--spec-type", spec_type, *sizes]


def server_argv(binary: Path, gguf: Path, port: int, ctx: int, spec: list[str],
                extra: str = "") -> list[str]:  # fmt: skip
    """One slot, the machine's cores for its decode and prompt batches, `spec` flags."""
    threads = str(os.cpu_count() or 1)
    return [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", threads, "--threads-batch", threads, "--parallel", "1",
            "--ctx-size", str(ctx), "--no-webui", *spec, *shlex.split(extra)]  # fmt: skip


def draft_counts(event: dict) -> tuple[int, int] | None:
    """(drafted, accepted) from a streamed chunk's `timings` (llama-server puts them on
    its last chunk when the request drafted anything), else None."""
    t = event.get("timings")
    if not isinstance(t, dict) or "draft_n" not in t:
        return None
    return int(t["draft_n"]), int(t.get("draft_n_accepted", 0))


@contextmanager
def llama_servers(args: argparse.Namespace, gguf: Path) -> Iterator[dict[bool, str]]:
    """Both servers up and healthy: {speculating: base URL}; stopped however we leave."""
    if args.setup_llamacpp:
        llamacpp_peer.setup_llamacpp(Path(args.setup_llamacpp))
    binary = llamacpp_peer.find_binary(args)
    if binary is None or not binary.is_file():
        raise SystemExit(f"no llama-server at {args.llama_server or args.setup_llamacpp}")
    flags = {False: [], True: spec_flags(args.llama_spec_type, args.spec_k, args.llama_ngram_n)}
    procs, urls = [], {}
    try:
        for on, spec in flags.items():
            port = free_port()
            argv = server_argv(binary, gguf, port, args.llama_ctx, spec, args.llamacpp_args)
            print(f"llama.cpp {'on ' if on else 'off'}: {shlex.join(argv)}", flush=True)
            procs.append(spawn(argv, f"bench-spec-llama-{'on' if on else 'off'}"))
            urls[on] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[on], procs[-1:], timeout_s=300.0)
        yield urls
    finally:
        if procs:
            stop(*procs)
