"""The composition root: an engine for a server role, wired from the model runner
(model + pools), the ZeroMQ KV channel (transfer) and the scheduler. Nothing below
the scheduler knows the others; only this module puts them together."""

from __future__ import annotations

from dataclasses import replace

from pdserve.config import EngineConfig, TransferConfig
from pdserve.kernels.core_share import Cores
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.decode import DecodeEngine
from pdserve.scheduler.engine_api import Engine
from pdserve.scheduler.prefill import PrefillEngine
from pdserve.transfer.curve import load_keys
from pdserve.transfer.identity import model_fingerprint
from pdserve.transfer.receiving.receiver import KVReceiver
from pdserve.transfer.sending.sender import KVSender


def build_engine(role: str, cfg: EngineConfig, transfer: TransferConfig) -> Engine:
    """role "prefill": binds the bootstrap socket; role "decode": binds a data socket."""
    # this engine's cores, shared with the other engines on its host where `pdserve up`
    # says so: one policy for its forwards, kernels, prefill-first and KV transfer
    cores = Cores.for_engine(cfg.core_share, cfg.device, cfg.num_threads)
    runner = ModelRunner(cfg, cores=cores)
    curve = load_keys(transfer.curve_secret_key_file)
    model = model_fingerprint(runner.arch, runner.layout)
    native = runner.native_dir() is not None  # off under --disable-compile
    if role == "prefill":
        sink = KVSender(
            runner.layout,
            transfer,
            model=model,
            curve=curve,
            native=native,
            kernel_threads=cores.kernel_threads,
        )
        return PrefillEngine(cfg, runner, sink)
    if role == "decode":
        settings = replace(transfer, advertise_host=_advertise_host(transfer.advertise_host))
        source = KVReceiver(
            runner.layout,
            settings,
            model=model,
            curve=curve,
            native_scatter=native,
            kernel_threads=cores.kernel_threads,
        )
        return DecodeEngine(cfg, runner, source)
    raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")


def _advertise_host(value: str) -> str:
    """ "auto" resolves to this host's address (a container's own IP), else as given."""
    if value != "auto":
        return value
    import socket

    return socket.gethostbyname(socket.gethostname())
