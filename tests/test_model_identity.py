"""Model identity in the handshake: a prefill and a decode serving different models refuse
each other's rooms at once, naming what differs, and both keep serving their own model.

Two pairs over real ZeroMQ: A = prefill `tiny` + decode `tiny-llama3`, B = prefill
`tiny-llama3` + decode `tiny` (same architecture, vocab and KV layout; only the rope
config differs, so only the config hash tells them apart). Crossing them (A's prefill
with B's decode and B's prefill with A's decode) pairs the same models again.
A first token outside the vocabulary is refused before the decode uses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from engine_pair import Pair, engine_cfg

from pdserve.kvcache.pools import KVLayout
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.transfer.base import SourceEvent
from pdserve.transfer.identity import config_hash, describe_mismatch, model_fingerprint
from tests.conftest import hf_greedy, model_path


@pytest.fixture(scope="module")
def pairs() -> Iterator[tuple[Pair, Pair]]:
    tiny, llama3 = model_path("tiny"), model_path("tiny-llama3")
    a = Pair(engine_cfg(tiny, 512), engine_cfg(llama3, 512))
    b = Pair(engine_cfg(llama3, 512), engine_cfg(tiny, 512))
    yield a, b
    a.close()
    b.close()


def _pump(pairs: tuple[Pair, ...], done, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    assert pairs[0].pump_until(lambda: done() or any(_step(p) for p in pairs[1:]), timeout_s)


def _step(p: Pair) -> bool:
    p.step_prefill()
    p.step_decode()
    return False


def test_mismatched_models_refuse_each_other_naming_the_difference(pairs) -> None:
    a, _ = pairs
    req = a.request("mismatch", 7001, 12)
    a.prefill.add_request(req)
    a.decode.add_request(req)

    def ended() -> bool:
        return bool(a.finished("prefill", "mismatch") and a.finished("decode", "mismatch"))

    _pump((a,), ended, 5.0)
    for side in ("prefill", "decode"):
        [end] = a.finished(side, "mismatch")
        assert end.error and "model mismatch" in end.error and "config" in end.error, end
        assert not end.token_ids, end
    assert a.pump_until(lambda: not a.holdings(), 2.0), a.holdings()


@pytest.mark.parametrize("cross", ["tiny", "tiny-llama3"])
def test_both_engines_serve_their_own_model_afterwards(pairs, cross: str) -> None:
    a, b = pairs
    # tiny: A's prefill with B's decode; tiny-llama3: B's prefill with A's decode
    prefill, decode = (a, b) if cross == "tiny" else (b, a)
    req = prefill.request(f"own-{cross}", 7100 + len(cross), 12, max_tokens=5)
    prefill.prefill.add_request(req)
    decode.decode.add_request(req)
    _pump((a, b), lambda: bool(decode.finished("decode", req.rid)))
    [end] = decode.finished("decode", req.rid)
    assert end.error is None, end
    tokens = [t for e in decode.events["decode", req.rid] for t in e.token_ids]
    assert tokens == hf_greedy(model_path(cross), list(req.input_ids), 5)


def test_fingerprint_covers_every_computation_field_but_not_eos() -> None:
    from pdserve.model.arch.registry import load_arch

    arch = load_arch(model_path("tiny"))
    layout = KVLayout(arch.num_layers, arch.num_kv_heads, arch.head_dim, "float32", 16)
    base = model_fingerprint(arch, layout)
    assert model_fingerprint(dataclasses.replace(arch, eos_token_ids=(1, 2)), layout) == base
    for f in dataclasses.fields(arch):
        if f.name in ("eos_token_ids", "torch_dtype"):
            continue
        value = getattr(arch, f.name)
        changed = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v * 2,
                   str: lambda v: v + "x"}.get(type(value), lambda v: {"x": 1})(value)  # fmt: skip
        other = model_fingerprint(dataclasses.replace(arch, **{f.name: changed}), layout)
        assert other != base, f.name
    smaller = dataclasses.replace(arch, vocab_size=arch.vocab_size // 2)
    assert config_hash(smaller) != config_hash(arch)
    msg = describe_mismatch(model_fingerprint(smaller, layout), base)
    assert f"vocab: decode {arch.vocab_size // 2}, prefill {arch.vocab_size}" in msg, msg


class _LyingSource:
    """A KVSource whose transfers all 'succeed' with a first token the model does not have."""

    def __init__(self, first_token: int) -> None:
        self.first_token = first_token
        self.pending: list[SourceEvent] = []

    def announce(self, req) -> None:  # type: ignore[no-untyped-def]
        pass

    def expect(self, req, pool, slots) -> None:  # type: ignore[no-untyped-def]
        self.pending.append(SourceEvent(req.rid, True, first_token=self.first_token))

    def cancel(self, req, reason: str) -> None:  # type: ignore[no-untyped-def]
        pass

    def reject(self, req, reason: str) -> None:  # type: ignore[no-untyped-def]
        pass

    def poll(self) -> list[SourceEvent]:
        out, self.pending = self.pending, []
        return out


@pytest.mark.parametrize("first_token", [-1, "vocab", 2**40])
def test_first_token_outside_the_vocabulary_is_refused_before_use(first_token) -> None:  # type: ignore[no-untyped-def]
    cfg = engine_cfg(model_path("tiny"), 512)
    runner = ModelRunner(cfg)
    token = runner.arch.vocab_size if first_token == "vocab" else first_token
    engine = DecodeEngine(cfg, runner, _LyingSource(token))
    params = SamplingParams(max_tokens=3, temperature=0.0)
    engine.add_request(EngineRequest(rid="liar", input_ids=[5, 6, 7], params=params, room=9))
    events = [ev for _ in range(5) for ev in engine.step()]
    engine.drain()
    [end] = [e for e in events if e.finished]
    assert end.error and "outside the vocabulary" in end.error and not end.token_ids, end
    assert runner.req_pool.free_rows == runner.req_pool.total_rows
    assert runner.kv_pool.allocator.free_pages == runner.kv_pool.allocator.total_pages
    engine.close()
