"""ModelRunner: one model, its request rows and paged KV pool and its attention backend;
it computes logits (the engines pick tokens from them: model/sampling/)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pdserve import config
from pdserve.config import EngineConfig
from pdserve.kernels.core_share import Cores
from pdserve.kvcache.pools import KVLayout, KVPool, ReqToTokenPool
from pdserve.model.arch.config import ModelArch
from pdserve.model.arch.llama import LlamaModel
from pdserve.model.arch.registry import load_arch, lookup
from pdserve.model.attention.backends import AttentionBackend
from pdserve.model.attention.registry import make_attention
from pdserve.model.attention.triton_backend import TritonAttention
from pdserve.model.cuda_graph import GraphedDecode
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.native_forward import NativeDecodeForward
from pdserve.model.native_kernels import NativeKernels
from pdserve.model.weights import load_model

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in config.DTYPES}  # config.DTYPES -> torch


def device_problem(device: str) -> str:
    """Why this process cannot compute on `device` ("" if it can): said before the model
    loads, instead of torch's assertion from the first tensor moved there."""
    if not device.startswith("cuda"):
        return ""
    if not torch.cuda.is_available():
        if torch.version.cuda is None and torch.version.hip is None:
            why = f"this torch ({torch.__version__}) is built without CUDA"
        else:
            why = "no CUDA device is visible (torch.cuda.is_available() is False)"
        return f"--device {device}: {why}; use --device cpu"
    index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
    if index >= count:
        return f"--device {device}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})"
    return ""


