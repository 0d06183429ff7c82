"""--quant-activations int8 in numpy: what kernels/native/quant_int8.h computes, written
from the GGUF block formats (not from the C): x quantized per block to 8 bits, integer
dot products against each weight block's codes, the scales applied to the integer sums.

Every integer sum is exact here (int64); the float32 products of scales are formed as the
C forms them; the blocks' contributions are added in float64, so the C's result differs
from this only by float32 rounding of its sums.
"""

from __future__ import annotations

import numpy as np

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
f32 = np.float32


def quantize(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x [m, k] float32 -> (q int8 [m, k], d float32 [m, k / block]): d = max |x| / 127,
    q = x * (1 / d) rounded to nearest even (0 where d is 0)."""
    xb = x.astype(f32).reshape(x.shape[0], -1, block)
    d = np.abs(xb).max(axis=2) / f32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, f32(1) / d, f32(0)).astype(f32)
    q = np.rint(xb * inv[:, :, None]).astype(np.int8)
    return q.reshape(x.shape), d.astype(f32)


def _half(b: np.ndarray, off: int) -> np.ndarray:
    return b[:, off : off + 2].copy().view(np.float16).astype(f32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 codes: the low nibbles, then the high ones"""
    return np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int64)


def _high_bit(b: np.ndarray, off: int) -> np.ndarray:
    qh = b[:, off : off + 4].copy().view(np.uint32)[:, 0].astype(np.int64)
    return ((qh[:, None] >> np.arange(32)) & 1) << 4


def codes32(b: np.ndarray, type_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of 32 [nb, size] -> (codes [nb, 32], d [nb], min [nb]): w = d * c + min."""
    zero = np.zeros(len(b), f32)
    if type_id == 8:  # Q8_0
        return b[:, 2:34].view(np.int8).astype(np.int64), _half(b, 0), zero
    if type_id == 2:  # Q4_0
        return _nibbles(b[:, 2:18]) - 8, _half(b, 0), zero
    if type_id == 3:  # Q4_1
        return _nibbles(b[:, 4:20]), _half(b, 0), _half(b, 2)
    if type_id == 6:  # Q5_0
        return (_nibbles(b[:, 6:22]) | _high_bit(b, 2)) - 16, _half(b, 0), zero
    if type_id == 7:  # Q5_1
        return _nibbles(b[:, 8:24]) | _high_bit(b, 4), _half(b, 0), _half(b, 2)
    if type_id == 20:  # IQ4_NL
        return KVALUES[_nibbles(b[:, 2:18])], _half(b, 0), zero
    raise ValueError(type_id)


def _scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes [nb, 12] -> 6-bit (sc, mn) [nb, 8]"""
    s = s.astype(np.int64)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], 1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    return sc, mn


