"""Regenerate docs/configuration.md from the configuration of a project baked with each task.

python docs/gen_config.py           rewrite docs/configuration.md
python docs/gen_config.py --check   exit 1 if docs/configuration.md is out of date

Each `task` answer is baked with the default answers into a temporary directory, and a child
process imports the bake's `<package>.engine.config` and reports what it holds: the sections of
`Config` and, for each field, its type, its default and the docstring under it (`field_docs`),
`choices`, `at_least_one` and the task's `SPEC.defaults`. A child of its own per bake keeps
the two packages, which share a name, apart. The sections whose dataclass `engine/config.py`
defines are shared by every task and get one table each; the others (data, model) come from the
task's `task/config.py` and get a table per task. A task's own defaults of shared keys are shown
beside the shared default. A default the bake writes from an answer (the tracker's) is shown as
that answer, found in the template's unrendered source.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from cookiecutter.main import cookiecutter

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "{{cookiecutter.project_slug}}"
PACKAGE = Path("src") / "{{cookiecutter.package_name}}"
# Each task's own files sit in tasks/<task>/ at the paths they take in a baked project
# (hooks/post_gen_project.py, use_task); the rest of PROJECT is the engine and the shared commands.
TASKS_DIR = PROJECT / "tasks"
COOKIECUTTER_JSON = ROOT / "cookiecutter.json"
CONFIGURATION_MD = ROOT / "docs" / "configuration.md"

# Run in a baked project with its src/ on sys.path: argv is the package name and the output file.
READ_CONFIG = r'''
import ast, dataclasses, importlib, inspect, json, sys, textwrap

package, out = sys.argv[1:]
config = importlib.import_module(f"{package}.engine.config")
seam = importlib.import_module(f"{package}.engine.seam")
spec = importlib.import_module(f"{package}.task.config").SPEC


def default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()


def written_as(cls):
    """{field: (module, NAME)} for a field whose default is written as a module-level NAME."""
    found = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node in body:
            if isinstance(node, ast.AnnAssign):
                if isinstance(node.value, ast.Name):
                    found[node.target.id] = (klass.__module__, node.value.id)
                else:
                    found.pop(node.target.id, None)
    return found


sections = []
for section in dataclasses.fields(config.config_class(spec)):
    cls = section.default_factory
    sections.append({
        "name": section.name,
        "class": cls.__name__,
        "shared": cls.__module__ == config.__name__,
        "fields": [  # a group of keys (model.lora) leaf by leaf: lora.r, lora.alpha, ...
            {
                "name": name,
                "type": field.type if isinstance(field.type, str) else field.type.__name__,
                "default": default(field),
                "doc": " ".join(config.field_docs(owner).get(field.name, "").split()),
                "written_as": written_as(owner).get(field.name),
            }
            for name, field, owner in config.leaves(cls)
        ],
    })
report = {
    "package": package,
    "sections": sections,
    "choices": config.choices(spec),
    "at_least_one": list(config.at_least_one(spec)),
    "task_defaults": spec.defaults,
    "base": {
        "data": [field.name for field in dataclasses.fields(seam.DataBase)],
        "model": [field.name for field in dataclasses.fields(seam.ModelBase)],
    },
}
with open(out, "w", encoding="utf-8") as file:
    json.dump(report, file)
'''


def task_names(path: Path = COOKIECUTTER_JSON) -> list[str]:
    """The `task` answers, the default first."""
    return json.loads(path.read_text(encoding="utf-8"))["task"]


def bake(task: str, into: Path) -> Path:
    """Bake the template with the default answers and `task` into `into`; return the project.

    The user's own cookiecutter settings (a default_context, a replay directory) play no part."""
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


def read_config(project: Path, out: Path) -> dict:
    """What the baked project's `<package>.engine.config` holds (READ_CONFIG), read in a child."""
    (package,) = {path.parents[1].name for path in (project / "src").glob("*/engine/config.py")}
    completed = subprocess.run(
        [sys.executable, "-c", READ_CONFIG, package, str(out)],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"reading {package}.engine.config failed:\n{completed.stderr[-3000:]}")
    return json.loads(out.read_text(encoding="utf-8"))


@cache
def read_tasks() -> dict[str, dict]:
    """Each task's configuration as READ_CONFIG reports it, by `task` answer, the default first."""
    with tempfile.TemporaryDirectory(prefix="gen-config-") as tmp:
        baked = {task: bake(task, Path(tmp)) for task in task_names()}
        with ThreadPoolExecutor(len(baked)) as pool:
            reports = {
                task: pool.submit(read_config, project, Path(tmp) / f"{task}.json")
                for task, project in baked.items()
            }
            return {task: report.result() for task, report in reports.items()}


