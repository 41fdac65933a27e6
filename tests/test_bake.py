"""Every supported combination of answers bakes a complete, clean, lint-free project."""

import json
import re
import subprocess
import sys
import warnings

import pytest
import yaml
from conftest import ROOT, bake, project_files

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# The exact files of a default bake (MIT, include_ci=yes, include_docker=no) besides its task's
# TASK_FILES: the engine, the shared commands and the engine's tests. PKG stands for the package
# name. include_ci=no drops .github/workflows/ci.yml; include_docker=yes adds the Dockerfile and
# .dockerignore; no bake keeps a licenses/ or tasks/ directory.
ENGINE = [
    *("__init__", "seam", "config", "errors", "loop", "cli", "startup", "rundir", "metrics"),
    *("trackers", "optim", "state", "step", "loaders", "ema", "preemption", "profiler"),
    *("provenance", "launcher"),
    "monitor",
    *("torch_private", "ckpt/__init__", "ckpt/files", "ckpt/names", "ckpt/checkpoint"),
    "ckpt/sharded",
    *("ckpt/restore", "parallel/__init__", "parallel/distributed", "parallel/meta_init"),
    *("parallel/recompute", "parallel/state_dicts"),
    *("sweep/__init__", "sweep/config", "sweep/study", "sweep/trial", "sweep/report"),
]
ENGINE_TESTS = [
    *("checkpoint", "config", "device_loader", "distributed", "ema", "errors", "faults"),
    *("launcher", "monitor", "plot", "profiler", "provenance", "recompute", "resume", "scale"),
    *("faults_in_process", "sharded"),
    *("state", "sweep", "torch_private", "trackers"),
]
EXPECTED_FILES = frozenset(
    {
        ".cookiecutter.yaml",
        ".gitignore",
        ".pre-commit-config.yaml",
        ".github/workflows/ci.yml",
        "LICENSE",
        "Makefile",
        "README.md",
        "pyproject.toml",
        "configs/accelerate/multi_gpu.yaml",
        "configs/accelerate/fsdp.yaml",
        "configs/accelerate/multi_cpu.yaml",
        "src/PKG/__init__.py",
        *(f"src/PKG/{command}.py" for command in ("train", "evaluate", "export", "plot", "sweep")),
        *(f"src/PKG/engine/{module}.py" for module in ENGINE),
        "tests/conftest.py",
        *(f"tests/engine/test_{name}.py" for name in ENGINE_TESTS),
    }
)
# Each task's own folder, tasks/<task>/ in the template: its task/ package, configs, tests and
# commands.
TASK_CONFIGS = {"configs/default.yaml", "configs/smoke.yaml", "configs/sweep.yaml"}
TASK_MODULES = ("__init__", "task", "config", "data", "validation")
TASK_FILES = {
    "image-classification": {
        *TASK_CONFIGS,
        *(f"src/PKG/task/{module}.py" for module in (*TASK_MODULES, "model")),
        *(f"tests/task/{name}.py" for name in ("tiny", "test_data", "test_model", "test_metrics")),
        *(f"tests/task/{name}.py" for name in ("test_export", "test_evaluate", "test_train")),
        "configs/recipes/torchvision-resnet50.yaml",
        "configs/recipes/timm-finetune.yaml",
        "src/PKG/task/augment.py",  # the recipe: policies, mixup, cutmix, random erasing
        "tests/task/test_augment.py",
    },
    "language-model": {
        *TASK_CONFIGS,
        *(f"src/PKG/task/{module}.py" for module in TASK_MODULES),
        *(f"src/PKG/task/{m}.py" for m in ("tokenizer", "generate", "chat", "sampling")),
        "src/PKG/task/benchmarks.py",  # evaluate --tasks, trainer.eval_tasks: lm-evaluation-harness
        "src/PKG/task/harness_tasks.py",  # its tasks and their local data
        *(f"src/PKG/task/model/{m}.py" for m in ("__init__", "build", "blocks", "gpt2", "llama")),
        "src/PKG/task/model/hf.py",  # Hugging Face folders in and out
        "src/PKG/task/model/lora.py",  # adapters: LoRA, rsLoRA, DoRA, NF4 (QLoRA)
        *(f"src/PKG/task/prepare/{m}.py" for m in ("__init__", "sources", "pieces", "split")),
        *(f"src/PKG/task/prepare/{m}.py" for m in ("encode", "shards", "options", "cli")),
        "src/PKG/prepare.py",
        "src/PKG/generate.py",
        *(f"tests/task/{name}.py" for name in ("tiny", "test_data", "test_prepare", "test_model")),
        *(f"tests/task/{n}.py" for n in ("test_commands", "test_hf", "test_llama", "test_chat")),
        "tests/task/test_chat_training.py",  # packing, the step's loss, a tiny model that learns
        "tests/task/test_chat_tokens.py",  # conversations' ids under each tokenizer style
        "tests/task/hf_folders.py",  # small Hugging Face folders the tests make
        "tests/task/test_lora.py",  # adapters
        "tests/task/test_benchmarks.py",  # lm-evaluation-harness tasks
        "tests/task/fixtures/flat_layout_step_3.checkpoint",  # the flat layout's, before task/
    },
}
CI_FILES = frozenset({".github/workflows/ci.yml"})
DOCKER_FILES = frozenset({"Dockerfile", ".dockerignore"})

