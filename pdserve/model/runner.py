"""ModelRunner: one model, its request rows and paged KV pool, attention and sampling."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve import config
from pdserve.config import EngineConfig
from pdserve.envs import ENV, cache_root
from pdserve.kernels.core_share import Cores
from pdserve.kernels.native import decode_forward, decode_ops, linear_f32
from pdserve.kvcache.pools import KVLayout, KVPool, ReqToTokenPool
from pdserve.model.attention_registry import make_attention
from pdserve.model.attention_triton import TritonAttention
from pdserve.model.cuda_graph import GraphedDecode
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.hf_config import ModelArch, load_arch
from pdserve.model.llama import LlamaModel
from pdserve.model.models import MODEL_REGISTRY
from pdserve.model.native_forward import NativeDecodeForward
from pdserve.model.ops import NativeOps
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
        self.arch: ModelArch = load_arch(cfg.model_path)
        if self.arch.architecture not in MODEL_REGISTRY:
            raise ValueError(
                f"architecture {self.arch.architecture} is not supported; "
                f"supported: {sorted(MODEL_REGISTRY)}"
            )
        self.dtype = DTYPES[cfg.dtype]
        self.device = cfg.device
        self.max_context = cfg.cache.context_length(self.arch.max_position_embeddings)
        if model is None:
            cls = MODEL_REGISTRY[self.arch.architecture]
            model = load_model(
                cfg, self.arch, self.dtype, self.native_dir(),
                lambda state: cls(self.arch, state, self.max_context),
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
        self.attn = make_attention(
            cfg.attention_backend,
            self.kv_pool,
            self.req_pool.req_to_token,
            self.arch.attention_scale,
            self.arch.layer_windows,
            native_dir=self.native_dir(),
            kernel_threads=self.cores.kernel_threads,
        )
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
        if not self.cfg.compile or ENV.DISABLE_COMPILE.get("0") == "1":
            return None
        if not self.device.startswith("cpu"):
            return None  # CUDA runs the Triton backend
        return str(cache_root())

    def warm_up_prefill(self) -> None:
        """Build what prefill steps run natively (start-up; a no-op when compile is off):
        the native norms, rotation and activation (model/ops.py), the attention kernel
        (model/attention.py, _extend_native), and the linear kernel every projection
        moves to. Both kernels split a prompt's work over par.c's threads in chunks, not
        in one fixed part per thread as oneDNN's and torch's OpenMP regions do: on a host
        shared with the router, the HTTP servers and a decode, a fixed part's thread is
        preempted now and then, and its partner waits for it at the join. One thread
        alone pays little or nothing for it (the native linear is 5-10% slower than
        oneDNN at a prompt's rows, the native attention 1.5x faster than torch's fused
        one). Under `pdserve up` on 2 cores the machine is then busier, so more of it
        goes to tokens (benchmarks/compare.py)."""
        native_dir = self.native_dir()
        if native_dir is None or self.dtype != torch.float32:
            return
        self._native_ops(Path(native_dir))
        self._warm_up_attention()
        self._native_linears(Path(native_dir))

    def warm_up_decode(self) -> None:
        """Build what decode steps run natively (start-up; a no-op when compile is off):
        the decode attention kernel, the native norms, rotation and activation, and the
        linear kernel every projection moves to (a model shared with a prefill runner, as
        in the offline LLM, moves for both)."""
        self._warm_up_attention()
        self._capture_graphs()
        native_dir = self.native_dir()
        if native_dir is None or self.dtype != torch.float32:
            return
        self._native_ops(Path(native_dir))
        if self._native_linears(Path(native_dir)):
            self._native_forward(Path(native_dir))

    def _warm_up_attention(self) -> None:
        """The attention backend's native kernel, where it has one (TorchAttention)."""
        warm_up = getattr(self.attn, "warm_up", None)
        if warm_up is not None:
            warm_up(self.arch.num_heads)

    def _native_linears(self, native_dir: Path) -> bool:
        """Every projection on the native linear (a model shared with another runner, as
        in the offline LLM, moves for both); False where it was not built."""
        kernel = linear_f32.linear_f32(native_dir, self.cores.kernel_threads)
        if kernel is None:
            log.warning("projections stay on oneDNN (the native linear was not built)")
            return False
        for lin in self.model.linears():
            lin.use_native(kernel)
        return True

    def _capture_graphs(self) -> None:
        """On CUDA, the decode forward's graphs for every batch size the engine runs."""
        if not (self.cfg.cuda_graph and self.device.startswith("cuda")):
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

    def _native_forward(self, native_dir: Path) -> None:
        """The whole decode step as one native call, where the model fits it."""
        if ENV.PER_CALL_DECODE.get("0") == "1":
            return
        kernel = decode_forward.decode_forward(native_dir)
        self.native_forward, why = NativeDecodeForward.build(
            kernel, self.model, self.attn, self.cores.share, self.cores.host_core
        )
        if why is not None:
            log.info("decode steps call their kernels one by one: %s", why)

    def _native_ops(self, native_dir: Path) -> None:
        ops = decode_ops.decode_ops(native_dir, self.cores.kernel_threads)
        if ops is None:
            log.warning("norms, rotation and activation stay on torch (native ops not built)")
        else:
            self.model.ops = NativeOps(ops)

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
