"""The template's docs are current with cookiecutter.json and the baked projects, and build cleanly.

What a baked project holds (its configuration, its task's SPEC, the seam between the engine and the
task, its files) is read from real bakes: each `task` answer is baked once for this module and a
child process imports the bake's package and reports (FACTS), independently of the docs' own
generator scripts.
"""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, project_files

DOCS = ROOT / "docs"
TASK_CHOICES = json.loads((ROOT / "cookiecutter.json").read_text(encoding="utf-8"))["task"]
DEFAULT_TASK = TASK_CHOICES[0]

# Run in a baked project with src/ on sys.path; argv: the package name and the output file.
FACTS = r"""
import dataclasses, importlib, json, sys

package, out = sys.argv[1:]
config = importlib.import_module(f"{package}.engine.config")
rundir = importlib.import_module(f"{package}.engine.rundir")
seam = importlib.import_module(f"{package}.engine.seam")
task = importlib.import_module(f"{package}.task.task")
spec = importlib.import_module(f"{package}.task.config").SPEC
Config = config.config_class(spec)


def public(cls):
    return [name for name in vars(cls) if not name.startswith("_")]


facts = {
    "package": package,
    "sections": {
        section.name: [name for name, _, _ in config.leaves(section.default_factory)]
        for section in dataclasses.fields(Config)
    },
    "shared": [
        section.name
        for section in dataclasses.fields(Config)
        if section.default_factory.__module__ == config.__name__
    ],
    "choices": config.choices(spec),
    "spec": {
        "metrics": spec.metrics,
        "monitor": spec.monitor,
        "defaults": spec.defaults,
        "resume_may_change": list(spec.resume_may_change),
    },
    "resume_may_change": list(rundir.RESUME_MAY_CHANGE),
    "seam_task": [[name, name in seam.Task.__abstractmethods__] for name in public(seam.Task)],
    "spec_fields": [
        [field.name, (field.default, field.default_factory) == (dataclasses.MISSING,) * 2]
        for field in dataclasses.fields(seam.TaskSpec)
    ],
    "base": {
        "data": [field.name for field in dataclasses.fields(seam.DataBase)],
        "model": [field.name for field in dataclasses.fields(seam.ModelBase)],
    },
    "batch_size": {"base": seam.DataBase().batch_size, "task": spec.data().batch_size},
    "task_class": {
        "subclass": issubclass(task.Task, seam.Task)
        and issubclass(spec.data, seam.DataBase)
        and issubclass(spec.model, seam.ModelBase),
        "abstract_left": sorted(task.Task.__abstractmethods__),
        "own": public(task.Task),
    },
}
with open(out, "w", encoding="utf-8") as file:
    json.dump(facts, file)
"""


def _load_docs_script(name: str):
    """Import docs/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bake(task: str, into: Path) -> Path:
    """A project baked with the default answers and `task`; no user settings play a part."""
    from cookiecutter.main import cookiecutter

    settings = {
        "cookiecutters_dir": str(into / "cookiecutters"),
        "replay_dir": str(into / "replay"),
    }
    return Path(
        cookiecutter(
            str(ROOT),
            no_input=True,
            extra_context={"task": task},
            output_dir=str(into / task),
            default_config=settings,
        )
    )


def _facts(project: Path, out: Path) -> dict:
    """FACTS, run in the baked project."""
    (package,) = {path.name for path in (project / "src").iterdir() if (path / "engine").is_dir()}
    completed = subprocess.run(
        [sys.executable, "-c", FACTS, package, str(out)],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return {**json.loads(out.read_text(encoding="utf-8")), "path": project}


@pytest.fixture(scope="module")
def baked(tmp_path_factory) -> dict[str, dict]:
    """Each task's bake and its FACTS, by `task` answer, the default first."""
    tmp = tmp_path_factory.mktemp("docs-bakes")
    projects = {task: _bake(task, tmp) for task in TASK_CHOICES}
    with ThreadPoolExecutor(len(projects)) as pool:
        facts = {
            task: pool.submit(_facts, path, tmp / f"{task}.json") for task, path in projects.items()
        }
        return {task: future.result() for task, future in facts.items()}


