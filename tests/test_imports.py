"""The baked package's imports point one way: commands name the task and the engine, the engine
never imports the task, the task reaches the engine through the seam and a few shared helpers, and
no import cycle exists. Read statically from each bake's source (no module is run)."""

import ast
from pathlib import Path

import pytest
from conftest import bake

TASKS = ("image-classification", "language-model")

# What task/ may import from engine/: the seam (the interface's types), the configuration and the
# error kinds, and the shared helpers a task builds on (the command-line wrapper, the loaders'
# seeding and lockstep helpers, autocast, process-group helpers and meta-device init, atomic files,
# weights files, and restoring a trained model for the task's own commands).
TASK_MAY_IMPORT = {
    "engine",
    "engine.seam",
    "engine.config",
    "engine.errors",
    "engine.cli",
    "engine.loaders",
    "engine.step",
    "engine.parallel",
    "engine.parallel.distributed",
    "engine.parallel.meta_init",
    "engine.ckpt",
    "engine.ckpt.files",
    "engine.ckpt.checkpoint",
    "engine.ckpt.restore",
}
MAX_LINES = 500  # no source or test file of a bake longer than this


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """The ids of import nodes under `if TYPE_CHECKING:` (annotations only, never run)."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            guarded.update(id(child) for child in ast.walk(node))
    return guarded


def import_graph(src: Path, package: str) -> dict[str, dict[str, bool]]:
    """{module: {imported module of the package: whether the import runs (not TYPE_CHECKING only)}},
    module names relative to the package ("engine.loop"); imports at module and function level."""
    files = {_module_name(path, src / package): path for path in (src / package).rglob("*.py")}
    graph: dict[str, dict[str, bool]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        guarded = _type_checking_nodes(tree)
        is_package = path.name == "__init__.py"
        edges: dict[str, bool] = {}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = [package, *name.split(".")] if name else [package]
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
            for target in targets:
                if not (target == package or target.startswith(package + ".")):
                    continue
                relative = target[len(package) + 1 :]
                while relative and relative not in files:  # `from .x import name`: the module x
                    relative = relative.rpartition(".")[0]
                if relative in files and relative != name:
                    edges[relative] = edges.get(relative, False) or id(node) not in guarded
                    break  # the first (longest) name that is a module is what the import reaches
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The strongly connected components of more than one module among imports that run (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target, runs in graph.get(node, {}).items():
            if not runs:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module", params=TASKS)
def graph(request, cookies_session):
    baked = bake(cookies_session, task=request.param)
    return baked, import_graph(baked.path / "src", baked.package)


def imports_of(imports: dict[str, dict[str, bool]], folder: str) -> set[tuple[str, str]]:
    """(module, imported module) for every import made by a module of folder (engine, task)."""
    mine = {module: edges for module, edges in imports.items() if module.startswith(folder)}
    return {(module, target) for module, edges in mine.items() for target in edges}


def test_the_engine_never_imports_the_task_or_a_command(graph):
    """Nothing under engine/ imports task/ or a command module, even for annotations: the commands
    hand the task to the engine."""
    wrong = {pair for pair in imports_of(graph[1], "engine") if not pair[1].startswith("engine")}
    assert not wrong, sorted(wrong)


def test_the_task_reaches_the_engine_through_the_seam_and_named_helpers(graph):
    """task/ imports from engine/ only the seam, the configuration, the error kinds and the shared
    helpers TASK_MAY_IMPORT names (never the loop, the state or the checkpoint writer)."""
    engine = {pair for pair in imports_of(graph[1], "task") if pair[1].startswith("engine")}
    wrong = {pair for pair in engine if pair[1] not in TASK_MAY_IMPORT}
    assert not wrong, sorted(wrong)


def test_every_command_names_both_and_no_library_imports_a_command(graph):
    """The commands (train, evaluate, export, plot, sweep, ...) are the composition roots: each
    imports the task's declaration itself, and no module imports a command."""
    _, imports = graph
    packages = ("", "engine", "task")
    commands = {module for module in imports if "." not in module and module not in packages}
    assert {"train", "evaluate", "export", "plot", "sweep"} <= commands, commands
    for command in ("train", "evaluate", "export", "plot", "sweep"):
        assert "task.config" in imports[command], (command, sorted(imports[command]))
    importers = {(module, target) for module, edges in imports.items() for target in edges}
    assert not {pair for pair in importers if pair[1] in commands}, sorted(importers)


def test_no_import_cycle(graph):
    """No two modules import each other through any chain of imports that run."""
    _, imports = graph
    assert cycles(imports) == []


def test_the_cycle_check_finds_a_cycle():
    """The check above can fail: a circle of three modules is reported, a TYPE_CHECKING-only edge
    is not."""
    circle = {"a": {"b": True}, "b": {"c": True}, "c": {"a": True}, "d": {"a": False}}
    assert cycles(circle) == [["a", "b", "c"]]
    assert cycles({"a": {"b": False}, "b": {"a": True}}) == []


def test_no_file_is_over_500_lines(graph):
    """No Python file of a bake (source or test) is longer than MAX_LINES: a longer one is usually
    two things."""
    baked, _ = graph
    long = {
        path.relative_to(baked.path).as_posix(): length
        for path in baked.path.rglob("*.py")
        if (length := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, long