# The SPDX expression pyproject.toml declares for each license answer (PEP 639).
SPDX = {
    "MIT": "MIT",
    "Apache-2.0": "Apache-2.0",
    "BSD-3-Clause": "BSD-3-Clause",
    "proprietary": "LicenseRef-Proprietary",
}
# A phrase only the chosen LICENSE text contains.
LICENSE_MARKERS = {
    "MIT": "MIT License",
    "Apache-2.0": "Apache License",
    "BSD-3-Clause": "BSD 3-Clause License",
    "proprietary": "All rights reserved",
}

# Jinja left unrendered: a {% tag %} or a one-line {{ expression }}. Bare "}}" is not searched
# for, since nested dict literals end that way; GitHub Actions' ${{ ... }} is removed first.
JINJA_LEFTOVER = re.compile(r"\{%|%\}|\{\{[^{}\n]*\}\}")
GITHUB_EXPRESSION = re.compile(r"\$\{\{.*?\}\}")


CLUSTER_FILES = {
    "none": set(),
    "slurm": {"scripts/slurm/train.sbatch"},
    "kubernetes": {"scripts/kubernetes/pytorchjob.yaml"},
    "all": {"scripts/slurm/train.sbatch", "scripts/kubernetes/pytorchjob.yaml"},
}


def expected_files(package: str, context: dict[str, str]) -> set[str]:
    """Return the exact file set a bake with these answers must produce."""
    files = EXPECTED_FILES if context["include_ci"] == "yes" else EXPECTED_FILES - CI_FILES
    if context["include_docker"] == "yes":
        files = files | DOCKER_FILES
    files = files | TASK_FILES[context["task"]] | CLUSTER_FILES[context["cluster"]]
    return {path.replace("PKG", package) for path in files}


def _combinations() -> list[dict[str, str]]:
    """Return the answer combinations to bake: defaults, license x CI, each other choice value, and
    each task with the other answers changed."""
    questions = json.loads((ROOT / "cookiecutter.json").read_text(encoding="utf-8"))
    choices = {name: values for name, values in questions.items() if isinstance(values, list)}
    interacting = ("license", "include_ci")
    combos = [{}]
    combos += [
        {"license": license_name, "include_ci": include_ci}
        for license_name in choices["license"]
        for include_ci in choices["include_ci"]
    ]
    combos += [
        {name: value}
        for name, values in choices.items()
        if name not in interacting
        for value in values
    ]
    # Each task with every other answer away from its default, so the tasks' files meet each option.
    for task in choices["task"]:
        combos += [
            {"task": task, "tracker": "wandb", "launcher": "accelerate", "cluster": "all",
             "include_docker": "yes", "include_ci": "no", "license": "Apache-2.0"},
            {"task": task, "tracker": "tensorboard", "python_version": "3.13"},
            {"task": task, "tracker": "mlflow", "cluster": "slurm", "python_version": "3.10"},
        ]  # fmt: skip
    return combos


COMBINATIONS = _combinations()


def _combo_id(context: dict[str, str]) -> str:
    """Name a combination in test ids, e.g. ``license=MIT,include_ci=no``."""
    return ",".join(f"{key}={value}" for key, value in context.items()) or "defaults"


@pytest.fixture(scope="module", params=COMBINATIONS, ids=[_combo_id(c) for c in COMBINATIONS])
def baked(request, cookies_session):
    """A project baked once per combination and shared by the checks below."""
    return bake(cookies_session, **request.param)