@pytest.fixture(scope="module")
def gen_config():
    """docs/gen_config.py, imported once (it bakes and reads each task once, then caches)."""
    return _load_docs_script("gen_config")


@pytest.fixture(scope="module")
def reference(gen_config) -> str:
    """docs/configuration.md as docs/gen_config.py generates it now."""
    return gen_config.render()


def _all_config_keys(baked: dict) -> set[str]:
    """Every dotted key of any task's configuration."""
    return {
        f"{section}.{name}"
        for facts in baked.values()
        for section, names in facts["sections"].items()
        for name in names
    }


def _task_defaults(facts: dict) -> dict[str, object]:
    """The task's own defaults of shared keys (its SPEC.defaults), by dotted key."""
    return {
        f"{section}.{name}": value
        for section, values in facts["spec"]["defaults"].items()
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


def _marked(page: str, name: str) -> str:
    """The text between `<!-- name: ... -->` and `<!-- /name -->` on a docs page."""
    text = (DOCS / page).read_text(encoding="utf-8")
    found = re.search(rf"<!-- {name}:.*?-->(.*?)<!-- /{name} -->", text, re.S)
    assert found, f"docs/{page} has no {name} list"
    return found[1]


def test_options_table_matches_cookiecutter_json():
    """docs/options.md is exactly what docs/gen_options.py generates from cookiecutter.json."""
    gen_options = _load_docs_script("gen_options")
    committed = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    assert committed == gen_options.render(), "run: python docs/gen_options.py"


def test_options_table_lists_every_question():
    """Every question in cookiecutter.json has a row in the options table."""
    gen_options = _load_docs_script("gen_options")
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
    """docs/pitfalls.md has one row for each of the fifty-five pitfalls, numbered in order, each
    inside a table (after a row or a table's header; after a blank line it would be loose text)."""
    lines = (ROOT / "docs" / "pitfalls.md").read_text(encoding="utf-8").splitlines()
    rows = [
        i
        for i, line in enumerate(lines)
        if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    ]
    assert [int(lines[i].split("|")[1]) for i in rows] == list(range(1, 56))
    assert all(lines[i - 1].startswith("|") for i in rows)


def test_pitfalls_table_names_tests_where_they_are(baked):
    """Every test the pitfalls table cites is a test function of a baked project (either task), and
    a test file named after it, as in "`test_x`, `test_y` (test_train.py)", defines it."""
    text = (ROOT / "docs" / "pitfalls.md").read_text(encoding="utf-8")
    defined: dict[str, set[str]] = {}  # test function -> the names of the files that define it
    for facts in baked.values():
        for path in (facts["path"] / "tests").rglob("test_*.py"):
            for name in re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M):
                defined.setdefault(name, set()).add(path.name)
    cited, placed = set(), []
    for line in text.splitlines():
        if not line.startswith("| ") or not line.split("|")[1].strip().isdigit():
            continue
        waiting = []  # tests cited since the last file name
        for test, file in re.findall(r"`(test_\w+)[^`]*`|\((test_\w+\.py)", _cells(line)[-1]):
            if test:
                cited.add(test)
                waiting.append(test)
            else:
                placed += [(test, file) for test in waiting]
                waiting = []
    assert len(cited) >= 30 and len(placed) >= 30, (len(cited), len(placed))
    assert cited <= set(defined), sorted(cited - set(defined))
    misplaced = [(test, file) for test, file in placed if file not in defined[test]]
    assert not misplaced, [(test, file, sorted(defined[test])) for test, file in misplaced]


