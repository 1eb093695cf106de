"""No module of a listed package imports itself back, directly or through other modules.

The graph is built from the source (``ast``), not by importing: every ``import`` statement counts,
including ones inside functions and under ``TYPE_CHECKING`` (a deferred import hides a cycle, it
does not remove it). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else
to ``pkg``. Importing a submodule does not count as importing its parent package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent

CYCLE_FREE = ["engine", "sidecar", "agent_adapters", "benchmarks"]
"""Top-level packages whose modules must form an acyclic import graph."""


def module_files(package: str, root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file for every .py file under ``root / package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted ``name`` that is one of ``modules``."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module`` (at ``path``) imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                target = sub if sub in modules else _resolve(name, modules)
                if target:
                    found.add(target)
    found.discard(module)
    return found


def import_graph(packages: list[str], root: Path = ROOT) -> nx.DiGraph:
    modules: dict[str, Path] = {}
    for package in packages:
        modules.update(module_files(package, root))
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        graph.add_edges_from((module, target) for target in imports_of(module, path, modules))
    return graph


@pytest.mark.parametrize("package", CYCLE_FREE)
def test_no_import_cycles(package):
    graph = import_graph([package])
    cycles = [" -> ".join(c + [c[0]]) for c in nx.simple_cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def test_the_check_finds_a_cycle(tmp_path):
    """The check can fail: a two-module package that imports itself back is reported."""
    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclic.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("import cyclic.a\n")  # imports into the cycle, is not part of it
    cycles = list(nx.simple_cycles(import_graph(["cyclic"], tmp_path)))
    assert sorted(cycles[0]) == ["cyclic.a", "cyclic.b"] and len(cycles) == 1


LAYER_RULES = {
    "engine.cache": ("engine.cache",),
    "engine.method_spec": (),
    "engine.lifecycle": ("engine.cache", "engine.method_spec"),
    "engine.methods": (
        "engine.methods",
        "engine.lifecycle",
        "engine.method_spec",
        "engine.cache",
        "engine.distributed.group",
    ),
    "engine.distributed": ("engine.distributed", "engine.model", "engine.cache"),
    "engine.distributed.group": (),
}
"""A module under a prefix may import only modules under the listed prefixes (docs/architecture.md).
``engine.method_spec`` (which method a sequence uses, and its errors) imports nothing of the engine:
everything that carries a MethodSpec, the Lifecycle Contract and the methods included, reads it.
``engine.distributed.group`` (the tensor-parallel collectives) is a leaf: it imports nothing of the
engine, so the methods whose rule spans a layer's heads (tova, adakv) may call it. The rest of
``engine.distributed`` (sharding, sharded layers, capacity, snapshot merging) sits below the model
and the cache: the tensor-parallel front door that builds engines (``engine.tensor_parallel``) is
not part of it."""

TOP_OF_ENGINE = ("engine.tensor_parallel",)
"""Packages nothing else in ``engine/`` imports: they build and wrap the engine (the tensor-parallel
front door runs an LLMEngine on every rank)."""


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_violations(graph: nx.DiGraph) -> list[str]:
    """``a -> b`` for every import against LAYER_RULES."""
    return sorted(
        f"{a} -> {b}"
        for a, b in graph.edges()
        for prefix, allowed in LAYER_RULES.items()
        if _under(a, prefix) and not any(_under(b, p) for p in allowed)
    )


def test_engine_layers_point_down():
    bad = layer_violations(import_graph(["engine"]))
    assert not bad, "imports against the layer rules:\n" + "\n".join(bad)


def test_nothing_in_the_engine_imports_the_packages_above_it():
    graph = import_graph(["engine"])
    bad = [f"{a} -> {b}" for a, b in graph.edges() for top in TOP_OF_ENGINE if _under(b, top) and not _under(a, top)]
    assert not bad, "imports of the tensor-parallel front door from below it:\n" + "\n".join(sorted(bad))


def test_the_layer_rule_catches_a_leaf_importing_the_front_door(tmp_path):
    """The rule can fail: an ``engine.distributed`` module that imports ``engine.llm`` (as the
    tensor-parallel driver did when it lived there) is reported."""
    for folder in ("engine", "engine/distributed"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "engine" / "llm.py").write_text("")
    (tmp_path / "engine" / "distributed" / "driver.py").write_text("def f():\n    from engine.llm import LLMEngine\n")
    assert layer_violations(import_graph(["engine"], tmp_path)) == ["engine.distributed.driver -> engine.llm"]


SIDECAR_MAY_IMPORT = ("engine.api", "engine.config", "engine.tensor_parallel.launcher")
"""The engine modules the sidecar may import: the front door (engine/api.py) and what builds an
engine (its settings, and the tensor-parallel launcher that starts one per rank)."""


def sidecar_imports_past_the_front_door(root: Path = ROOT) -> list[str]:
    """``module -> engine module`` for every import of the sidecar's outside ``SIDECAR_MAY_IMPORT``."""
    modules = {**module_files("engine", root), **module_files("sidecar", root)}
    return sorted(
        f"{module} -> {target}"
        for module, path in module_files("sidecar", root).items()
        for target in imports_of(module, path, modules)
        if _under(target, "engine") and not any(_under(target, p) for p in SIDECAR_MAY_IMPORT)
    )


