"""The template's docs are current with cookiecutter.json and build cleanly."""

import importlib.util
import subprocess
import sys

from conftest import ROOT


def _load_gen_options():
    """Import docs/gen_options.py as a module."""
    spec = importlib.util.spec_from_file_location("gen_options", ROOT / "docs" / "gen_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
