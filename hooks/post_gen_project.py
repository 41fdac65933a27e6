"""Prune the baked project down to the answers given.

Cookiecutter renders this file with Jinja and runs it inside the new project. Optional files are
shipped whole and removed here by small named functions, so the project's files stay plain.
"""

import json
import shutil
import sys
from pathlib import Path

import yaml  # cookiecutter depends on PyYAML, so every interpreter that runs this hook has it

# tojson escapes ' as \u0027, so no answer can close this raw string early; single quotes matter.
CONTEXT = r'''{{ cookiecutter | tojson }}'''  # fmt: skip

ANSWERS_FILE = ".cookiecutter.yaml"
ANSWERS_HEADER = """\
# The answers this project was baked with, as a cookiecutter user-config file. Bake the same
# project again (into the current directory) from the same template version with:
#   cookiecutter --config-file .cookiecutter.yaml --no-input <template>
"""


def install_license(license_name: str, root: Path = Path()) -> None:
    """Move the chosen ``licenses/<license_name>`` text to ``LICENSE``."""
    source = root / "licenses" / license_name
    if not source.is_file():
        choices = sorted(path.name for path in (root / "licenses").iterdir())
        raise ValueError(f"license {license_name!r} is not one of {choices}.")
    source.replace(root / "LICENSE")


def remove_licenses_dir(root: Path = Path()) -> None:
    """Delete the texts of the licenses that were not chosen."""
    shutil.rmtree(root / "licenses")


def remove_ci(root: Path = Path()) -> None:
    """Delete the GitHub Actions workflow."""
    shutil.rmtree(root / ".github")


def remove_docker(root: Path = Path()) -> None:
    """Delete the CUDA Dockerfile and its .dockerignore."""
    (root / "Dockerfile").unlink()
    (root / ".dockerignore").unlink()


def remove_slurm(root: Path = Path()) -> None:
    """Delete the SLURM batch script."""
    shutil.rmtree(root / "scripts" / "slurm")


def remove_kubernetes(root: Path = Path()) -> None:
    """Delete the Kubernetes PyTorchJob manifest."""
    shutil.rmtree(root / "scripts" / "kubernetes")


# tasks/<task>/ holds everything one task owns, at the paths it takes in the project.
TASKS_DIR = "tasks"


def use_task(task: str, root: Path = Path()) -> None:
    """Move the chosen task's folder tasks/<task>/ into the project whole and delete the others.

    A task folder mirrors the project's layout: src/PACKAGE/task/ (the Task and its building
    blocks), its configs/, tests/task/ and any command of its own (src/PACKAGE/<command>.py). The
    project around it is the engine and the commands every task shares, so no file is replaced.
    """
    tasks = root / TASKS_DIR
    choices = sorted(path.name for path in tasks.iterdir() if path.is_dir())
    if task not in choices:
        raise ValueError(f"task {task!r} is not one of {choices}.")
    chosen = tasks / task
    for source in sorted(path for path in chosen.rglob("*") if path.is_file()):
        target = root / source.relative_to(chosen)
        if target.exists():
            taken = target.relative_to(root)
            raise ValueError(f"task {task!r} would replace the engine's {taken}.")
        target.parent.mkdir(parents=True, exist_ok=True)
        source.replace(target)
    shutil.rmtree(tasks)


def remove_empty_scripts_dir(root: Path = Path()) -> None:
    """Delete scripts/ when no cluster file is left in it."""
    scripts = root / "scripts"
    if scripts.is_dir() and not any(scripts.iterdir()):
        scripts.rmdir()


def write_answers(answers: dict, root: Path = Path()) -> None:
    """Record every answer not starting with ``_`` (no machine paths) in ``.cookiecutter.yaml``."""
    public = {key: value for key, value in answers.items() if not key.startswith("_")}
    text = yaml.safe_dump({"default_context": public}, allow_unicode=True, sort_keys=True)
    (root / ANSWERS_FILE).write_text(ANSWERS_HEADER + text, encoding="utf-8")


def main() -> int:
    """Apply the answers to the baked project; print one ERROR line and return 1 on failure."""
    answers = json.loads(CONTEXT)
    try:
        install_license(answers["license"])
        use_task(answers["task"])
    except ValueError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 1
    remove_licenses_dir()
    if answers["include_ci"] == "no":
        remove_ci()
    if answers["include_docker"] == "no":
        remove_docker()
    if answers["cluster"] not in ("slurm", "all"):
        remove_slurm()
    if answers["cluster"] not in ("kubernetes", "all"):
        remove_kubernetes()
    remove_empty_scripts_dir()
    write_answers(answers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
