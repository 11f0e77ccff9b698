"""The layers as STYLE.md draws them, read from every module's imports (``ast``).

Every ``import`` counts, at module level or inside a function (a lazy import
is a dependency too, and an import cycle that works only because of the
order modules happen to load in is one edit away from breaking):

- the import graph of ``gradclip_cli`` has no cycle;
- ``source/`` imports nothing from ``format/``, ``report/``, ``commands/`` or
  ``cli`` (data flows one way: source -> core -> report -> format);
- ``core/`` imports nothing of gradclip's outside ``core/``;
- ``source/`` imports nothing from ``sink/``: a layout says how a checkpoint
  is written back as plain data (``WriteBackPlan``), and the sink writes it;
- ``sink/`` imports nothing from ``distributed/``: the command says which rank
  writes which file, and passes that to the sink;
- no module imports a private (underscore) name from another folder (a
  module whose package differs): what folders share is public, and a
  private name stays free to change within its own folder;
- no layout (``source/layouts/``) imports ``source/what.py``: a layout hands
  over an inventory, and choosing what to measure from it comes after; a
  layout that names optimizer state by shape uses ``source/naming.py``, as
  ``what.py`` does.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gradclip_cli"


def _modules() -> dict[str, tuple[Path, list[str]]]:
    """Dotted name -> (file, the package its relative imports start from)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["gradclip_cli", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
            package = parts
        else:
            package = parts[:-1]
        out[".".join(parts)] = (path, package)
    return out


MODULES = _modules()


def _owner(name: str) -> str:
    """The module ``name`` lives in: itself, or the nearest enclosing module."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imported(name: str) -> list[tuple[str, str]]:
    """Every ``(module, name)`` that module ``name`` imports from gradclip: the module
    itself for ``import x`` and ``from package import module``, else its owner and the
    name taken from it."""
    path, package = MODULES[name]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(_owner(a.name), "") for a in node.names
                      if a.name.startswith("gradclip_cli")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith("gradclip_cli"):
                continue
            for alias in node.names:  # `from pkg import module` imports the module
                full = f"{target}.{alias.name}"
                found.append((full, "") if full in MODULES else (_owner(target), alias.name))
    return found


def _imports(name: str) -> set[str]:
    return {module for module, _ in _imported(name)} - {name}


GRAPH = {name: _imports(name) for name in MODULES}
# (importer, module, name) for every private name imported (``_x``; ``__x__`` is not private)
PRIVATE = sorted(
    (name, module, taken)
    for name in MODULES
    for module, taken in _imported(name)
    if taken.startswith("_") and not taken.endswith("__")
)


def _layer(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


def _folder(name: str) -> str:
    """The package a module lives in (a package's ``__init__``: the package itself)."""
    return ".".join(MODULES[name][1])


def _crossing(upper: str, lower: str) -> list[tuple[str, str]]:
    """Every import from a module of layer ``upper`` into one of layer ``lower``."""
    return sorted((name, dep) for name, deps in GRAPH.items() if _layer(name) == upper
                  for dep in deps if _layer(dep) == lower)


def _a_cycle() -> list[str] | None:
    """One cycle of the graph as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(GRAPH):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_reader_sees_imports_of_every_kind():
    # module level, relative, `from package import module`, and inside a function
    assert "gradclip_cli.core" in GRAPH["gradclip_cli.commands.common"]
    assert "gradclip_cli.report" in GRAPH["gradclip_cli.commands.inspect"]
    assert "gradclip_cli.source.layouts.dcp" in GRAPH["gradclip_cli.source.layouts.lightning"]
    assert "gradclip_cli.report.grouping" in GRAPH["gradclip_cli.values"]  # in a function
    assert "gradclip_cli.commands.inspect" not in GRAPH["gradclip_cli.cli"]  # by name only
    assert len(GRAPH) > 60


def test_the_import_graph_has_no_cycle():
    cycle = _a_cycle()
    assert cycle is None, " -> ".join(cycle)


def test_a_cycle_is_found_where_there_is_one():
    back = ("gradclip_cli.core", "gradclip_cli.commands.common")  # common imports the core
    GRAPH[back[0]].add(back[1])
    try:
        cycle = _a_cycle()
        assert cycle is not None and set(back) <= set(cycle)
    finally:
        GRAPH[back[0]].discard(back[1])


def test_sources_import_no_format_report_command_or_cli():
    upward = {"format", "report", "commands", "cli"}
    found = sorted(
        (name, dep)
        for name, deps in GRAPH.items()
        if _layer(name) == "source"
        for dep in deps
        if _layer(dep) in upward
    )
    assert found == []


def test_the_core_imports_nothing_else_of_gradclips():
    found = sorted(
        (name, dep)
        for name, deps in GRAPH.items()
        if _layer(name) == "core"
        for dep in deps
        if _layer(dep) != "core"
    )
    assert found == []


def test_sources_import_nothing_of_the_sink():
    assert _crossing("source", "sink") == []


def test_the_sink_imports_nothing_of_distributed():
    assert _crossing("sink", "distributed") == []


def test_the_crossings_are_seen_where_they_are():
    # the directions allowed: the command and distributed/ use the sink, the sink sources
    assert ("gradclip_cli.distributed.sets", "gradclip_cli.sink.sharded_set") in \
        _crossing("distributed", "sink")
    assert ("gradclip_cli.sink.write_back", "gradclip_cli.source.interface") in \
        _crossing("sink", "source")


def _layouts_importing(module: str) -> list[str]:
    return sorted(name for name, deps in GRAPH.items()
                  if name.startswith("gradclip_cli.source.layouts") and module in deps)


def test_layouts_import_nothing_of_what():
    assert _layouts_importing("gradclip_cli.source.what") == []


def test_the_layouts_imports_are_seen_where_they_are():
    # the shared naming of optimizer state: imported by layouts, by what.py and previous.py
    assert "gradclip_cli.source.layouts.deepspeed.plain" in \
        _layouts_importing("gradclip_cli.source.naming")
    assert "gradclip_cli.source.naming" in GRAPH["gradclip_cli.source.what"]
    assert "gradclip_cli.source.what" in GRAPH["gradclip_cli.source.previous"]


def test_no_private_name_is_imported_across_folders():
    found = [(name, module, taken) for name, module, taken in PRIVATE
             if _folder(name) != _folder(module)]
    assert found == []


def test_private_names_are_seen_within_a_folder():
    # allowed: one module of sink/ uses another's private helper
    assert ("gradclip_cli.sink.sharded_set", "gradclip_cli.sink.atomic", "_fsync_folder") \
        in PRIVATE
    assert _folder("gradclip_cli.sink.sharded_set") == _folder("gradclip_cli.sink.atomic")
    assert _folder("gradclip_cli.sink") == "gradclip_cli.sink"
    # a dunder is not private: ``cli`` takes the package's ``__version__``
    assert not [p for p in PRIVATE if p[2] == "__version__"]
