"""A model runner's native-or-portable choice, made once where the runner is built.

A runner computes on portable objects first: TorchOps, TorchAttention, each Linear on
oneDNN or torch.mm. `NativeKernels.for_engine` says, once per runner, whether native CPU
kernels are on (a CPU engine without --disable-compile or PDSERVE_DISABLE_COMPILE): None keeps the
portable objects throughout. Otherwise the runner's warm-up (its start-up, before any
step) asks it for each native piece once and swaps it in for the portable one:

    ops()                       NativeOps for model.ops            (kernels/native/decode_ops.c)
    attention(attn, heads)      NativeAttention for runner.attn    (kernels/native/paged_decode.c)
    move_linears(model)         every Linear onto the native linear (kernels/native/linear_f32.c)
    decode_forward(...)         the decode step as one call         (kernels/native/decode_forward.c)
    linear_quant()              GGUF blocks' kernel, at load        (kernels/native/linear_quant.c)

A piece that does not build (no C compiler) or does not take the model's shape leaves
the portable object in place, and the log says why. From then on no call site asks
which one it has: each object computes its way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.config import EngineConfig
from pdserve.envs import ENV, cache_root
from pdserve.kernels.core_share import Cores
from pdserve.kernels.native import (
    decode_forward,
    decode_ops,
    linear_f32,
    linear_quant,
    paged_decode,
)
from pdserve.kernels.native.linear_quant import LinearQuant
from pdserve.kernels.native.par import Threads
from pdserve.model.arch.llama import LlamaModel
from pdserve.model.attention.backends import AttentionBackend, NativeAttention, TorchAttention
from pdserve.model.layers.ops import NativeOps
from pdserve.model.native_forward import NativeDecodeForward

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NativeKernels:
    cache_dir: Path  # where the libraries are built and cached (kernels/native/cache.py)
    threads: Threads  # how many threads a kernel call may use (Cores.kernel_threads)
    one_call_decode: bool = True  # False: decode steps call the kernels one by one

    @classmethod
    def for_engine(cls, cfg: EngineConfig, threads: Threads) -> NativeKernels | None:
        """None where native kernels are off: --disable-compile (or PDSERVE_DISABLE_COMPILE,
        which the offline LLM's tests use to run the portable paths), or not the CPU (CUDA
        runs the Triton backend). PDSERVE_PER_CALL_DECODE=1 keeps the per-call decode on a
        model the one-call forward fits (the tests and benchmarks that compare the two)."""
        if not cfg.compile or ENV.DISABLE_COMPILE.get("0") == "1":
            return None
        if not cfg.device.startswith("cpu"):
            return None
        return cls(cache_root(), threads, ENV.PER_CALL_DECODE.get("0") != "1")

    def ops(self) -> NativeOps | None:
        kernels = decode_ops.decode_ops(self.cache_dir, self.threads)
        if kernels is None:
            log.warning("norms, rotation and activation stay on torch (native ops not built)")
            return None
        return NativeOps(kernels)

    def attention(self, attn: AttentionBackend, num_heads: int) -> AttentionBackend:
        """`attn` on the native kernel where it is the portable CPU backend over an fp32 pool
        and the kernel takes `num_heads` query heads over the pool's KV heads (else `attn`:
        a shape over paged_decode.c's limits stays eager instead of failing every step)."""
        if type(attn) is not TorchAttention:  # Triton, or native already
            return attn
        pool = attn.pool
        if pool.k.dtype != torch.float32 or pool.k.device.type != "cpu":
            return attn
        kernel = paged_decode.paged_decode(self.cache_dir, self.threads)
        kv_write = decode_ops.decode_ops(self.cache_dir)
        if kernel is None or kv_write is None:
            log.warning("attention stays eager (the native kernel was not built)")
            return attn
        _, kh, d = pool.k.shape[1:]
        if not kernel.takes(num_heads, kh, d):
            log.warning(
                "attention stays eager: the native kernel does not take %d query heads "
                "over %d KV heads of %d",
                num_heads,
                kh,
                d,
            )
            return attn
        return NativeAttention(pool, attn.req_to_token, attn.scale, attn.windows, kernel, kv_write)

    def move_linears(self, model: LlamaModel) -> bool:
        """Every projection onto the native linear (a model shared with another runner, as
        in the offline LLM, moves for both); False where it was not built."""
        kernel = linear_f32.linear_f32(self.cache_dir, self.threads)
        if kernel is None:
            log.warning("projections stay on oneDNN (the native linear was not built)")
            return False
        for lin in model.linears():
            lin.use_native(kernel)
        return True

    def decode_forward(
        self, model: LlamaModel, attn: AttentionBackend, cores: Cores
    ) -> NativeDecodeForward | None:
        """The whole decode step as one native call, where the model fits it."""
        if not self.one_call_decode:
            return None
        kernel = decode_forward.decode_forward(self.cache_dir)
        forward, why = NativeDecodeForward.build(kernel, model, attn, cores.share, cores.host_core)
        if why is not None:
            log.info("decode steps call their kernels one by one: %s", why)
        return forward

    def linear_quant(self, int8: bool = False) -> LinearQuant | None:
        """`int8`: --quant-activations int8 (LinearQuant's)."""
        return linear_quant.linear_quant(self.cache_dir, int8=int8)
