"""The template's docs are current with cookiecutter.json and config.py and build cleanly."""

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import ROOT

DOCS = ROOT / "docs"
PROJECT = ROOT / "{{cookiecutter.project_slug}}"
PACKAGE = Path("src") / "{{cookiecutter.package_name}}"
PACKAGE_SRC = PROJECT / PACKAGE
# Each task's own modules, by the `task` answer: the project as shipped is the default task's;
# another task's files sit in tasks/<task>/ at the paths the bake moves them to.
TASK_CHOICES = json.loads((ROOT / "cookiecutter.json").read_text(encoding="utf-8"))["task"]
DEFAULT_TASK = TASK_CHOICES[0]
TASK_SRC = {
    task: PACKAGE_SRC if task == DEFAULT_TASK else PROJECT / "tasks" / task / PACKAGE
    for task in TASK_CHOICES
}


def _load_docs_script(name: str):
    """Import docs/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_gen_options():
    """Import docs/gen_options.py as a module."""
    return _load_docs_script("gen_options")


def _module(path: Path) -> ast.Module:
    """A module of the generated project, parsed: never imported (Jinja in it, torch imports)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    """The top-level classes of a module by name."""
    return {node.name: node for node in _module(path).body if isinstance(node, ast.ClassDef)}


def _constant(path: Path, name: str) -> ast.expr:
    """The expression a module assigns to the top-level `name`."""
    for node in _module(path).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if getattr(target, "id", None) == name and node.value is not None:
            return node.value
    raise AssertionError(f"{path.name} has no {name}")


def _config_fields(task: str = DEFAULT_TASK) -> dict[str, list[str]]:
    """Each section of a task's Config and its field names, in Config's order.

    config.py defines the shared sections' dataclasses; the task's task_config.py the others."""
    classes = _classes(PACKAGE_SRC / "config.py")
    classes |= _classes(TASK_SRC[task] / "task_config.py")
    fields = {}
    for node in classes["Config"].body:
        if isinstance(node, ast.AnnAssign):
            factory = next(kw.value.id for kw in node.value.keywords if kw.arg == "default_factory")
            fields[node.target.id] = [
                leaf.target.id for leaf in classes[factory].body if isinstance(leaf, ast.AnnAssign)
            ]
    return fields


def _shared_sections() -> list[str]:
    """The sections of Config whose dataclass config.py itself defines, in Config's order."""
    classes = _classes(PACKAGE_SRC / "config.py")
    return [
        node.target.id
        for node in classes["Config"].body
        if isinstance(node, ast.AnnAssign)
        and next(kw.value.id for kw in node.value.keywords if kw.arg == "default_factory")
        in classes
    ]


def _all_config_keys() -> set[str]:
    """Every dotted key of any task's configuration."""
    return {
        f"{section}.{name}"
        for task in TASK_SRC
        for section, names in _config_fields(task).items()
        for name in names
    }


def _config_choices(task: str = DEFAULT_TASK) -> dict[str, tuple]:
    """The CHOICES of config.py, with the task_config.CHOICES it merges in taken from `task`."""
    node = _constant(PACKAGE_SRC / "config.py", "CHOICES")
    choices = {}
    for key, value in zip(node.keys, node.values, strict=True):
        if key is None:  # **task_config.CHOICES
            assert ast.unparse(value) == "task_config.CHOICES", ast.unparse(value)
            task_choices = _constant(TASK_SRC[task] / "task_config.py", "CHOICES")
            choices.update(ast.literal_eval(task_choices))
        else:
            choices[ast.literal_eval(key)] = ast.literal_eval(value)
    return choices


def _task_defaults(task: str) -> dict[str, object]:
    """The task's own defaults of shared keys (task_config.DEFAULTS), by dotted key."""
    defaults = ast.literal_eval(_constant(TASK_SRC[task] / "task_config.py", "DEFAULTS"))
    return {
        f"{section}.{name}": value
        for section, values in defaults.items()
        for name, value in values.items()
    }


def _reference_parts(markdown: str) -> tuple[str, dict[str, str]]:
    """The configuration reference split into the shared sections and each task's part."""
    shared, *rest = re.split(r"^## Task: (\S+)\n", markdown, flags=re.M)
    return shared, dict(zip(rest[0::2], rest[1::2], strict=True))


def _reference(markdown: str, task: str) -> str:
    """The rows that hold for a project of `task`: the shared sections and the task's own."""
    shared, tasks = _reference_parts(markdown)
    return shared + tasks[task]


