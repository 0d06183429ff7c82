"""A prefill engine and a decode engine in this process, joined by the real ZeroMQ
transfer (KVSender / KVReceiver on loopback), stepped by the test thread.

The test decides exactly when each engine steps, so it can put a request into any
state (queued, admitted, KV in flight, prebuilt) before it refuses or aborts it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.model.runner import ModelRunner
from pdserve.protocol import EngineRequest, TokenEvent
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.identity import model_fingerprint
from pdserve.transfer.loopback import transfer_settings
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending.sender import KVSender


def engine_cfg(model: Path, tokens: int, max_prefill: int = 2048) -> EngineConfig:
    return EngineConfig(
        model_path=str(model),
        cache=CacheConfig(page_size=16, max_total_tokens=tokens, max_context=1024),
        scheduler=SchedulerConfig(max_running_requests=8, max_prefill_tokens=max_prefill),
    )


class Pair:
    def __init__(
        self,
        prefill_cfg: EngineConfig,
        decode_cfg: EngineConfig,
        timeout_s: float = 60.0,
        weights: object = None,
    ) -> None:
        """`weights`: a loaded model to share (both configs must name the same model)."""
        p_runner = ModelRunner(prefill_cfg, model=weights)  # type: ignore[arg-type]
        same = prefill_cfg.model_path == decode_cfg.model_path
        d_runner = ModelRunner(decode_cfg, model=p_runner.model if same else None)
        self.sender = KVSender(
            p_runner.layout,
            transfer_settings(
                kv_ready_timeout_s=timeout_s,
                kv_timeout_s=timeout_s,
                heartbeat_interval_s=0.2,
                heartbeat_timeout_s=2.0,
            ),
            model=model_fingerprint(p_runner.arch, p_runner.layout),
        )
        self.receiver = KVReceiver(
            d_runner.layout,
            transfer_settings(
                kv_timeout_s=timeout_s, heartbeat_timeout_s=2.0, heartbeat_interval_s=0.2
            ),
            model=model_fingerprint(d_runner.arch, d_runner.layout),
        )
        self.prefill = PrefillEngine(prefill_cfg, p_runner, self.sender)
        self.decode = DecodeEngine(decode_cfg, d_runner, self.receiver)
        self.events: dict[tuple[str, str], list[TokenEvent]] = defaultdict(list)

    def request(self, rid: str, room: int, prompt_len: int, max_tokens: int = 4) -> EngineRequest:
        ids = [5 + (i * 7) % 500 for i in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return EngineRequest(rid=rid, input_ids=ids, params=params, room=room,
                             bootstrap_host="127.0.0.1", bootstrap_port=self.sender.bootstrap_port)  # fmt: skip

    def step_prefill(self) -> None:
        for ev in self.prefill.step():
            self.events["prefill", ev.rid].append(ev)

    def step_decode(self) -> None:
        for ev in self.decode.step():
            self.events["decode", ev.rid].append(ev)

    def pump_until(self, cond: Callable[[], bool], timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > end:
                return False
            self.step_prefill()
            self.step_decode()
            time.sleep(0.002)
        return True

    def finished(self, side: str, rid: str) -> list[TokenEvent]:
        return [e for e in self.events[side, rid] if e.finished]

    def holdings(self) -> dict[str, object]:
        """What either side still holds (empty: everything free)."""
        out: dict[str, object] = {}
        for name, eng in (("prefill", self.prefill), ("decode", self.decode)):
            pool, alloc = eng.runner.req_pool, eng.runner.kv_pool.allocator
            if pool.free_rows != pool.total_rows:
                out[f"{name} rows"] = pool.total_rows - pool.free_rows
            free = eng.stats()["free_kv_pages"]  # a prefix cache's unreferenced pages are free
            if free != alloc.total_pages:
                out[f"{name} pages"] = alloc.total_pages - free
            if eng.has_unfinished():
                out[f"{name} requests"] = list(eng.reqs)
        if self.sender.active_rooms():
            out["sender rooms"] = self.sender.room_phases()
        if self.receiver.active_rooms():
            out["receiver rooms"] = self.receiver.active_rooms()
        return out

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