def codes256(b: np.ndarray, type_id: int) -> tuple[np.ndarray, ...]:
    """Super-blocks [nb, size] -> (codes [nb, 256], scales [nb, G] per group of 256 / G,
    mins [nb, 8] (6-bit integers, 0 where none), d, dmin [nb]):
    w = d * scale_g * c - dmin * min_j."""
    nb = len(b)
    if type_id in (12, 13):  # Q4_K, Q5_K
        sc, mn = _scale_min(b[:, 4:16])
        five = type_id == 13
        qs = b[:, 48:176] if five else b[:, 16:144]
        qh = b[:, 16:48].astype(np.int64)
        parts = []
        for j in range(4):
            chunk = qs[:, 32 * j : 32 * j + 32].astype(np.int64)
            lo, hi = chunk & 15, chunk >> 4
            if five:
                lo = lo | (((qh >> (2 * j)) & 1) << 4)
                hi = hi | (((qh >> (2 * j + 1)) & 1) << 4)
            parts += [lo, hi]
        return np.concatenate(parts, 1), sc, mn, _half(b, 0), _half(b, 2)
    if type_id == 14:  # Q6_K: codes less 32, 16 groups of 16
        ql, qh = b[:, 0:128].astype(np.int64), b[:, 128:192].astype(np.int64)
        parts = []
        for h in range(2):
            lq, hq = ql[:, 64 * h : 64 * h + 64], qh[:, 32 * h : 32 * h + 32]
            parts += [
                (lq[:, :32] & 15) | ((hq & 3) << 4),
                (lq[:, 32:] & 15) | (((hq >> 2) & 3) << 4),
                (lq[:, :32] >> 4) | (((hq >> 4) & 3) << 4),
                (lq[:, 32:] >> 4) | (((hq >> 6) & 3) << 4),
            ]
        sc = b[:, 192:208].view(np.int8).astype(np.int64)
        return (
            np.concatenate(parts, 1) - 32,
            sc,
            np.zeros((nb, 8), np.int64),
            _half(b, 208),
            np.zeros(nb, f32),
        )
    if type_id == 23:  # IQ4_XS
        sh = b[:, 2:4].copy().view(np.uint16)[:, 0].astype(np.int64)
        sl = b[:, 4:8].astype(np.int64)
        ls = [
            ((sl[:, j // 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4) for j in range(8)
        ]
        codes = np.concatenate(
            [KVALUES[_nibbles(b[:, 8 + 16 * j : 24 + 16 * j])] for j in range(8)], 1
        )
        return (
            codes,
            np.stack(ls, 1) - 32,
            np.zeros((nb, 8), np.int64),
            _half(b, 0),
            np.zeros(nb, f32),
        )
    raise ValueError(type_id)


def dequantized(w: np.ndarray, type_id: int, block: int, size: int) -> np.ndarray:
    """W [n, k] from the codes and scales above (checked against gguf's de-quantize)."""
    b = w.reshape(-1, size)
    if block == 32:
        c, d, m = codes32(b, type_id)
        return (d[:, None] * c + m[:, None]).reshape(w.shape[0], -1)
    c, sc, mn, d, dmin = codes256(b, type_id)
    g = 256 // sc.shape[1]
    ds = (d[:, None] * sc.astype(f32)).astype(f32)
    dm = (dmin[:, None] * mn.astype(f32)).astype(f32)
    val = np.repeat(ds, g, 1) * c - np.repeat(dm, 32, 1)
    return val.reshape(w.shape[0], -1)


def matmul(x: np.ndarray, w: np.ndarray, type_id: int, block: int, size: int):
    """(y [m, n] float64, the sum of |each block's term| bounding float32 noise)"""
    m, k = x.shape
    n = w.shape[0]
    b = w.reshape(-1, size)
    q, dx = quantize(x, block)
    qb = q.reshape(m, 1, k // block, block).astype(np.int64)  # [m, 1, blocks, block]
    if block == 32:
        c, d, mins = codes32(b, type_id)
        c = c.reshape(1, n, k // 32, 32)
        isum = (qb * c).sum(3)
        scale = (dx[:, None, :] * d.reshape(1, n, -1)).astype(f32)
        sx = (dx * q.reshape(m, -1, 32).astype(np.int64).sum(2).astype(f32)).astype(f32)
        minterm = (mins.reshape(1, n, -1) * sx[:, None, :]).astype(f32)
        terms = scale.astype(np.float64) * isum + minterm
        return terms.sum(2), np.abs(scale.astype(np.float64) * isum).sum(2) + np.abs(minterm).sum(2)
    c, sc, mn, d, dmin = codes256(b, type_id)
    g = sc.shape[1]
    prod = (qb * c.reshape(1, n, k // 256, 256)).reshape(m, n, k // 256, g, 256 // g).sum(4)
    isum = (prod * sc.reshape(1, n, -1, g)).sum(3)
    bs = q.reshape(m, 1, k // 256, 8, 32).astype(np.int64).sum(4)
    msum = (bs * mn.reshape(1, n, -1, 8)).sum(3)
    s1 = (dx[:, None, :] * d.reshape(1, n, -1)).astype(f32).astype(np.float64)
    s2 = (dx[:, None, :] * dmin.reshape(1, n, -1)).astype(f32).astype(np.float64)
    terms = s1 * isum - s2 * msum
    return terms.sum(2), (np.abs(s1 * isum) + np.abs(s2 * msum)).sum(2)