def cookiecutter_default(variable: str, path: Path = COOKIECUTTER_JSON) -> str:
    """The answer `cookiecutter --no-input` gives to a question with a literal default."""
    raw = json.loads(path.read_text(encoding="utf-8"))[variable]
    return raw[0] if isinstance(raw, list) else raw


# A module-level name the bake assigns an answer:
# DEFAULT_TRACKER = "{{ cookiecutter.tracker }}".
JINJA_ASSIGNMENT = re.compile(r"""^(\w+)\s*=\s*["']\{\{\s*cookiecutter\.(\w+)\s*\}\}["']""", re.M)


def template_source(module: str, task: str) -> Path:
    """The unrendered template file of a baked module ("my_trainer.engine.config"): the engine's
    in the project, or the task's in tasks/<task>/."""
    relative = Path(*module.split(".")[1:]).with_suffix(".py")
    for package in (PROJECT / PACKAGE, TASKS_DIR / task / PACKAGE):
        if (package / relative).is_file():
            return package / relative
    raise FileNotFoundError(f"{module}: no template source for it")


def answer_of(written_as: list | None, task: str) -> str | None:
    """The cookiecutter answer a field's default is baked from, if it is written as a name the
    template assigns one (`name: str = DEFAULT_TRACKER`)."""
    if not written_as:
        return None
    module, name = written_as
    source = template_source(module, task).read_text(encoding="utf-8")
    return dict(JINJA_ASSIGNMENT.findall(source)).get(name)


INTRO = (
    "Every run of a baked project is configured by typed dataclasses. The sections every task "
    "shares, {shared}, are in `src/<package>/engine/config.py`; the task's own sections, {task}, "
    "are in `src/<package>/task/config.py` (its `SPEC`) and differ from task to task (the `task` "
    "answer; see [the training core and the task](tasks.md)). Every task has the keys the engine "
    "reads itself, {base} (`DataBase` and `ModelBase` in `engine/seam.py`), though it may give "
    "them "
    "other defaults. Later sources win: the defaults below, then each `--config FILE.yaml` in "
    "order, then `section.key=value` overrides on the command line:"
)
HEADER = """\
# Configuration

{intro}

```bash
python -m my_trainer.train --config configs/default.yaml trainer.max_epochs=5 data.batch_size=64
```

`configs/default.yaml` spells out every default of the project's task; copy it to start an
experiment. `python -m my_trainer.train --help` prints the same keys with their defaults and
meanings. The resolved configuration of every run is written to `<run.output_dir>/config.yaml`,
and `evaluate` and `export` rebuild the model from the configuration stored in the checkpoint.

A mistake stops the run before it starts, with exit status 2 and one line naming the key: an
unknown key (with the closest known one suggested), a value of the wrong type, a value outside
the allowed ones, a number below its minimum, or a combination that cannot work (for example
`trainer.precision=fp16` or `distributed.sync_batchnorm=true` without CUDA).

```console
$ python -m my_trainer.train data.batch_sz=64
error: data.batch_sz: unknown key; did you mean data.batch_size?
```

In YAML and on the command line, `null` means None and `true` / `false` are booleans.

<!-- Generated by docs/gen_config.py from engine/config.py and task/config.py; edit those. -->
"""

TASK_HEADER = """
## Task: {task}

{text}
"""


def literal(value: object) -> str:
    """A Python value as it is written in YAML and on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(literal(item) for item in value) + "]"
    return str(value)


def describe_value(value: object, answer: str | None = None) -> str:
    """A default as a cell shows it: a literal, or for a value baked from an answer, the answer."""
    if answer:
        return f"the `{answer}` answer (default `{cookiecutter_default(answer)}`)"
    text = literal(value)
    return f"`{text}`" if text else '`""`'


def wrap(text: str) -> str:
    """A paragraph in lines of at most 100 characters (never broken at a hyphen)."""
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)


def escape(text: str) -> str:
    """Text that markdown shows as written inside a table cell."""
    for char in "\\*|":
        text = text.replace(char, "\\" + char)
    return text.replace("<", "&lt;")


def task_default(report: dict, key: str) -> tuple[bool, object]:
    """(True, value) when the task's SPEC.defaults set `key`, else (False, None)."""
    *groups, name = key.split(".")  # a group's key (model.lora.r) is looked up group by group
    found = report["task_defaults"]
    for group in groups:
        found = found.get(group, {})
    return (name in found, found.get(name))


