"""The native decode passes (kernels/native/decode_ops.c through model/ops.NativeOps) compute
what the torch reference computes: norms with and without the residual add, silu * up and
gelu_tanh * up,
the in-place rotation of strided q/k heads, the pool write, and the greedy argmax with
torch's tie and NaN rules. Bad calls raise instead of reading or writing out of bounds,
and a decode engine running them still produces transformers' greedy tokens."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.native import decode_ops, library
from pdserve.model.attention.backends import NativeAttention
from pdserve.model.layers.ops import NativeOps, TorchOps
from pdserve.model.layers.rope import RotaryEmbedding
from pdserve.sampling_params import SamplingParams
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> NativeOps:
    if library.compiler() is None:
        pytest.skip("no C compiler")
    k = decode_ops.decode_ops(tmp_path_factory.mktemp("native"))
    assert k is not None  # plain C: builds wherever a compiler is
    return NativeOps(k)


REF = TorchOps()


@pytest.mark.parametrize(("t", "heads", "d"), [(1, 2, 64), (3, 6, 128), (17, 3, 37)])
def test_head_norm_of_strided_rows_in_place(native, t, heads, d) -> None:
    qkv = torch.randn(t, heads * d + 11)  # heads side by side, rows strided, as in qkv
    x, w = qkv[:, : heads * d].view(t, heads, d), torch.randn(d)
    want = REF.head_norm(x.clone(), w, 1e-6)
    rest = qkv[:, heads * d :].clone()
    got = native.head_norm(x, w, 1e-6)
    assert got.data_ptr() == x.data_ptr()  # in place
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, heads * d :], rest)  # nothing past the heads touched


@pytest.mark.parametrize(("t", "n"), [(1, 8), (3, 64), (8, 512), (5, 37), (64, 896)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_norm(native, t, n, with_delta) -> None:
    g = torch.Generator().manual_seed(t * 100 + n)
    h, w = torch.randn(t, n, generator=g) * 3, torch.randn(n, generator=g)
    delta = torch.randn(t, n, generator=g) if with_delta else None
    want_h, want_x = REF.add_norm(h.clone(), delta, w, 1e-6)
    got_h, got_x = native.add_norm(h, delta, w, 1e-6)
    assert got_h is h  # in place: h now holds h + delta
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=0)
    torch.testing.assert_close(got_x, want_x, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize(("t", "inter"), [(1, 8), (8, 1408), (3, 37), (64, 896)])
def test_silu_mul(native, t, inter) -> None:
    gu = torch.randn(t, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    gu[0, :4] = torch.tensor([0.0, -100.0, 100.0, -89.0])  # the exp's clamps and overflow
    want = REF.act_mul(F.silu, gu)
    torch.testing.assert_close(native.act_mul(F.silu, gu), want, rtol=1e-6, atol=1e-6)
    # another activation is left to torch, not computed as silu
    torch.testing.assert_close(native.act_mul(F.gelu, gu), REF.act_mul(F.gelu, gu))


@pytest.mark.parametrize(("t", "inter"), [(1, 8), (3, 37), (64, 640)])
def test_gelu_tanh_mul(native, t, inter) -> None:
    """Gemma's gelu_pytorch_tanh: close to the exact value (float64) and to torch's, and
    what NativeOps computes for that activation (the per-call path and the one-call
    forward then call one kernel: their logits are equal bit for bit)."""
    from pdserve.model.layers.activations import ACTIVATIONS

    gu = torch.randn(t, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    gu[0, :4] = torch.tensor([0.0, -100.0, 100.0, -9.0])  # the exp's clamps and overflow
    got = native.kernels.gelu_tanh_mul(gu)
    g, up = gu.double().chunk(2, dim=-1)
    exact = g * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)) * up
    torch.testing.assert_close(got, exact.float(), rtol=1e-6, atol=1e-7)
    gelu = ACTIVATIONS["gelu_pytorch_tanh"]
    # torch rounds 1 + tanh(u) to 0 below g ~ -9 and loses digits on the way there
    torch.testing.assert_close(got, REF.act_mul(gelu, gu), rtol=1e-5, atol=1e-5)
    assert torch.equal(native.act_mul(gelu, gu), got)


@pytest.mark.parametrize(
    ("t", "heads", "kv_heads", "d"), [(1, 8, 2, 64), (7, 4, 4, 32), (5, 2, 1, 128)]
)
def test_rotation_in_place_of_strided_heads(native, t, heads, kv_heads, d) -> None:
    rope = RotaryEmbedding(d, 512, 10000.0, None, torch.float32, "cpu")
    positions = torch.tensor([0, 511, 17, 300, 1, 2, 3][:t])
    tables = rope.tables(positions)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    before = qkv.clone()
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)  # rows strided
    want = REF.rotate(qk.clone(), tables)
    got = native.rotate(qk, tables)
    assert got.data_ptr() == qk.data_ptr()  # in place
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    v = slice((heads + kv_heads) * d, None)
    assert torch.equal(qkv[:, v], before[:, v])  # v untouched


@pytest.mark.parametrize("t", [1, 3])
def test_kv_write_matches_index_copy_and_refuses_slots_outside(native, t) -> None:
    kc, vc = torch.zeros(40, 2, 8), torch.zeros(40, 2, 8)
    qkv = torch.randn(t, 6 * 8)  # [q (2 heads) | k (2) | v (2)]
    # one row: view() may give k and v different strides for the size-1 dimension
    k, v = qkv[:, 16:32].view(t, 2, 8), qkv[:, 32:].view(t, 2, 8)
    slots = torch.tensor([7, 39, 0][:t])
    native.kernels.kv_write(kc, vc, slots, k, v)
    want_k, want_v = torch.zeros(40, 2, 8), torch.zeros(40, 2, 8)
    want_k.index_copy_(0, slots, k)
    want_v.index_copy_(0, slots, v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    for bad in ([40, 7, 0][:t], [-1, 1, 2][:t]):
        kc2, vc2 = kc.clone(), vc.clone()
        with pytest.raises(ValueError, match="outside the pool"):
            native.kernels.kv_write(kc2, vc2, torch.tensor(bad), k, v)
        assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # nothing written


def test_argmax_follows_torch_on_ties_nan_and_infinities(native) -> None:
    x = torch.randn(9, 1003, generator=torch.Generator().manual_seed(3))
    x[1, [5, 900]] = 50.0  # a tie: the first wins
    x[2, [10, 20]] = float("nan")  # the first NaN wins over anything
    x[3, :] = float("-inf")
    x[4, 1002] = float("inf")  # in the tail past the last block of 8
    x[5, :] = 0.0
    logits = x[:, :1001]  # strided rows
    for rows in (logits, x, torch.randn(64, 32000)):
        assert torch.equal(native.argmax(rows), rows.argmax(dim=-1))


def test_bad_input_is_refused(native) -> None:
    k = native.kernels
    with pytest.raises(ValueError, match="decode_ops"):
        k.add_rms_norm(torch.randn(2, 8, dtype=torch.float64), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="decode_ops"):
        k.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="decode_ops"):
        k.add_rms_norm(torch.randn(2, 8), None, torch.ones(9), 1e-6)
    rope = RotaryEmbedding(8, 16, 10000.0, None, torch.float32, "cpu")
    with pytest.raises(ValueError, match="decode_ops"):
        k.rope_(torch.randn(3, 2, 8), rope.tables(torch.tensor([0, 1])))  # 2 rows for 3
    with pytest.raises(ValueError, match="decode_ops"):
        k.kv_write(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.tensor([0]),
                   torch.randn(1, 1, 8), torch.randn(1, 1, 8))  # fmt: skip
    with pytest.raises(ValueError, match="decode_ops"):
        k.argmax(torch.randn(2, 0))
    with pytest.raises(ValueError, match="odd width"):
        k.silu_mul(torch.randn(2, 7))


def test_a_prefill_runner_takes_the_passes_the_linear_and_the_attention(
    native, monkeypatch, tiny_model
):
    """A prefill engine's own model (its own process under `pdserve up`) runs the native
    passes, projections and attention once warmed up (ModelRunner.warm_up_prefill)."""
    from pdserve.config import EngineConfig
    from pdserve.model.runner import ModelRunner

    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    runner = ModelRunner(EngineConfig(model_path=str(tiny_model)))
    assert type(runner.model.ops) is TorchOps
    runner.warm_up_prefill()
    assert isinstance(runner.model.ops, NativeOps)
    assert all(lin.native is not None for lin in runner.model.linears())
    assert isinstance(runner.attn, NativeAttention)


def test_engine_runs_them_and_matches_transformers(native, monkeypatch, tiny_model) -> None:
    from pdserve.llm import LLM

    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    llm = LLM(str(tiny_model))
    try:
        assert isinstance(llm.decode.runner.model.ops, NativeOps)
        prompts = [[5, 9, 200, 31, 7], list(range(3, 40)), [11, 12]]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()
    assert got == [hf_greedy(tiny_model, p, 12) for p in prompts]


def test_without_the_library_the_model_keeps_torch(monkeypatch, tiny_model, caplog) -> None:
    from pdserve.llm import LLM

    monkeypatch.setenv("PDSERVE_DISABLE_COMPILE", "0")
    monkeypatch.setattr(decode_ops, "decode_ops", lambda *_: None)
    caplog.set_level(logging.WARNING)
    llm = LLM(str(tiny_model))
    try:
        assert type(llm.decode.runner.model.ops) is TorchOps
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        (out,) = llm.generate([[5, 9, 200]], params)
    finally:
        llm.close()
    assert "stay on torch" in caplog.text
    assert out.token_ids == hf_greedy(tiny_model, [5, 9, 200], 6)


def test_prompt_rows_in_chunks_give_the_one_call_bits(native, tmp_path) -> None:
    """From CHUNK_ROWS rows each pass runs in chunks of rows over the threads (range
    functions with row offsets); every pass gives exactly the bits of one whole call."""
    lib = library.load("decode_ops", tmp_path)  # the one the fixture loaded
    assert lib is not None
    whole = NativeOps(decode_ops.DecodeOps(lib))  # no split: one call
    t, n, inter, heads, d = 203, 96, 80, 5, 32  # 203: chunks of 12, the last of 11
    assert t >= decode_ops.CHUNK_ROWS
    g = torch.Generator().manual_seed(9)
    h, delta = torch.randn(t, n, generator=g), torch.randn(t, n, generator=g)
    w = torch.randn(n, generator=g)
    gu = torch.randn(t, 2 * inter, generator=g)
    qkv = torch.randn(t, 2 * heads * d + 7, generator=g)  # rows strided, as in qkv
    rope = RotaryEmbedding(d, 512, 10000.0, None, torch.float32, "cpu")
    tables = rope.tables(torch.randint(0, 512, (t,), generator=g))
    wd = torch.randn(d, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        outs = []
        for ops in (native, whole):
            hh, x = ops.add_norm(h.clone(), delta, w, 1e-6)
            heads_in = qkv.clone()
            view = heads_in[:, : 2 * heads * d].view(t, 2 * heads, d)
            ops.head_norm(view, wd, 1e-6)
            ops.rotate(view, tables)
            outs.append((hh, x, ops.act_mul(F.silu, gu), heads_in))
    finally:
        torch.set_num_threads(before)
    for got, want in zip(*outs):
        assert torch.equal(got, want)
