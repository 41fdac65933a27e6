"""A project baked with cruft stays in step with the template: create, check, update, diff, link.

Each test works on a private git copy of the template as it is in the working tree, so template
changes can be committed without touching this repository, and nothing is fetched over a network.
"""

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, project_files, run

CRUFT = Path(sys.executable).parent / "cruft"
ANSWERS = {"project_name": "Acme Vision", "license": "Apache-2.0", "tracker": "tensorboard"}
# Underscore keys cruft itself records next to the answers; anything else would be a leak.
CRUFT_PRIVATE_KEYS = {"__year", "_template", "_commit"}
# Commits must work on a bare machine with no git identity configured.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "Template Tests",
    "GIT_AUTHOR_EMAIL": "template-tests@example.com",
    "GIT_COMMITTER_NAME": "Template Tests",
    "GIT_COMMITTER_EMAIL": "template-tests@example.com",
}
# Variables that would point git or cookiecutter somewhere other than the test's own files.
REDIRECTS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_CONFIG", "COOKIECUTTER_CONFIG")

TEMPLATE_CHANGE_IGNORE = ".mypy_cache/"
TEMPLATE_CHANGE_README = " Kept in step with torch-template by cruft."
USER_SECTION = "\n## Lab notes\n\nThis section belongs to the project, not the template.\n"


@dataclass(frozen=True)
class CruftProject:
    """A template repository and a project cruft baked from it, committed to its own git repo."""

    template: Path
    commit: str
    project: Path


def _ok(command: list, cwd: Path, env: dict) -> str:
    """Run `command` in `cwd`, fail the test on a non-zero exit, and return its stdout."""
    completed = run([str(part) for part in command], cwd=cwd, env=env, timeout=120)
    assert completed.returncode == 0, f"{command}:\n{completed.stdout}\n{completed.stderr}"
    return completed.stdout


def _commit_all(repo: Path, env: dict, message: str) -> str:
    """Commit every change in `repo` and return the new commit's hash."""
    _ok(["git", "add", "-A"], repo, env)
    _ok(["git", "commit", "-q", "-m", message], repo, env)
    return _ok(["git", "rev-parse", "HEAD"], repo, env).strip()


def _init_repo(path: Path, env: dict, message: str) -> str:
    """Make `path` a git repository holding its current files in one commit."""
    _ok(["git", "init", "-q", "-b", "main"], path, env)
    return _commit_all(path, env, message)


def _template_repo(destination: Path, env: dict) -> str:
    """Copy the template's files as they are in the working tree into a new git repository."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT)
    if listed.returncode != 0:
        pytest.skip(f"the template is not a git checkout: {listed.stderr.strip()}")
    for name in filter(None, listed.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is gone from the template
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return _init_repo(destination, env, "template")


def _cruft_create(template: Path, output: Path, env: dict, answers: dict) -> Path:
    """Bake `template` with `cruft create --no-input` into `output` and return the project."""
    output.mkdir()
    command = [CRUFT, "create", "--no-input", "--output-dir", output]
    _ok([*command, "--extra-context", json.dumps(answers), template], output, env)
    (project,) = output.iterdir()
    return project


def _cruft_project(root: Path, env: dict, answers: dict) -> CruftProject:
    """Build a template repository under `root` and a committed cruft project baked from it."""
    template = root / "template"
    template.mkdir()
    commit = _template_repo(template, env)
    project = _cruft_create(template, root / "projects", env, answers)
    _init_repo(project, env, "Bake from torch-template")
    return CruftProject(template, commit, project)


def _cruft(project: Path, env: dict, *args: str):
    """Run a cruft command in `project` and return the completed process."""
    return run([str(CRUFT), *args], cwd=project, env=env, timeout=120)


def _change_template(template: Path, env: dict) -> str:
    """Commit a maintainer's change: one more ignored cache, a reworded README line."""
    project_dir = template / "{{cookiecutter.project_slug}}"
    gitignore = project_dir / ".gitignore"
    ignored = gitignore.read_text(encoding="utf-8")
    assert TEMPLATE_CHANGE_IGNORE not in ignored
    gitignore.write_text(f"{ignored.rstrip()}\n{TEMPLATE_CHANGE_IGNORE}\n", encoding="utf-8")
    readme = project_dir / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines(keepends=True)
    index = lines.index("{{ cookiecutter.description }}\n")
    lines[index] = "{{ cookiecutter.description }}" + TEMPLATE_CHANGE_README + "\n"
    readme.write_text("".join(lines), encoding="utf-8")
    return _commit_all(template, env, "Ignore .mypy_cache/; say how the project is kept current")


def _unmerged_or_rejected(project: Path, env: dict) -> list[str]:
    """Return the files a patch left in conflict: unmerged paths and ``*.rej`` files."""
    unmerged = _ok(["git", "ls-files", "--unmerged"], project, env).splitlines()
    return unmerged + [str(path) for path in project.rglob("*.rej")]


@pytest.fixture(scope="module")
def git_env(tmp_path_factory) -> dict:
    """An environment with a git identity and a private HOME, so no user config leaks in."""
    env = {**os.environ, **GIT_IDENTITY, "HOME": str(tmp_path_factory.mktemp("home"))}
    for name in REDIRECTS:
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def baked(tmp_path_factory, git_env) -> CruftProject:
    """A project cruft baked with non-default answers; tests using it must not change it."""
    return _cruft_project(tmp_path_factory.mktemp("shared"), git_env, ANSWERS)


