"""Baked projects pass their own test suites, run the way a user would run them."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    Background,
    background_result,
    bake,
    baked_tests,
    compile_bytecode,
    files_left,
    run,
    run_baked_tests,
    temproot_for,
)

pytestmark = pytest.mark.baked

# Each baked test runs once in the whole template run. The image bake's fast tier runs in the
# README-install venv (test_readme_install_then_tests_pass, what `make test` runs) and, like the
# language-model bake's (test_language_model_fast_tier_passes_under_a_second_arithmetic), under a
# second arithmetic (SECOND_ARITHMETIC), so a test that expects numbers made on another CPU fails
# here rather than on a user's machine. The tests marked `core` (engine behaviour no task changes:
# signals, restarts, checkpoint formats and damage, resume rules, the command line, trackers,
# sweeps) run once: the fast ones in the image bake's fast tier, the slow ones with the cheaper
# task, in the language-model bake's slow tier. The image bake's other slow tests run in
# test_baked_slow_tests_pass. Each other bake runs only the
# tests that its answer changes the outcome of. The tracker answer changes the configured default
# tracker (the defaults test checks default.yaml against the config's defaults); every tracker test
# names its tracker itself, so it runs the same in any bake. The launcher answer changes the README
# and runs the launch tests.
#
# The language model's slow tier, the longest suite, starts with the session, beside the others
# (conftest.py's BACKGROUND); pytest runs this file's other tests in order beside it and the
# benchmark check, the image project's slow tier last. The tiers run on two workers (TWO_WORKERS):
# the one that ends the run would otherwise leave a core idle.
VARIANT_TESTS = {
    "tracker=wandb": ["tests/engine/test_config.py", "-k", "defaults"],
    "tracker=tensorboard": ["tests/engine/test_config.py", "-k", "defaults"],
    "tracker=mlflow": ["tests/engine/test_config.py", "-k", "defaults"],
}
# Launchers' own behaviour (accelerate, two torchrun agents, torchrun's restarts): the accelerate
# bake runs them, the other runs leave them out.
LAUNCH_TESTS = "accelerate_launch or two_nodes or restarted_group"
# The language model's default demo, trained in full (the template's CI leaves it out, for time).
DEMO_TEST = "default_demo"
VARIANT_TESTS["launcher=accelerate"] = ["-m", "not gpu", "-k", LAUNCH_TESTS]

# Every baked suite runs on two pytest workers (pytest-xdist), each taking whole files, so that a
# file's module fixtures (the fault matrix's reference runs, say) are made once, as the baked
# Makefile's test targets run them: on one worker a slow tier's tests wait on their processes
# (checkpoints, signals, timeouts) for a third of the time.
TWO_WORKERS = ("-n", "2", "--dist", "loadfile")

# The install line the README must show, e.g. pip install -e '.[dev]' (any quoting).
README_INSTALL = re.compile(r"""pip install -e ['"]?\.\[dev\]['"]?""")
# Packages that must come from the already-installed environment, never from the index.
HEAVY_PACKAGE = re.compile(r"^\s*(Collecting|Downloading) (torch|torchvision|numpy|nvidia)", re.M)


def _tail(text: str, lines: int = 60) -> str:
    """Return the last lines of a long output, for failure messages."""
    return "\n".join(text.splitlines()[-lines:])


def _assert_passed_and_cleaned_up(completed: subprocess.CompletedProcess, project: Path) -> None:
    """The baked suite passed, and removed its temporary directories (checkpoints of a ResNet-18
    are 135 MB each, so a suite that kept them would fill a disk over a few runs). The temporary
    root goes either way: it may be in RAM."""
    output = completed.stdout + completed.stderr
    temproot = temproot_for(project)
    left = files_left(temproot)
    shutil.rmtree(temproot, ignore_errors=True)
    assert completed.returncode == 0, _tail(output)
    assert re.search(r"\d+ passed", completed.stdout), _tail(output)
    assert not left, f"the passing suite left {len(left)} temporary files behind: {left[:5]}"


@pytest.mark.parametrize("variant", VARIANT_TESTS)
def test_baked_variant_passes_the_tests_its_answer_touches(cookies, variant):
    """Each tracker and the accelerate launcher: the baked tests that depend on that answer pass."""
    name, value = variant.split("=")
    baked = bake(cookies, **{name: value})
    completed = run_baked_tests(baked.path, *VARIANT_TESTS[variant], timeout=600)
    _assert_passed_and_cleaned_up(completed, baked.path)
    ran = int(re.search(r"(\d+) passed", completed.stdout)[1])
    assert ran >= 1, completed.stdout[-2000:]  # a selection that matched nothing proves nothing


# A second arithmetic for the fast tiers: torch's plain C++ kernels (no SIMD: this machine's run
# the AVX2 or AVX-512 ones), oneDNN's convolutions and MKL's products at SSE4 (ATEN_CPU_CAPABILITY
# does not reach them), on one thread instead of the cores'. Float sums then round otherwise, as
# on another CPU, so a test that expects a number made elsewhere (a stored result, a digest of
# trained weights) fails here, in CI, rather than on a user's machine.
SECOND_ARITHMETIC = {
    "ATEN_CPU_CAPABILITY": "default",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "OMP_NUM_THREADS": "1",
}
# The baked pytest header names the arithmetic in effect.
ARITHMETIC_HEADER = "CPU capability DEFAULT, 1 thread\n"


