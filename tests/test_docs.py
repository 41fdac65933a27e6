"""The template's docs are current with cookiecutter.json and config.py and build cleanly."""

import ast
import importlib.util
import re
import subprocess
import sys

import yaml
from conftest import ROOT

DOCS = ROOT / "docs"
PACKAGE_SRC = ROOT / "{{cookiecutter.project_slug}}" / "src" / "{{cookiecutter.package_name}}"


def _load_docs_script(name: str):
    """Import docs/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_gen_options():
    """Import docs/gen_options.py as a module."""
    return _load_docs_script("gen_options")


def _config_fields() -> dict[str, list[str]]:
    """Each section of the generated project's Config and its field names, read from config.py."""
    tree = ast.parse((PACKAGE_SRC / "config.py").read_text(encoding="utf-8"))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    fields = {}
    for node in classes["Config"].body:
        if isinstance(node, ast.AnnAssign):
            factory = next(kw.value.id for kw in node.value.keywords if kw.arg == "default_factory")
            fields[node.target.id] = [
                leaf.target.id for leaf in classes[factory].body if isinstance(leaf, ast.AnnAssign)
            ]
    return fields


def _config_choices() -> dict[str, tuple]:
    """The CHOICES dict of the generated project's config.py."""
    tree = ast.parse((PACKAGE_SRC / "config.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "CHOICES":
            return ast.literal_eval(node.value)
    raise AssertionError("config.py has no CHOICES")


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
    """docs/pitfalls.md has one row for each of the forty pitfalls, numbered in order."""
    text = (ROOT / "docs" / "pitfalls.md").read_text(encoding="utf-8")
    numbers = [
        int(line.split("|")[1])
        for line in text.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    ]
    assert numbers == list(range(1, 41))


def test_pitfalls_table_names_only_tests_that_exist():
    """Every test the pitfalls table cites is a test function of the generated project."""
    import re

    text = (ROOT / "docs" / "pitfalls.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"`(test_\w+)", text))
    project_tests = ROOT / "{{cookiecutter.project_slug}}" / "tests"
    defined = set()
    for path in project_tests.glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
    assert cited, "the table cites no tests"
    assert cited <= defined, sorted(cited - defined)


def test_configuration_reference_matches_config_py():
    """docs/configuration.md is exactly what docs/gen_config.py generates from config.py."""
    gen_config = _load_docs_script("gen_config")
    committed = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert committed == gen_config.render(), "run: python docs/gen_config.py"


def test_configuration_reference_lists_every_field():
    """Every field of every config section has a full row, the sections in Config's order."""
    table = _load_docs_script("gen_config").render()
    fields = _config_fields()
    assert list(fields) == re.findall(r"^## (\w+)$", table, re.M)
    for section, names in fields.items():
        for name in names:
            key, type_, default, _, meaning = _cells(_table_row(table, f"{section}.{name}"))
            assert type_ and default and meaning, key


def test_configuration_reference_shows_allowed_values():
    """Every key with a fixed set of values lists exactly those values in its row."""
    table = _load_docs_script("gen_config").render()
    choices = _config_choices()
    assert choices
    for key, allowed in choices.items():
        allowed_cell = _cells(_table_row(table, key))[3]
        assert allowed_cell == ", ".join(f"`{value}`" for value in allowed), key


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
}
FILE_SUFFIXES = {"json", "jsonl", "lock", "md", "pt", "py", "safetensors", "yaml"}


def test_docs_cite_only_real_config_keys():
    """Every `section.key` a docs page puts in code is a key of the generated project's config."""
    fields = _config_fields()
    known = {f"{section}.{name}" for section, names in fields.items() for name in names}
    sections = "|".join(fields)
    pattern = re.compile(rf"(?<![\w/.-])((?:{sections})\.([a-z_]+))(?![\w(])")
    cited = {}
    for page in sorted(DOCS.glob("*.md")):
        for span in _code_spans(page.read_text(encoding="utf-8")):
            for key, leaf in pattern.findall(span):
                if leaf not in FILE_SUFFIXES:
                    cited.setdefault(key, page.name)
    assert "data.batch_size" in cited
    unknown = {key: page for key, page in cited.items() if key not in known | NOT_CONFIG_KEYS}
    assert not unknown, unknown


def test_docs_cite_only_metrics_the_project_logs():
    """Every train/, val/ or perf/ metric the docs name is a key the generated code writes."""
    source = "\n".join(path.read_text(encoding="utf-8") for path in PACKAGE_SRC.glob("*.py"))
    pattern = re.compile(r"(?<![\w/.<-])((?:train|val|perf)/\w+)")
    cited = {}
    for page in sorted(DOCS.glob("*.md")):
        for metric in pattern.findall(page.read_text(encoding="utf-8")):
            cited.setdefault(metric, page.name)
    assert "perf/samples_per_s" in cited
    unknown = {metric: page for metric, page in cited.items() if f'"{metric}"' not in source}
    assert not unknown, unknown


def test_guides_state_the_defaults_config_py_has():
    """Every default a docs page states for a config key is the one config.py gives it."""
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
        text = " ".join(page.read_text(encoding="utf-8").split())
        stated += [(page.name, *found) for pattern in patterns for found in pattern.findall(text)]
    assert len(stated) >= 3, stated
    for page, key, value in stated:
        default = _cells(_table_row(table, key))[2]
        assert default.strip("`") == value, f"{page}: {key} (default {value}), config.py: {default}"


def test_resume_allow_list_in_the_docs_is_the_one_in_rundir_py():
    """docs/fault-tolerance.md lists exactly the keys rundir.RESUME_MAY_CHANGE lets a resumed run change."""
    tree = ast.parse((PACKAGE_SRC / "rundir.py").read_text(encoding="utf-8"))
    allowed = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "RESUME_MAY_CHANGE"
    )
    text = (DOCS / "fault-tolerance.md").read_text(encoding="utf-8")
    listed = re.search(r"<!-- resume-may-change:.*?-->(.*?)<!-- /resume-may-change -->", text, re.S)
    assert listed, "docs/fault-tolerance.md has no resume-may-change list"
    assert re.findall(r"`([^`]+)`", listed[1]) == list(allowed)


def test_task_interface_in_the_docs_is_the_one_task_py_has():
    """docs/tasks.md names exactly the public attributes and methods of the generated task.Task."""
    tree = ast.parse((PACKAGE_SRC / "task.py").read_text(encoding="utf-8"))
    task = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Task")
    names = []
    for node in task.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            names.append(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            names.append(node.targets[0].id)
    text = (DOCS / "tasks.md").read_text(encoding="utf-8")
    listed = re.search(r"<!-- task-interface:.*?-->(.*?)<!-- /task-interface -->", text, re.S)
    assert listed, "docs/tasks.md has no task-interface list"
    assert re.findall(r"^- `(\w+)", listed[1], re.M) == names
