"""The hooks refuse bad answers with one clear line and prune the baked project."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, bake, project_files


@pytest.mark.parametrize("name", ["my_trainer", "trainer2", "_private_net", "Resnet_Lab"])
def test_valid_package_names_are_accepted(pre_gen, name):
    """Ordinary identifiers that shadow nothing are accepted as package names."""
    assert pre_gen.validate_package_name(name) is None


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "identifier"),
        ("2fast", "identifier"),
        ("my-trainer", "identifier"),
        ("my trainer", "identifier"),
        ("café", "identifier"),
        ("class", "keyword"),
        ("import", "keyword"),
        ("match", "keyword"),
        ("json", "shadow"),
        ("logging", "shadow"),
        ("Queue", "shadow"),
        ("test", "shadow"),
        ("tests", "shadow"),
        ("torch", "shadow"),
        ("torchvision", "shadow"),
        ("torchaudio", "shadow"),
        ("numpy", "shadow"),
        ("yaml", "shadow"),
        ("pil", "shadow"),
        ("wandb", "shadow"),
        ("mlflow", "shadow"),
        ("sqlalchemy", "shadow"),
        ("sympy", "shadow"),
        ("filelock", "shadow"),
        ("__main__", "dunder"),
        ("__init__", "dunder"),
        ("__trainer__", "dunder"),
        ("conftest", "shadow"),
        ("Conftest", "shadow"),
        ("test_config", "shadow"),
        ("test_mine", "shadow"),
        ("antlr4", "shadow"),
        ("matplotlib", "shadow"),
        ("fonttools", "shadow"),
        ("dateutil", "shadow"),
        ("huggingface_hub", "shadow"),
        ("psutil", "shadow"),
        ("google", "shadow"),
        ("grpc", "shadow"),
        ("werkzeug", "shadow"),
        ("pydantic", "shadow"),
        ("_pytest", "shadow"),
        ("ruff", "shadow"),
        ("sitecustomize", "shadow"),
    ],
)
def test_bad_package_names_are_refused_with_a_reason(pre_gen, name, reason):
    """Non-identifiers, keywords and names that shadow stdlib or dependency modules are refused."""
    error = pre_gen.validate_package_name(name)
    assert error is not None
    assert reason in error
    assert "package_name" in error


# `import x` / `from x import ...` at the start of a line; relative imports and Jinja are skipped.
IMPORTED = re.compile(
    r"^\s*(?:from\s+([A-Za-z_]\w*)[\w.]*\s+import\s|import\s+([A-Za-z_]\w*))", re.M
)


def test_package_name_cannot_shadow_anything_the_project_imports(pre_gen):
    """Every top-level module the generated code or its tests import, for every task (matplotlib,
    conftest, ...) is refused as a package name, so the project never imports itself in its place.
    """
    project = ROOT / "{{cookiecutter.project_slug}}"
    imported = {
        name
        for pattern in ("src/**/*.py", "tests/**/*.py", "tasks/*/**/*.py")
        for path in project.glob(pattern)
        for match in IMPORTED.findall(path.read_text(encoding="utf-8"))
        for name in match
        if name
    }
    assert {"torch", "omegaconf", "matplotlib", "conftest", "tokenizers", "tiny"} <= imported
    accepted = sorted(name for name in imported if pre_gen.validate_package_name(name) is None)
    assert not accepted, f"accepted as package names, yet imported by the project: {accepted}"


@pytest.mark.parametrize("slug", ["my-trainer", "my_trainer", "trainer2", "2-fast", "a"])
def test_valid_project_slugs_are_accepted(pre_gen, slug):
    """Lowercase slugs of letters, digits, dashes and underscores are accepted."""
    assert pre_gen.validate_project_slug(slug) is None


@pytest.mark.parametrize(
    "slug",
    [
        "",
        "a/b",
        "../escape",
        "..",
        "a..b",
        "My-Trainer",
        "my trainer",
        "trainer.v2",
        "-lead",
        "end_",
    ],
)
def test_bad_project_slugs_are_refused(pre_gen, slug):
    """Empty slugs, paths, uppercase, spaces and other characters outside [a-z0-9_-] are refused."""
    error = pre_gen.validate_project_slug(slug)
    assert error is not None
    assert "project_slug" in error


@pytest.mark.parametrize("name", ["", "   ", "\t", "Two\nLines"])
def test_blank_or_multiline_project_names_are_refused(pre_gen, name):
    """A project name must have visible text on a single line."""
    assert "project_name" in pre_gen.validate_project_name(name)


@pytest.mark.parametrize("name", ["My Trainer", 'Zoë\'s "Quoted" \\ Trainer', "日本 Trainer 2"])
def test_free_text_project_names_are_accepted(pre_gen, name):
    """Quotes, backslashes and non-ASCII letters are fine in a project name."""
    assert pre_gen.validate_project_name(name) is None


@pytest.mark.parametrize("key", ["project_name", "description", "author", "email"])
def test_lone_surrogates_are_refused(pre_gen, key):
    """Bytes that are not UTF-8 (a lone surrogate on the command line) are refused, by name."""
    good = {
        "project_name": "My Trainer",
        "project_slug": "my-trainer",
        "package_name": "my_trainer",
        "description": "d",
        "author": "a",
        "email": "e@example.com",
    }
    error = pre_gen.validate_answers({**good, key: "Ana \udcff Lima"})
    assert error is not None and error.startswith(key) and "surrogate" in error


@pytest.mark.parametrize("value", ["Ana 🚀 Lima", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 trainer", "日本 🤖"])
def test_characters_beyond_the_basic_plane_are_accepted(pre_gen, value):
    """Emoji and other characters beyond U+FFFF are fine in every free-text answer."""
    assert pre_gen.validate_project_name(value) is None
    for key in ("description", "author", "email"):
        assert pre_gen.validate_free_text(key, value) is None


def test_validate_answers_reports_the_first_bad_answer(pre_gen):
    """The combined check names the answer to change, and passes the defaults."""
    good = {
        "project_name": "My Trainer",
        "project_slug": "my-trainer",
        "package_name": "my_trainer",
        "description": 'Says "hi"',
        "author": "Renée O'Brien",
        "email": "you@example.com",
    }
    assert pre_gen.validate_answers(good) is None
    assert "package_name" in pre_gen.validate_answers({**good, "package_name": "json"})
    assert "author" in pre_gen.validate_answers({**good, "author": "Two\nLines"})


def test_hooks_are_valid_python_before_rendering():
    """Both hook files compile as they are stored, so linters and tests can read them."""
    for hook in (ROOT / "hooks").glob("*.py"):
        compile(hook.read_text(encoding="utf-8"), str(hook), "exec")


def _licensed_tree(root: Path) -> Path:
    """Lay out the licenses/ and .github/ files the generated project ships, under `root`."""
    for name in ("MIT", "Apache-2.0", "BSD-3-Clause", "proprietary"):
        (root / "licenses").mkdir(parents=True, exist_ok=True)
        (root / "licenses" / name).write_text(f"{name} text\n")
    (root / ".github" / "workflows").mkdir(parents=True)
    (root / ".github" / "workflows" / "ci.yml").write_text("name: ci\n")
    return root


def test_install_license_moves_the_chosen_text(post_gen, tmp_path):
    """The chosen license text becomes LICENSE and no licenses/ directory is left."""
    root = _licensed_tree(tmp_path)
    post_gen.install_license("Apache-2.0", root)
    post_gen.remove_licenses_dir(root)
    assert (root / "LICENSE").read_text() == "Apache-2.0 text\n"
    assert project_files(root) == {"LICENSE", ".github/workflows/ci.yml"}


def test_install_license_refuses_an_unknown_license(post_gen, tmp_path):
    """An unknown license name fails with the list of available ones."""
    root = _licensed_tree(tmp_path)
    with pytest.raises(ValueError, match="MIT"):
        post_gen.install_license("GPL-3.0", root)


def _task_tree(root: Path) -> Path:
    """The engine's files and two task folders, each mirroring the project's layout."""
    for name in ("src/pkg/train.py", "src/pkg/engine/loop.py", "tests/engine/test_train.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"engine {name}\n")
    owned = {
        "image-classification": ("src/pkg/task/task.py", "configs/default.yaml", "tests/task/a.py"),
        "language-model": ("src/pkg/task/task.py", "src/pkg/prepare.py", "tests/task/b.py"),
    }
    for task, names in owned.items():
        for name in names:
            (root / "tasks" / task / name).parent.mkdir(parents=True, exist_ok=True)
            (root / "tasks" / task / name).write_text(f"{task} {name}\n")
    return root


@pytest.mark.parametrize("task", ["image-classification", "language-model"])
def test_use_task_moves_the_chosen_task_folder_in_whole(post_gen, tmp_path, task):
    """The chosen task's folder lands at the project's paths, the other task leaves nothing behind,
    the engine's files stay, and no tasks/ folder is left."""
    root = _task_tree(tmp_path)
    post_gen.use_task(task, root)
    files = {name: (root / name).read_text() for name in project_files(root)}
    assert files["src/pkg/task/task.py"] == f"{task} src/pkg/task/task.py\n"
    if task == "image-classification":
        assert "src/pkg/prepare.py" not in files and "tests/task/a.py" in files
    else:
        assert files["src/pkg/prepare.py"] == "language-model src/pkg/prepare.py\n"
        assert "configs/default.yaml" not in files and "tests/task/a.py" not in files
    assert files["src/pkg/engine/loop.py"] == "engine src/pkg/engine/loop.py\n"
    assert not (root / "tasks").exists()