def _make_venv_on_top_of_this_one(venv: Path) -> Path:
    """Create a fresh venv that also sees this interpreter's packages; return its bin/ directory.

    A .pth file appends this venv's site-packages to the new one's sys.path, so pip counts torch
    and friends as installed (it reads dist-info from sys.path) instead of downloading gigabytes.
    """
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    new_site = subprocess.run(
        [bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(new_site, "template-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return bin_dir


def test_readme_install_then_tests_pass(cookies, tmp_path):
    """The README's `pip install -e '.[dev]'` works in a fresh venv and the default bake's fast tier
    (`make test`: all but the slow tests, which test_baked_slow_tests_pass runs) then passes, under
    the second arithmetic (SECOND_ARITHMETIC): its tests compare only numbers computed in the same
    run, so they pass on any CPU."""
    baked = bake(cookies)
    readme = (baked.path / "README.md").read_text(encoding="utf-8")
    assert README_INSTALL.search(readme), "README.md does not show pip install -e '.[dev]'"

    bin_dir = _make_venv_on_top_of_this_one(tmp_path / "venv")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(VIRTUAL_ENV=str(bin_dir.parent), PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    env.update(PYTEST_DEBUG_TEMPROOT=str(temproot_for(baked.path)))

    install = run([bin_dir / "pip", "install", "-e", f"{baked.path}[dev]"], cwd=tmp_path, env=env)
    assert install.returncode == 0, _tail(install.stdout + install.stderr)
    assert "Requirement already satisfied: torch" in install.stdout, _tail(install.stdout)
    assert not HEAVY_PACKAGE.search(install.stdout), HEAVY_PACKAGE.search(install.stdout)

    compile_bytecode(baked.path)
    pytest_command = [
        bin_dir / "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--verbose",
        *TWO_WORKERS,
        "-k",
        f"not ({LAUNCH_TESTS})",
    ]
    tests = run(pytest_command, baked.path, {**env, **SECOND_ARITHMETIC}, timeout=600)
    _assert_passed_and_cleaned_up(tests, baked.path)
    assert ARITHMETIC_HEADER in tests.stdout, tests.stdout[:2000]  # the run really used it


def test_language_model_fast_tier_passes_under_a_second_arithmetic(cookies):
    """The language model's fast tier passes with other float rounding (plain kernels, one thread):
    its tests compare only numbers computed in the same run, so they pass on any CPU. (The image
    bake's runs so in test_readme_install_then_tests_pass, with the fast `core` tests, which this
    one leaves out: the engine's, the same in either bake.)"""
    baked = bake(cookies, task="language-model")
    completed = run_baked_tests(
        baked.path,
        *("--verbose", *TWO_WORKERS, "-m", "not slow and not core", "-k", f"not ({LAUNCH_TESTS})"),
        env=SECOND_ARITHMETIC,
        timeout=600,
    )
    _assert_passed_and_cleaned_up(completed, baked.path)
    assert ARITHMETIC_HEADER in completed.stdout, completed.stdout[:2000]  # the run really used it


def test_baked_slow_tests_pass(cookies):
    """The default bake's slow tier passes, but for the `core` tests the language-model bake runs:
    SIGKILL under FSDP, world-size invariance and the data pipeline with images, and an imagefolder
    of PNG files that trains well."""
    baked = bake(cookies)
    selection = ("-m", "slow and not core", "-k", f"not ({LAUNCH_TESTS})")
    completed = run_baked_tests(baked.path, *TWO_WORKERS, *selection, timeout=1500)
    _assert_passed_and_cleaned_up(completed, baked.path)


# The language model's slow tier: the fault matrix, sweeps, trackers, formats, adapters, benchmarks.
LANGUAGE_MODEL_SLOW = ("-m", "slow and not gpu", "-k", f"not ({LAUNCH_TESTS} or {DEMO_TEST})")


def language_model_slow_command(work: Path) -> Background:
    """Bake task=language-model into work; the command that runs its slow tier on 2 workers."""
    from cookiecutter.main import cookiecutter

    context = {"task": "language-model"}
    project = Path(
        cookiecutter(str(ROOT), no_input=True, output_dir=str(work), extra_context=context)
    )
    return baked_tests(project, *TWO_WORKERS, *LANGUAGE_MODEL_SLOW)


BACKGROUND = {"language_model_slow_tier": language_model_slow_command}


@pytest.fixture
def language_model_slow_tier() -> tuple[subprocess.CompletedProcess, Path]:
    """The language model's slow tier, started with the session, once it ended: its outcome and
    the project it ran in."""
    result = background_result("language_model_slow_tier", language_model_slow_command, 1800)
    code, stdout, stderr, work = result
    project = next(work.glob("*/pyproject.toml")).parent
    return subprocess.CompletedProcess([], code, stdout, stderr), project


def test_language_model_bake_passes_its_slow_tier(language_model_slow_tier):
    """The task=language-model bake's slow tier passes, with the `core` tests: the fault matrix
    (runs killed on 1 process, under DDP and FSDP, signalled, restarted, peers hung), sweeps,
    trackers, checkpoint formats, prepare's memory, and 2 gloo processes against one (its fast tier
    runs under the second arithmetic). The default demo's test (600 steps, 105 s) is left to the
    project's own `make test-all` and to `make bench`, which checks the demo's targets."""
    completed, project = language_model_slow_tier
    _assert_passed_and_cleaned_up(completed, project)
    assert int(re.search(r"(\d+) passed", completed.stdout)[1]) >= 50, completed.stdout[-2000:]
