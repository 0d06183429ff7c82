"""The bench harness's math on synthetic records: exact values, no server."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest

from pdserve.bench.backends import RequestRecord, _count_ids, _Stream
from pdserve.bench.config import BenchConfig
from pdserve.bench.datasets import PromptMaker, build_requests
from pdserve.bench.metrics import Dist, compute_metrics, meets_slo, percentile
from pdserve.bench.plot import token_rate
from pdserve.bench.runner import arrival_offsets


def rec(ttft: float, itl: list[float], out: int, prompt: int = 10, **kw) -> RequestRecord:
    latency = ttft + sum(itl)
    return RequestRecord(prompt, out, ttft=ttft, itl=itl, latency=latency, output_tokens=out, **kw)


def test_percentile_interpolates_between_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # pos 2.7
    assert percentile([7.0], 99) == 7.0
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_dist_is_in_ms_and_empty_is_zero():
    d = Dist.of_seconds([0.010, 0.020, 0.030])
    assert (d.mean, d.median, d.count) == (pytest.approx(20.0), pytest.approx(20.0), 3)
    assert d.p90 == pytest.approx(28.0)
    assert Dist.of_seconds([]) == Dist()


def test_tpot_and_latency_of_a_record():
    r = rec(0.05, [0.02, 0.02, 0.04], out=4)
    assert r.latency == pytest.approx(0.13)
    assert r.tpot == pytest.approx((0.13 - 0.05) / 3)
    assert rec(0.05, [], out=1).tpot is None


def test_metrics_throughput_latency_and_errors():
    records = [
        rec(0.1, [0.02, 0.04], out=3, prompt=10),  # e2e 0.16
        rec(0.3, [0.06], out=2, prompt=20),  # e2e 0.36
        RequestRecord(30, 5, error="http_500"),
        RequestRecord(40, 5, error="timeout"),
        RequestRecord(40, 5, error="http_500"),
    ]
    m = compute_metrics(records, duration_s=2.0)
    assert (m.completed, m.failed) == (2, 3)
    assert m.errors == {"http_500": 2, "timeout": 1}
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 5)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.input_throughput == pytest.approx(15.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.ttft_ms.median == pytest.approx(200.0)
    assert m.ttft_ms.p99 == pytest.approx(100 + 200 * 0.99)
    assert m.itl_ms.count == 3 and m.itl_ms.mean == pytest.approx(40.0)
    assert m.tpot_ms.mean == pytest.approx((30.0 + 60.0) / 2)  # (0.06/2, 0.06/1)
    assert m.e2e_ms.mean == pytest.approx(260.0)
    assert m.goodput is None and m.slo_attainment is None and m.ttft_breakdown_ms is None


def test_goodput_and_slo_attainment():
    records = [
        rec(0.05, [0.01] * 4, out=5),  # ttft 50, tpot 10: good
        rec(0.15, [0.01] * 4, out=5),  # ttft 150: misses ttft
        rec(0.05, [0.05] * 4, out=5),  # tpot 50: misses tpot
        rec(0.08, [], out=1),  # no tpot: good on ttft alone
        RequestRecord(10, 5, error="disconnect"),  # failures never count as good
    ]
    m = compute_metrics(records, duration_s=4.0, slo_ttft_ms=100, slo_tpot_ms=20)
    assert m.goodput == pytest.approx(2 / 4.0)
    assert m.slo_attainment == pytest.approx(2 / 5)
    only_ttft = compute_metrics(records, duration_s=4.0, slo_ttft_ms=100)
    assert only_ttft.slo_attainment == pytest.approx(3 / 5)
    assert not meets_slo(records[4], None, None)
    assert meets_slo(records[1], None, 20)


def test_ttft_breakdown_means_and_medians():
    b1 = {"queue": 0.001, "prefill": 0.02, "kv_transfer": 0.01, "decode_admission": 0.002}
    b2 = {"queue": 0.003, "prefill": 0.04, "kv_transfer": 0.03, "decode_admission": 0.004}
    records = [rec(0.1, [], 1, ttft_breakdown=b1), rec(0.1, [], 1, ttft_breakdown=b2)]
    records.append(rec(0.1, [], 1))  # reported nothing: not averaged in
    bd = compute_metrics(records, 1.0).ttft_breakdown_ms
    assert bd is not None
    assert list(bd) == ["queue", "prefill", "kv_transfer", "decode_admission"]
    assert bd["prefill"].mean == pytest.approx(30.0)
    assert bd["kv_transfer"].median == pytest.approx(20.0)
    assert bd["queue"].count == 2


def test_arrivals_are_seeded_and_have_the_right_rate():
    a = arrival_offsets(2000, 10.0, "poisson", random.Random(3))
    assert a == arrival_offsets(2000, 10.0, "poisson", random.Random(3))
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    assert arrival_offsets(4, 4.0, "constant", random.Random(0)) == [0.0, 0.25, 0.5, 0.75]
    assert arrival_offsets(3, math.inf, "poisson", random.Random(0)) == [0.0] * 3


def test_output_ids_counted_cumulative_or_incremental():
    inc = _Stream()
    for ids in ([5], [5], [7, 8], [9]):
        _count_ids(ids, inc)
    assert inc.ids_tokens == 5
    cum = _Stream()
    for ids in ([5], [5, 6], [5, 6, 7], [5, 6, 7]):  # last: a repeated final chunk
        _count_ids(ids, cum)
    assert cum.ids_tokens == 3


def test_token_rate_bins_tokens_by_arrival_time():
    r1 = rec(0.5, [1.0, 1.0], out=3, start=0.0)  # tokens at 0.5, 1.5, 2.5
    r2 = rec(0.2, [], out=4, start=1.0)  # one chunk of 4 tokens at 1.2
    r3 = RequestRecord(10, 5, error="timeout", start=0.1)
    assert token_rate([r1, r2, r3], 1.0) == [(0.0, 1.0), (1.0, 5.0), (2.0, 1.0)]


def test_datasets_are_seeded_and_sized(tmp_path):
    cfg = BenchConfig(num_prompts=6, num_warmup=2, random_input_len=(3, 5), seed=7)
    reqs = build_requests(cfg)
    assert reqs == build_requests(cfg) and len(reqs) == 8
    assert all(3 <= r.prompt_len <= 5 and len(str(r.prompt).split()) == r.prompt_len for r in reqs)
    ids = build_requests(BenchConfig(num_prompts=4, random_tokens_as_ids=True, vocab_size=50))
    assert all(isinstance(r.prompt, list) and max(r.prompt) < 50 for r in ids)
    sp = BenchConfig(dataset="shared-prefix", num_prompts=6, shared_prefix_groups=2,
                     shared_prefix_len=8, shared_prefix_suffix_len=2)  # fmt: skip
    prefixes = {" ".join(str(r.prompt).split()[:8]) for r in build_requests(sp)}
    assert len(prefixes) == 2
    conv = [
        {"conversations": [{"from": "human", "value": "a b c"}, {"from": "gpt", "value": "x y"}]}
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(conv + [{"conversations": []}]))
    sg = build_requests(BenchConfig(dataset="sharegpt", dataset_path=str(path), num_prompts=3))
    assert [(r.prompt, r.prompt_len, r.output_len) for r in sg] == [("a b c", 3, 2)] * 3


def test_the_harness_imports_no_engine_code():
    code = (
        "import sys, pdserve.bench.cli, pdserve.bench.runner, pdserve.bench.report, "
        "pdserve.bench.plot; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('pdserve.model', "
        "'pdserve.scheduler', 'pdserve.server', 'pdserve.kernels', 'pdserve.transfer'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_tokenizer_prompts_have_exact_token_lengths(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog, then naps in the warm sun"] * 50
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = BenchConfig(num_prompts=20, random_input_len=(5, 40), tokenizer=str(tmp_path), seed=1)
    reqs = build_requests(cfg)
    assert all(isinstance(r.prompt, str) for r in reqs)
    counts = [len(tok.encode(str(r.prompt), add_special_tokens=False).ids) for r in reqs]
    assert counts == [r.prompt_len for r in reqs]  # the recorded length is the true one
    maker = PromptMaker(random.Random(0), str(tmp_path), as_ids=False, vocab=None)
    made = [maker.random(n) for n in range(1, 60)]
    assert [count for _, count in made] == list(range(1, 60))
