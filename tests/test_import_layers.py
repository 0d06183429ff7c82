"""The packages form a one-way stack (docs/architecture.md §1): each imports only those below it.
(kernels/native/ and the two sides of transfer/ have rules of their own: the end of this file.)

    cli.py, llm.py, __init__.py                      top: may import anything
    server/ (frontends, launcher)   router/   bench/  start processes, speak HTTP / protocol.py
    edge/                                            the HTTP edge rules server/ and router/ share
    scheduler/                                       engines, engine process, composition root
    model/          transfer/                        (siblings: neither knows the other)
    checkpoints/                                     what lies on disk (below model/)
    kernels/        kvcache/                         the bottom
    protocol.py  config.py  sampling_params.py  envs.py  netaddr.py     leaves anyone may import

Every import counts: module-level, inside functions, and module names given as
strings (`importlib.import_module("pdserve....")`, or any string constant that names
a pdserve module), so a cycle cannot hide behind a lazy import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pdserve"

LEAVES = {"protocol", "config", "sampling_params", "envs", "netaddr"}
# what each leaf may import (besides itself)
LEAF_DEPS = {"protocol": {"config", "sampling_params"}, "config": set(), "envs": set()}
LEAF_DEPS["sampling_params"] = set()
LEAF_DEPS["netaddr"] = set()
TOP = {"cli", "llm", "__init__"}
# package -> the packages below it that it may import (leaves are always allowed)
MAY_IMPORT: dict[str, set[str]] = {
    "kvcache": set(),
    "kernels": set(),
    "checkpoints": set(),
    "model": {"kvcache", "kernels", "checkpoints"},
    "transfer": {"kvcache", "kernels"},
    "scheduler": {"model", "transfer", "kernels", "kvcache"},
    "edge": set(),
    "server": {"edge", "checkpoints"},
    "router": {"edge"},
    "bench": set(),
}
# Narrow, named exceptions (none today): a frontend resolves a model name to a folder
# through checkpoints/, which it may import, and never imports the model.
EXCEPTIONS: set[tuple[str, str]] = set()
# Module names a package may put on a command line: it starts that program as a new
# process (`python -m NAME`) and never imports it.
PROCESS_ENTRIES = {
    ("server", "pdserve.scheduler.engine_proc"),
    ("server", "pdserve.cli"),
}


def layer_of(module: str) -> str:
    """'pdserve.scheduler.decode' -> 'scheduler'; 'pdserve.config' -> 'config'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def referenced_modules(tree: ast.AST) -> list[tuple[str, bool]]:
    """(pdserve module, named-as-string) for every import and module-name string."""
    out: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, False) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "pdserve":  # `from pdserve import protocol as P`
                out += [(f"pdserve.{a.name}", False) for a in node.names]
            else:
                out.append((node.module, False))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if is_module(node.value):  # not a logger name that merely looks like one
                out.append((node.value, True))
    return [(m, s) for m, s in out if m == "pdserve" or m.startswith("pdserve.")]


def is_module(name: str) -> bool:
    if not name.startswith("pdserve.") or not name.replace(".", "").isidentifier():
        return False
    path = PKG.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def violation(src_module: str, target: str, as_string: bool) -> str | None:
    src, dst = layer_of(src_module), layer_of(target)
    if target == "pdserve" or src == dst or src in TOP:
        return None
    if as_string and (src, target) in PROCESS_ENTRIES:
        return None
    if (src, target) in EXCEPTIONS:
        return None
    if src in LEAVES:
        ok = dst in LEAF_DEPS[src]
    else:
        ok = dst in LEAVES or dst in MAY_IMPORT[src]
    return None if ok else f"{src_module} -> {target}"


def violations(source: str, src_module: str) -> list[str]:
    found = (violation(src_module, m, s) for m, s in referenced_modules(ast.parse(source)))
    return sorted({v for v in found if v})


def test_every_package_is_placed_in_the_stack() -> None:
    layers = {layer_of(module_name(p)) for p in PKG.rglob("*.py")}
    unknown = layers - LEAVES - TOP - set(MAY_IMPORT)
    assert not unknown, f"place these in the stack (MAY_IMPORT / LEAVES): {sorted(unknown)}"


def test_no_import_runs_up_the_stack_or_across() -> None:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        bad += violations(path.read_text(), module_name(path))
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("pdserve.model.runner", "from pdserve.scheduler.request import Req"),
        ("pdserve.transfer.sending.sender", "def f():\n    from pdserve.scheduler import decode"),
        (
            "pdserve.server.app",
            "import importlib\nimportlib.import_module('pdserve.scheduler.build')",
        ),
        ("pdserve.model.attention.backends", "from pdserve.transfer.base import Ticket"),
        ("pdserve.kvcache.pools", "from pdserve.model.runner import ModelRunner"),
        ("pdserve.bench.runner", "from pdserve import server"),
        ("pdserve.router.app", "from pdserve.server.http_util import read_json"),
        ("pdserve.protocol", "from pdserve.scheduler.request import Req"),
    ],
)
def test_the_checker_catches_each_kind(module: str, source: str) -> None:
    """A checker that finds nothing proves nothing: each kind of bad import is caught."""
    assert violations(source, module), (module, source)


