"""The package's layout stays readable: a dozen entries at the top, one folder per stage, no
module over 600 lines (the spool's stages under 450), no two module names that differ only by a
suffix, no import cycle among opt_ds_ops's modules, and no folder importing one that
docs/architecture.md puts before it in the data flow."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "opt_ds_ops"
MAX_LINES = 600
SPOOL_MAX_LINES = 450

# The folders in the order of the data flow, as docs/architecture.md's "Folders" table lists them:
# a module may import only from its own folder, from folders after its own, and the shared
# helpers below them (FOUNDATION). cli.py, the command line, comes before every folder.
FOLDER_ORDER = ["commands", "daemon", "sources", "spool", "scoring", "training", "lifecycle", "store", "health", "model",
                "dataset", "observe", "config"]
TOP_MODULES = {"cli", "fsutil"}  # the top level's modules besides __init__.py
FOUNDATION = {"opt_ds_ops", "opt_ds_ops.fsutil"}  # __version__, EARLY_STOP; file-system helpers
MAX_TOP_ENTRIES = 16  # 13 stage folders (sources/, telemetry in from Prometheus, the 13th), cli, fsutil, __init__
# Two module names that differ only by one of these endings are mixed up by readers (score,
# scorer, scoring; job, jobs): a name says its role instead.
CONFUSING_SUFFIXES = {"s", "r", "er", "es", "d", "ed", "ing", "dir"}

# Allowed for now, each with the branch that removes the entry when it merges; an entry that is no
# longer needed fails its test, so the lists only shrink. Modules allowed over MAX_LINES:
OVER_LIMIT_ALLOWED: set[str] = set()
# Import cycles allowed, each as the set of modules that import each other:
CYCLES_ALLOWED: list[set[str]] = []


def _modules() -> dict[str, Path]:
    """Return {dotted module name: path} for every module of opt_ds_ops, packages included."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Return the opt_ds_ops modules that module ``name`` imports, at any level (the module's top,
    inside functions and methods): ``from .x import y`` counts ``x``, or ``x.y`` where y is a
    submodule. A submodule importing its own package (``from . import sibling``) is not an edge
    to the package: Python runs a package's __init__ before any of its submodules anyway."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found.update(c for c in candidates if c in modules and c != name and c not in ancestors)
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Return the strongly connected components of more than one module: each holds at least one
    import cycle (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """Return a shortest cycle through the component's first module, as a path a -> ... -> a."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_no_module_of_the_package_is_over_600_lines():
    over = {str(p.relative_to(REPO)): _lines(p) for p in _modules().values() if _lines(p) > MAX_LINES}
    unexpected = {p: n for p, n in over.items() if p not in OVER_LIMIT_ALLOWED}
    assert not unexpected, f"modules over {MAX_LINES} lines (split them by role): {unexpected}"
    assert not OVER_LIMIT_ALLOWED - set(over), f"no longer over {MAX_LINES}: remove from OVER_LIMIT_ALLOWED"


def test_every_module_of_the_spool_package_is_under_450_lines():
    spool = sorted((PACKAGE / "spool").glob("*.py"))
    assert len(spool) >= 6, "opt_ds_ops/spool/ is a package of one module per stage"
    over = {p.name: _lines(p) for p in spool if _lines(p) >= SPOOL_MAX_LINES}
    assert not over, f"spool modules of {SPOOL_MAX_LINES} lines or more: {over}"


def test_the_import_walk_sees_imports_inside_functions(tmp_path):
    """The walk is what the cycle test relies on: an import inside a function is an edge too."""
    modules = {"opt_ds_ops.a": tmp_path / "a.py", "opt_ds_ops.b": tmp_path / "b.py",
               "opt_ds_ops.pkg": tmp_path / "pkg" / "__init__.py", "opt_ds_ops.pkg.c": tmp_path / "pkg" / "c.py"}
    (tmp_path / "pkg").mkdir()
    modules["opt_ds_ops.a"].write_text("def f():\n    from .b import g\n    from .pkg import c\n")
    modules["opt_ds_ops.pkg.c"].write_text("from . import x\nfrom .. import b\nfrom ..a import f\n")
    assert _imports("opt_ds_ops.a", modules["opt_ds_ops.a"], modules) == {"opt_ds_ops.b", "opt_ds_ops.pkg",
                                                                          "opt_ds_ops.pkg.c"}
    assert _imports("opt_ds_ops.pkg.c", modules["opt_ds_ops.pkg.c"], modules) == {"opt_ds_ops.b", "opt_ds_ops.a"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _components(graph) == [{"a", "b", "c"}] and _cycle_in(graph, {"a", "b", "c"}) == ["a", "b", "c", "a"]


def test_no_import_cycle_among_the_package_modules():
    graph = _import_graph()
    components = _components(graph)
    tangles = [c for c in components if c not in CYCLES_ALLOWED]
    assert not tangles, "import cycles (move what both sides share into a module both import):\n" + "\n".join(
        f"{' -> '.join(_cycle_in(graph, c))} (modules importing each other: {', '.join(sorted(c))})" for c in tangles)
    assert all(c in components for c in CYCLES_ALLOWED), "an allowed cycle is gone: remove it from CYCLES_ALLOWED"


def _rank(module: str) -> int:
    """Return the place of a module's folder in FOLDER_ORDER; cli first, the foundation last."""
    parts = module.split(".")
    if module in FOUNDATION:
        return len(FOLDER_ORDER)
    if parts[1] == "cli":
        return -1
    return FOLDER_ORDER.index(parts[1])


def test_the_top_level_is_a_dozen_entries_of_folders_named_for_their_stage():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert len(entries) <= MAX_TOP_ENTRIES, f"opt_ds_ops/ has {len(entries)} entries: {entries}"
    assert folders == set(FOLDER_ORDER), f"folders not in FOLDER_ORDER (or gone): {folders ^ set(FOLDER_ORDER)}"
    assert modules == TOP_MODULES, f"modules at the top level besides cli and fsutil: {modules - TOP_MODULES}"
    for folder in folders:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text(encoding="utf-8")))
        assert doc and len(doc) > 200, f"opt_ds_ops/{folder}/__init__.py: a paragraph saying what the folder is"


