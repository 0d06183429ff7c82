"""The container engine for deploy/container_test.py: podman or docker, whichever works.

Host facts this handles (sandboxed hosts such as CI machines; see docs/deploy.md):
- podman: when CONTAINERS_CONF is unset, deploy/podman/containers.conf is used
  (runc, since crun refuses a hybrid cgroup layout; rlimits a sandbox grants);
- `podman build --format docker`, or podman drops the HEALTHCHECK;
- podman runs no healthcheck timer without systemd: health is probed with
  `podman healthcheck run`;
- pip inside the build trusts the host's CA bundle (PDSERVE_BUILD_CA, default
  /etc/ssl/certs/ca-certificates.crt), bind-mounted for the build only (podman).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = (
    "install podman and runc (Debian: apt-get install podman runc), or start a docker daemon"
)
WHEEL_PORT = 39871  # fixed, so TORCH_INDEX_URL (a build argument) keeps the layer cache


@dataclass(frozen=True)
class Engine:
    name: str  # "podman" | "docker"
    env: dict[str, str]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([self.name, *args], env=self.env, capture_output=True, text=True)
        if check and r.returncode != 0:
            raise RuntimeError(f"{self.name} {' '.join(args)}: exit {r.returncode}\n{r.stderr}")
        return r

    def lines(self, *args: str) -> list[str]:
        return [ln for ln in self.run(*args).stdout.splitlines() if ln.strip()]

    def logs(self, name: str) -> str:
        r = self.run("logs", name, check=False)
        return r.stdout + r.stderr

    def state(self, name: str) -> str:
        return self.run(
            "inspect", "--format", "{{.State.Status}}", name, check=False
        ).stdout.strip()

    def healthy(self, name: str) -> bool:
        if self.name == "podman":
            return self.run("healthcheck", "run", name, check=False).returncode == 0
        fmt = "{{.State.Health.Status}}"
        return self.run("inspect", "--format", fmt, name, check=False).stdout.strip() == "healthy"

    def describe(self) -> str:
        version = self.run("--version", check=False).stdout.strip()
        conf = self.env.get("CONTAINERS_CONF", "")
        return version + (f" (CONTAINERS_CONF={conf})" if conf else "")


def find_engine(root: Path) -> Engine:
    """CONTAINER_ENGINE if set, else the first of podman, docker that answers `info`."""
    wanted = os.environ.get("CONTAINER_ENGINE")
    for name in [wanted] if wanted else ["podman", "docker"]:
        if shutil.which(name) is None:
            continue
        env = dict(os.environ)
        if name == "podman" and "CONTAINERS_CONF" not in env and shutil.which("runc"):
            env["CONTAINERS_CONF"] = str(root / "deploy" / "podman" / "containers.conf")
        eng = Engine(name, env)
        if eng.run("info", check=False).returncode == 0:
            return eng
    raise SystemExit(f"container-test: no working container engine; {INSTALL_HINT}")


def build_image(eng: Engine, root: Path, env: dict[str, str], log: Callable[[str], None]) -> None:
    """Build env's PDSERVE_IMAGE from root/Dockerfile with the compose build arguments."""
    argv = ["build", "-t", env["PDSERVE_IMAGE"], "--network", "host"]
    for arg, var in (("BASE_IMAGE", "PDSERVE_BASE_IMAGE"), ("TORCH_INDEX_URL", "TORCH_INDEX_URL")):
        if env.get(var):
            argv += ["--build-arg", f"{arg}={env[var]}"]
    if eng.name == "podman":
        argv += ["--format", "docker"]
        ca = env.get("PDSERVE_BUILD_CA", "/etc/ssl/certs/ca-certificates.crt")
        if ca and Path(ca).is_file():
            argv += ["-v", f"{ca}:/run/host-ca.crt:ro", "--build-arg", "PIP_CERT=/run/host-ca.crt"]
    build_log = Path(tempfile.gettempdir()) / "pdserve-container-test-build.log"
    log(f"build: {eng.name} {' '.join(argv)} .  (log: {build_log})")
    with build_log.open("w") as out:
        r = subprocess.run([eng.name, *argv, str(root)], env=eng.env, stdout=out, stderr=out)
    if r.returncode != 0:
        tail = "\n".join(build_log.read_text().splitlines()[-25:])
        raise RuntimeError(f"image build failed (exit {r.returncode}):\n{tail}")
    log(
        "build: done; " + eng.lines("image", "ls", "--format", "{{.Size}}", env["PDSERVE_IMAGE"])[0]
    )