def _template_files() -> set[str]:
    """The template's own files, relative to its root: no hidden, build or cache folders."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [
            name
            for name in dirnames
            if not name.startswith(".") and name not in {"build", "site", "__pycache__"}
        ]
        for name in filenames:
            path = (Path(dirpath) / name).relative_to(ROOT).as_posix()
            found |= {path, path.replace("{{cookiecutter.package_name}}", "<package>")}
    return found


# Where a docs page may name a .py file that no bake and no template file is: torch's own.
FOREIGN_PY = ("torch/",)
PY_FILE = re.compile(r"(?<![\w/.<>{}-])([\w<>{}./-]*\w\.py)\b")
# What docs/updating.md says about the flat layout: the names of files that no longer exist.
OLD_LAYOUT = re.compile(r"<!-- old-layout:.*?-->.*?<!-- /old-layout -->", re.S)


def test_docs_name_only_files_that_exist(baked):
    """Every `something.py` a docs page names is a file of a baked project (either task; with
    `<package>` for the package) or of the template, by its path from the root or the tail of it:
    no module path from an older layout survives (`task_config.py`, `src/<package>/config.py`)
    but in the marked section of docs/updating.md that tells what moved, where they are gone."""
    known = set()
    for facts in baked.values():
        for path in project_files(facts["path"]):
            known |= {path, path.replace(f"src/{facts['package']}/", "src/<package>/")}
    known |= _template_files()

    def exists(path: str) -> bool:
        return any(file == path or file.endswith("/" + path) for file in known)

    named, old = {}, set()
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        old_layout = OLD_LAYOUT.findall(text)
        old |= {path for block in old_layout for path in PY_FILE.findall(block)}
        for path in PY_FILE.findall(OLD_LAYOUT.sub("", text)):
            named.setdefault(path, page.name)
    assert {"engine/seam.py", "task/config.py"} <= set(named), sorted(named)
    missing = {
        path: page
        for path, page in named.items()
        if not path.startswith(FOREIGN_PY) and not exists(path)
    }
    assert not missing, missing
    assert {"task_config.py", "model_init.py"} <= {path for path in old if not exists(path)}, old


def test_configuration_reference_matches_the_baked_configuration(reference):
    """docs/configuration.md is exactly what docs/gen_config.py generates from the bakes."""
    committed = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert committed == reference, "run: python docs/gen_config.py"


def test_configuration_reference_check_mode_reports_a_stale_page(gen_config, reference, tmp_path):
    """`gen_config.py --check` exits 0 for a current page, 1 for a stale one, and writes nothing."""
    page = tmp_path / "configuration.md"
    gen_config.CONFIGURATION_MD, real = page, gen_config.CONFIGURATION_MD
    try:
        page.write_text(reference, encoding="utf-8")
        assert gen_config.main(["--check"]) == 0
        stale = reference.replace("| `run.seed` |", "| `run.sed` |")
        page.write_text(stale, encoding="utf-8")
        assert gen_config.main(["--check"]) == 1
        assert page.read_text(encoding="utf-8") == stale
    finally:
        gen_config.CONFIGURATION_MD = real


def test_configuration_reference_lists_every_field(baked, reference):
    """The shared sections come once, then each task's own sections; every field has a full row."""
    shared, tasks = _reference_parts(reference)
    default_shared = baked[DEFAULT_TASK]["shared"]
    assert re.findall(r"^## (\w+)$", shared, re.M) == default_shared
    assert list(tasks) == TASK_CHOICES
    for task, part in tasks.items():
        facts = baked[task]
        assert facts["shared"] == default_shared, task
        own = [section for section in facts["sections"] if section not in facts["shared"]]
        assert own == ["data", "model"], task
        assert re.findall(r"^### (\w+)$", part, re.M) == own, task
        for section, names in facts["sections"].items():
            for name in names:
                row = _table_row(_reference(reference, task), f"{section}.{name}")
                key, type_, default, _, meaning = _cells(row)
                assert type_ and default and meaning, (task, key)


def test_configuration_reference_shows_allowed_values(baked, reference):
    """Every key with a fixed set of values lists exactly those values in its row, in each task."""
    for task, facts in baked.items():
        choices = facts["choices"]
        assert "data.name" in choices and "run.device" in choices, task
        for key, allowed in choices.items():
            allowed_cell = _cells(_table_row(_reference(reference, task), key))[3]
            shown = ["null" if value is None else value for value in allowed]
            assert allowed_cell == ", ".join(f"`{value}`" for value in shown), (task, key)


