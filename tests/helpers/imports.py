"""The import graph of our packages, read from their source: every import in a file counts, a deferred one too, and
`from pkg import submodule` is an import of the submodule. `circles` finds the loops in it."""
from __future__ import annotations

import ast

from tests.helpers import REPO


def import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """{module of `packages`: what it imports}, a module by its dotted name, any other name as `module:name`."""
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
               for package in packages for p in (REPO / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                graph[name] |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else
                                f"{node.module}:{a.name}" for a in node.names}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles among the modules of `graph`, each as the path that closes it (first module repeated last)."""
    edges = {m: {t.split(":")[0] for t in ts if t.split(":")[0] in graph and t.split(":")[0] != m}
             for m, ts in graph.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def circle(m: str, path: list[str]) -> list[str] | None:  # path: the modules being walked, m last
        state[m] = 1
        found = None
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                found = path[path.index(t):] + [t]
            elif t not in state:
                found = circle(t, path + [t])
            if found:
                break
        state[m] = 2
        return found

    return [c for m in sorted(edges) if m not in state and (c := circle(m, [m]))]
