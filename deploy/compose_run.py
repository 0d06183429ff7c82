"""The services of docker-compose.yml as plain `podman run` / `docker run` commands.

Used by deploy/container_test.py instead of a compose tool: podman-compose 1.0.3
(Debian 12) ignores profiles and `depends_on` conditions, and `docker compose`
needs a daemon. This reads only the subset of the compose format our file uses:
`${VAR}` / `${VAR:-default}` interpolation, profiles, depends_on with conditions,
named volumes, environment maps (a key without a value passes the host's variable
through when set), ports "HOST:PORT:CONTAINER", healthcheck.disable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)|\$\$")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose-style `${VAR}`, `${VAR:-default}`, `$VAR` and `$$` in every string of `value`."""
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group(1) or m.group(3)
            return env.get(name) or (m.group(2) or "")

        return VAR.sub(sub, value)
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    return value


@dataclass(frozen=True)
class Service:
    name: str
    command: list[str]
    env: dict[str, str | None]  # None: pass the host's variable through if set
    volumes: list[str]  # "SOURCE:TARGET[:ro]"
    ports: list[str]  # "HOST:PORT:CONTAINER"
    depends_on: dict[str, str]  # service -> condition
    healthcheck: bool
    image: str
    build_target: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


def load(path: Path, env: Mapping[str, str], profiles: set[str] | None = None) -> list[Service]:
    """The services active without (or with) `profiles`, in an order that honours depends_on."""
    spec = interpolate(yaml.safe_load(path.read_text()), env)
    active = profiles or set()
    chosen = {
        name: svc
        for name, svc in spec["services"].items()
        if not svc.get("profiles") or active & set(svc["profiles"])
    }
    services = {name: _service(name, svc) for name, svc in chosen.items()}
    return _ordered(services)


def named_volumes(path: Path) -> list[str]:
    return list((yaml.safe_load(path.read_text()).get("volumes") or {}).keys())


def _service(name: str, svc: dict[str, Any]) -> Service:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        deps = {d: {"condition": "service_started"} for d in deps}
    return Service(
        name=name,
        command=[str(c) for c in svc.get("command") or []],
        env={k: None if v is None else str(v) for k, v in (svc.get("environment") or {}).items()},
        volumes=[str(v) for v in svc.get("volumes") or []],
        ports=[str(p) for p in svc.get("ports") or []],
        depends_on={d: c.get("condition", "service_started") for d, c in deps.items()},
        healthcheck=not (svc.get("healthcheck") or {}).get("disable", False),
        image=str(svc["image"]),
        build_target=(svc.get("build") or {}).get("target"),
    )


def _ordered(services: dict[str, Service]) -> list[Service]:
    out: list[Service] = []
    seen: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in seen:
            return
        if name in path:
            raise ValueError(f"depends_on cycle: {' -> '.join((*path, name))}")
        if name not in services:
            raise ValueError(f"{path[-1]} depends on {name}, which is not active")
        for dep in services[name].depends_on:
            visit(dep, (*path, name))
        seen.add(name)
        out.append(services[name])

    for name in services:
        visit(name, ())
    return out


def run_argv(engine: str, project: str, svc: Service, env: Mapping[str, str]) -> list[str]:
    """`ENGINE run -d ...` for `svc` in `project` (restart policies left out: a crash must show)."""
    argv = [engine, "run", "-d", "--name", f"{project}_{svc.name}"]
    argv += ["--network", f"{project}_default", "--network-alias", svc.name]
    argv += ["--label", f"pdserve.container-test={project}"]
    for v in svc.volumes:
        source, rest = v.split(":", 1)
        named = not source.startswith((".", "/"))
        argv += [
            "-v",
            f"{project}_{source}:{rest}" if named else f"{os.path.abspath(source)}:{rest}",
        ]
    for k, val in svc.env.items():
        if val is not None:
            argv += ["-e", f"{k}={val}"]
        elif k in env:
            argv += ["-e", f"{k}={env[k]}"]
    for p in svc.ports:
        argv += ["-p", p]
    if not svc.healthcheck:
        argv += ["--no-healthcheck"]
    return argv + [svc.image, *svc.command]