def test_configuration_reference_shows_each_tasks_own_defaults_of_shared_keys(
    baked, reference, gen_config
):
    """A default a task's SPEC.defaults change (the language model's optim.lr) is shown for it."""
    changed = {task: _task_defaults(facts) for task, facts in baked.items()}
    assert changed[DEFAULT_TASK] == {}
    assert {"optim.lr", "trainer.max_steps", "trainer.val_every"} <= set(changed["language-model"])
    for task, defaults in changed.items():
        for key, value in defaults.items():
            shown = _reference_default(reference, task, key)
            assert shown == f"`{gen_config.literal(value)}`", (task, key)
    assert _reference_default(reference, DEFAULT_TASK, "optim.lr") == "`0.002`"


def test_configuration_reference_shows_a_tasks_own_default_of_an_engine_key(baked, reference):
    """A task that declares a key of the engine's DataBase again (data.batch_size) shows its own
    default for it, not the base class's."""
    shown = {task: _reference_default(reference, task, "data.batch_size") for task in baked}
    assert shown == {task: f"`{facts['batch_size']['task']}`" for task, facts in baked.items()}
    assert any(
        facts["batch_size"]["task"] != facts["batch_size"]["base"] for facts in baked.values()
    )


def test_configuration_reference_shows_the_baked_tracker_default(reference):
    """The tracker's default is shown as the cookiecutter answer and its default, not as Jinja."""
    row = _table_row(reference, "tracker.name")
    assert "the `tracker` answer (default `none`)" in row
    assert "{{" not in reference and "{%" not in reference


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
    "distributed.gradient_sync",  # a function of engine/parallel/distributed.py
}
EXAMPLE_TASK = ROOT / "docs" / "examples" / "regression"


def _example_task_names() -> tuple[set[str], set[str]]:
    """The config keys and the metrics of the example task that docs/tasks.md shows in full (its
    files are real: tests/test_example_task.py bakes and trains them)."""
    config = ast.parse((EXAMPLE_TASK / "task" / "config.py").read_text(encoding="utf-8"))
    sections = {"DataConfig": "data", "ModelConfig": "model"}
    keys = {
        f"{sections[node.name]}.{leaf.target.id}"
        for node in config.body
        if isinstance(node, ast.ClassDef) and node.name in sections
        for leaf in node.body
        if isinstance(leaf, ast.AnnAssign)
    }
    code = (EXAMPLE_TASK / "task" / "task.py").read_text(encoding="utf-8")
    metrics = set(re.findall(r'"((?:val|train)/\w+)"', code))
    return keys, metrics


FILE_SUFFIXES = {"json", "jsonl", "lock", "md", "pt", "py", "safetensors", "yaml"}


def test_docs_cite_only_real_config_keys(baked):
    """Every `section.key` a docs page puts in code is a key of some task's configuration."""
    known = _all_config_keys(baked)
    known |= {key.rsplit(".", 1)[0] for key in known if key.count(".") > 1}  # groups: model.lora
    sections = "|".join(baked[DEFAULT_TASK]["sections"])
    pattern = re.compile(rf"(?<![\w/.-])((?:{sections})\.([a-z_]+(?:\.[a-z_]+)?))(?![\w(])")
    cited = {}
    for page in sorted(DOCS.glob("*.md")):
        for span in _code_spans(page.read_text(encoding="utf-8")):
            for key, leaf in pattern.findall(span):
                if leaf.split(".")[0] not in FILE_SUFFIXES:
                    cited.setdefault(key, page.name)
    assert {"data.batch_size", "data.seq_len", "trainer.val_every"} <= set(cited)
    example_keys, _ = _example_task_names()
    assert {"data.noise", "model.hidden"} <= example_keys
    allowed = known | NOT_CONFIG_KEYS | example_keys
    unknown = {key: page for key, page in cited.items() if key not in allowed}
    assert not unknown, unknown


