"""Refuse cookiecutter answers that would bake a broken project.

Cookiecutter renders this file with Jinja and runs it before writing any file. A refused answer
prints one line, ``ERROR: <reason>``, to stderr and exits 1, which stops the bake. The checks are
plain functions returning the reason (or None), so tests can import this file unrendered.
"""

import json
import keyword
import re
import sys
import unicodedata

# tojson escapes ' as \u0027, so no answer can close this raw string early; single quotes matter.
CONTEXT = r'''{{ cookiecutter | tojson }}'''  # fmt: skip

# A PyPA distribution name must start and end with a letter or digit.
SLUG_PATTERN = re.compile(r"[a-z0-9]([a-z0-9_-]*[a-z0-9])?")

# Importable names the generated project or its tests need; a package with one of these names
# would be imported instead of the real module (compared case-insensitively, for macOS and Windows).
RESERVED_PACKAGE_NAMES = frozenset(
    {
        "torch",
        "torchvision",
        "torchaudio",
        "numpy",
        "omegaconf",
        "yaml",
        "safetensors",
        "tqdm",
        "wandb",
        "tensorboard",
        "accelerate",
        "PIL",
        "setuptools",
        "pytest",
        "test",
        "tests",
        # torch's own dependencies: shadowing one breaks `import torch` itself
        "sympy",
        "mpmath",
        "filelock",
        "jinja2",
        "markupsafe",
        "networkx",
        "fsspec",
        "typing_extensions",
        "triton",
        "packaging",
        "pkg_resources",
        "pip",
        "nvidia",
        "cookiecutter",
    }
)


def validate_project_name(name: str) -> str | None:
    """Return why `name` cannot be a project name, or None if it can."""
    if not name.strip():
        return "project_name is empty; give the project a name, e.g. 'My Trainer'."
    if any(unicodedata.category(char) == "Cc" for char in name):
        return "project_name contains a control character (newline, tab, ...); use one plain line."
    return None


def validate_free_text(key: str, value: str) -> str | None:
    """Return why a one-line free-text answer (description, author, email) is unusable, or None."""
    if any(unicodedata.category(char) == "Cc" for char in value):
        return f"{key} contains a control character (newline, tab, ...); use one plain line."
    return None


def validate_project_slug(slug: str) -> str | None:
    """Return why `slug` cannot be the project directory and distribution name, or None."""
    if not slug:
        return (
            "project_slug is empty (project_name has no letters or digits to derive it from); "
            "pass project_slug=my-trainer."
        )
    if "/" in slug or "\\" in slug or ".." in slug:
        return f"project_slug {slug!r} is a path; use a single name of [a-z0-9_-]."
    if not SLUG_PATTERN.fullmatch(slug):
        return (
            f"project_slug {slug!r} must use only lowercase letters, digits, '-' and '_', "
            "and start and end with a letter or digit."
        )
    return None


def validate_package_name(name: str) -> str | None:
    """Return why `name` cannot be the importable package name, or None if it can."""
    if not name.isascii() or not name.isidentifier():
        return (
            f"package_name {name!r} is not a valid Python identifier "
            "(ASCII letters, digits and '_', not starting with a digit); "
            "pass package_name=<identifier>."
        )
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return f"package_name {name!r} is a Python keyword; pick another name."
    shadowed = {module.lower() for module in sys.stdlib_module_names | RESERVED_PACKAGE_NAMES}
    if name.lower() in shadowed:
        return (
            f"package_name {name!r} would shadow the module {name!r} that Python or the "
            "project needs; pick another name, e.g. my_trainer."
        )
    return None


def validate_answers(answers: dict) -> str | None:
    """Return the first reason the answers are refused, or None if all are acceptable."""
    checks = [
        validate_project_name(answers["project_name"]),
        validate_project_slug(answers["project_slug"]),
        validate_package_name(answers["package_name"]),
        *(
            validate_free_text(key, answers.get(key, ""))
            for key in ("description", "author", "email")
        ),
    ]
    return next((error for error in checks if error), None)


def main() -> int:
    """Validate the rendered answers; print one ERROR line and return 1 on the first bad one."""
    error = validate_answers(json.loads(CONTEXT))
    if error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
