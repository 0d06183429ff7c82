"""compare.py's llama.cpp peer: the llama-server command (one slot per request in flight,
every core, the GGUF), the workload sent to it, its row; and why a row is missing."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

from benchmarks import compare  # as tests import benchmarks.soak: no sys.path change
from pdserve.bench.config import BenchConfig

# A stand-in llama-server: records its argv and each request body, answers /health,
# /v1/models and streamed /v1/completions (one chunk per token, then usage).
FAKE = r"""#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
if argv == ["--version"]:
    print("version: 1 (fake)"); sys.exit(0)
rec = open({record!r}, "a")
rec.write(json.dumps({{"argv": argv}}) + "\n"); rec.flush()
port = int(argv[argv.index("--port") + 1])

class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _json(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        self._json({{"status": "ok"}} if self.path == "/health" else {{"data": [{{"id": "m"}}]}})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rec.write(json.dumps({{"body": req}}) + "\n"); rec.flush()
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = req["max_tokens"]
        for _ in range(n):
            self.wfile.write(b'data: {{"choices": [{{"text": "x"}}]}}\n\n'); self.wfile.flush()
        usage = {{"choices": [], "usage": {{"prompt_tokens": len(req["prompt"]), "completion_tokens": n}}}}
        self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        self.close_connection = True

HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _fake(tmp_path: Path) -> tuple[Path, Path]:
    record = tmp_path / "record.jsonl"
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE.format(python=sys.executable, record=str(record)))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake, record


def test_llama_server_serves_the_gguf_with_a_slot_per_request_in_flight(tmp_path: Path) -> None:
    fake, record = _fake(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    argv = ["--llama-server", str(fake), "--gguf", str(gguf), "--num-prompts", "3",
            "--concurrency", "2", "--input-len", "4:8", "--output-len", "3:5",
            "--num-warmup", "1", "--startup-timeout", "60"]  # fmt: skip
    args = compare.parse_args(argv)
    cfg = BenchConfig(
        backend="openai", dataset="random", num_prompts=3, num_warmup=1, max_concurrency=2,
        random_input_len=(4, 8), random_output_len=(3, 5), random_tokens_as_ids=True,
        vocab_size=100, temperature=0.0, disable_progress=True,
    )  # fmt: skip
    row = compare.run_llamacpp(args, str(tmp_path), cfg)
    assert row["status"] == "ok", row
    assert row["version"] == "1 (fake)"
    assert row["metrics"]["completed"] == 3
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    server = lines[0]["argv"]
    flag = {a: b for a, b in zip(server, server[1:], strict=False) if a.startswith("--")}
    cores = str(os.cpu_count())
    assert flag["--model"] == str(gguf.resolve()) and "--cont-batching" in server
    assert (flag["--parallel"], flag["--threads"], flag["--threads-batch"]) == ("2", cores, cores)
    assert flag["--ctx-size"] == str(2 * (8 + 5 + 16))  # each slot the longest request
    bodies = [x["body"] for x in lines[1:]]
    assert len(bodies) == 4  # the warm-up and the three measured
    for body in bodies:
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0.0
        assert all(isinstance(t, int) for t in body["prompt"]) and 4 <= len(body["prompt"]) <= 8
    measured = sum(b["max_tokens"] for b in bodies[1:])
    assert row["metrics"]["total_output_tokens"] == measured


def test_a_missing_binary_or_gguf_is_said_in_the_row(tmp_path: Path) -> None:
    args = compare.parse_args(["--llama-server", str(tmp_path / "absent")])
    cfg = BenchConfig(backend="openai")
    assert compare.run_llamacpp(args, str(tmp_path), cfg)["status"] == "not installed"
    fake, _ = _fake(tmp_path)
    args = compare.parse_args(["--llama-server", str(fake)])
    status = compare.run_llamacpp(args, str(tmp_path), cfg)["status"]  # a folder, no GGUF
    assert status.startswith("skipped: the model has no GGUF")


def test_pdserve_weights_setting_follows_the_model_and_flags(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    args = compare.parse_args([])
    assert compare.pdserve_weights(args, str(folder)) == "float32"  # no source.gguf
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (folder / "source.gguf").symlink_to(tmp_path / "m.gguf")
    assert compare.pdserve_weights(args, str(folder)).startswith("quantized")
    for flags in ("--weights float32", "--weights=float32"):
        args = compare.parse_args([f"--pdserve-args={flags}"])
        assert compare.pdserve_weights(args, str(folder)) == "float32"


def test_setup_unpacks_the_sdist_and_builds_only_llama_server(tmp_path: Path, monkeypatch) -> None:
    import io
    import subprocess
    import tarfile

    from benchmarks import llamacpp_peer

    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        info = tarfile.TarInfo("llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt")
        tar.addfile(info, io.BytesIO(b""))
    calls: list[tuple[list[str], Path]] = []

    def run(cmd: list[str], cwd: Path | None = None, check: bool = False) -> None:
        calls.append((cmd, Path(cwd or ".")))
        if "--build" in cmd:  # what cmake's build leaves
            binary = Path(cwd or ".") / "build" / "bin" / "llama-server"
            binary.parent.mkdir(parents=True)
            binary.write_text("")

    monkeypatch.setattr(subprocess, "run", run)
    binary = llamacpp_peer.setup_llamacpp(tmp_path)
    src = tmp_path / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    assert binary == src / "build" / "bin" / "llama-server"
    (configure, where), (build, _) = calls  # the sdist was there: no download
    assert where == src and configure[:3] == ["cmake", "-B", "build"]
    assert "-DGGML_NATIVE=OFF" in configure and "-DGGML_AVX512=ON" in configure
    assert build[:5] == ["cmake", "--build", "build", "--target", "llama-server"]
    assert llamacpp_peer.setup_llamacpp(tmp_path) == binary and len(calls) == 2  # built once