def test_docs_cite_only_metrics_the_project_logs(baked):
    """Every train/, val/ or perf/ metric the docs name is a key some task's baked code writes.

    The engine logs the best value of the monitored metric val/<x> so far as val/best_<x> (of a
    benchmark's eval/TASK/METRIC as eval/best_TASK/METRIC); a task's trainer.monitor may be any
    metric of its SPEC.metrics (by default SPEC.monitor)."""
    source = "\n".join(
        path.read_text(encoding="utf-8")
        for facts in baked.values()
        for path in sorted((facts["path"] / "src").rglob("*.py"))
    )
    builds_best = 'f"{kind}/best_{name}"' in source
    assert builds_best, "the engine no longer builds val/best_<x> (KIND/best_NAME)"
    best = {
        "val/best_" + metric.split("/", 1)[1]
        for facts in baked.values()
        for metric in facts["spec"]["metrics"]
    }
    defaults_best = {
        "val/best_" + facts["spec"]["monitor"].split("/", 1)[1] for facts in baked.values()
    }
    assert {"val/best_acc", "val/best_loss"} <= defaults_best <= best
    best.add("val/best_")  # the docs' val/best_<name>
    pattern = re.compile(r"(?<![\w/.<-])((?:train|val|perf)/\w+)")
    cited = {}
    for page in sorted(DOCS.glob("*.md")):
        for metric in pattern.findall(page.read_text(encoding="utf-8")):
            cited.setdefault(metric, page.name)
    assert {"perf/samples_per_s", "perf/tokens_per_s", "val/bpb", *defaults_best} <= set(cited)
    _, example_metrics = _example_task_names()
    assert "val/mae" in example_metrics
    unknown = {
        metric: page
        for metric, page in cited.items()
        if f'"{metric}"' not in source and metric not in best | example_metrics
    }
    assert not unknown, unknown


