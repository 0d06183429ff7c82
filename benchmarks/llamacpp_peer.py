"""llama.cpp's `llama-server` as a peer in compare.py, serving the GGUF pdserve serves.

    --llama-server PATH     the binary (default: DIR/build/bin/llama-server under
                            --setup-llamacpp's DIR where built, else `llama-server` on PATH)
    --setup-llamacpp DIR    fetch the llama-cpp-python sdist (it vendors llama.cpp's source)
                            into DIR with pip and build its llama-server there with cmake
    --gguf FILE             the file llama.cpp serves (default: the GGUF the model came
                            from, which pdserve's --weights quantized reads its blocks from)

The server runs with continuous batching, one slot per request in flight (--parallel C,
each slot the context of the longest request) and as many threads, for both its decode and
its prompt batches, as the machine has cores: what pdserve's two engines share.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
# The build names the x86 vector paths one by one instead of GGML_NATIVE: on a VM whose CPU
# reports AMX, the native build's AMX code path dies with SIGILL.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON",
    "-DGGML_AVX512_BF16=ON",
)  # fmt: skip


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="llama.cpp's llama-server binary (default: built by --setup-llamacpp, "
                         "else on PATH)")  # fmt: skip
    ap.add_argument("--setup-llamacpp", default=None, metavar="DIR",
                    help=f"download the {SDIST} sdist into DIR and build its vendored "
                         "llama-server there first (once)")  # fmt: skip
    ap.add_argument("--gguf", default=None, metavar="FILE",
                    help="the GGUF llama.cpp serves (default: the model's own GGUF; "
                         "alone, it is also the model pdserve serves)")  # fmt: skip
    ap.add_argument("--llamacpp-args", default="",
                    help='extra llama-server flags: --llamacpp-args="--flash-attn on"')  # fmt: skip


def source_dir(root: Path) -> Path | None:
    """The vendored llama.cpp source tree under `root` (the unpacked sdist), or None."""
    found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return found[-1] if found else None


def built_binary(root: Path) -> Path | None:
    src = source_dir(root)
    binary = src / "build" / "bin" / "llama-server" if src else None
    return binary if binary and binary.is_file() else None


def setup_llamacpp(root: Path) -> Path:
    """Download, unpack and build llama-server under `root` unless already built; its path."""
    found = built_binary(root)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    if source_dir(root) is None:
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            subprocess.run([*pip, "-d", str(root), SDIST], check=True)
            sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(root, filter="data")
    src = source_dir(root)
    if src is None:
        raise RuntimeError(f"no vendor/llama.cpp in the sdist under {root}")
    subprocess.run(["cmake", "-B", "build", *CMAKE_FLAGS], cwd=src, check=True)
    jobs = str(os.cpu_count() or 1)
    build = ["cmake", "--build", "build", "--target", "llama-server", "-j", jobs]
    subprocess.run(build, cwd=src, check=True)
    return src / "build" / "bin" / "llama-server"


def find_binary(args: argparse.Namespace) -> Path | None:
    if args.llama_server:
        return Path(args.llama_server)
    if args.setup_llamacpp and (found := built_binary(Path(args.setup_llamacpp))):
        return found
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


def version(binary: Path) -> str | None:
    """llama-server's `--version` line ('version: 1 (abc123)'), None if it does not run."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    except OSError:
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("version:"):
            return line.split(":", 1)[1].strip()
    return None


def server_argv(binary: Path, gguf: Path, port: int, args: argparse.Namespace) -> list[str]:
    slot = args.input_len[1] + args.output_len[1] + 16
    threads = str(os.cpu_count() or 1)
    return [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", threads, "--threads-batch", threads,
            "--parallel", str(args.concurrency), "--cont-batching",
            "--ctx-size", str(args.concurrency * slot), "--no-webui",
            *shlex.split(args.llamacpp_args)]  # fmt: skip