def test_cruft_json_records_the_template_commit_and_answers(baked):
    """.cruft.json names the template and its commit and holds the answers, with no local paths."""
    text = (baked.project / ".cruft.json").read_text(encoding="utf-8")
    state = json.loads(text)
    assert state["template"] == str(baked.template)
    assert state["commit"] == baked.commit
    context = state["context"]["cookiecutter"]
    assert {key: context[key] for key in ANSWERS} == ANSWERS
    assert (context["project_slug"], context["package_name"]) == ("acme-vision", "acme_vision")
    assert context["_commit"] == baked.commit
    assert {key for key in context if key.startswith("_")} <= CRUFT_PRIVATE_KEYS
    rest = text.replace(str(baked.template), "<template>")
    for local in (str(ROOT), tempfile.gettempdir(), str(baked.template.parent.parent)):
        assert local not in rest, f"{local} leaked into .cruft.json"


def test_answers_file_agrees_with_cruft_json(baked):
    """.cookiecutter.yaml in a cruft bake holds exactly the answers .cruft.json records."""
    context = json.loads((baked.project / ".cruft.json").read_text())["context"]["cookiecutter"]
    answers = yaml.safe_load((baked.project / ".cookiecutter.yaml").read_text(encoding="utf-8"))
    public = {key: value for key, value in context.items() if not key.startswith("_")}
    assert answers == {"default_context": public}


def test_fresh_bake_passes_check_and_has_no_diff(baked, git_env):
    """Right after baking, `cruft check` passes and `cruft diff` shows nothing."""
    check = _cruft(baked.project, git_env, "check")
    assert check.returncode == 0, check.stdout + check.stderr
    diff = _cruft(baked.project, git_env, "diff", "--exit-code")
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert diff.stdout.strip() == ""


def test_update_applies_a_template_change_and_keeps_local_edits(tmp_path, git_env):
    """A template change fails `cruft check`; `cruft update -y` applies it and keeps own edits."""
    baked = _cruft_project(tmp_path, git_env, {})
    project = baked.project
    assert _cruft(project, git_env, "check").returncode == 0

    new_commit = _change_template(baked.template, git_env)
    behind = _cruft(project, git_env, "check")
    assert behind.returncode != 0
    assert "out of date" in behind.stdout

    with (project / "README.md").open("a", encoding="utf-8") as handle:
        handle.write(USER_SECTION)
    _commit_all(project, git_env, "Add lab notes")

    _ok([CRUFT, "update", "-y"], project, git_env)
    assert _unmerged_or_rejected(project, git_env) == []
    assert (project / ".gitignore").read_text().splitlines()[-1] == TEMPLATE_CHANGE_IGNORE
    readme = (project / "README.md").read_text(encoding="utf-8")
    assert TEMPLATE_CHANGE_README + "\n" in readme
    assert readme.endswith(USER_SECTION)
    assert json.loads((project / ".cruft.json").read_text())["commit"] == new_commit
    assert _cruft(project, git_env, "check").returncode == 0

    # What is left between the project and the template is the project's own edit, nothing else.
    diff = _cruft(project, git_env, "diff", "--exit-code")
    assert diff.returncode == 1, diff.stdout + diff.stderr
    headers = [line for line in diff.stdout.splitlines() if line.startswith("diff --git")]
    assert len(headers) == 1 and headers[0].endswith("/README.md"), headers
    changed = [
        line[1:]
        for line in diff.stdout.splitlines()
        if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
    ]
    assert "## Lab notes" in changed
    assert set(changed) <= set(USER_SECTION.splitlines())


def test_update_leaves_skipped_paths_alone(tmp_path, git_env):
    """Paths in the `skip` list of .cruft.json keep the project's version through an update."""
    baked = _cruft_project(tmp_path, git_env, {})
    project = baked.project
    state = json.loads((project / ".cruft.json").read_text())
    (project / ".cruft.json").write_text(json.dumps({**state, "skip": ["configs"]}, indent=2))
    _commit_all(project, git_env, "The project owns its configs")
    configs_before = {
        name: (project / "configs" / name).read_bytes()
        for name in project_files(project / "configs")
    }

    task = baked.template / "{{cookiecutter.project_slug}}" / "tasks" / "image-classification"
    default_yaml = task / "configs" / "default.yaml"
    with default_yaml.open("a", encoding="utf-8") as handle:
        handle.write("# A template-wide default the project has opted out of.\n")
    _change_template(baked.template, git_env)

    _ok([CRUFT, "update", "-y"], project, git_env)
    assert _unmerged_or_rejected(project, git_env) == []
    configs_after = {
        name: (project / "configs" / name).read_bytes()
        for name in project_files(project / "configs")
    }
    assert configs_after == configs_before
    assert (project / ".gitignore").read_text().splitlines()[-1] == TEMPLATE_CHANGE_IGNORE


def test_link_adopts_a_plain_cookiecutter_bake(baked, tmp_path, git_env):
    """`cruft link --config-file .cookiecutter.yaml` links a plain bake with its own answers."""
    output = tmp_path / "plain"
    command = [sys.executable, "-m", "cookiecutter", "--no-input", "-o", output, baked.template]
    _ok([*command, *(f"{key}={value}" for key, value in ANSWERS.items())], tmp_path, git_env)
    (project,) = output.iterdir()
    assert not (project / ".cruft.json").exists()
    _init_repo(project, git_env, "Plain cookiecutter bake")

    link = [CRUFT, "link", "--config-file", ".cookiecutter.yaml", "--no-input", baked.template]
    _ok(link, project, git_env)
    state = json.loads((project / ".cruft.json").read_text())
    assert state["commit"] == baked.commit
    assert {key: state["context"]["cookiecutter"][key] for key in ANSWERS} == ANSWERS
    diff = _cruft(project, git_env, "diff", "--exit-code")
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert _cruft(project, git_env, "check").returncode == 0