# How a shared key's default cell shows a task's own default: "`0.002` (language-model: `0.003`)".
TASK_DEFAULT = re.compile(r" \(([\w-]+): (`[^`]*`)\)")


def _reference_default(markdown: str, task: str, key: str) -> str:
    """The default the reference gives `key` in a project of `task`, as its cell shows it."""
    cell = _cells(_table_row(_reference(markdown, task), key))[2]
    return dict(TASK_DEFAULT.findall(cell)).get(task, TASK_DEFAULT.sub("", cell))


def _task_interface(task: str) -> list[str]:
    """The public class attributes and methods of a task's task.Task, in order."""
    task_class = _classes(TASK_SRC[task] / "task.py")["Task"]
    names = []
    for node in task_class.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            names.append(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            names.append(node.targets[0].id)
    return names


def _task_constant(task: str, name: str) -> object:
    """A class attribute of a task's task.Task, e.g. MONITOR."""
    task_class = _classes(TASK_SRC[task] / "task.py")["Task"]
    for node in task_class.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{task}: Task has no {name}")


def _val_metrics(task: str) -> dict:
    """A task's task_config.VAL_METRICS: the metrics trainer.monitor may name."""
    tree = ast.parse((TASK_SRC[task] / "task_config.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "VAL_METRICS":
            return ast.literal_eval(node.value)
    raise AssertionError(f"{task}: task_config.py has no VAL_METRICS")


def _table_row(markdown: str, key: str) -> str:
    """The table row of the configuration reference whose first cell is `key`."""
    rows = [line for line in markdown.splitlines() if line.startswith(f"| `{key}` |")]
    assert len(rows) == 1, f"{key}: {len(rows)} rows"
    return rows[0]


def _cells(row: str) -> list[str]:
    """The cells of a markdown table row; a pipe inside backticks or escaped splits no cell."""
    cells, cell, in_code, previous = [], "", False, ""
    for char in row.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code and previous != "\\":
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
        previous = char
    return [*cells, cell.strip()]


def _nav_pages(nav) -> list[str]:
    """Every page file named in an mkdocs nav, nested sections included."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    return [page for value in nav.values() for page in _nav_pages(value)]


def _code_spans(markdown: str) -> list[str]:
    """The inline code spans and fenced code blocks of a markdown page."""
    return re.findall(r"```.*?```|`[^`\n]+`", markdown, re.S)


def test_options_table_matches_cookiecutter_json():
    """docs/options.md is exactly what docs/gen_options.py generates from cookiecutter.json."""
    gen_options = _load_gen_options()
    committed = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    assert committed == gen_options.render(), "run: python docs/gen_options.py"


def test_options_table_lists_every_question():
    """Every question in cookiecutter.json has a row in the options table."""
    gen_options = _load_gen_options()
    table = gen_options.render()
    for name in gen_options.default_answers():
        if not name.startswith("_"):
            assert f"| `{name}` |" in table, name


def test_docs_build_strictly(tmp_path):
    """`mkdocs build --strict` succeeds: no broken links or pages missing from the nav."""
    completed = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_pitfalls_table_numbers_every_pitfall():
    """docs/pitfalls.md has one row for each of the forty-eight pitfalls, numbered in order."""
    text = (ROOT / "docs" / "pitfalls.md").read_text(encoding="utf-8")
    numbers = [
        int(line.split("|")[1])
        for line in text.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    ]
    assert numbers == list(range(1, 49))


def test_pitfalls_table_names_only_tests_that_exist():
    """Every test the pitfalls table cites is a test function of a generated project (any task)."""
    import re

    text = (ROOT / "docs" / "pitfalls.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"`(test_\w+)", text))
    project = ROOT / "{{cookiecutter.project_slug}}"
    defined = set()
    for path in [*project.glob("tests/test_*.py"), *project.glob("tasks/*/tests/test_*.py")]:
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
    assert cited, "the table cites no tests"
    assert cited <= defined, sorted(cited - defined)


def test_configuration_reference_matches_config_py():
    """docs/configuration.md is exactly what docs/gen_config.py generates from config.py."""
    gen_config = _load_docs_script("gen_config")
    committed = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert committed == gen_config.render(), "run: python docs/gen_config.py"


def test_configuration_reference_lists_every_field():
    """The shared sections come once, then each task's own sections; every field has a full row."""
    table = _load_docs_script("gen_config").render()
    shared, tasks = _reference_parts(table)
    assert re.findall(r"^## (\w+)$", shared, re.M) == _shared_sections()
    assert list(tasks) == TASK_CHOICES
    for task, part in tasks.items():
        fields = _config_fields(task)
        own = [section for section in fields if section not in _shared_sections()]
        assert own == ["data", "model"], task
        assert re.findall(r"^### (\w+)$", part, re.M) == own, task
        reference = _reference(table, task)
        for section, names in fields.items():
            for name in names:
                key, type_, default, _, meaning = _cells(_table_row(reference, f"{section}.{name}"))
                assert type_ and default and meaning, (task, key)


def test_configuration_reference_shows_allowed_values():
    """Every key with a fixed set of values lists exactly those values in its row, in each task."""
    table = _load_docs_script("gen_config").render()
    for task in TASK_SRC:
        choices = _config_choices(task)
        assert "data.name" in choices and "run.device" in choices, task
        for key, allowed in choices.items():
            allowed_cell = _cells(_table_row(_reference(table, task), key))[3]
            assert allowed_cell == ", ".join(f"`{value}`" for value in allowed), (task, key)


def test_configuration_reference_shows_each_tasks_own_defaults_of_shared_keys():
    """A default a task's DEFAULTS change (the language model's optim.lr) is shown for that task."""
    gen_config = _load_docs_script("gen_config")
    table = gen_config.render()
    changed = {task: _task_defaults(task) for task in TASK_SRC}
    assert changed[DEFAULT_TASK] == {}
    assert {"optim.lr", "trainer.max_steps", "trainer.val_every"} <= set(changed["language-model"])
    for task, defaults in changed.items():
        for key, value in defaults.items():
            shown = _reference_default(table, task, key)
            assert shown == f"`{gen_config.literal(value)}`", (task, key)
    assert _reference_default(table, DEFAULT_TASK, "optim.lr") == "`0.002`"


def test_configuration_reference_shows_the_baked_tracker_default():
    """The tracker's default is shown as the cookiecutter answer and its default, not as Jinja."""
    table = _load_docs_script("gen_config").render()
    row = _table_row(table, "tracker.name")
    assert "the `tracker` answer (default `none`)" in row
    assert "{{" not in table and "{%" not in table


def test_nav_pages_exist():
    """Every page in the mkdocs nav is a file under docs/."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    pages = _nav_pages(config["nav"])
    assert "configuration.md" in pages
    missing = [page for page in pages if not (DOCS / page).is_file()]
    assert not missing, missing


# Dotted names in the docs' code that look like config keys but are not meant as one.
NOT_CONFIG_KEYS = {
    "data.batch_sz",  # the unknown-key error example
    "distributed.gradient_sync",  # a function of distributed.py
    # keys of the example third task that docs/tasks.md writes out in full
    "data.features",
    "data.noise",
    "model.hidden",
}
FILE_SUFFIXES = {"json", "jsonl", "lock", "md", "pt", "py", "safetensors", "yaml"}


def test_docs_cite_only_real_config_keys():
    """Every `section.key` a docs page puts in code is a key of some task's configuration."""
    known = _all_config_keys()
    sections = "|".join(_config_fields())
    pattern = re.compile(rf"(?<![\w/.-])((?:{sections})\.([a-z_]+))(?![\w(])")
    cited = {}
    for page in sorted(DOCS.glob("*.md")):
        for span in _code_spans(page.read_text(encoding="utf-8")):
            for key, leaf in pattern.findall(span):
                if leaf not in FILE_SUFFIXES:
                    cited.setdefault(key, page.name)
    assert {"data.batch_size", "data.seq_len", "trainer.val_every"} <= set(cited)
    unknown = {key: page for key, page in cited.items() if key not in known | NOT_CONFIG_KEYS}
    assert not unknown, unknown


def test_docs_cite_only_metrics_the_project_logs():
    """Every train/, val/ or perf/ metric the docs name is a key some task's generated code writes.

    train.py logs the best value of the monitored metric val/<x> so far as val/best_<x>; a task's
    trainer.monitor may be any of its task_config.VAL_METRICS (by default its Task.MONITOR)."""
    train_py = (PACKAGE_SRC / "train.py").read_text(encoding="utf-8")
    assert '"val/best_" + monitor' in train_py, "train.py no longer builds val/best_<x>"
    best = {
        "val/best_" + metric.split("/", 1)[1] for task in TASK_SRC for metric in _val_metrics(task)
    }
    defaults = {_task_constant(task, "MONITOR") for task in TASK_SRC}
    # the docs name these
    defaults_best = {"val/best_" + metric.split("/", 1)[1] for metric in defaults}
    assert defaults_best <= best
    assert {"val/best_acc", "val/best_loss"} <= best
    source = "\n".join(
        path.read_text(encoding="utf-8")
        for package in dict.fromkeys([PACKAGE_SRC, *TASK_SRC.values()])
        for path in sorted(package.glob("*.py"))
    )
    pattern = re.compile(r"(?<![\w/.<-])((?:train|val|perf)/\w+)")
    cited = {}
    for page in sorted(DOCS.glob("*.md")):
        for metric in pattern.findall(page.read_text(encoding="utf-8")):
            cited.setdefault(metric, page.name)
    assert {"perf/samples_per_s", "perf/tokens_per_s", "val/bpb", *defaults_best} <= set(cited)
    unknown = {
        metric: page
        for metric, page in cited.items()
        if f'"{metric}"' not in source and metric not in best
    }
    assert not unknown, unknown


def _task_scopes(markdown: str) -> list[tuple[str, str]]:
    """(task, text) for each stretch of a page under one heading: the task that the nearest
    enclosing heading naming one names ("A language model", "language-model"), else the default."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)  # a "# comment" there is no heading
    first, *rest = re.split(r"^(#{1,6}) (.*)$", prose, flags=re.M)
    scopes, enclosing = [(DEFAULT_TASK, first)], []
    for hashes, title, body in zip(rest[0::3], rest[1::3], rest[2::3], strict=True):
        named = [task for task in TASK_SRC if re.search(task.replace("-", "[ -]"), title, re.I)]
        enclosing = [(level, task) for level, task in enclosing if level < len(hashes)]
        enclosing.append((len(hashes), named[0] if named else None))
        scopes.append((next((t for _, t in reversed(enclosing) if t), DEFAULT_TASK), body))
    return scopes


def test_guides_state_the_defaults_config_py_has():
    """Every default a docs page states for a config key is the one the configuration gives it,
    for the task the page is talking about there (the default task unless a heading names one)."""
    table = _load_docs_script("gen_config").render()
    sections = "|".join(_config_fields())
    patterns = [
        re.compile(rf"`((?:{sections})\.\w+)` \(default `?([^`)]+)`?\)"),
        re.compile(rf"`((?:{sections})\.\w+)=([^`]+)`,? \(?the default"),
    ]
    stated = []
    for page in sorted(DOCS.glob("*.md")):
        if page.name == "configuration.md":
            continue
        for task, scope in _task_scopes(page.read_text(encoding="utf-8")):
            text = " ".join(scope.split())
            stated += [
                (page.name, task, *found) for pattern in patterns for found in pattern.findall(text)
            ]
    assert len(stated) >= 3, stated
    assert {task for _, task, _, _ in stated} == set(TASK_SRC), stated
    for page, task, key, value in stated:
        default = _reference_default(table, task, key)
        assert default.strip("`") == value, f"{page}: {key} (default {value}), {task}: {default}"


def test_resume_allow_list_in_the_docs_is_the_one_in_rundir_py():
    """docs/fault-tolerance.md lists exactly the keys that rundir.RESUME_MAY_CHANGE holds."""
    tree = ast.parse((PACKAGE_SRC / "rundir.py").read_text(encoding="utf-8"))
    allowed = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", None) == "RESUME_MAY_CHANGE"
    )
    text = (DOCS / "fault-tolerance.md").read_text(encoding="utf-8")
    listed = re.search(r"<!-- resume-may-change:.*?-->(.*?)<!-- /resume-may-change -->", text, re.S)
    assert listed, "docs/fault-tolerance.md has no resume-may-change list"
    assert re.findall(r"`([^`]+)`", listed[1]) == list(allowed)


def test_task_interface_in_the_docs_is_the_one_task_py_has():
    """Every task's task.Task has the same public names, and docs/tasks.md lists exactly those."""
    interfaces = {task: _task_interface(task) for task in TASK_SRC}
    names = interfaces[DEFAULT_TASK]
    assert all(interface == names for interface in interfaces.values()), interfaces
    text = (DOCS / "tasks.md").read_text(encoding="utf-8")
    listed = re.search(r"<!-- task-interface:.*?-->(.*?)<!-- /task-interface -->", text, re.S)
    assert listed, "docs/tasks.md has no task-interface list"
    assert re.findall(r"^- `(\w+)", listed[1], re.M) == names