def _text_files(baked):
    """Yield (relative path, text) for every UTF-8 text file of the baked project."""
    for relative in sorted(project_files(baked.path)):
        try:
            yield relative, (baked.path / relative).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: cookiecutter copies it unrendered, and the file-set test judges it


def _ruff(baked, *args: str) -> subprocess.CompletedProcess:
    """Run ruff in the baked project, so its own pyproject.toml configures it."""
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", "."],
        cwd=baked.path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _pyproject(baked) -> dict:
    """Return the baked project's [project] table."""
    return tomllib.loads((baked.path / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def assert_exact_files(baked) -> None:
    """Fail unless the bake holds exactly the expected files, naming the missing and unexpected."""
    expected = expected_files(baked.package, baked.context)
    actual = project_files(baked.path)
    missing, unexpected = sorted(expected - actual), sorted(actual - expected)
    assert not missing and not unexpected, f"missing: {missing}; unexpected: {unexpected}"


def assert_python_compiles(baked) -> None:
    """Fail if a .py file does not compile or compiles with a warning (e.g. a bad escape)."""
    for relative, text in _text_files(baked):
        if relative.endswith(".py"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                compile(text, relative, "exec")


def assert_ruff_clean(baked) -> None:
    """Fail if `ruff check` reports anything in the baked project."""
    completed = _ruff(baked, "check")
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_file_set_is_exact(baked):
    """A bake writes exactly the expected files: nothing missing, nothing left over."""
    assert_exact_files(baked)


def test_no_jinja_left_unrendered(baked):
    """No file or path of the baked project still contains Jinja markup."""
    for relative, text in _text_files(baked):
        assert not JINJA_LEFTOVER.search(relative), relative
        leftover = JINJA_LEFTOVER.search(GITHUB_EXPRESSION.sub("", text))
        assert leftover is None, (
            f"{relative}: {text[leftover.start() - 40 : leftover.end() + 40]!r}"
        )


def test_python_files_compile_without_warnings(baked):
    """Every .py file is valid Python, with no invalid escape sequences from rendered answers."""
    assert_python_compiles(baked)


def test_ruff_check_is_clean(baked):
    """The baked project passes `ruff check` under its own configuration."""
    assert_ruff_clean(baked)


def test_ruff_format_is_clean(baked):
    """The baked project is already formatted as `ruff format` would write it."""
    completed = _ruff(baked, "format", "--check")
    assert completed.returncode == 0, completed.stdout + completed.stderr


# Words of one task that a bake of the other must not contain, in any module, message or docstring:
# the engine and the commands speak of "the task", and each task folder only of itself.
FOREIGN_WORDS = {
    "language-model": re.compile(
        r"image|pixel|classif|torchvision|cifar|resnet|convnext|imagefolder|val/acc|accuracy",
        re.IGNORECASE,
    ),
    "image-classification": re.compile(
        r"\btokens?\b|tokeniz|vocab|language|\bgpt|perplex|bits per byte|val/bpb|val/ppl|seq_len",
        re.IGNORECASE,
    ),
}


def test_a_bake_speaks_only_of_its_own_task(baked):
    """No module, message or docstring of a bake names the other task's things (a language-model
    project says nothing of images, an image project nothing of tokens)."""
    foreign = FOREIGN_WORDS[baked.context["task"]]
    hits = [
        f"{path.relative_to(baked.path)}:{number}: {line.strip()}"
        for path in sorted((baked.path / "src").rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if foreign.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_pyproject_declares_name_license_and_python(baked):
    """pyproject.toml parses and names the distribution, its license and lowest Python."""
    project = _pyproject(baked)
    assert project["name"] == baked.context["project_slug"]
    assert project["license"] == SPDX[baked.context["license"]]
    assert project["requires-python"] == f">={baked.context['python_version']}"


# The package each tracker answer needs, as the generated pyproject.toml names it.
TRACKER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow-skinny"}


def test_default_config_trains_with_the_chosen_tracker(baked):
    """configs/default.yaml (what a run without overrides uses) names the tracker answer."""
    config = yaml.safe_load((baked.path / "configs" / "default.yaml").read_text(encoding="utf-8"))
    assert config["tracker"]["name"] == baked.context["tracker"]


def test_pyproject_depends_on_the_chosen_tracker_and_offers_every_tracker_as_an_extra(baked):
    """The tracker answer's package is a dependency (no other tracker's), each tracker an extra."""
    project = _pyproject(baked)
    names = {re.match(r"[A-Za-z0-9._-]+", dependency)[0] for dependency in project["dependencies"]}
    chosen = TRACKER_PACKAGES.get(baked.context["tracker"])
    assert names & set(TRACKER_PACKAGES.values()) == ({chosen} if chosen else set())
    extras = project["optional-dependencies"]
    for tracker, package in TRACKER_PACKAGES.items():
        assert any(requirement.startswith(package) for requirement in extras[tracker]), tracker


def test_license_text_is_the_chosen_one(baked):
    """LICENSE holds the chosen license's text, with the author filled in where it names one."""
    text = (baked.path / "LICENSE").read_text(encoding="utf-8")
    for license_name, marker in LICENSE_MARKERS.items():
        assert (marker in text) == (license_name == baked.context["license"]), license_name
    # The Apache-2.0 text is shipped verbatim; its copyright line is a placeholder by design.
    if baked.context["license"] != "Apache-2.0":
        assert baked.context["author"] in text


def test_readme_leads_with_the_chosen_launcher(baked):
    """README names the project and shows the chosen launcher first, while documenting both."""
    readme = (baked.path / "README.md").read_text(encoding="utf-8")
    assert baked.context["project_name"] in readme
    positions = {
        "torchrun": readme.find("torchrun"),
        "accelerate": readme.find("accelerate launch"),
    }
    assert min(positions.values()) >= 0, positions
    assert positions[baked.context["launcher"]] == min(positions.values()), positions


def test_ci_workflow_is_valid_yaml(baked):
    """When CI is included, the workflow is a YAML mapping with jobs."""
    workflow = baked.path / ".github" / "workflows" / "ci.yml"
    if baked.context["include_ci"] == "no":
        assert not workflow.exists()
        return
    assert "jobs" in yaml.safe_load(workflow.read_text(encoding="utf-8"))


# Refused awkward names ("2nd Trainer", "!!!", "Import") are covered in test_hooks.py.
AWKWARD = [
    pytest.param(
        {
            "project_name": 'Zoë\'s "Quoted" \\ Trainer',
            "author": 'Renée O\'Brien "RB"',
            "description": 'Says "hi" \\ and <b>bye</b> & leaves',
        },
        "zoe-s-quoted-trainer",
        id="quotes-backslash",
    ),
    pytest.param({"project_name": "Café Über-Net"}, "cafe-uber-net", id="accents"),
    pytest.param({"project_name": "日本 Trainer 2"}, "ri-ben-trainer-2", id="cjk"),
    # Beyond U+FFFF: JSON escapes these as surrogate pairs (\ud83d\ude80), which TOML forbids.
    pytest.param(
        {
            "project_name": "Ana 🚀 Lima Net",
            "author": "Ana 🚀 Lima",
            "description": 'Trains 𝛼-nets fast 🤖 \\u0041 "q"',
            "email": "ana🚀@example.com",
        },
        "ana-lima-net",
        id="emoji",
    ),
]


@pytest.mark.parametrize(("context", "slug"), AWKWARD)
def test_awkward_answers_bake_valid_projects(cookies, context, slug):
    """Quotes, backslashes and non-ASCII answers (emoji too) still give valid TOML, Python, README,
    LICENSE and answers file, each holding the answers as given."""
    baked = bake(cookies, **context)
    assert baked.path.name == slug
    assert baked.package == slug.replace("-", "_")
    assert_exact_files(baked)

    project = _pyproject(baked)
    assert project["name"] == slug
    if "description" in context:
        assert project["description"] == context["description"]
    if "author" in context:
        assert project["authors"][0]["name"] == context["author"]
    if "email" in context:
        assert project["authors"][0]["email"] == context["email"]

    assert_python_compiles(baked)
    assert_ruff_clean(baked)
    readme = (baked.path / "README.md").read_text(encoding="utf-8")
    assert context["project_name"] in readme
    assert context.get("description", "") in readme
    assert baked.context["author"] in (baked.path / "LICENSE").read_text(encoding="utf-8")
    answers = yaml.safe_load((baked.path / ".cookiecutter.yaml").read_text(encoding="utf-8"))
    for key, value in context.items():
        assert answers["default_context"][key] == value, key