def test_the_sidecar_reaches_the_engine_only_through_its_front_door():
    bad = sidecar_imports_past_the_front_door()
    assert not bad, "sidecar imports past engine.api:\n" + "\n".join(bad)


def test_the_front_door_rule_finds_a_stray_import(tmp_path):
    """The rule can fail: a sidecar module importing an engine module other than the front door is
    reported, one importing engine.api or engine.config is not."""
    for pkg, files in {
        "engine": ["__init__", "api", "config", "llm"],
        "sidecar": ["__init__", "ok", "stray"],
    }.items():
        (tmp_path / pkg).mkdir()
        for name in files:
            (tmp_path / pkg / f"{name}.py").write_text("")
    (tmp_path / "sidecar" / "ok.py").write_text("from engine.api import X\nfrom engine.config import C\n")
    (tmp_path / "sidecar" / "stray.py").write_text("def f():\n    from engine import llm\n")
    assert sidecar_imports_past_the_front_door(tmp_path) == ["sidecar.stray -> engine.llm"]


def test_engine_never_imports_the_sidecar():
    imported = set()
    for module, path in module_files("engine").items():
        imported |= imports_of(module, path, {**module_files("engine"), **module_files("sidecar")})
    assert not [m for m in imported if _under(m, "sidecar")]


SIDECAR_ROOMS = (
    "sidecar.cli",
    "sidecar.http",
    "sidecar.grpc",
    "sidecar.turns",
    "sidecar.sessions",
    "sidecar.engine_bridge",
    "sidecar.store",
)
"""The sidecar's rooms, top to bottom (docs/architecture.md, the sidecar's module map). A module may
import modules of its own room and of the rooms below it, never of one above: the command line
starts the fronts, the HTTP front runs on the gRPC server's ``SidecarServer``, the server hands
turns to the turn runner, turns take sessions, sessions reach the engine through its bridge and
keep their snapshots in the store."""

SIDECAR_FOUNDATION = ("sidecar", "sidecar.session_ids", "sidecar.settings", "sidecar.protogen", "sidecar._proto")
"""Below every room: the session-id header and key (which an agent's client imports too), the
settings declaration, the generated stubs and their generator. They import no room."""


def sidecar_room(module: str) -> int | None:
    """The rank of ``module``'s room (0 is the top), ``len(SIDECAR_ROOMS)`` for the foundation, None
    for a module in neither."""
    for rank, room in enumerate(SIDECAR_ROOMS):
        if _under(module, room):
            return rank
    if module in SIDECAR_FOUNDATION or _under(module, "sidecar._proto"):
        return len(SIDECAR_ROOMS)
    return None


def room_violations(graph: nx.DiGraph) -> list[str]:
    """``a -> b`` for every import of a sidecar module from a room above it (or from the
    foundation), and ``a: in no room`` for a sidecar module outside the rooms and the foundation."""
    bad = [f"{m}: in no room" for m in graph if _under(m, "sidecar") and sidecar_room(m) is None]
    for a, b in graph.edges():
        ra, rb = sidecar_room(a), sidecar_room(b)
        if ra is not None and rb is not None and rb < ra:
            bad.append(f"{a} -> {b}")
    return sorted(bad)


def test_the_sidecar_rooms_point_down():
    bad = room_violations(import_graph(["sidecar"]))
    assert not bad, "imports against the sidecar's room order (SIDECAR_ROOMS):\n" + "\n".join(bad)


def test_the_room_rule_catches_an_upward_import(tmp_path):
    """The rule can fail: a session module importing the server's settings (as the janitor did
    before it read them through a protocol), a foundation module importing a room, and a module
    left outside the rooms are reported; a front importing the sessions below it is not."""
    files = {
        "sidecar/__init__.py": "",
        "sidecar/settings.py": "from sidecar.store.base import S\n",
        "sidecar/stray.py": "",
        "sidecar/store/__init__.py": "",
        "sidecar/store/base.py": "from sidecar.settings import setting\n",
        "sidecar/sessions/__init__.py": "",
        "sidecar/sessions/janitor.py": "def loop():\n    from sidecar.grpc.options import ServerOptions\n",
        "sidecar/grpc/__init__.py": "",
        "sidecar/grpc/options.py": "",
        "sidecar/http/__init__.py": "",
        "sidecar/http/backend.py": "from sidecar.sessions import janitor\nfrom sidecar.grpc import options\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert room_violations(import_graph(["sidecar"], tmp_path)) == [
        "sidecar.sessions.janitor -> sidecar.grpc.options",
        "sidecar.settings -> sidecar.store.base",
        "sidecar.stray: in no room",
    ]