def serve_wheels(env: dict[str, str], log: Callable[[str], None]) -> Callable[[], None]:
    """With TORCH_WHEEL_DIR set, serve its torch wheels as a package index on 127.0.0.1
    for the build and point TORCH_INDEX_URL at it; returns the function that stops it."""
    folder = env.get("TORCH_WHEEL_DIR")
    if not folder:
        return lambda: None
    wheels = sorted(Path(folder).glob("torch-*.whl"))
    if not wheels:
        raise SystemExit(f"container-test: TORCH_WHEEL_DIR={folder} holds no torch-*.whl")
    page = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in wheels)

    class Index(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") in ("", "/torch"):
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.end_headers()
                self.wfile.write(page.encode())
            else:
                self.path = "/" + self.path.rsplit("/", 1)[-1]
                super().do_GET()

        def log_message(self, *args: object) -> None:
            pass

    port = int(env.get("PDSERVE_WHEEL_PORT", WHEEL_PORT))
    handler = functools.partial(Index, directory=folder)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env["TORCH_INDEX_URL"] = f"http://127.0.0.1:{port}/"
    log(f"torch wheels from {folder} at {env['TORCH_INDEX_URL']}: {[w.name for w in wheels]}")

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return stop


DEBIAN_BASE = "localhost/pdserve-base:bookworm"
DEBIAN_PACKAGES = "python3,python3-venv,ca-certificates"


def ensure_base(eng: Engine, env: dict[str, str], log: Callable[[str], None]) -> None:
    """Without PDSERVE_BASE_IMAGE: a base made from Debian packages when mmdebstrap is
    here (kept for later runs), else the Dockerfile's default from a registry."""
    if env.get("PDSERVE_BASE_IMAGE"):
        return
    if eng.name != "podman" or shutil.which("mmdebstrap") is None:
        log("base: the Dockerfile's default BASE_IMAGE (from a registry)")
        return
    env["PDSERVE_BASE_IMAGE"] = DEBIAN_BASE
    if eng.run("image", "exists", DEBIAN_BASE, check=False).returncode == 0:
        log(f"base: {DEBIAN_BASE} (exists)")
        return
    log(f"base: making {DEBIAN_BASE} with mmdebstrap ({DEBIAN_PACKAGES})")
    mm = subprocess.Popen(
        ["mmdebstrap", "--variant=minbase", f"--include={DEBIAN_PACKAGES}", "bookworm", "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    imp = subprocess.run(
        [eng.name, "import", "-q", "-", DEBIAN_BASE], stdin=mm.stdout, env=eng.env, text=True
    )
    if mm.wait() != 0 or imp.returncode != 0:
        raise RuntimeError(f"base: mmdebstrap exit {mm.returncode}, import exit {imp.returncode}")


def local_torch_wheels(env: dict[str, str], version: str) -> str | None:
    """A folder from pip's find-links (PIP_FIND_LINKS or `pip config`) holding the CPU
    torch `version` wheel, or None."""
    links = env.get("PIP_FIND_LINKS", "").split()
    r = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True,
        text=True,
    )
    links += r.stdout.split() if r.returncode == 0 else []
    for link in links:
        folder = Path(link.removeprefix("file://"))
        if folder.is_dir() and any(folder.glob(f"torch-{version}+cpu-*.whl")):
            return str(folder)
    return None
