"""lm-evaluation-harness tasks and their data, offline: what evaluate --tasks and trainer.eval_tasks ask for.

A task reads its data set through `datasets`, from the hub or its cache. --task-data NAME=PATH
(trainer.eval_task_data) serves a local copy instead: a save_to_disk folder, a folder of SPLIT.jsonl or
SPLIT.parquet files, or one such file, which then serves every split the task reads. --include DIR
(trainer.eval_include) adds the user's own task YAMLs (the harness's include path). A task whose data
cannot be read fails in one line that names the `datasets` command to fetch it where the hub is
reachable.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import datasets
from lm_eval.tasks import TaskManager

from ..engine.errors import ConfigError, DataError


@dataclass
class Request:
    """What evaluate --tasks (or trainer.eval_tasks) asks of the harness."""

    tasks: list[str]
    limit: float | None = None
    num_fewshot: int | None = None
    task_data: dict[str, str] | None = None
    include: str | None = None
    chat: bool = False
    manager: TaskManager | None = field(default=None, compare=False, repr=False)  # the index, once built

    @classmethod
    def of_trainer(cls, trainer) -> Request:
        """trainer.eval_tasks with trainer.eval_limit, eval_include and eval_task_data (engine/monitor.py
        checked their values)."""
        if trainer.eval_include is not None and not Path(trainer.eval_include).is_dir():
            raise ConfigError(f"trainer.eval_include={trainer.eval_include!r}: no such folder")
        limit = _items(trainer.eval_limit)
        return cls(list(trainer.eval_tasks), limit, None, dict(trainer.eval_task_data), trainer.eval_include)

    @classmethod
    def of(cls, options: dict[str, str | None]) -> Request:
        """From evaluate's options (--tasks, --limit, --num-fewshot, --task-data, --include,
        --apply-chat-template), each checked."""
        tasks = [name.strip() for name in (options.get("--tasks") or "").split(",") if name.strip()]
        if not tasks:
            raise ConfigError("--tasks needs at least one task name, e.g. --tasks hellaswag,arc_easy")
        limit = options.get("--limit")
        fewshot = options.get("--num-fewshot")
        try:
            limit = float(limit) if limit is not None else None
            fewshot = int(fewshot) if fewshot is not None else None
        except ValueError:
            raise ConfigError(f"--limit {limit!r} or --num-fewshot {fewshot!r} is not a number") from None
        if (limit is not None and limit <= 0) or (fewshot is not None and fewshot < 0):
            raise ConfigError("--limit must be above 0 and --num-fewshot at least 0")
        task_data = {}
        for pair in (options.get("--task-data") or "").split(","):
            if pair.strip():
                name, equals, path = pair.partition("=")
                if not equals or not name.strip() or not path.strip():
                    raise ConfigError(f"--task-data {pair!r}: write NAME=PATH, e.g. hellaswag=data/hellaswag")
                task_data[name.strip()] = path.strip()
        if given := sorted(set(task_data) - set(tasks)):
            raise ConfigError(f"--task-data names {', '.join(given)}, which --tasks does not")
        include = options.get("--include")
        if include is not None and not Path(include).is_dir():
            raise ConfigError(f"--include {include!r}: no such folder")
        return cls(tasks, _items(limit), fewshot, task_data, include, "--apply-chat-template" in options)


def _items(limit: float | None) -> float | int | None:
    """A limit as the harness reads it: a count of items (an int) from 1 up, a fraction of them below 1."""
    return limit if limit is None or limit < 1 else int(limit)


def load_tasks(request: Request) -> tuple[list, TaskManager]:
    """The harness's tasks (and groups) request names, each built with its data (--task-data's local copy,
    else the `datasets` hub or cache); an unknown name or unreadable data is a one-line error. Tasks all
    found in --include are looked up there alone: indexing the harness's own 15,000 takes 6 s."""
    manager = request.manager
    if manager is None and request.include:
        manager = TaskManager(include_path=request.include, include_defaults=False)
    if manager is None or not set(request.tasks) <= set(manager.all_tasks):
        manager = TaskManager(include_path=request.include)
    request.manager = manager
    built = []
    for name in request.tasks:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else "see lm_eval ls tasks"
            where = f" or in --include {request.include}" if request.include else ""
            raise ConfigError(f"--tasks {name}: no such task in lm-evaluation-harness{where}; {hint}")
        local = request.task_data.get(name) if request.task_data else None
        with _data(name, local):
            loaded = manager.load([name])
        if name in loaded["groups"]:
            built.append(loaded["groups"][name])
        elif name in loaded["tasks"]:
            built.append(loaded["tasks"][name])
        else:  # a tag: its tasks
            built.extend(loaded["tasks"].values())
    return built, manager