def test_no_folder_imports_one_before_it_in_the_data_flow():
    graph = _import_graph()
    wrong = sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets
                   if a not in FOUNDATION and _rank(b) < _rank(a))
    assert not wrong, "imports against the data flow (docs/architecture.md, Folders):\n" + "\n".join(wrong)
    assert all(_rank(b) >= _rank(a) for a, targets in graph.items() if a in FOUNDATION for b in targets)


def test_the_folder_order_is_the_one_docs_architecture_md_gives():
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text.split("## Folders", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([a-z_]+)/` \|", table, flags=re.M)
    assert listed == FOLDER_ORDER, f"docs/architecture.md's Folders table lists {listed}"


def test_no_two_module_names_differ_only_by_a_suffix():
    # commands/ is exempt: its modules are named for the subcommands they implement (ds-ops score, train, models)
    names = {p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__" and p.parent.name != "commands"}
    names |= {p.name for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    mixed = sorted((a, b) for a in names for b in names if b != a and b.startswith(a) and b[len(a):] in CONFUSING_SUFFIXES)
    assert not mixed, f"module names that differ only by a suffix (name each for its role): {mixed}"


def test_the_folder_rule_catches_an_import_against_the_flow():
    assert _rank("opt_ds_ops.daemon.service") < _rank("opt_ds_ops.store.versions") < _rank("opt_ds_ops.config.conffile")
    assert _rank("opt_ds_ops.cli") < _rank("opt_ds_ops.commands.train") and _rank("opt_ds_ops.fsutil") == len(FOLDER_ORDER)


def test_the_repository_names_no_tracker_numbers():
    """"issue 19" means nothing to someone who has only the repository: the code, the docs and the
    packaging say the reason or link the docs page instead (CHANGELOG.md's history excepted)."""
    tracked = [REPO / p for p in ("opt_ds_ops", "tests", "docs", "scripts", "debian", "etc")]
    tracked += [REPO / f for f in ("README.md", "Makefile", "pyproject.toml")]
    files = [f for top in tracked for f in ([top] if top.is_file() else top.rglob("*"))
             if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".gz", ".png", ".npy", ".deb")]
    pattern = re.compile(r"\b[Ii]ssues? [0-9]+\b|\bissue-[0-9]+\b")
    hits = [f"{f.relative_to(REPO)}:{n}" for f in files
            for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if pattern.search(line) and f.name != "test_layout.py"]
    assert not hits, f"tracker numbers: {hits[:20]}"
