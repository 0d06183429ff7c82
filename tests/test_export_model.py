"""`pdserve export-model`: the served folder of a model name, copied where servers share it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.checkpoints.export import MARKER, export_model
from pdserve.checkpoints.resolve import resolve_model


def test_export_copies_the_served_folder_once(tmp_path: Path) -> None:
    out = tmp_path / "model"
    export_model("tiny", out)
    src = resolve_model("tiny").path
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert (out / MARKER).read_text() == "tiny"
    stamp = (out / "config.json").stat().st_mtime_ns
    export_model("tiny", out)  # same model: left as it is (a restarted compose service)
    assert (out / "config.json").stat().st_mtime_ns == stamp


def test_export_of_another_model_replaces_the_folder(tmp_path: Path) -> None:
    out = tmp_path / "model"
    export_model("tiny", out)
    export_model("tiny-qwen2", out)
    assert '"Qwen2ForCausalLM"' in (out / "config.json").read_text()
    assert not (tmp_path / "model.tmp").exists()


def test_cli(tmp_path: Path) -> None:
    out = tmp_path / "m"
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "export-model",
        "--model",
        "tiny",
        "--out",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (out / "tokenizer.json").is_file() and "exported 'tiny'" in r.stdout


def _run_cli(model: Path, out: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "export-model", "--model", str(model)]
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache)}
    return subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize(
    "kw, words",
    [({"arch": "gpt2"}, ["general.architecture = 'gpt2'", "supported: llama"]),
     ({"odd_tensor": ("blk.0.ffn_down.weight", "F64")},
      ["'blk.0.ffn_down.weight'", "F64", "supported: F32"])],
)  # fmt: skip
def test_cli_refuses_an_unsupported_gguf_in_one_line(tmp_path: Path, kw, words) -> None:
    from gguf_files import write_llama_gguf

    path = write_llama_gguf(tmp_path / "odd.gguf", "Q8_0", **kw)
    r = _run_cli(path, tmp_path / "out", tmp_path / "cache")
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pdserve export-model: error: {path}: ")
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "out").exists()


def test_cli_names_a_missing_file(tmp_path: Path) -> None:
    r = _run_cli(tmp_path / "nope.gguf", tmp_path / "out", tmp_path / "cache")
    assert r.returncode == 1 and "nope.gguf does not exist" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
