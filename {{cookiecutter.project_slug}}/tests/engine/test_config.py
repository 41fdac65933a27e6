"""Configuration: defaults, YAML, overrides, and one clear line for every mistake."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from {{ cookiecutter.package_name }}.engine.config import ConfigError, all_keys, config_class, field_docs, leaves, load_config
from {{ cookiecutter.package_name }}.engine.seam import DataBase, ModelBase, TaskSpec
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.train import main

from tiny import BAD_CONFIGS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_default_yaml_spells_out_the_defaults():
    """configs/default.yaml and the defaults (the dataclasses', with the task's own) describe the same run,
    and the file names every key."""
    assert load_config(SPEC, [CONFIGS / "default.yaml"]) == load_config(SPEC)
    spelled = yaml.safe_load((CONFIGS / "default.yaml").read_text())

    def keys(mapping: dict, prefix: str = "") -> list[str]:  # a group (model.lora) leaf by leaf; {}: a key
        found = []
        for key, value in mapping.items():
            found += keys(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [f"{prefix}{key}"]
        return found

    assert sorted(keys(spelled)) == sorted(all_keys(SPEC))


@dataclasses.dataclass
class Points(DataBase):
    count: int = 10
    """Points to fit."""


@dataclasses.dataclass
class Line(ModelBase):
    slope: float = 1.0
    """The line's initial slope."""


def _positive_slope(cfg) -> None:
    if cfg.model.slope <= 0:
        raise ConfigError(f"model.slope={cfg.model.slope} must be above 0")


OTHER = TaskSpec(
    data=Points, model=Line, metrics={"val/loss": "min"}, monitor="val/loss", choices={"data.count": (10, 20)},
    validate=_positive_slope, defaults={"optim": {"lr": 0.5}},
)  # fmt: skip


