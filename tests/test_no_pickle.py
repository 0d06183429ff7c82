"""No pickle-family serializer anywhere in pdserve/, and loopback-only defaults."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from pdserve.config import TransferConfig
from pdserve.server.server_config import ServerConfig

PKG = Path(__file__).resolve().parents[1] / "pdserve"
FORBIDDEN = {"pickle", "cPickle", "_pickle", "dill", "marshal", "shelve", "cloudpickle"}
# multiprocessing pickles every argument it passes to a child; shared_memory alone does not
MP_OK = {"multiprocessing.shared_memory"}


def imported_modules(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            out += [a.value for a in node.args if isinstance(a, ast.Constant)]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
            out += [a.value for a in node.args if isinstance(a, ast.Constant)]
    return [m for m in out if isinstance(m, str)]


def offenders(source: str) -> list[str]:
    bad = []
    for mod in imported_modules(ast.parse(source)):
        root = mod.split(".")[0]
        if root in FORBIDDEN:
            bad.append(mod)
        elif root == "multiprocessing" and not any(mod.startswith(ok) for ok in MP_OK):
            bad.append(mod)
        elif mod.startswith("concurrent.futures.Process"):
            bad.append(mod)
    return bad


def test_scanner_catches_each_form() -> None:
    for src in ["import pickle", "from dill import dumps", "import marshal as m",
                "import multiprocessing", "from multiprocessing import Process",
                "from concurrent.futures import ProcessPoolExecutor",
                "importlib.import_module('pickle')", "__import__('cPickle')"]:  # fmt: skip
        assert offenders(src), src
    assert not offenders("import msgspec\nfrom multiprocessing.shared_memory import SharedMemory")


def test_no_pickle_family_import_in_pdserve() -> None:
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 20
    found = {str(f.relative_to(PKG)): b for f in files if (b := offenders(f.read_text()))}
    assert not found, found


def test_sockets_bind_loopback_by_default() -> None:
    t, s = TransferConfig(), ServerConfig(role="prefill", model_path="m")
    assert t.transfer_host == "127.0.0.1" and t.advertise_host == "127.0.0.1"
    assert s.host == "127.0.0.1"
    router_host = [f.default for f in dataclasses.fields(_router_config()) if f.name == "host"]
    assert router_host == ["127.0.0.1"]


def _router_config() -> type:
    from pdserve.router.app import RouterConfig

    return RouterConfig