def table(section: dict, report: dict, level: str, default_cell) -> str:
    """One section's heading, a line on how to set it, and the table of its fields."""
    name = section["name"]
    at_least_one = set(report["at_least_one"])
    rows = []
    for field in section["fields"]:
        key = f"{name}.{field['name']}"
        allowed = ", ".join(f"`{literal(choice)}`" for choice in report["choices"].get(key, ()))
        if key in at_least_one:
            allowed = "at least 1"
        cells = (
            f"`{key}`",
            f"`{field['type']}`",  # a pipe inside backticks splits no cell
            default_cell(key, field),
            allowed,
            escape(field["doc"]),
        )
        rows.append("| " + " | ".join(cells) + " |\n")
    return (
        f"\n{level} {name}\n\n`{section['class']}`: set as `{name}.<key>=value` on the command "
        f"line or under `{name}:` in YAML.\n\n"
        "| key | type | default | allowed | meaning |\n"
        "|---|---|---|---|---|\n" + "".join(rows)
    )


def render_task(task: str, report: dict) -> str:
    """A task's part of the page: where its sections come from, its defaults, their tables."""
    own = [section for section in report["sections"] if not section["shared"]]
    changed = [
        f"`{section}.{name}={literal(value)}`"
        for section, values in report["task_defaults"].items()
        for name, value in values.items()
    ]
    defaults = (
        "It starts from other defaults for these shared keys (`defaults` in its `SPEC`, shown "
        f"beside the shared defaults above): {', '.join(changed)}."
        if changed
        else "The defaults of the shared sections above are its own."
    )
    own_names = " and ".join(f"`{section['name']}`" for section in own)
    text = (
        f"The {own_names} sections of a project baked with `task={task}` (its "
        "`src/<package>/task/config.py`; in the template, "
        f"`tasks/{task}/src/<package>/task/config.py`, "
        "which the bake moves into place). "
    )
    parts = [TASK_HEADER.format(task=task, text=wrap(text + defaults))]

    def own_default(key: str, field: dict) -> str:
        changed, value = task_default(report, key)
        if changed:
            return describe_value(value)
        return describe_value(field["default"], answer_of(field["written_as"], task))

    for section in own:
        parts.append(table(section, report, "###", own_default))
    return "".join(parts)


def shared_sections(reports: dict[str, dict]) -> list[dict]:
    """The sections every task shares, which every bake must hold alike."""
    first, *others = (
        [section for section in report["sections"] if section["shared"]]
        for report in reports.values()
    )
    for task, sections in zip(list(reports)[1:], others, strict=True):
        if sections != first:
            raise RuntimeError(f"task={task} bakes other shared sections than the default task")
    return first


def render(reports: dict[str, dict] | None = None) -> str:
    """Return the full text of docs/configuration.md for each task's configuration (read_tasks)."""
    reports = reports or read_tasks()
    default_task, default_report = next(iter(reports.items()))
    shared = shared_sections(reports)

    def shared_default(key: str, field: dict) -> str:
        """The shared default, then each task's own where its SPEC.defaults change it."""
        cell = describe_value(field["default"], answer_of(field["written_as"], default_task))
        for task, report in reports.items():
            changed, value = task_default(report, key)
            if changed and value != field["default"]:
                cell += f" ({task}: {describe_value(value)})"
        return cell

    own = [section["name"] for section in default_report["sections"] if not section["shared"]]
    base = [
        f"`{section}.{name}`" for section, names in default_report["base"].items() for name in names
    ]
    intro = INTRO.format(
        shared=", ".join(f"`{section['name']}`" for section in shared),
        task=" and ".join(f"`{name}`" for name in own),
        base=", ".join(base),
    )
    parts = [HEADER.format(intro=wrap(intro))]
    for section in shared:
        parts.append(table(section, default_report, "##", shared_default))
    parts += [render_task(task, report) for task, report in reports.items()]
    return "".join(parts)


def main(argv: list[str]) -> int:
    """Write docs/configuration.md, or with --check report whether it is up to date."""
    text = render()
    if "--check" in argv:
        if CONFIGURATION_MD.read_text(encoding="utf-8") != text:
            print(
                "docs/configuration.md is out of date: run python docs/gen_config.py",
                file=sys.stderr,
            )
            return 1
        return 0
    CONFIGURATION_MD.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