def test_benchmark_keys_need_a_task_that_scores_them_and_values_that_can_work():
    """trainer.eval_tasks for a task without benchmarks (TaskSpec.benchmarks None) is refused; for one with
    them, so are an eval_every that is not a multiple of val_every, a limit of 0, eval_task_data or eval_every
    without a task to go with, and a monitored benchmark scored less often than validation runs. A monitored
    benchmark improves in the direction TaskSpec.benchmarks gives."""
    from {{ cookiecutter.package_name }}.engine.monitor import monitored

    scored = dataclasses.replace(OTHER, benchmarks=lambda metric: "min" if metric == "perplexity" else "max")
    with pytest.raises(ConfigError, match="trainer.eval_tasks: this task scores no benchmarks"):
        load_config(OTHER, [], ["trainer.eval_tasks=[quiz]"])
    tasks = ["trainer.eval_tasks=[quiz]", "trainer.val_every=10"]
    for overrides, message in [
        ([*tasks, "trainer.eval_every=15"], "trainer.eval_every=15 must be a multiple of trainer.val_every=10"),
        ([*tasks, "trainer.eval_limit=0"], "trainer.eval_limit=0.0 must be above 0"),
        ([*tasks, "trainer.eval_task_data.other=x"], "trainer.eval_task_data names other, which trainer.eval_tasks"),
        (["trainer.eval_every=10"], "trainer.eval_every goes with trainer.eval_tasks, which names no task"),
        ([*tasks, "trainer.monitor=eval/other/acc"], "is not a validation metric of this task; choose one of"),
        ([*tasks, "trainer.eval_every=20", "trainer.monitor=eval/quiz/acc"], "set trainer.eval_every=null"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(scored, [], overrides)
    for metric, mode in [("acc", "max"), ("perplexity", "min")]:
        trainer = load_config(scored, [], [*tasks, f"trainer.monitor=eval/quiz/{metric}"]).trainer
        assert monitored(trainer, scored) == (f"eval/quiz/{metric}", mode)


def test_the_config_is_the_one_of_the_task_it_is_given():
    """The engine reads the task from the TaskSpec a caller passes, never by looking one up: another spec's
    sections, allowed values, checks and defaults apply, and each spec's configs share one type."""
    cfg = load_config(OTHER, [], ["data.count=20", "model.slope=2.5"])
    assert (cfg.data.count, cfg.model.slope, cfg.optim.lr) == (20, 2.5, 0.5)
    assert type(cfg) is config_class(OTHER) is not config_class(SPEC) is type(load_config(SPEC))
    assert load_config(OTHER) == load_config(OTHER) and all_keys(OTHER)[:3] == [
        "run.output_dir",
        "run.seed",
        "run.deterministic",
    ]
    for override, message in [
        ("data.count=30", "data.count=30 is not allowed"),
        ("model.slope=-1", "model.slope=-1.0 must be above 0"),
        ("data.root=elsewhere", "data.root: unknown key"),  # a key of this project's task, not of the other
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(OTHER, [], [override])


def test_every_key_is_documented():
    """Each config field has a docstring, which --help prints."""
    for key, leaf, owner in leaves(config_class(SPEC)):
        assert field_docs(owner).get(leaf.name), f"{key} has no doc"


def test_later_sources_win(tmp_path):
    """Overrides beat YAML files, which beat the defaults, and values get their field's type."""
    extra = tmp_path / "extra.yaml"
    extra.write_text("data:\n  batch_size: 64\ntrainer:\n  max_epochs: 7\n")
    cfg = load_config(SPEC, [extra], ["trainer.max_epochs=9", "optim.lr=1e-2", "trainer.max_steps=null"])
    assert (cfg.data.batch_size, cfg.trainer.max_epochs, cfg.optim.lr) == (64, 9, 0.01)
    assert cfg.trainer.max_steps is None


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.batch_sz=3"], "data.batch_sz: unknown key; did you mean data.batch_size?"),
        (["lr=0.1"], "did you mean optim.lr?"),
        (["data.batch_size=abc"], "data.batch_size: expected int"),
        (["trainer.precision=fp8"], "trainer.precision='fp8' is not allowed; choose one of fp32, bf16, fp16"),
        (["data.batch_size=0"], "data.batch_size=0 must be at least 1"),
        (["trainer.precision=fp16", "run.device=cpu"], "trainer.precision=fp16 needs a CUDA device"),
        (["distributed.sync_batchnorm=true", "run.device=cpu"], "distributed.sync_batchnorm=true needs CUDA"),
        (["trainer.resume=/nonexistent.pt"], "trainer.resume='/nonexistent.pt': no such file"),
        (["trainer.max_epochs"], "write it as key=value"),
        (["run.seed=-5"], "run.seed=-5 must be between 0 and 2**31 - 1"),
        (["optim.lr=nan"], "optim.lr=nan must be a finite number"),
        (["optim.betas=[0.9,1.0]"], "optim.betas=[0.9, 1.0] must be two numbers in [0, 1)"),
        (["optim.betas=[0.9]"], "optim.betas=[0.9] must be two numbers in [0, 1)"),
        *BAD_CONFIGS,  # the task's own keys
    ],
)
def test_bad_configuration_is_refused_with_the_key_named(overrides, expected):
    """Each mistake raises ConfigError whose message names the key and what is allowed."""
    with pytest.raises(ConfigError) as err:
        load_config(SPEC, [], overrides)
    assert expected in str(err.value)


def test_bad_yaml_files_are_refused(tmp_path):
    """A missing file, broken YAML or an unknown key in a file is a ConfigError."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [unclosed\n")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("data:\n  batchsize: 3\n")
    for path, expected in [
        (tmp_path / "missing.yaml", "no such file"),
        (broken, "not valid YAML"),
        (unknown, "did you mean data.batch_size?"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            load_config(SPEC, [path])


def test_all_keys_are_dotted_section_fields():
    """all_keys() (used for did-you-mean) lists every section.field."""
    assert "data.batch_size" in all_keys(SPEC) and "distributed.timeout_s" in all_keys(SPEC)


@pytest.mark.slow
@pytest.mark.core  # the command line: the same for every task
def test_cli_exits_2_with_one_line_and_no_traceback():
    """The train command refuses a bad key with exit status 2 and a single stderr line."""
    result = subprocess.run(
        [sys.executable, "-m", "{{ cookiecutter.package_name }}.train", "data.batch_sz=3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: data.batch_sz: unknown key; did you mean data.batch_size?"]


@pytest.mark.slow
@pytest.mark.core  # the command line: the same for every task
def test_commands_exit_without_the_interpreter_s_last_garbage_collections():
    """The commands' module freezes the garbage collector's objects at exit (engine/cli.py), so the
    interpreter's last collections skip what torch made: an exit handler registered before that
    module is imported runs after its handler, and finds the objects frozen."""
    probe = "import atexit, gc; atexit.register(lambda: print(gc.get_freeze_count() > 0))\n"
    probe += "import {{ cookiecutter.package_name }}.engine.cli"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stdout + result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.core  # the command line: the same for every task
def test_a_command_imports_with_the_collector_off_and_runs_with_it_on(tmp_path):
    """Under `python -m PACKAGE.COMMAND` (Python sets sys.argv[0] to "-m" while it imports the command's
    packages) the package turns the garbage collector off before the command imports torch
    (engine/startup.py): those imports run no collection, and cli.run turns it back on with what they
    made frozen. Imported any other way, the package leaves the collector alone. The probe is a package
    of its own that imports this one, run both ways."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "__init__.py").write_text(
        "import gc\nbefore = [g['collections'] for g in gc.get_stats()]\n"
        "import {{ cookiecutter.package_name }}.engine.cli as cli\n"
        "OFF = [g['collections'] for g in gc.get_stats()] == before and not gc.isenabled()\n"
    )
    (probe / "__main__.py").write_text(
        "import gc\nfrom probe import OFF, cli\ncli.run(lambda: 0)\n"
        "print(OFF, gc.isenabled(), gc.get_freeze_count() > 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    for how, expected in ((["-m", "probe"], "True True True"), (["-c", "import probe.__main__"], "False True False")):
        result = subprocess.run([sys.executable, *how], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0 and result.stdout.strip() == expected, (how, result.stdout, result.stderr[-2000:])


def test_main_returns_2_on_bad_option(capsys):
    """Unknown command-line options are refused, not ignored."""
    assert main(["--epochs", "3"]) == 2
    assert "unknown option --epochs" in capsys.readouterr().err


def test_help_lists_every_key(capsys):
    """--help prints every key with its default and documentation."""
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(key in out for key in all_keys(SPEC))


@pytest.mark.slow
@pytest.mark.core  # the command line: the same for every task
def test_help_into_a_closed_pipe_ends_quietly():
    """`train --help | head` ends with status 0 and no BrokenPipeError traceback when the reader has gone."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.train", "--help"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader leaves before the help is written (the child is still importing)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err
