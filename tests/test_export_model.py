"""`pdserve export-model`: the served folder of a model name, copied where servers share it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdserve.model.export import MARKER, export_model
from pdserve.model.resolve import resolve_model


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