def test_use_task_refuses_an_unknown_task(post_gen, tmp_path):
    root = _task_tree(tmp_path)
    with pytest.raises(ValueError, match="language-model"):
        post_gen.use_task("speech", root)


def test_use_task_refuses_to_replace_an_engine_file(post_gen, tmp_path):
    """A task folder that would overwrite the engine is a template bug, caught at bake time."""
    root = _task_tree(tmp_path)
    (root / "tasks" / "language-model" / "src/pkg/train.py").write_text("a task's own train.py\n")
    with pytest.raises(ValueError, match="src/pkg/train.py"):
        post_gen.use_task("language-model", root)


def test_remove_ci_deletes_the_workflow(post_gen, tmp_path):
    """Without CI the .github/ directory is gone."""
    root = _licensed_tree(tmp_path)
    post_gen.remove_ci(root)
    assert not (root / ".github").exists()


def test_write_answers_records_the_answers_without_machine_paths(post_gen, tmp_path):
    """.cookiecutter.yaml holds every answer as a default_context and no ``_`` key or local path."""
    public = {
        "project_name": 'Zoë\'s "Quoted" \\ Trainer',
        "project_slug": "zoes-quoted-trainer",
        "python_version": "3.10",
        "include_ci": "no",
        "tracker": "none",
        "description": "Line: with # and {braces}",
    }
    private = {
        "_template": "/home/someone/src/torch-template",
        "_output_dir": "/tmp/bake-output",
        "_repo_dir": "/home/someone/.cookiecutters/torch-template",
        "_checkout": None,
        "__year": "2031",
        "__prompts__": {"project_name": "Project name (free text)"},
    }
    post_gen.write_answers({**public, **private}, tmp_path)
    text = (tmp_path / ".cookiecutter.yaml").read_text(encoding="utf-8")
    assert text.startswith("# ")
    assert "cookiecutter --config-file .cookiecutter.yaml --no-input" in text
    assert yaml.safe_load(text) == {"default_context": public}
    for value in ("/home/someone", "/tmp/bake-output", "__year", "2031", "_template", "prompts"):
        assert value not in text


