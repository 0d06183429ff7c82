"""`pdserve bench` against a real fake server that streams on a known clock
(first token 50 ms after the server reads the request, then one every 20 ms).
Tolerances are generous: the CI machine has 2 noisy cores. The server never
sends early (each gap is at least its ITL, counted from the previous send), so
TTFT's and ITL's lower bounds are sharp. TPOT's is not: a client stalled at a
stream's first token reads it late and the next ones at once, which shortens
(latency - TTFT) / (n - 1); test_bench_metrics pins the formula exactly.
The upper bounds are loose on purpose: they also hold connection setup and the
client's own scheduling, which a 2-core machine running other jobs stretches by
hundreds of ms. They catch a metric measured from or to the wrong event (a whole
answer is at least TTFT + 3 ITL); the sharp lower bounds catch the rest."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace

import pytest
from fake_stream_server import BREAKDOWN, FakeStreamServer

from pdserve.bench.config import BenchConfig
from pdserve.bench.runner import run_benchmark
from pdserve.cli import main

pytestmark = pytest.mark.timeout(60)

TTFT_MS, ITL_MS = 50.0, 20.0
TTFT_SLACK_MS = 1000.0
ITL_SLACK_MS = 2 * 20.0  # a stalled read makes one gap long and the next short


def config(url: str, backend: str, **kw) -> BenchConfig:
    base = BenchConfig(
        base_url=url,
        backend=backend,
        num_prompts=12,
        random_input_len=(4, 12),
        random_output_len=(4, 9),
        max_concurrency=6,
        disable_progress=True,
        timeout=10.0,
    )
    return replace(base, **kw)


def assert_clock(m) -> None:
    assert TTFT_MS - 2 <= m.ttft_ms.median <= TTFT_MS + TTFT_SLACK_MS
    assert ITL_MS - 5 <= m.itl_ms.median <= ITL_MS + ITL_SLACK_MS
    assert ITL_MS - 10 <= m.tpot_ms.mean <= ITL_MS + ITL_SLACK_MS
    assert m.e2e_ms.median >= TTFT_MS + 3 * ITL_MS - 5  # at least 4 tokens each


@pytest.mark.parametrize("backend", ["native", "openai", "openai-chat"])
@pytest.mark.parametrize("server_counts", [True, False])
def test_timing_and_token_counts_per_backend(backend, server_counts):
    with FakeStreamServer(server_counts=server_counts) as srv:
        res = asyncio.run(run_benchmark(config(srv.url, backend, num_warmup=2)))
        sent = srv.requests
    m = res.metrics
    assert (m.completed, m.failed, m.errors) == (12, 0, {})
    assert len(sent) == 14  # 2 warm-up + 12 measured
    asked = [r.output_len for r in res.records]
    assert [r.output_tokens for r in res.records] == asked  # exact, ignore_eos
    assert m.total_output_tokens == sum(asked)
    assert all(len(r.itl) == r.output_tokens - 1 for r in res.records)
    assert all(r.latency >= r.ttft + sum(r.itl) - 1e-6 for r in res.records)
    assert_clock(m)
    assert m.output_throughput == pytest.approx(sum(asked) / m.duration_s)
    assert res.model == (None if backend == "native" else "fake-model")
    if server_counts:  # the fake server reports the breakdown with its counts
        assert m.ttft_breakdown_ms is not None
        assert m.ttft_breakdown_ms["prefill"].mean == pytest.approx(BREAKDOWN["prefill"] * 1e3)
    else:
        assert m.ttft_breakdown_ms is None


def test_payloads_follow_each_wire_format():
    with FakeStreamServer() as srv:
        cfg = config(srv.url, "native", num_prompts=2, random_tokens_as_ids=True, vocab_size=99)
        asyncio.run(run_benchmark(cfg))
        asyncio.run(run_benchmark(config(srv.url, "openai-chat", num_prompts=1, model="m")))
        native, chat = srv.requests[0], srv.requests[2]
    assert native["stream"] is True and all(0 <= t < 99 for t in native["input_ids"])
    assert native["sampling_params"]["ignore_eos"] is True
    assert 4 <= native["sampling_params"]["max_new_tokens"] <= 9
    assert chat["model"] == "m" and chat["messages"][0]["role"] == "user"
    assert chat["stream_options"] == {"include_usage": True} and chat["temperature"] == 0.0


def test_failures_are_counted_by_reason_and_the_run_completes():
    faults = ["500", "drop", "ok", "500", "error", "ok"]
    with FakeStreamServer(faults=faults) as srv:
        cfg = config(srv.url, "openai", num_prompts=10, max_concurrency=1)
        res = asyncio.run(run_benchmark(cfg))
    m = res.metrics
    assert m.errors == {"http_500": 2, "disconnect": 1, "stream_error": 1}
    assert (m.completed, m.failed) == (6, 4)
    bad = [r for r in res.records if not r.success]
    assert "injected failure" in bad[0].error_detail
    assert [r.output_tokens for r in res.records if r.success] == [
        r.output_len for r in res.records if r.success
    ]
    assert_clock(m)


def test_a_hung_server_times_out_without_stalling_the_others():
    with FakeStreamServer(faults=["hang", "ok", "hang"]) as srv:
        cfg = config(srv.url, "native", num_prompts=5, timeout=0.8, max_concurrency=None)
        res = asyncio.run(run_benchmark(cfg))
    assert res.metrics.errors == {"timeout": 2}
    assert res.metrics.completed == 3
    assert res.metrics.duration_s < 30.0  # the timeout is 10 s per request


def test_connection_refused_is_an_error_not_a_crash():
    with FakeStreamServer() as srv:
        url = srv.url
    res = asyncio.run(run_benchmark(config(url, "native", num_prompts=3)))
    assert res.metrics.errors == {"connect_error": 3}


def test_cli_end_to_end_writes_a_json_line(tmp_path, capsys):
    out = tmp_path / "runs.jsonl"
    with FakeStreamServer() as srv:
        argv = ["bench", "--base-url", srv.url, "--backend", "openai", "--num-prompts", "6",
                "--random-input-len", "5:10", "--random-output-len", "5", "--request-rate", "50",
                "--arrival", "constant", "--max-concurrency", "4", "--slo-ttft-ms", "1000",
                "--slo-tpot-ms", "1000", "--output", str(out), "--details", "--seed", "3"]  # fmt: skip
        assert main(argv) == 0
        rerun = [*argv[:-3], "--disable-progress", "--api-key", "sekret"]
        assert main(rerun) == 0  # appends a second line
    lines = out.read_text().splitlines()
    assert len(lines) == 2
    run = json.loads(lines[0])
    assert run["config"]["request_rate"] == 50.0 and run["config"]["backend"] == "openai"
    assert run["model"] == "fake-model"
    m = run["metrics"]
    assert m["completed"] == 6 and m["total_output_tokens"] == 30
    assert m["slo_attainment"] == 1.0
    assert TTFT_MS - 2 <= m["ttft_ms"]["median"] <= TTFT_MS + TTFT_SLACK_MS
    assert len(run["details"]) == 6 and all(d["output_tokens"] == 5 for d in run["details"])
    assert "details" not in json.loads(lines[1]) and "sekret" not in lines[1]
    printed = capsys.readouterr()
    assert "Output throughput (tok/s)" in printed.out and "TTFT breakdown" in printed.out
    assert "bench [" in printed.err  # the progress bar of the first run


def test_cli_rejects_bad_settings(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    png = tmp_path / "p.png"
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--plot", str(png)]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err and not png.exists()
    assert main(["bench", "--dataset", "sharegpt", "--disable-progress"]) == 2
    assert "--dataset-path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--random-input-len", "9:3"])
