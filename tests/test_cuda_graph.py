"""The decode forward replayed per batch-size bucket (model/cuda_graph.py).

On a CPU there is no graph to capture, but everything around it is the same: the
static buffers, the bucket a step goes to, the padding of the entries past the step's
batch (and of those a larger step left behind). The stand-in "replay" runs the forward
over the static buffers, so greedy tokens through it, with the batch shrinking and
growing across buckets, must still equal transformers'. On CUDA (gpu_check.sh) the
same workload runs with graphs captured, and with them off, and the tokens agree.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.model import cuda_graph
from pdserve.model.cuda_graph import GraphedDecode, buckets
from pdserve.model.runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.handoff import InProcessHandoff
from tests import test_forward_sync_guard as guard
from tests.conftest import hf_greedy

ROWS = 5  # buckets 1, 2, 4, 5: a step of 3 pads one entry, a step of 5 none


def test_buckets_cover_every_batch_size() -> None:
    for m in (1, 3, 5, 8, 9, 64, 100, 300):
        sizes = buckets(m)
        assert sizes == sorted(set(sizes)) and sizes[-1] == m and sizes[0] == 1
        for n in range(1, m + 1):  # the bucket a step of n goes to wastes under half of it
            b = next(s for s in sizes if s >= n)
            assert b < 2 * n or b <= 2, (m, n, b)


def _workload(seed: int = 3) -> list[tuple[list[int], int]]:
    """Prompts with different output lengths: the running batch shrinks step by step,
    and new requests join in the rows others leave."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 4096) for _ in range(rng.randint(1, 30))], rng.randint(2, 14))
        for _ in range(9)
    ]


def _engines(model, device: str, graphs: bool) -> tuple[PrefillEngine, DecodeEngine]:
    def cfg(attention: str) -> EngineConfig:
        return EngineConfig(
            model_path=str(model),
            device=device,
            attention_backend=attention,
            cuda_graph=graphs,
            cache=CacheConfig(page_size=4, max_total_tokens=1024, max_context=64),
            scheduler=SchedulerConfig(max_running_requests=ROWS),
        )

    # NOTE: the decode's forward thread and the prefill (this thread) would both run
    # Triton kernels, and the CPU's Triton interpreter is not thread-safe: the prefill
    # keeps the torch backend there ("auto" is Triton on CUDA)
    handoff = InProcessHandoff()
    prefill_runner = ModelRunner(cfg("auto"))
    prefill = PrefillEngine(cfg("auto"), prefill_runner, handoff.sink)
    dec_cfg = cfg("triton")
    decode = DecodeEngine(dec_cfg, ModelRunner(dec_cfg, model=prefill_runner.model), handoff.source)
    return prefill, decode


def _generate(prefill: PrefillEngine, decode: DecodeEngine, work) -> dict[str, list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
    return guard._generate(prefill, decode, [p for p, _ in work], params)


def _count_replays(graphed: GraphedDecode) -> list[tuple[int, int]]:
    """(step's batch size, bucket) of every replay from now on."""
    seen: list[tuple[int, int]] = []
    for g in graphed.graphs:
        plain = g.replay

        def replay(plain=plain, size=g.size) -> None:
            seen.append((int(graphed.static.seq_lens[:size].gt(1).sum()), size))
            plain()

        g.replay = replay
    return seen


def _check(model, prefill, decode, work) -> list[tuple[int, int]]:
    graphed = decode.runner.graphed
    assert graphed is not None
    seen = _count_replays(graphed)
    tokens = _generate(prefill, decode, work)
    for i, (prompt, n) in enumerate(work):
        assert tokens[str(i)] == hf_greedy(model, prompt, n), f"request {i}"
    stats = decode.stats()
    assert stats["free_rows"] == stats["total_rows"]
    assert stats["free_kv_pages"] == stats["total_kv_pages"]
    return seen


# The stand-in runs the Triton attention on CPU tensors, which only the interpreter takes:
# pdserve.kernels turns it on where no GPU is (on a GPU the CUDA test below runs instead).
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU stand-in: Triton runs compiled here, not interpreted"
)


def _stand_in(model) -> tuple[PrefillEngine, DecodeEngine]:
    """CPU engines whose decode goes through the buckets with the eager stand-in replay."""
    prefill, decode = _engines(model, "cpu", graphs=False)
    runner = decode.runner
    assert runner.graphed is None  # nothing is captured off CUDA
    runner.graphed = GraphedDecode.capture(
        lambda batch: runner.model.forward(batch, runner.attn), runner.attn, ROWS,
        torch.device("cpu"),
    )  # fmt: skip
    return prefill, decode


@cpu_only
def test_bucketed_decode_matches_transformers_on_cpu(tiny_model) -> None:
    prefill, decode = _stand_in(tiny_model)
    try:
        seen = _check(tiny_model, prefill, decode, _workload())
    finally:
        decode.close()
    assert seen, "no step went through the buckets"
    assert any(n < b for n, b in seen), f"no padded step: {seen}"
    assert {b for _, b in seen} >= {4, 5}, seen


@cpu_only
def test_the_static_plan_is_what_the_kernels_read(tiny_model, monkeypatch) -> None:
    """The guard on the test above: with the steps' sequence lengths kept out of the
    static buffers (every entry attends to its first position only), tokens go wrong."""
    plain = cuda_graph._Static.load

    def without_lens(self, batch, seq_lens) -> None:
        plain(self, batch, torch.ones_like(seq_lens))

    monkeypatch.setattr(cuda_graph._Static, "load", without_lens)
    prefill, decode = _stand_in(tiny_model)
    work = _workload()
    try:
        tokens = _generate(prefill, decode, work)
    finally:
        decode.close()
    assert any(tokens[str(i)] != hf_greedy(tiny_model, p, n) for i, (p, n) in enumerate(work))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graphs are captured")
def test_cuda_graphs_match_transformers_and_the_eager_forward(tiny_model) -> None:
    work = _workload()
    prefill, decode = _engines(tiny_model, "cuda", graphs=True)
    try:
        seen = _check(tiny_model, prefill, decode, work)
    finally:
        decode.close()
    assert any(n < b for n, b in seen), f"no padded step: {seen}"
    prefill, decode = _engines(tiny_model, "cuda", graphs=False)
    assert decode.runner.graphed is None
    try:
        eager = _generate(prefill, decode, work)
    finally:
        decode.close()
    assert eager == {str(i): hf_greedy(tiny_model, p, n) for i, (p, n) in enumerate(work)}