def _rebake_from_answers(answers_file: Path, output: Path) -> Path:
    """Bake the template with `cookiecutter --config-file <answers_file> --no-input`."""
    env = {**os.environ, "HOME": str(output.parent / "home")}  # replay files land in this HOME
    env.pop("COOKIECUTTER_CONFIG", None)
    command = [sys.executable, "-m", "cookiecutter", "--no-input", "-o", str(output)]
    command += ["--config-file", str(answers_file), str(ROOT)]
    completed = subprocess.run(
        command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    (project,) = output.iterdir()
    return project


def test_answers_file_rebakes_an_identical_project(cookies, tmp_path):
    """Baking again from a project's .cookiecutter.yaml reproduces the project file for file."""
    baked = bake(cookies, project_name="Acme Vision", license="Apache-2.0", tracker="tensorboard")
    rebaked = _rebake_from_answers(baked.path / ".cookiecutter.yaml", tmp_path / "rebake")
    assert rebaked.name == baked.path.name == "acme-vision"
    files = project_files(baked.path)
    assert ".cookiecutter.yaml" in files
    assert project_files(rebaked) == files
    for name in sorted(files):
        assert (rebaked / name).read_bytes() == (baked.path / name).read_bytes(), name


@pytest.mark.parametrize(
    "context",
    [
        {"package_name": "json"},
        {"package_name": "torch"},
        {"package_name": "class"},
        {"package_name": "my-trainer"},
        {"package_name": "__main__"},
        {"package_name": "conftest"},
        {"package_name": "antlr4"},
        {"package_name": "matplotlib"},
        {"project_slug": "../escape"},
        {"project_slug": "My Trainer"},
        {"project_name": "   "},
        {"project_name": "2nd Trainer"},
        {"project_name": "!!!"},
        {"project_name": "Import"},
    ],
    ids=lambda context: f"{next(iter(context))}={next(iter(context.values()))!r}",
)
def test_refused_answers_fail_the_bake(cookies, context):
    """A refused answer stops the bake with an error and leaves no project behind."""
    result = cookies.bake(extra_context=context, template=str(ROOT))
    assert result.exit_code != 0
    assert result.exception is not None
    assert result.project_path is None or not Path(result.project_path).exists()


def test_cli_refusal_is_one_line_without_traceback(tmp_path):
    """`cookiecutter --no-input . package_name=json` fails with one ERROR line on stderr."""
    config = tmp_path / "config.yaml"
    config.write_text(
        f"cookiecutters_dir: {tmp_path / 'cookiecutters'}\nreplay_dir: {tmp_path / 'replay'}\n"
    )
    output = tmp_path / "out"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "cookiecutter",
            "--no-input",
            "-o",
            str(output),
            ".",
            "package_name=json",
        ],
        cwd=ROOT,
        env={**os.environ, "COOKIECUTTER_CONFIG": str(config)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode != 0
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith("ERROR: package_name 'json'")
    assert "shadow" in lines[0]
    assert "Traceback" not in completed.stderr
    assert not output.exists() or not any(output.iterdir())
