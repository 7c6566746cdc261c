"""The project's layout rules, checked on the source (no imports run): the import graph of ``megatron_jf/``,
``recipes/``, ``bench/``, ``tools/`` and ``pretrain_jf.py`` has no cycle (function-level imports included); nothing
under ``megatron_jf/`` imports the recipes, benches, tools or tests; no file outside ``tests/`` patches ``sys.path``;
an inference :class:`~megatron_jf.inference.engine.Engine` is built only inside ``megatron_jf/inference/``."""

from __future__ import annotations

import ast
import os
from functools import lru_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("megatron_jf", "recipes", "bench", "tools", "pretrain_jf.py")
#: top-level names that are not the library: the library must not import them
OUTSIDE = ("recipes", "bench", "tools", "tests", "pretrain_jf")


def module_name(rel: str) -> str:
    """``megatron_jf/data/__init__.py`` -> ``megatron_jf.data``; ``bench/decode.py`` -> ``bench.decode``."""
    name = rel[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def source_files(roots=ROOTS) -> list[str]:
    """The ``.py`` files under ``roots``, relative to the repository."""
    out = []
    for root in roots:
        if root.endswith(".py"):
            out.append(root)
            continue
        for d, dirs, files in os.walk(os.path.join(REPO, root)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            out += [os.path.relpath(os.path.join(d, f), REPO) for f in files if f.endswith(".py")]
    return sorted(out)


@lru_cache(maxsize=None)
def _tree(rel: str) -> ast.Module:
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
        return ast.parse(f.read(), filename=rel)


@lru_cache(maxsize=None)
def import_graph() -> dict[str, frozenset[str]]:
    """Module -> the project modules it imports anywhere in its body (``from pkg import sub`` counts as ``pkg.sub``
    when that is a module, else as ``pkg``; relative imports resolved)."""
    files = {module_name(f): f for f in source_files()}
    graph = {}
    for mod, rel in files.items():
        package = mod if rel.endswith("__init__.py") else mod.rpartition(".")[0]
        targets = set()
        for node in ast.walk(_tree(rel)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    targets.add(name)
        graph[mod] = frozenset(targets)
    return graph


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_planted_cycle():
    g = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({**g, "c": frozenset()}) == []


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 100 and "megatron_jf.inference.engine" in graph["megatron_jf.inference.llm"]
    assert cycles(graph) == []


def test_the_library_imports_no_recipe_bench_tool_or_test():
    upward = {m: sorted(t for t in ts if t.split(".")[0] in OUTSIDE)
              for m, ts in import_graph().items() if m.split(".")[0] == "megatron_jf"}
    assert {m: ts for m, ts in upward.items() if ts} == {}


def _patches_sys_path(rel: str) -> bool:
    for node in ast.walk(_tree(rel)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("insert", "append", "extend")
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "path"
                and isinstance(node.func.value.value, ast.Name) and node.func.value.value.id == "sys"):
            return True
    return False


def test_no_sys_path_patching_outside_tests():
    assert [f for f in source_files() if _patches_sys_path(f)] == []


def test_engines_are_built_only_by_the_inference_package():
    """``Engine(...)`` appears only in ``megatron_jf/inference/`` (the engine itself and :class:`LLM`); recipes,
    benches and tools load through :meth:`LLM.from_checkpoint` / :meth:`LLM.from_model`."""
    builders = set()
    for rel in source_files():
        for node in ast.walk(_tree(rel)):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name == "Engine":
                    builders.add(rel)
    assert builders and all(f.startswith("megatron_jf/inference/") for f in builders), sorted(builders)
