"""`pdserve bench`: the command line of the load-test harness."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pdserve.bench.config import ARRIVALS, BACKENDS, DATASETS, BenchConfig

_D = BenchConfig()  # defaults live in the dataclass

_DESCRIPTION = """\
Load-test an LLM server and measure it the way other servers are measured.
Works against any OpenAI-compatible server (pdserve, vLLM, sglang) or a native
/generate endpoint. Prints a summary table; --output appends one JSON line per run.

metrics (successful requests; mean, median, p90, p99):
  TTFT   time from sending a request to its first content chunk
  ITL    gap between successive content chunks
  TPOT   (E2E - TTFT) / (output tokens - 1)
  E2E    time from sending a request to the end of its stream
  throughput: completed requests, input and output tokens per second of run time
  goodput: requests/s that met every --slo-* given; SLO attainment: their share
  TTFT breakdown (router, frontend, queue, prefill_queue, prefill, kv_transfer,
  decode_admission): when the server reports it (pdserve does; `router` only
  behind pdserve's own router).

example:
  pdserve bench --base-url http://127.0.0.1:8000 --backend openai --dataset random \\
      --num-prompts 200 --request-rate 8 --max-concurrency 64 --output runs.jsonl"""


def _length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return a, b


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0 or inf")
    return value


def _fmt_range(r: tuple[int, int]) -> str:
    return f"{r[0]}:{r[1]}"


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="load-test a server (TTFT, ITL, TPOT, throughput, goodput)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target_args(p)
    _add_workload_args(p)
    _add_load_args(p)
    _add_output_args(p)
    p.set_defaults(func=run)


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--base-url",
        metavar="URL",
        default=_D.base_url,
        help="server root URL (default: %(default)s)",
    )
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default=_D.backend,
        help="native: POST /generate (pdserve, sglang); openai: /v1/completions; "
        "openai-chat: /v1/chat/completions (default: %(default)s)",
    )
    g.add_argument(
        "--model", metavar="NAME", default=None, help="model name to send (default: ask /v1/models)"
    )
    g.add_argument(
        "--api-key", metavar="KEY", default=None, help="sent as 'Authorization: Bearer KEY'"
    )
    g.add_argument(
        "--timeout",
        metavar="S",
        type=float,
        default=_D.timeout,
        help="per-request limit in s (default: %(default)s)",
    )


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default=_D.dataset, help="(default: %(default)s)")
    g.add_argument(
        "--dataset-path",
        metavar="FILE",
        default=None,
        help="ShareGPT-format JSON: a list of {conversations: [human, gpt, ...]}; the human "
        "turn is the prompt, the gpt turn's length the output length",
    )
    g.add_argument(
        "--num-prompts",
        metavar="N",
        type=int,
        default=_D.num_prompts,
        help="(default: %(default)s)",
    )
    g.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="folder with a tokenizer.json: exact prompt "
        "lengths in tokens (default: about one token per word)",
    )
    g.add_argument(
        "--random-input-len",
        type=_length_range,
        default=_D.random_input_len,
        metavar="N|MIN:MAX",
        help=f"prompt tokens, uniform in the range (default: {_fmt_range(_D.random_input_len)})",
    )
    g.add_argument(
        "--random-output-len",
        type=_length_range,
        default=_D.random_output_len,
        metavar="N|MIN:MAX",
        help="output tokens (random and shared-prefix; "
        f"sent with ignore_eos) (default: {_fmt_range(_D.random_output_len)})",
    )
    g.add_argument(
        "--random-tokens-as-ids",
        action="store_true",
        help="send prompts as token ids instead of text (not with openai-chat)",
    )
    g.add_argument(
        "--vocab-size",
        metavar="V",
        type=int,
        default=None,
        help="random token ids are drawn below this (default: the tokenizer's, or 1000)",
    )
    g.add_argument(
        "--shared-prefix-groups",
        metavar="G",
        type=int,
        default=_D.shared_prefix_groups,
        help="shared-prefix: number of prefixes G (default: %(default)s)",
    )
    g.add_argument(
        "--shared-prefix-prompts-per-group",
        metavar="P",
        type=int,
        default=None,
        help="shared-prefix: prompts per prefix P (default: num-prompts / G); like every "
        "dataset, it is cycled or cut to --num-prompts",
    )
    g.add_argument(
        "--shared-prefix-len",
        metavar="L",
        type=int,
        default=_D.shared_prefix_len,
        help="shared-prefix: prefix tokens (default: %(default)s)",
    )
    g.add_argument(
        "--shared-prefix-suffix-len",
        metavar="S",
        type=int,
        default=_D.shared_prefix_suffix_len,
        help="shared-prefix: unique suffix tokens (default: %(default)s)",
    )
    g.add_argument(
        "--temperature",
        metavar="T",
        type=float,
        default=_D.temperature,
        help="(default: %(default)s)",
    )
    g.add_argument(
        "--seed",
        metavar="SEED",
        type=int,
        default=_D.seed,
        help="seeds prompts, lengths and arrival times (default: %(default)s)",
    )


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        metavar="R",
        type=_rate,
        default=_D.request_rate,
        help="requests/s; inf sends all at once (default: %(default)s)",
    )
    g.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default=_D.arrival,
        help="gaps between requests: exponential or fixed (default: %(default)s)",
    )
    g.add_argument(
        "--max-concurrency",
        metavar="C",
        type=int,
        default=None,
        help="at most this many requests in flight (default: no limit)",
    )
    g.add_argument(
        "--num-warmup",
        metavar="K",
        type=int,
        default=_D.num_warmup,
        help="requests sent first and left out of the metrics (default: %(default)s)",
    )


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "--slo-ttft-ms", metavar="MS", type=float, default=None, help="TTFT SLO for goodput"
    )
    g.add_argument(
        "--slo-tpot-ms", metavar="MS", type=float, default=None, help="TPOT SLO for goodput"
    )
    g.add_argument(
        "--output", metavar="FILE", default=None, help="append one JSON line per run to this file"
    )
    g.add_argument(
        "--details", action="store_true", help="put per-request records into the JSON line"
    )
    g.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw latency CDFs and output tokens/s over time (needs matplotlib)",
    )
    g.add_argument("--disable-progress", action="store_true", help="no progress bar on stderr")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    names = {f for f in BenchConfig.__dataclass_fields__}
    return BenchConfig(**{k: v for k, v in vars(args).items() if k in names})


def run(args: argparse.Namespace) -> int:
    """Run one benchmark; 0 when at least one request succeeded, 1 when none
    did, 2 on an invalid setting or an unreachable model list."""
    from pdserve.bench.plot import plot_result, require_matplotlib
    from pdserve.bench.report import append_json_line, json_record, summary_table
    from pdserve.bench.runner import run_benchmark

    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    try:
        if args.plot:
            require_matplotlib()  # fail before the run, not after it
        cfg = config_from_args(args)
        result = asyncio.run(run_benchmark(cfg))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    print(summary_table(result))
    if args.output:
        append_json_line(args.output, json_record(result, cfg.details))
    if args.plot:
        plot_result(result, args.plot)
    return 0 if result.metrics.completed else 1