# model/ inside: architectures over shared layers, the loading glue at the top.
#   model top (runner, weights, quant_weights, native_*, cuda_graph)   may import all of model/ and checkpoints/
#   model/arch/         one module per family, the registry           over the floor below
#   model/layers/  model/attention/  model/sampling/  forward_batch, state_reader   the floor
# No compute module (arch or the floor) imports checkpoints/: what is on disk reaches
# the model only through the loading glue.
MODEL = "pdserve.model"
MODEL_FLOOR = ("layers", "attention", "sampling", "forward_batch", "state_reader")


def model_rank(module: str) -> int | None:
    """2: the model's top (loading glue), 1: model/arch, 0: the floor; None outside model/."""
    parts = module.split(".")
    if parts[:2] != ["pdserve", "model"] or len(parts) < 3:
        return None
    return 0 if parts[2] in MODEL_FLOOR else 1 if parts[2] == "arch" else 2


def model_violations(source: str, src_module: str) -> list[str]:
    """Imports up model/'s own floors, or of checkpoints/ by a compute module."""
    src = model_rank(src_module)
    if src is None:
        return []
    bad = set()
    for target, _ in referenced_modules(ast.parse(source)):
        dst = model_rank(target)
        if (dst is not None and dst > src) or (src < 2 and layer_of(target) == "checkpoints"):
            bad.add(f"{src_module} -> {target}")
    return sorted(bad)


def test_model_keeps_its_floors() -> None:
    bad = []
    for path in sorted((PKG / "model").rglob("*.py")):
        bad += model_violations(path.read_text(), module_name(path))
    assert not bad, "imports against model/'s floors:\n" + "\n".join(bad)


def test_the_model_rules_catch_what_they_forbid() -> None:
    assert model_violations("from pdserve.model.arch import llama", f"{MODEL}.layers.linear")
    assert model_violations("from pdserve.model.runner import ModelRunner", f"{MODEL}.arch.llama")
    assert model_violations("from pdserve.checkpoints import resolve", f"{MODEL}.arch.gemma3")
    assert model_violations("from pdserve.checkpoints.gguf import arch", f"{MODEL}.sampling.pick")
    assert not model_violations("from pdserve.checkpoints.gguf import arch", f"{MODEL}.weights")
    assert not model_violations("from pdserve.model.layers import rope", f"{MODEL}.arch.llama")
    assert violations("from pdserve.model.runner import ModelRunner", "pdserve.checkpoints.resolve")
    assert violations("from pdserve.kernels import stream", "pdserve.checkpoints.presets")


def test_the_checker_allows_what_the_stack_allows() -> None:
    assert not violations("from pdserve.kvcache.pools import KVPool", "pdserve.model.runner")
    assert not violations("from pdserve import protocol as P", "pdserve.server.app")
    assert not violations("x = ['-m', 'pdserve.scheduler.engine_proc']", "pdserve.server.engine")