class ModelRunner:
    def __init__(
        self, cfg: EngineConfig, model: LlamaModel | None = None, cores: Cores | None = None
    ) -> None:
        """`model`: share already loaded weights (read-only) instead of loading them.
        `cores`: the engine's core policy (kernels/core_share.Cores), made by the
        composition root (scheduler/build.py); None: alone on the host."""
        problem = device_problem(cfg.device)
        if problem:
            raise ValueError(problem)
        if cores is None and cfg.core_share:
            raise ValueError("core_share: made by the engine process (scheduler/build.py)")
        self.cfg = cfg  # NOTE: EngineConfig refused a dtype outside config.DTYPES
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)  # process-wide: one engine per process
        self.native_forward: NativeDecodeForward | None = None  # set by warm_up_decode
        self.graphed: GraphedDecode | None = None  # CUDA; set by warm_up_decode
        self.cores = Cores() if cores is None else cores
        # native kernels or the portable paths, chosen once (model/native_kernels.py)
        self.native = NativeKernels.for_engine(cfg, self.cores.kernel_threads)
        self.arch: ModelArch = load_arch(cfg.model_path)
        make_model = lookup(self.arch.architecture).model
        self.dtype = DTYPES[cfg.dtype]
        self.device = cfg.device
        self.max_context = cfg.cache.context_length(self.arch.context_positions)
        if model is None:
            model = load_model(
                cfg, self.arch, self.dtype, self.native,
                lambda state: make_model(self.arch, state, self.max_context),
            )  # fmt: skip
        self.model = model
        self.layout = KVLayout(
            num_layers=self.arch.num_layers,
            num_kv_heads=self.arch.num_kv_heads,
            head_dim=self.arch.head_dim,
            dtype=cfg.dtype,
            page_size=cfg.cache.page_size,
        )
        self.req_pool = ReqToTokenPool(cfg.max_rows, self.max_context, self.device)
        self.kv_pool = KVPool(self.layout, cfg.cache.num_pages, self.device)
        self.attn: AttentionBackend = make_attention(
            cfg.attention_backend,
            self.kv_pool,
            self.req_pool.req_to_token,
            self.arch.attention_scale,
            self.arch.layer_windows,
        )  # the portable backend on the CPU until warm-up swaps in the native one
        log.info(
            "loaded %s (%s, %d layers) with %d rows and %d KV pages of %d tokens",
            cfg.model_path,
            self.arch.architecture,
            self.arch.num_layers,
            self.req_pool.total_rows,
            self.kv_pool.allocator.total_pages,
            cfg.cache.page_size,
        )
        log.info(
            "context length %d (--max-context %s, the model's %d, the pool's %d tokens)",
            self.max_context,
            cfg.cache.max_context or "unset",
            self.arch.max_position_embeddings,
            (cfg.cache.num_pages - 1) * cfg.cache.page_size,
        )

    def native_dir(self) -> str | None:
        """Where native CPU kernels are built and cached, when they are on; else None."""
        return None if self.native is None else str(self.native.cache_dir)

    def warm_up_prefill(self) -> None:
        """Swap in what prefill steps run natively (start-up; a no-op when native kernels
        are off or the model is not fp32): the native norms, rotation and activation
        (model/layers/ops.py), the attention kernel (model/attention/backends.py, NativeAttention), and
        the linear kernel every projection moves to. Both kernels split a prompt's work
        over par.c's threads in chunks, not in one fixed part per thread as oneDNN's and
        torch's OpenMP regions do: on a host shared with the router, the HTTP servers and
        a decode, a fixed part's thread is preempted now and then, and its partner waits
        for it at the join. One thread alone pays little or nothing for it (the native
        linear is a little slower than oneDNN at a prompt's rows, the native attention
        faster than torch's fused one); under `pdserve up` on a small host more of the
        machine goes to tokens (benchmarks/compare.py)."""
        native = self._native_compute()
        if native is not None:
            self._go_native(native)

    def warm_up_decode(self) -> None:
        """Swap in what decode steps run natively (start-up; a no-op when native kernels
        are off or the model is not fp32): as warm_up_prefill, then the whole decode step
        as one native call where the model fits it. On CUDA: the decode's graphs."""
        self._capture_graphs()
        native = self._native_compute()
        if native is not None and self._go_native(native):
            self.native_forward = native.decode_forward(self.model, self.attn, self.cores)

    def _native_compute(self) -> NativeKernels | None:
        """The native kernels this runner computes with (fp32 only; the KV transfer's page
        copies, `native_dir`, take any dtype)."""
        return self.native if self.dtype == torch.float32 else None

    def _go_native(self, native: NativeKernels) -> bool:
        """The model's ops, the attention backend and the projections onto native kernels,
        each where it builds; False where the projections stay (no one-call forward then)."""
        ops = native.ops()
        if ops is not None:
            self.model.ops = ops
        self.attn = native.attention(self.attn, self.arch.num_heads)
        return native.move_linears(self.model)

    def _capture_graphs(self) -> None:
        """On CUDA, the decode forward's graphs for every batch size the engine runs."""
        if not (self.cfg.cuda_graph and self.device.startswith("cuda")):
            return
        if self.arch.moe is not None:  # its routing reads each expert's token count on the host
            log.info("decode steps launch kernels one by one: the expert routing syncs")
            return
        if not isinstance(self.attn, TritonAttention):
            log.info("decode steps launch kernels one by one: graphs need Triton attention")
            return
        self.graphed = GraphedDecode.capture(
            lambda batch: self.model.forward(batch, self.attn),
            self.attn,
            self.cfg.scheduler.max_running_requests,
            torch.device(self.device),
        )

    def prepare(self, batch: ForwardBatch) -> None:
        """Schedule side: build every index tensor the forward needs (host -> device
        copies, attention plans). Afterwards `forward` issues device work only."""
        batch.last_index = batch.last_token_index()
        self.attn.prepare(batch)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab]. Call `prepare` first where the forward runs on its own
        stream (the decode's overlap loop); callers that run both inline may skip it."""
        if batch.attn_plan is None or batch.last_index is None:
            self.prepare(batch)
        with self.cores.computing() as between_layers:  # on host cores lent by peers
            return self._forward(batch, between_layers)

    def _forward(
        self, batch: ForwardBatch, between_layers: Callable[[], None] | None = None
    ) -> torch.Tensor:
        graphed = self.graphed
        if graphed is not None and graphed.fits(batch):
            return graphed(batch)  # NOTE: logits are the graph's; sample before the next step
        native = self.native_forward
        if native is not None and native.fits(batch):
            return native(batch)  # NOTE: asks the core share itself, kernel by kernel
        return self.model.forward(batch, self.attn, between_layers)