BUILDERS = ("json", "parquet", "csv", "text", "arrow")  # datasets' readers of files the task names


@contextlib.contextmanager
def _data(task: str, local: str | None) -> Iterator[None]:
    """While a task is built: its data from local (a path) when given, else through datasets.load_dataset,
    whose failure becomes one line naming what fetches the data set."""
    real = datasets.load_dataset
    asked = {}

    def load(path=None, name=None, *args, **kwargs):
        asked.update(path=path, name=name, files=kwargs.get("data_files"))
        return local_dataset(local, task, real) if local else real(path, name, *args, **kwargs)

    try:
        with mock.patch.object(datasets, "load_dataset", load):
            yield
    except (ConfigError, DataError):
        raise
    except Exception as err:  # datasets and the hub raise many kinds (ConnectionError, FileNotFoundError, ...)
        if not asked:
            raise DataError(f"--tasks {task}: the harness cannot build it ({_first_line(err)})") from None
        local_copy = f"--task-data {task}=PATH for a local copy"
        if asked["path"] in BUILDERS:  # the task reads files of its own
            raise DataError(
                f"--tasks {task}: its data files ({asked['path']}: {asked['files']}) cannot be read "
                f"({_first_line(err)}); pass {local_copy}"
            ) from None
        named = f", {asked['name']!r}" if asked["name"] else ""
        fetch = f"datasets.load_dataset({asked['path']!r}{named}).save_to_disk('data/{task}')"
        raise DataError(
            f"--tasks {task}: its data ({asked['path']}{'/' + asked['name'] if asked['name'] else ''}) is neither "
            f"local nor reachable ({_first_line(err)}); where the hub is reachable run "
            f'python -c "import datasets; {fetch}", then pass --task-data {task}=data/{task}'
        ) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


class AnySplit(datasets.DatasetDict):
    """One file's records as every split a task asks for."""

    def __missing__(self, split: str) -> datasets.Dataset:
        return self["all"]

    def __contains__(self, split: object) -> bool:
        return True


READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def local_dataset(path: str, task: str, load_dataset=datasets.load_dataset) -> datasets.DatasetDict:
    """--task-data's copy: a save_to_disk folder, a folder of SPLIT.jsonl / SPLIT.parquet files, or one file
    (read with load_dataset: datasets' own, which _data stands in for while a task is built)."""
    where = Path(path)
    try:
        if (where / "dataset_dict.json").is_file() or (where / "dataset_info.json").is_file():
            loaded = datasets.load_from_disk(str(where))
            return loaded if isinstance(loaded, datasets.DatasetDict) else AnySplit(all=loaded)
        if where.is_dir():
            files = {file.stem: file for file in sorted(where.iterdir()) if file.suffix in READERS}
            kinds = {READERS[file.suffix] for file in files.values()}
            if len(kinds) == 1:
                return load_dataset(kinds.pop(), data_files={s: str(f) for s, f in files.items()})
        elif where.suffix in READERS and where.is_file():
            return AnySplit(all=load_dataset(READERS[where.suffix], data_files=str(where), split="train"))
    except Exception as err:  # datasets raises many kinds on a damaged file
        raise DataError(f"--task-data {task}={path}: unreadable ({_first_line(err)})") from None
    raise DataError(
        f"--task-data {task}={path}: not a save_to_disk folder, a folder of SPLIT.jsonl or SPLIT.parquet files, "
        "or a .jsonl, .json or .parquet file"
    )