def module_graph() -> dict[str, set[str]]:
    """module -> pdserve modules it references (a `from pkg import sub` names the submodule)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        tree, name = ast.parse(path.read_text()), module_name(path)
        started = {t for src, t in PROCESS_ENTRIES if src == layer_of(name)}  # not imports
        deps = {m for m, s in referenced_modules(tree) if is_module(m) and not (s and m in started)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("pdserve")
            ):
                deps |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if is_module(d)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle (a list of modules, first == last), or [] if there is none."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return []


def test_no_module_import_cycle() -> None:
    """Inside a package too: two modules that import each other (even lazily) are one unit."""
    graph = {m: {d for d in deps if d != m} for m, deps in module_graph().items()}
    assert find_cycle(graph) == []


def test_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# kernels/native/: the bottom of kernels, each C file's wrapper beside it. It imports no
# other pdserve module; the C structs Python hands a library are declared once, in its ABI
# module (checked against the library at load), or beside the one C file outside it.
NATIVE = "pdserve.kernels.native"
STRUCT_HOMES = {f"{NATIVE}.abi", "pdserve.transfer.zmq_native"}


def native_violations(source: str, src_module: str) -> list[str]:
    """Imports out of kernels/native/ by a module in it."""
    if not (src_module == NATIVE or src_module.startswith(NATIVE + ".")):
        return []
    refs = (m for m, _ in referenced_modules(ast.parse(source)))
    return sorted({f"{src_module} -> {m}" for m in refs if not m.startswith(NATIVE)})


def struct_violations(source: str, src_module: str) -> list[str]:
    """ctypes Structures declared outside STRUCT_HOMES."""
    if src_module in STRUCT_HOMES:
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            if any(b in ("Structure", "ctypes.Structure", "ctypes.Union") for b in bases):
                found.append(f"{src_module}.{node.name}")
    return found


def test_kernels_native_imports_only_itself() -> None:
    bad = []
    for path in sorted((PKG / "kernels" / "native").rglob("*.py")):
        bad += native_violations(path.read_text(), module_name(path))
    assert not bad, "kernels/native/ imports outside itself:\n" + "\n".join(bad)


def test_c_structs_are_declared_only_in_the_abi_module() -> None:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        bad += struct_violations(path.read_text(), module_name(path))
    assert not bad, "declare C structs in kernels/native/abi.py:\n" + "\n".join(bad)


def test_the_native_rules_catch_what_they_forbid() -> None:
    assert native_violations("from pdserve.kernels import core_share", f"{NATIVE}.par")
    assert native_violations("from pdserve.envs import ENV", f"{NATIVE}.library")
    assert native_violations(
        "from pdserve.model.layers.ops import NativeOps", f"{NATIVE}.decode_ops"
    )
    assert native_violations("def f():\n    from pdserve.scheduler import build", f"{NATIVE}.par")
    assert not native_violations("from pdserve.kernels.native import abi", f"{NATIVE}.par")
    assert not native_violations("from pdserve.kernels import core_share", "pdserve.model.runner")
    src = "import ctypes\nclass Args(ctypes.Structure):\n    _fields_ = []"
    assert struct_violations(src, f"{NATIVE}.page_copy") == [f"{NATIVE}.page_copy.Args"]
    assert struct_violations(src, "pdserve.model.native_forward")
    assert not struct_violations(src, f"{NATIVE}.abi")


# transfer/: two sides over a common layer. sending/ (the prefill's KVSender) and
# receiving/ (the decode's KVReceiver) each import the common layer (transfer/'s own
# modules) and themselves, never the other side; the common layer imports neither side.
# What puts the two together (scheduler/build.py) sits above transfer/.
TRANSFER = "pdserve.transfer"
SIDES = ("sending", "receiving")


def transfer_side(module: str) -> str | None:
    """'pdserve.transfer.sending.push' -> 'sending', 'pdserve.transfer.messages' ->
    'common', a module of another sub-package of transfer/ -> 'unplaced', None outside."""
    parts = module.split(".")
    if module != TRANSFER and not module.startswith(TRANSFER + "."):
        return None
    if len(parts) <= 3:
        return parts[2] if len(parts) == 3 and parts[2] in SIDES else "common"
    return parts[2] if parts[2] in SIDES else "unplaced"


def named_modules(tree: ast.AST) -> set[str]:
    """referenced_modules, and the submodules a `from package import module` names."""
    out = {m for m, _ in referenced_modules(tree)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdserve"):
            out |= {
                f"{node.module}.{a.name}"
                for a in node.names
                if is_module(f"{node.module}.{a.name}")
            }
    return out


def side_violations(source: str, src_module: str) -> list[str]:
    """Imports of one side of the transfer by the other, or of either by the common layer."""
    src = transfer_side(src_module)
    if src is None:
        return []
    found = (m for m in named_modules(ast.parse(source)) if transfer_side(m) in SIDES)
    return sorted({f"{src_module} -> {m}" for m in found if transfer_side(m) != src})


def test_every_transfer_module_is_common_or_on_a_side() -> None:
    names = [module_name(p) for p in sorted((PKG / "transfer").rglob("*.py"))]
    unplaced = [m for m in names if transfer_side(m) not in ("common", *SIDES)]
    assert not unplaced, f"put these in transfer/, sending/ or receiving/: {unplaced}"


def test_the_transfer_sides_never_import_each_other() -> None:
    bad = []
    for path in sorted((PKG / "transfer").rglob("*.py")):
        bad += side_violations(path.read_text(), module_name(path))
    assert not bad, "imports across the transfer's sides:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        (
            f"{TRANSFER}.receiving.writer",
            "from pdserve.transfer.sending.staging import gather_rows",
        ),
        (f"{TRANSFER}.receiving.data", "def f():\n    from pdserve.transfer.sending import push"),
        (f"{TRANSFER}.sending.push", "from pdserve.transfer.receiving import validate"),
        (f"{TRANSFER}.sending", "x = 'pdserve.transfer.receiving.receiver'"),
        (f"{TRANSFER}.messages", "from pdserve.transfer.sending.room import Room"),
        (TRANSFER, "from pdserve.transfer.receiving.receiver import KVReceiver"),
    ],
)
def test_the_side_rule_catches_each_kind(module: str, source: str) -> None:
    assert side_violations(source, module), (module, source)


def test_the_side_rule_allows_the_common_layer_and_what_sits_above() -> None:
    assert not side_violations(
        "from pdserve.transfer.messages import KVChunk", f"{TRANSFER}.receiving.data"
    )
    assert not side_violations("from pdserve.transfer import stages", f"{TRANSFER}.sending.push")
    assert not side_violations(
        "from pdserve.transfer.sending.room import Room", f"{TRANSFER}.sending.peers"
    )
    assert not side_violations(
        "from pdserve.transfer.sending.sender import KVSender", "pdserve.scheduler.build"
    )
    assert transfer_side(f"{TRANSFER}.native.other.x") == "unplaced"
    # kernels/ (native/ included) stays below both sides
    below = "from pdserve.transfer.receiving.writer import land"
    assert violations(below, f"{NATIVE}.page_copy") and native_violations(
        below, f"{NATIVE}.page_copy"
    )
