"""One name per setting from the flag to the field: each field of the engine's configs is
set by the flag named after it (config.flag_of; a switch on by default by `--disable-`
and that name), and the parsed flags give configs whose every field came from its flag."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, TransferConfig, flag_of
from pdserve.server.serve_flags import add_engine_flags, add_server_flags, config_from_flags
from pdserve.server.server_config import ServerConfig

CONFIGS = (TransferConfig, EngineConfig, CacheConfig, SchedulerConfig, ServerConfig)
# set otherwise: the role's command, the resolved --model, the nested configs (speculative:
# the decode's own flags, serve_flags.add_decode_flags); and the
# frontend's fields without a flag (docs/reliability.md)
NOT_FLAGS = {"role", "model_path", "cache", "scheduler", "speculative","engine_heartbeat_timeout_s",
             "health_generate_timeout_s", "default_max_new_tokens"}  # fmt: skip
# strings the configs check: a value they accept other than the default
ACCEPTED = {
    "dtype": "bfloat16",
    "weights": "float32",
    "device": "cuda",
    "quant_activations": "int8",
}
ROLES = ("prefill", "decode")


def _parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_server_flags(p, role)
    add_engine_flags(p)
    return p


def _flag(f: dataclasses.Field) -> str:
    return "--disable-" + flag_of(f.name)[2:] if f.default is True else flag_of(f.name)


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name not in NOT_FLAGS]


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_the_flag_named_after_it(cls: type) -> None:
    flags = {s for role in ROLES for s in _options(_parser(role))}
    missing = [f"{f.name}: {_flag(f)}" for f in _fields(cls) if _flag(f) not in flags]
    assert not missing, f"fields without their flag: {missing}"


def test_no_two_fields_share_a_flag() -> None:
    """(TransferConfig's `host` and the HTTP frontend's would both be `--host`.)"""
    flags = [_flag(f) for cls in CONFIGS for f in _fields(cls)]
    assert not sorted({f for f in flags if flags.count(f) > 1})


def _argv(p: argparse.ArgumentParser) -> tuple[list[str], dict[str, Any]]:
    """Flags setting every field this role has a flag for to a value of its own (never the
    default, never another field's), and those values by field name."""
    options, argv, want = _options(p), [], {}
    every = [f for cls in CONFIGS for f in _fields(cls)]
    for i, f in enumerate(every):
        action = options.get(_flag(f))
        if action is None:
            continue
        if isinstance(f.default, bool):
            argv.append(_flag(f))
            want[f.name] = not f.default
            continue
        if action.choices:
            value: Any = next(c for c in action.choices if c != f.default)
        elif isinstance(f.default, (int, float)):
            value = type(f.default)(1000 + 10 * i + (0.5 if isinstance(f.default, float) else 0))
        else:
            value = ACCEPTED.get(f.name, f"value-of-{f.name}")
        argv += [_flag(f), str(value)]
        want[f.name] = (value,) if isinstance(f.default, tuple) else value
    return argv, want


@pytest.mark.parametrize("role", ROLES)
def test_parsed_flags_give_configs_whose_fields_came_from_their_flags(role: str) -> None:
    p = _parser(role)
    argv, want = _argv(p)
    args = p.parse_args(argv)
    transfer = config_from_flags(TransferConfig, args)
    cache, scheduler = (
        config_from_flags(CacheConfig, args),
        config_from_flags(SchedulerConfig, args),
    )
    engine = config_from_flags(EngineConfig, args, model_path="m", cache=cache, scheduler=scheduler)
    server = config_from_flags(ServerConfig, args, role=role, model_path="m")
    for cfg in (transfer, engine, cache, scheduler, server):
        for f in _fields(type(cfg)):
            expected = want.get(f.name, f.default)  # no flag in this role: the default
            assert getattr(cfg, f.name) == expected, f"{type(cfg).__name__}.{f.name}"
    # the one field each role goes without
    assert {"prefill": "data_port", "decode": "bootstrap_port"}[role] not in want
