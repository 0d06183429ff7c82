"""Triton paged attention (decode + extend) against torch, and the "triton" backend.

Without CUDA the kernels run under the Triton interpreter: shapes stay small so each
test takes seconds. On CUDA the same tests run compiled (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch

import pdserve.kernels  # noqa: F401  (TRITON_INTERPRET before any kernel is defined)
from pdserve.config import CacheConfig, EngineConfig
from pdserve.kernels import attention_triton as at
from pdserve.kvcache.pools import KVLayout, KVPool, slots_of
from pdserve.model.attention.backends import TorchAttention
from pdserve.model.attention.registry import make_attention
from pdserve.model.attention.triton_backend import TritonAttention
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.runner import ModelRunner
from tests.conftest import model_path

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# (KV heads, group, head_dim, seed); 24: a padded head_dim
SHAPES = [(1, 1, 16, 0), (2, 4, 32, 1), (4, 2, 24, 2)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(seed: int, slots: int, kh: int, d: int, dtype: torch.dtype):
    k = torch.randn(slots, kh, d, generator=_gen(seed)).to(DEVICE, dtype)
    v = torch.randn(slots, kh, d, generator=_gen(seed + 1)).to(DEVICE, dtype)
    return k, v


def _table(seed: int, rows: int, cols: int, slots: int) -> torch.Tensor:
    """req_to_token with distinct, shuffled slots (a fragmented pool)."""
    perm = torch.randperm(slots, generator=_gen(seed))[: rows * cols]
    return perm.view(rows, cols).to(torch.int32).to(DEVICE)


def _ivec(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def test_kernels_run_under_the_interpreter_without_cuda() -> None:
    if CUDA:
        pytest.skip("CUDA present: kernels are compiled, not interpreted")
    assert type(at._decode_kernel).__name__ == "InterpretedFunction"
    assert type(at._extend_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kh", "group", "d", "seed"), SHAPES)
def test_decode_matches_reference(kh: int, group: int, d: int, seed: int, dtype) -> None:
    lens = [1, 33, 7, 64]  # 33 and 64: several key blocks, one partly masked
    r2t = _table(seed, 6, 64, 6 * 64)
    k, v = _pool(seed, 6 * 64, kh, d, dtype)
    rows, tok = _ivec([5, 0, 3, 1]), _ivec([2, 0, 3, 1])  # tokens in shuffled order
    q = torch.randn(4, kh * group, d, generator=_gen(seed + 2)).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))  # poisoned
    at.decode_attention(q, k, v, out, r2t, rows, _ivec(lens), tok, d**-0.5)
    want = at.decode_attention_ref(q, k, v, r2t, rows, _ivec(lens), tok, d**-0.5)
    torch.testing.assert_close(out[tok.long()], want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kh", "group", "d", "seed"), SHAPES)
def test_extend_matches_reference(kh: int, group: int, d: int, seed: int, dtype) -> None:
    # (prefix, new): a fresh prompt, a chunk after a prefix, one token, > BLOCK_M new
    reqs = [(0, 5), (20, 9), (6, 1), (3, 40)]
    new = [n for _, n in reqs]
    lens = [p + n for p, n in reqs]
    starts = [sum(new[:i]) for i in range(len(new))]
    r2t = _table(seed, 5, 48, 5 * 48)
    k, v = _pool(seed, 5 * 48, kh, d, dtype)
    rows = _ivec([2, 4, 1, 3])
    q = torch.randn(sum(new) + 2, kh * group, d, generator=_gen(seed + 2)).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    args = (r2t, rows, _ivec(lens), _ivec(new), _ivec(starts))
    at.extend_attention(q, k, v, out, *args, max(new), d**-0.5)
    want = torch.cat(at.extend_attention_ref(q, k, v, *args, d**-0.5))
    torch.testing.assert_close(out[: sum(new)], want, atol=TOL[dtype], rtol=TOL[dtype])
    assert out[sum(new) :].isnan().all(), "wrote outside the listed tokens"


@pytest.mark.parametrize("window", [1, 40])
def test_sliding_window_decode_and_extend_match_reference(window: int) -> None:
    """A window narrower than the context: keys before p - window + 1 are skipped,
    including blocks a whole BLOCK_N wide and chunks that start after a long prefix."""
    kh, group, d, seed = 2, 2, 16, 3
    r2t = _table(seed, 6, 96, 6 * 96)
    k, v = _pool(seed, 6 * 96, kh, d, torch.float32)
    scale = d**-0.5
    lens, rows, tok = _ivec([1, 70, 9, 96]), _ivec([5, 0, 3, 1]), _ivec([2, 0, 3, 1])
    q = torch.randn(4, kh * group, d, generator=_gen(seed)).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    at.decode_attention(q, k, v, out, r2t, rows, lens, tok, scale, window)
    want = at.decode_attention_ref(q, k, v, r2t, rows, lens, tok, scale, window)
    torch.testing.assert_close(out[tok.long()], want, atol=2e-5, rtol=2e-5)
    reqs = [(0, 45), (50, 9), (6, 1), (30, 40)]  # (prefix, new)
    new, total = [n for _, n in reqs], [p + n for p, n in reqs]
    starts = [sum(new[:i]) for i in range(len(new))]
    q = torch.randn(sum(new), kh * group, d, generator=_gen(seed + 1)).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    args = (r2t, _ivec([2, 4, 1, 3]), _ivec(total), _ivec(new), _ivec(starts))
    at.extend_attention(q, k, v, out, *args, max(new), scale, window)
    want = torch.cat(at.extend_attention_ref(q, k, v, *args, scale, window))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    full = torch.cat(at.extend_attention_ref(q, k, v, *args, scale))
    assert not torch.allclose(want, full), "the window must change the result"


def test_wrappers_reject_bad_inputs() -> None:
    k, v = _pool(0, 32, 2, 16, torch.float32)
    q = torch.zeros(2, 4, 16, device=DEVICE)
    r2t = _table(0, 2, 16, 32)
    ok = (_ivec([0, 1]), _ivec([3, 4]), _ivec([0, 1]))
    with pytest.raises(ValueError, match="H % KH"):
        q3 = torch.zeros(2, 3, 16, device=DEVICE)
        at.decode_attention(q3, k, v, q3.clone(), r2t, *ok, 1.0)
    with pytest.raises(ValueError, match="dtypes differ"):
        at.decode_attention(q.double(), k, v, q.double(), r2t, *ok, 1.0)
    with pytest.raises(ValueError, match="index vectors"):
        at.decode_attention(q, k, v, q.clone(), r2t, ok[0], _ivec([3]), ok[2], 1.0)
    strided = torch.zeros(2, 4, 32, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="last dim"):
        at.decode_attention(strided, k, v, q.clone(), r2t, *ok, 1.0)


def _mixed_batch(pool: KVPool, r2t: torch.Tensor) -> ForwardBatch:
    """Two decode requests around one extend chunk after a 6-token prefix."""
    ps, seq_lens, extend_lens = pool.page_size, [9, 10, 4], [1, 4, 1]
    out_loc = []
    for row, total, n in zip([3, 1, 2], seq_lens, extend_lens):
        pages = pool.allocator.alloc(pool.allocator.pages_for(total))
        assert pages is not None
        slots = slots_of(pages[::-1], total, ps)  # pages out of order
        r2t[row, :total] = slots.to(r2t.device, r2t.dtype)
        out_loc.extend(slots[total - n : total].tolist())
    positions = [8, 6, 7, 8, 9, 3]
    return ForwardBatch(
        input_ids=torch.zeros(6, dtype=torch.int64, device=DEVICE),
        positions=torch.tensor(positions, device=DEVICE),
        out_cache_loc=torch.tensor(out_loc, device=DEVICE),
        rows=torch.tensor([3, 1, 2], device=DEVICE),
        seq_lens=seq_lens,
        extend_lens=extend_lens,
    )


@pytest.mark.parametrize("windows", [(), (3, 0)])
def test_backend_matches_torch_backend_on_a_mixed_batch(windows: tuple[int, ...]) -> None:
    kh, group, d = 2, 3, 16
    layout = KVLayout(num_layers=2, num_kv_heads=kh, head_dim=d, dtype="float32", page_size=4)
    pools = [KVPool(layout, 16, DEVICE) for _ in range(2)]
    k0 = torch.randn(pools[0].k.shape, generator=_gen(7)).to(DEVICE)  # same stale prefix
    tables = [torch.zeros(5, 16, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    batches = []
    for pool, r2t in zip(pools, tables):
        pool.k.copy_(k0)
        pool.v.copy_(k0.flip(1))
        batches.append(_mixed_batch(pool, r2t))
    triton_be = make_attention("triton", pools[0], tables[0], d**-0.5, windows)
    assert isinstance(triton_be, TritonAttention)
    torch_be = TorchAttention(pools[1], tables[1], d**-0.5, windows)
    for be, b in ((triton_be, batches[0]), (torch_be, batches[1])):
        be.prepare(b)
    for layer in range(2):
        q = torch.randn(6, kh * group, d, generator=_gen(layer)).to(DEVICE)
        k, v = torch.randn(2, 6, kh, d, generator=_gen(10 + layer)).to(DEVICE)
        got = triton_be.forward(layer, q, k, v, batches[0])
        want = torch_be.forward(layer, q, k, v, batches[1])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(pools[0].k, pools[1].k) and torch.equal(pools[0].v, pools[1].v)


def _greedy(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    """Prefill in two chunks (the second over a prefix), then `steps` decode steps."""
    total = len(prompt) + steps
    row = runner.req_pool.alloc()
    pages = runner.kv_pool.allocator.alloc(runner.kv_pool.allocator.pages_for(total))
    assert row is not None and pages is not None
    slots = slots_of(pages, total, runner.layout.page_size).to(runner.device)
    runner.req_pool.req_to_token[row, :total] = slots.to(torch.int32)
    cut, tokens = 3, list(prompt)
    chunks = [(0, cut), (cut, len(prompt))] + [(p, p + 1) for p in range(len(prompt), total - 1)]
    for lo, hi in chunks:
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens[lo:hi], device=runner.device),
            positions=torch.arange(lo, hi, device=runner.device),
            out_cache_loc=slots[lo:hi],
            rows=torch.tensor([row], device=runner.device),
            seq_lens=[hi],
            extend_lens=[hi - lo],
        )
        logits = runner.forward(batch)
        if hi >= len(prompt):
            tokens.append(int(logits[0].argmax()))
    return tokens[len(prompt) :]


def test_tiny_model_greedy_tokens_match_torch_backend() -> None:
    def cfg(backend: str) -> EngineConfig:
        cache = CacheConfig(page_size=4, max_total_tokens=64, max_context=32)
        path = str(model_path("tiny"))
        return EngineConfig(path, attention_backend=backend, cache=cache, device=DEVICE)

    ref = ModelRunner(cfg("torch"))
    tri = ModelRunner(cfg("triton"), model=ref.model)
    assert isinstance(tri.attn, TritonAttention)
    prompt = [17, 290, 33, 1024, 5]
    want = _greedy(ref, prompt, 4)
    assert _greedy(tri, prompt, 4) == want
    assert torch.allclose(tri.kv_pool.k, ref.kv_pool.k, atol=1e-4)