def _task_scopes(markdown: str) -> list[tuple[str, str]]:
    """(task, text) for each stretch of a page under one heading: the task that the nearest
    enclosing heading naming one names ("A language model", "language-model"), else the default."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)  # a "# comment" there is no heading
    first, *rest = re.split(r"^(#{1,6}) (.*)$", prose, flags=re.M)
    scopes, enclosing = [(DEFAULT_TASK, first)], []
    for hashes, title, body in zip(rest[0::3], rest[1::3], rest[2::3], strict=True):
        named = [task for task in TASK_CHOICES if re.search(task.replace("-", "[ -]"), title, re.I)]
        enclosing = [(level, task) for level, task in enclosing if level < len(hashes)]
        enclosing.append((len(hashes), named[0] if named else None))
        scopes.append((next((t for _, t in reversed(enclosing) if t), DEFAULT_TASK), body))
    return scopes


def test_guides_state_the_defaults_the_configuration_has(baked, reference):
    """Every default a docs page states for a config key is the one the configuration gives it,
    for the task the page is talking about there (the default task unless a heading names one)."""
    sections = "|".join(baked[DEFAULT_TASK]["sections"])
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
    assert {task for _, task, _, _ in stated} == set(TASK_CHOICES), stated
    for page, task, key, value in stated:
        default = _reference_default(reference, task, key)
        assert default.strip("`") == value, f"{page}: {key} (default {value}), {task}: {default}"


def test_resume_allow_list_in_the_docs_is_the_engines_and_each_tasks(baked):
    """docs/fault-tolerance.md lists exactly the keys engine/rundir.py's RESUME_MAY_CHANGE holds,
    then for each task exactly those of its SPEC.resume_may_change."""
    engine = baked[DEFAULT_TASK]["resume_may_change"]
    assert all(facts["resume_may_change"] == engine for facts in baked.values())
    assert re.findall(r"`([^`]+)`", _marked("fault-tolerance.md", "resume-may-change")) == engine
    listed = {
        task: re.findall(r"`([^`]+)`", keys)
        for task, keys in re.findall(
            r"^- `([\w-]+)`: (.*)$", _marked("fault-tolerance.md", "task-resume-may-change"), re.M
        )
    }
    assert listed == {task: facts["spec"]["resume_may_change"] for task, facts in baked.items()}
    assert all(listed.values()), listed


def test_task_interface_in_the_docs_is_the_seams(baked):
    """docs/tasks.md lists exactly the public methods of engine/seam.py's Task, in order, marking
    those every task must write (the abstract ones); each task's Task is a seam.Task that leaves
    none of them unwritten and adds no public name of its own the engine would never call."""
    seam_task = baked[DEFAULT_TASK]["seam_task"]
    assert sum(required for _, required in seam_task) >= 4, seam_task
    listed = re.findall(
        r"^- `(\w+)[^`]*`( \(required\))?:", _marked("tasks.md", "task-interface"), re.M
    )
    assert [(name, bool(required)) for name, required in listed] == [
        (name, required) for name, required in seam_task
    ]
    interface = {name for name, _ in seam_task}
    for task, facts in baked.items():
        assert facts["seam_task"] == seam_task, task
        assert facts["task_class"]["subclass"], task
        assert facts["task_class"]["abstract_left"] == [], task
        assert set(facts["task_class"]["own"]) <= interface, (task, facts["task_class"]["own"])


def test_task_spec_in_the_docs_is_the_seams(baked):
    """docs/tasks.md lists exactly the fields of engine/seam.py's TaskSpec, in order, marking those
    without a default as required."""
    spec_fields = baked[DEFAULT_TASK]["spec_fields"]
    assert {name for name, required in spec_fields if required} >= {"data", "model", "metrics"}
    assert any(not required for _, required in spec_fields), spec_fields
    listed = re.findall(r"^- `(\w+)`( \(required\))?:", _marked("tasks.md", "task-spec"), re.M)
    assert [(name, bool(required)) for name, required in listed] == [
        (name, required) for name, required in spec_fields
    ]


def test_engine_keys_in_the_docs_are_the_seams_base_sections(baked):
    """docs/tasks.md names exactly the data. and model. keys of engine/seam.py's DataBase and
    ModelBase as the ones every task has and the engine reads."""
    base = baked[DEFAULT_TASK]["base"]
    expected = [f"{section}.{name}" for section, names in base.items() for name in names]
    assert len(expected) >= 4, expected
    assert re.findall(r"`([^`]+)`", _marked("tasks.md", "engine-keys")) == expected
    for task, facts in baked.items():
        for section, names in base.items():
            assert set(names) <= set(facts["sections"][section]), (task, section)


def _bench_report():
    """bench/report.py as a module."""
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def test_readmes_quote_the_language_model_demo_as_the_last_benchmark_measured_it(tmp_path):
    """The template README and a baked README quote the language model's demo (over the floor,
    val/loss, wall time) exactly as bench/results/cpu.json has it, and report.py rewrites only
    those numbers."""
    report = _bench_report()
    figures = json.loads((ROOT / "bench" / "results" / "cpu.json").read_text())["figures"]
    expected = report.demo_figures(figures)
    for readme in report.DEMO_QUOTES:
        quoted = report.quoted(readme)
        assert quoted == {name: expected[name] for name in quoted}, (readme, quoted, expected)

    readme = ROOT / "README.md"
    copy = tmp_path / "README.md"
    copy.write_text(readme.read_text(encoding="utf-8"), encoding="utf-8")
    report.DEMO_QUOTES[copy] = report.DEMO_QUOTES[readme]
    moved = {**figures, "lm_demo/val_loss_over_floor": 1.0123, "lm_demo/wall_s": 99.6}
    report.quote_demo(copy, moved)
    assert report.quoted(copy) == {"over": "1.2", "wall": "100"}
    new, old = (
        "1.2% above that floor in 100 s",
        f"{expected['over']}% above that floor in {expected['wall']} s",
    )
    assert copy.read_text().replace(new, "") == readme.read_text().replace(old, "")
