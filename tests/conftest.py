"""Shared helpers for the template tests: bake a project, list its files, load a hook."""

import compileall
import contextlib
import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bytecode caches appear wherever Python imports a module; they are never template output.
# Other tool caches (.ruff_cache, .pytest_cache) count: the checks here run with caching off.
SKIPPED_DIRS = {"__pycache__"}


@dataclass(frozen=True)
class Baked:
    """A baked project: where it is and the answers it was generated with."""

    path: Path
    context: dict

    @property
    def package(self) -> str:
        """The importable package name."""
        return self.context["package_name"]


def bake(cookies, **context: str) -> Baked:
    """Bake the template with `context` overriding the defaults; fail the test if the bake fails."""
    result = cookies.bake(extra_context=context, template=str(ROOT))
    assert result.exception is None, f"bake with {context} failed: {result.exception!r}"
    assert result.exit_code == 0
    return Baked(Path(result.project_path), dict(result.context))


def project_files(root: Path) -> set[str]:
    """Return every file under `root` as a relative POSIX path, skipping bytecode caches."""
    files = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [name for name in dirnames if name not in SKIPPED_DIRS]
        for name in filenames:
            files.add((Path(dirpath) / name).relative_to(root).as_posix())
    return files


def load_hook(name: str) -> ModuleType:
    """Import ``hooks/<name>.py`` unrendered, so its functions can be tested directly."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(command: list, cwd: Path, env: dict | None = None, timeout: float = 300):
    """Run a command to completion without a terminal, capturing its text output."""
    return subprocess.run(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# The baked suites write tens of GB of checkpoints (a ResNet-18's with its optimizer is 135 MB; the
# resume tests alone write 8 GB), which a virtual disk takes ever more slowly over a long run. Their
# temporary directories go to memory (tmpfs) when it has this much room; fsync, renames and
# permissions behave there as on a disk.
RAM_DISK, RAM_DISK_ROOM = Path("/dev/shm"), 8 * 2**30


def temproot_for(project: Path) -> Path:
    """A temporary-directory root of its own for a baked project's test runs: in RAM_DISK when it
    has RAM_DISK_ROOM free, else next to the project (the same one on every call for a project).

    pytest puts its ``pytest-of-<user>/pytest-N`` directories under ``PYTEST_DEBUG_TEMPROOT``, so
    what a nested run leaves behind can be checked (see `files_left`).
    """
    name = f"{project.name}-pytest-temproot"
    if RAM_DISK.is_dir() and os.access(RAM_DISK, os.W_OK):
        in_ram = RAM_DISK / f"torch-template-{hashlib.sha1(str(project).encode()).hexdigest()[:12]}"
        if in_ram.is_dir() or shutil.disk_usage(RAM_DISK).free >= RAM_DISK_ROOM:
            in_ram.mkdir(exist_ok=True)
            return in_ram
    temproot = project.parent / name
    temproot.mkdir(exist_ok=True)
    return temproot


def files_left(root: Path) -> list[str]:
    """The regular files under `root`, as relative paths (symbolic links are not counted)."""
    return sorted(
        path.relative_to(root).as_posix()
        for path in root.rglob("*")
        if path.is_file() and not path.is_symlink()
    )


def compile_bytecode(project: Path) -> None:
    """Compile a baked project's modules once, before its suite runs. The suite starts hundreds of
    Python processes (training runs, torchrun's workers, sweeps' trials); where
    PYTHONDONTWRITEBYTECODE is set, as CI images often set it, each would compile the package again
    (0.3 s of CPU a process, 7% of a slow tier). Python reads bytecode files whatever it says."""
    for folder in ("src", "tests"):
        compileall.compile_dir(project / folder, quiet=1)


# Commands a test module checks the outcome of, started in the background when the session starts:
# a test module's BACKGROUND maps a fixture name to a function that, given a work directory, returns
# the command, as a list or as a `Background` (a command with its directory and variables); the
# fixture's tests wait for it. They run beside the foreground tests, at the same priority, with one
# thread per process (OMP_NUM_THREADS=1, as every baked suite here): the template's run is bound by
# its CPU time, and a suite alone keeps about 1.3 of 2 cores busy (its tests wait on their
# processes: checkpoints, signals, timeouts), so what runs beside it fills the other core. One
# thread each, because a process whose threads meet at every operation (OpenMP's) stalls whenever
# another process takes one of its cores: beside another suite, an image tier on 2 threads took 3
# times as long.
_background: dict[str, tuple[subprocess.Popen, Path]] = {}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Background:
    """A background command, the directory it runs in (else its work directory) and the variables
    it adds to this environment."""

    command: list
    cwd: Path | None = None
    env: dict | None = None


def pytest_collection_finish(session):
    """Start the BACKGROUND commands the selected tests use, once each."""
    for item in session.items:
        commands = getattr(getattr(item, "module", None), "BACKGROUND", {})
        for name in sorted(set(commands) & set(getattr(item, "fixturenames", ()))):
            if name not in _background:
                _start_in_background(name, commands[name])


def pytest_sessionfinish(session):
    """Stop what is still running in the background and remove its work directories."""
    while _background:
        process, work = _background.popitem()[1]
        if process.poll() is None:  # with what it started in its process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        shutil.rmtree(work, ignore_errors=True)


def _start_in_background(name: str, command: Callable[[Path], "list | Background"]) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"template-{name}-"))
    spec = command(work)
    spec = spec if isinstance(spec, Background) else Background(spec)
    with open(work / "stdout", "w") as stdout, open(work / "stderr", "w") as stderr:
        process = subprocess.Popen(
            list(map(str, spec.command)),
            cwd=spec.cwd or work,
            env={**os.environ, "PYTHON": sys.executable, **ONE_THREAD, **(spec.env or {})},
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    _background[name] = (process, work)


def background_result(
    name: str, command: Callable[[Path], "list | Background"], timeout: float
) -> tuple:
    """(return code, stdout, stderr, work directory) of a BACKGROUND command, waiting for it
    (started now if the session did not: a test selected on its own)."""
    if name not in _background:
        _start_in_background(name, command)
    process, work = _background[name]
    code = process.wait(timeout=timeout)
    return code, (work / "stdout").read_text(), (work / "stderr").read_text(), work


def baked_tests(project: Path, *args: str, env: dict | None = None) -> Background:
    """The command that runs a baked project's own test suite with this interpreter, importing it
    from ``src/``, on one thread per process (see Background), with env's variables added; its
    modules are compiled first (`compile_bytecode`). Its temporary directories go under
    `temproot_for(project)`."""
    compile_bytecode(project)
    env = {
        **ONE_THREAD,
        **(env or {}),
        "PYTHONPATH": str(project / "src"),
        "PYTEST_DEBUG_TEMPROOT": str(temproot_for(project)),
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return Background(command, project, env)


def run_baked_tests(
    project: Path, *args: str, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `baked_tests` to completion."""
    spec = baked_tests(project, *args, env=env)
    return run(spec.command, cwd=spec.cwd, env={**os.environ, **spec.env}, timeout=timeout)


@pytest.fixture(scope="session")
def pre_gen():
    """The pre-generation hook module, imported unrendered."""
    return load_hook("pre_gen_project")


@pytest.fixture(scope="session")
def post_gen():
    """The post-generation hook module, imported unrendered."""
    return load_hook("post_gen_project")
