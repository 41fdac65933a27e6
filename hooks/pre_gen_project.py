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

# Importable names the generated project, its tests and its tools need, directly or through a
# dependency; a package with one of these names would be imported instead of the real module
# (compared case-insensitively, for macOS and Windows). Dunder names, conftest and test_* are
# refused by rule in validate_package_name.
RESERVED_PACKAGE_NAMES = frozenset(
    {
        # what the project and its tests import
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
        "mlflow",
        "accelerate",
        "matplotlib",
        "PIL",
        "setuptools",
        "pytest",
        "test",
        "tests",
        "tiny",  # tests/tiny.py: the task's test configuration
        "hf_folders",  # tests/task/hf_folders.py: the language model's Hugging Face test folders
        "engine",  # tests/engine/: the engine's tests, whose fault helpers the adapter tests reuse
        "tokenizers",  # the language model's optional tokenizer.json support
        "pyarrow",  # the language model's prepare: Parquet and datasets inputs
        "datasets",  # its tests write a datasets folder with it
        "transformers",  # its Hugging Face GPT-2 export, and the tests of it
        "peft",  # the tests load its PEFT adapter export in peft
        "torchao",  # model.quantize=nf4: the NF4 weights of QLoRA
        "timm",  # the image task's model.name=timm:NAME
        "lm_eval",  # the language model's evaluate --tasks (lm-evaluation-harness)
        # torch's own dependencies: shadowing one breaks `import torch` itself
        "sympy",
        "isympy",
        "mpmath",
        "filelock",
        "jinja2",
        "markupsafe",
        "networkx",
        "fsspec",
        "typing_extensions",
        "triton",
        "functorch",
        "torchgen",
        "nvidia",
        "packaging",
        # omegaconf's (its config grammar) and PyYAML's
        "antlr4",
        "_yaml",
        # matplotlib's (the plot extra)
        "contourpy",
        "cycler",
        "fontTools",
        "kiwisolver",
        "pyparsing",
        "dateutil",
        "mpl_toolkits",
        "pylab",
        # accelerate's
        "huggingface_hub",
        "hf_xet",
        "psutil",
        "requests",
        "urllib3",
        "idna",
        "certifi",
        "charset_normalizer",
        # wandb's
        "click",
        "pydantic",
        "pydantic_core",
        "annotated_types",
        "google",
        "git",
        "sentry_sdk",
        "setproctitle",
        "platformdirs",
        "xxhash",
        "opentelemetry",
        # tensorboard's
        "absl",
        "grpc",
        "markdown",
        "werkzeug",
        "six",
        "tensorboard_data_server",
        # optuna's (the sweep extra): sqlalchemy and alembic too, below
        "optuna",
        "colorlog",
        # mlflow-skinny's, and sqlalchemy's and alembic's for its SQLite store
        "sqlalchemy",
        "alembic",
        "mako",
        "sqlparse",
        "cachetools",
        "cloudpickle",
        "databricks",
        "dotenv",
        "fastapi",
        "starlette",
        "uvicorn",
        "anyio",
        "sniffio",
        "cryptography",
        "importlib_metadata",
        "zipp",
        "annotated_doc",
        "typing_inspection",
        # the dev extra's tools and the installers
        "_pytest",
        "py",
        "pluggy",
        "iniconfig",
        "pygments",
        "ruff",
        "pre_commit",
        "virtualenv",
        "nodeenv",
        "identify",
        "cfgv",
        "distlib",
        "pip",
        "pkg_resources",
        "_distutils_hack",
        "cookiecutter",
        # imported by Python itself at startup when found on the path
        "sitecustomize",
        "usercustomize",
    }
)


def unusable_character(value: str) -> str | None:
    """Describe the first character that cannot go into a one-line answer, or None if none."""
    categories = {unicodedata.category(char) for char in value}
    if "Cc" in categories:
        return "a control character (newline, tab, ...); use one plain line"
    if "Cs" in categories:
        return "a lone surrogate (bytes that are not valid UTF-8); use valid Unicode text"
    return None


def validate_project_name(name: str) -> str | None:
    """Return why `name` cannot be a project name, or None if it can."""
    if not name.strip():
        return "project_name is empty; give the project a name, e.g. 'My Trainer'."
    bad = unusable_character(name)
    if bad:
        return f"project_name contains {bad}."
    return None


def validate_free_text(key: str, value: str) -> str | None:
    """Return why a one-line free-text answer (description, author, email) is unusable, or None."""
    bad = unusable_character(value)
    if bad:
        return f"{key} contains {bad}."
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
    if name.startswith("__") and name.endswith("__"):
        return (
            f"package_name {name!r} is a dunder name, which Python reserves for special modules "
            "(__main__, __init__, ...); pick another name, e.g. my_trainer."
        )
    if name.lower() == "conftest" or name.lower().startswith("test_"):
        return (
            f"package_name {name!r} would shadow the project's own tests (pytest imports "
            "conftest and test_*.py as top-level modules); pick another name, e.g. my_trainer."
        )
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
