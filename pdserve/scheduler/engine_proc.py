"""The engine process: one engine (prefill or decode) driven by its frontend over ZeroMQ.

Started by the frontend as
    python -m pdserve.scheduler.engine_proc --ipc-dir DIR --parent-pid PID --config-json JSON
where JSON is `{"role": ..., "engine": EngineConfig, "transfer": TransferConfig}`
(plain JSON decoded into typed msgspec structs). The loop:

    drain frontend messages (non-blocking; blocking poll with a short timeout when idle)
      -> engine.add_request / engine.abort / stats
    events = engine.step()  -> one Events message
    heartbeat every HEARTBEAT_S

Invariants: the process exits when its parent (the frontend) is gone, so no
engine outlives its frontend; a failure to build or step the engine is reported
as one EngineError message before exiting with status 1.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import msgspec
import zmq

from pdserve import protocol as P
from pdserve.config import EngineConfig, TransferConfig
from pdserve.protocol import TokenEvent
from pdserve.scheduler.engine_api import Engine
from pdserve.transfer.heap import keep_freed_memory

log = logging.getLogger("pdserve.engine_proc")

IDLE_POLL_MS = 5  # poll timeout while the engine has nothing to compute (it still steps)
# poll timeout with no request at all: then only a message (which ends the poll at once)
# or the heartbeat needs the loop, and an idle engine should not spend a core's percent
# waking up every IDLE_POLL_MS
EMPTY_POLL_MS = 100
HEARTBEAT_S = 0.5
PARENT_CHECK_S = 0.5

EngineBuilder = Callable[[str, EngineConfig, TransferConfig], Engine]


class EngineLoop:
    """Owns the sockets and the engine; `run` returns when told to stop."""

    def __init__(self, engine: Engine, ctx: zmq.Context, ipc_dir: str) -> None:
        to_engine, from_engine = P.ipc_paths(ipc_dir)
        self.engine = engine
        self.pull = ctx.socket(zmq.PULL)
        self.pull.connect(to_engine)
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)  # never drop or block on events
        self.push.connect(from_engine)
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)
        self.stopping = False
        self._last_beat = 0.0
        engine.publish = self.publish  # the loop's thread calls step(), hence publish too

    def publish(self, events: list[TokenEvent]) -> None:
        self.send(P.Events(events=events))

    def send(self, msg: P._Msg) -> None:
        self.push.send(P.encode(msg))

    def run(self) -> None:
        while not self.stopping:
            self._drain(self._wait_ms())
            if self.stopping:
                break
            # Step even when idle: transfers complete in the background and are seen
            # only by step(); has_work() just says whether to wait first.
            events = self.engine.step()
            if events:
                self.send(P.Events(events=events))
            self._heartbeat()

    def _wait_ms(self) -> int:
        """How long to wait for a message before the next step."""
        if self.engine.has_work():
            return 0
        # NOTE: no transfer runs without a request, so none can complete unseen meanwhile
        return IDLE_POLL_MS if self.engine.has_unfinished() else EMPTY_POLL_MS

    def _drain(self, timeout_ms: int) -> int:
        """Handle every message waiting now (after at most `timeout_ms` of waiting)."""
        n = 0
        if not self.poller.poll(timeout_ms):
            return 0
        while True:
            try:
                raw = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return n
            n += 1
            self._handle(P.to_engine_decoder.decode(raw))

    def _handle(self, msg: P.ToEngine) -> None:
        if isinstance(msg, P.GenerateReq):
            self._add(msg.req)
        elif isinstance(msg, P.Abort):
            self.engine.abort(msg.rid, msg.reason)
        elif isinstance(msg, P.StatsReq):
            self.send(P.Stats(nonce=msg.nonce, stats=dict(self.engine.stats())))
        elif isinstance(msg, P.Shutdown):
            self.stopping = True

    def _add(self, req: P.EngineRequest) -> None:
        """One request in; one that raises is answered with its error, and the loop goes
        on (a bad request must not end every other one)."""
        try:
            self.engine.add_request(req)
        except Exception as e:
            log.exception("request %s refused by an internal error", req.rid)
            error = f"internal error: {type(e).__name__}: {e}"
            self.publish([TokenEvent(rid=req.rid, finished=True, error=error)])

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            self.send(P.Heartbeat(time=time.time()))


def _watch_parent(parent_pid: int) -> None:
    """Exit at once when the frontend is gone (we get re-parented): no orphan engines."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(PARENT_CHECK_S)


def _report_error(ctx: zmq.Context, ipc_dir: str, message: str) -> None:
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(P.ipc_paths(ipc_dir)[1])
    push.send(P.encode(P.EngineError(message=message)))
    push.close()


def _default_builder() -> EngineBuilder:
    # lazy: torch, the model and the transfer load only in a real engine process
    from pdserve.scheduler.build import build_engine

    return build_engine


def serve(spec: P.EngineSpec, ipc_dir: str, build: EngineBuilder | None = None) -> int:
    build = build or _default_builder()
    if spec.engine.nice:
        os.nice(spec.engine.nice)  # the whole process: its threads inherit it
    keep_freed_memory()  # before the transfer's sockets and the model's buffers exist
    ctx = zmq.Context()
    try:
        engine = build(spec.role, spec.engine, spec.transfer)
    except KeyboardInterrupt:  # Ctrl+C while the model loads: gone quietly (see below)
        return 130
    except ValueError as e:  # a refusal (device, model, config field) says why by itself
        log.debug("engine refused to start", exc_info=True)  # where, for --log-level debug
        _report_error(ctx, ipc_dir, f"engine refused to start: {e}")
        return 1
    except Exception as e:
        log.exception("engine build failed")
        _report_error(ctx, ipc_dir, f"engine build failed: {type(e).__name__}: {e}")
        return 1
    # NOTE: everything built so far (modules, the model, pools, the transfer) lives as
    # long as the process. Freezing it takes it out of the cyclic collector's
    # generations, so a collection during a step or a KV transfer walks only what that
    # step allocated, not the whole heap (full collections showed up at ~5% of a
    # transfer's CPU time).
    gc.freeze()
    loop = EngineLoop(engine, ctx, ipc_dir)
    signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "stopping", True))
    # NOTE: Ctrl+C in a terminal signals every process of the group, the frontend and its
    # engine alike. The engine leaves it to the frontend, which stops it (SIGTERM) once its
    # own graceful shutdown is done: requests still streaming get their last tokens, and
    # no KeyboardInterrupt traceback. A frontend that dies instead: _watch_parent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loop.send(P.EngineReady(role=spec.role, pid=os.getpid()))
    try:
        loop.run()
    except Exception as e:
        log.error("engine loop failed:\n%s", traceback.format_exc())
        loop.send(P.EngineError(message=f"engine failed: {type(e).__name__}: {e}"))
        return 1
    finally:
        engine.close()
        loop.push.setsockopt(zmq.LINGER, 1000)
        ctx.destroy(linger=1000)
    return 0


def main(argv: list[str] | None = None, build: EngineBuilder | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve.scheduler.engine_proc")
    ap.add_argument("--ipc-dir", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    spec = msgspec.json.decode(args.config_json, type=P.EngineSpec)
    return serve(spec, args.ipc_dir, build)


def exit_now(code: int) -> None:
    """End the process with `code` once logs and stdio are flushed, skipping the
    interpreter's teardown: everything was closed by then (serve), and the teardown only
    made Triton's bindings (nanobind) print a page of "leaked instance" lines at every
    engine shutdown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
