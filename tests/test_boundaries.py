"""Package boundaries (docs/architecture.md, "Packages"): which part may import which."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# the user's side: public API, client, export, plan and status views, the local cluster launcher
CLIENT = {"atoll", "atoll.client"}
# the worker's side: daemon, executor, data plane
WORKER = {"atoll.worker"}
# composes both sides, by design
CLI = {"atoll.cli"}
# gRPC plumbing both daemons and the client share
NET = "atoll.net"


def _in(module: str, group: set[str]) -> bool:
    return any(module == g or module.startswith(f"{g}.") for g in group)


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = ["atoll", *rel.parts[1:]] if rel.parts[0] == "runtime" else ["atoll", *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    out = {}
    for folder in ("runtime", "controller"):
        for path in (ROOT / folder).rglob("*.py"):
            if "_rpc" in path.parts:
                continue
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found.add(node.module)
                    found.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
            out[_module(path)] = {m for m in found if m == "atoll" or m.startswith("atoll.")}
    return out


def _touches(imported: set[str], group: set[str]) -> set[str]:
    return {m for m in imported for g in group if g != "atoll" and (m == g or m.startswith(f"{g}."))}


def test_the_core_imports_only_the_core():
    for module, imported in _imports().items():
        if module.startswith("atoll.core"):
            outside = {m for m in imported if not m.startswith(("atoll.core", "atoll.errors", "atoll._rpc"))}
            assert not outside, f"{module} (core) imports {outside}"


def test_the_controller_never_imports_the_client_or_the_worker():
    for module, imported in _imports().items():
        if module.startswith("atoll.controller"):
            bad = _touches(imported, CLIENT | WORKER | CLI)
            assert not bad, f"{module} imports {bad}"


def test_the_client_never_imports_compiler_passes_or_the_worker():
    for module, imported in _imports().items():
        if _in(module, CLIENT - {"atoll"}) or module == "atoll":
            bad = {m for m in imported if m.startswith("atoll.controller")} | _touches(imported, WORKER)
            assert not bad, f"{module} imports {bad}"


def test_the_worker_never_imports_the_controller_or_the_client():
    for module, imported in _imports().items():
        if _in(module, WORKER):
            bad = {m for m in imported if m.startswith("atoll.controller")} | _touches(imported, CLIENT | CLI)
            assert not bad, f"{module} imports {bad}"


def test_the_network_layer_imports_only_itself_the_core_and_errors():
    for module, imported in _imports().items():
        if module.startswith(NET):
            outside = {m for m in imported if not m.startswith((NET, "atoll.core", "atoll.errors", "atoll._rpc"))}
            outside.discard("atoll")  # `from atoll import errors`
            assert not outside, f"{module} (net) imports {outside}"


def test_every_package_is_listed_in_the_packaging():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module(p) for folder in ("runtime", "controller") for p in (ROOT / folder).rglob("__init__.py")}
    assert found == listed, f"packages on disk and in pyproject.toml differ: {found ^ listed}"
