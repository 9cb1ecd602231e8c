"""The import rules hold: the contracts in ``pyproject.toml`` and no cycle between modules.

``docs/architecture.md`` draws the layers. The contracts run through ``lint-imports``
(the same command ``make lint`` runs); the module cycle check runs on grimp's graph and
names the cycle it finds. Both checkers are also shown to catch a planted violation, so a
green run means the rules hold, not that the checker saw nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout_gateway", "bench", "gateway", "backends")
LAYERS = ("rollout_gateway", "bench", "gateway", "backends")  # as in [tool.importlinter]


def module_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(graph: grimp.ImportGraph, component: Iterable[str]) -> str:
    """One concrete loop through the component: ``a -> b -> ... -> a``."""
    members = sorted(component)
    first = members[0]
    back = next(m for m in members if graph.direct_import_exists(importer=m, imported=first))
    path = graph.find_shortest_chain(importer=first, imported=back) or (first, back)
    return " -> ".join([*path, first])


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES)


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--config", "pyproject.toml", "--no-cache"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout and "10 kept" in out.stdout


def test_no_module_imports_itself_through_others(graph: grimp.ImportGraph) -> None:
    cycles = module_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(describe(graph, c) for c in cycles)


def control_plane_imports(graph: grimp.ImportGraph) -> list[str]:
    """Direct imports from the request path (proxy, dispatch) into the control plane
    (pool, weights): what the relay-apart contract forbids."""
    path = ("gateway.proxy", "gateway.dispatch")
    control = ("gateway.pool", "gateway.weights")
    return sorted(f"{a} -> {b}" for a in graph.modules if a.startswith(path)
                  for b in graph.find_modules_directly_imported_by(a)
                  if b.startswith(control))


def test_the_request_path_never_imports_the_control_plane(graph: grimp.ImportGraph) -> None:
    assert not control_plane_imports(graph)
    planted = grimp.build_graph(*PACKAGES)
    planted.add_import(importer="gateway.proxy.relay", imported="gateway.weights.update")
    assert control_plane_imports(planted) == ["gateway.proxy.relay -> gateway.weights.update"]


def test_cycle_check_names_a_planted_cycle(graph: grimp.ImportGraph) -> None:
    planted = grimp.build_graph(*PACKAGES)
    planted.add_import(importer="gateway.pool.manager", imported="gateway.runtime")
    cycles = module_cycles(planted)
    assert cycles, "a planted runtime <-> pool cycle went unnoticed"
    loop = describe(planted, next(c for c in cycles if "gateway.runtime" in c))
    assert "gateway.runtime" in loop and "gateway.pool.manager" in loop
    assert loop.split(" -> ")[0] == loop.split(" -> ")[-1]


def test_layer_check_catches_an_upward_import() -> None:
    layered = grimp.build_graph(*PACKAGES)
    # the one allowed upward import, as ignored in the contract: `python -m gateway` is an
    # alias of the whole CLI (an entry point that nothing imports)
    layered.remove_import(importer="gateway.__main__", imported="rollout_gateway.cli")
    assert not layered.find_illegal_dependencies_for_layers(layers=LAYERS, containers=set())
    layered.add_import(importer="backends.base", imported="gateway.config")
    illegal = layered.find_illegal_dependencies_for_layers(layers=LAYERS, containers=set())
    assert {(d.importer, d.imported) for d in illegal} == {("backends", "gateway")}


def test_client_reaches_no_server_module(graph: grimp.ImportGraph) -> None:
    """The trainer SDK and its schema stand alone; a server import in the schema (which
    the client reads samples with) would reach the client."""
    server = ("gateway.store", "gateway.api", "gateway.dispatch", "gateway.trajectories",
              "gateway.proxy", "gateway.runtime")
    for client in ("gateway.client", "gateway.schema"):
        assert not [m for m in server if graph.chain_exists(client, m, as_packages=True)]
    planted = grimp.build_graph(*PACKAGES)
    planted.add_import(importer="gateway.schema.samples", imported="gateway.store.models")
    assert planted.chain_exists("gateway.client", "gateway.store", as_packages=True)


def _tree_sections(doc: str) -> dict[str, set[str]]:
    """The "What lives where" block of docs/architecture.md: folder -> the names under it
    (a folder line starts at column 0 with its path and a slash)."""
    block = doc.split("## What lives where", 1)[1].split("```", 2)[1]
    sections: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in block.splitlines():
        head = re.match(r"^([a-z_]+(?:/[a-z_]+)*)/(?:\s|$)", line)
        if head:
            current = sections.setdefault(head.group(1), set())
            current.update(re.findall(r"[A-Za-z_][\w-]*", line[head.end():]))
        elif current is not None:
            current.update(re.findall(r"[A-Za-z_][\w-]*", line))
    return sections


def test_architecture_doc_names_every_module() -> None:
    sections = _tree_sections((ROOT / "docs" / "architecture.md").read_text())
    missing = []
    for pkg in LAYERS:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            folder = path.parent.relative_to(ROOT).as_posix()
            if path.stem not in sections.get(folder, set()):
                missing.append(f"{folder}/{path.name}")
    assert not missing, f"docs/architecture.md's tree does not name: {', '.join(missing)}"


def test_architecture_doc_names_every_bench_command() -> None:
    from typer.main import get_command

    from bench.cli import bench_app

    names = list(getattr(get_command(bench_app), "commands", {}))
    listed = _tree_sections((ROOT / "docs" / "architecture.md").read_text())["bench"]
    assert len(names) >= 16
    assert not [n for n in names if n not in listed], "bench commands missing from the doc"


def test_the_doc_check_fails_on_a_module_it_does_not_name() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert "governor" in _tree_sections(doc)["bench/harness"]
    without = doc.replace("  governor          slows", "  other             slows")
    assert "governor" not in _tree_sections(without)["bench/harness"]
