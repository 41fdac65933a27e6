"""The optional experiment tracker beside metrics.jsonl: TensorBoard, wandb or MLflow (tracker.name).

metrics.MetricsLogger (main process only) opens one with open_tracker and hands it every line it
writes to metrics.jsonl: tracker.log(metrics, step), then tracker.close(error) with what ended
training (None when it finished). evaluate adds its benchmark scores to the run's tracker afterwards
(log_scores).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import secrets
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

from . import PACKAGE
from .config import ConfigError, TrackerConfig
from .errors import Preempted

log = logging.getLogger(__name__)


def open_tracker(output_dir: Path, cfg: TrackerConfig, config: dict, run_info: dict | None, afterwards: bool = False):
    """The tracker tracker.name names (None for none), started for this run; afterwards: for scores of a run
    that has ended (log_scores), whose MLflow status stays."""
    if cfg.name == "tensorboard":
        return _TensorBoard(output_dir / "tensorboard", run_info)
    if cfg.name == "wandb":  # the run's provenance beside its configuration
        return _Wandb(output_dir, cfg, {**config, "run_info": run_info} if run_info else config)
    if cfg.name == "mlflow":
        return _MLflow(output_dir, cfg, config, run_info, afterwards)
    return None


def log_scores(output_dir: Path, cfg: TrackerConfig, scores: dict, step: int) -> None:
    """A checkpoint's scores, logged after training into the tracker tracker.name names: the run
    output_dir's wandb_run_id or mlflow_run_id names (a new run where the directory has none), or its
    tensorboard/ folder, at the checkpoint's step. The run's status and configuration stay as training
    left them."""
    tracker = open_tracker(output_dir, cfg, {}, None, afterwards=True) if scores else None
    if tracker is None:
        return
    try:
        tracker.log_scores(scores, step)
    finally:
        tracker.close()


class _TensorBoard:
    def __init__(self, log_dir: Path, run_info: dict | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "tracker.name=tensorboard needs the tensorboard package: pip install tensorboard"
            ) from None
        self.writer = SummaryWriter(str(log_dir))
        if run_info:  # provenance.py's record of this start, as text beside the scalars
            step = run_info.get("resumed_from_step") or 0
            self.writer.add_text("run_info", "```\n" + json.dumps(run_info, indent=1) + "\n```", step)

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    log_scores = log

    def close(self, error: BaseException | None = None) -> None:
        self.writer.close()


WANDB_MODES = ("online", "offline", "disabled")


class _Wandb:
    """wandb run; the API key comes from the environment or netrc, never from the config."""

    def __init__(self, output_dir: Path, cfg: TrackerConfig, config: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError("tracker.name=wandb needs the wandb package: pip install wandb") from None
        mode = os.environ.get("WANDB_MODE", "online")
        if mode not in WANDB_MODES:
            raise ConfigError(f"WANDB_MODE={mode!r} is not one of {', '.join(WANDB_MODES)}")
        id_file = output_dir / "wandb_run_id"  # a resumed run continues the same wandb run
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(6)
        id_file.write_text(run_id)
        try:
            self.run = wandb.init(
                project=cfg.project or PACKAGE,
                entity=cfg.entity,
                name=cfg.run_name or output_dir.name,
                tags=list(cfg.tags) or None,
                id=run_id,
                resume="allow",
                dir=str(output_dir),
                config=config,  # the resolved configuration, as config.yaml holds it
                mode=mode,
            )
        except Exception as err:  # wandb raises many types (no API key, network, permissions)
            raise ConfigError(
                f"tracker.name=wandb could not start ({str(err).strip().splitlines()[0]}); run `wandb login`, "
                "set WANDB_API_KEY, or WANDB_MODE=offline (or tracker.name=none)"
            ) from None

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_scores(self, scores: dict, step: int) -> None:
        """Into the run's summary (its table of runs), and its history unless that has passed `step`:
        wandb keeps a history in step order and drops a step it has passed."""
        self.run.summary.update(scores)
        if step >= self.run.step:
            self.run.log(scores, step=step)

    def close(self, error: BaseException | None = None) -> None:
        self.run.finish()


class _MLflow:
    """One MLflow run per output directory, through MlflowClient (an explicit run id, no global state).

    The store is MLFLOW_TRACKING_URI when set, else SQLite in output_dir/mlruns/: MLflow 3 made SQLite its
    default and, since 3.13, refuses its old ./mlruns file store unless MLFLOW_ALLOW_FILE_STORE=true.
    Credentials in the URI (user:password@) are never printed.
    """

    def __init__(
        self, output_dir: Path, cfg: TrackerConfig, config: dict, run_info: dict | None, afterwards: bool = False
    ):
        """afterwards: scores for a run that has ended (log_scores), whose status stays."""
        self.afterwards, self.started = afterwards, False
        try:
            from mlflow import MlflowClient
            from mlflow.exceptions import MlflowException
        except ImportError:
            raise ConfigError(
                "tracker.name=mlflow needs the mlflow-skinny package: pip install mlflow-skinny"
            ) from None
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        store = output_dir.resolve() / "mlruns"
        self.where = redact(uri) if uri else str(store)
        try:
            if not uri:
                store.mkdir(exist_ok=True)
            self.client = MlflowClient(uri or f"sqlite:///{(store / 'mlflow.db').as_posix()}")
            self.run_id = self._run(output_dir, cfg, None if uri else (store / "artifacts").as_uri())
            self._log_start(config, run_info)
        except ImportError as err:  # what a SQL store runs on: for SQLite (the local store) sqlalchemy and alembic
            raise ConfigError(
                f"tracker.name=mlflow could not open the store at {self.where} ({first_line(err)}); "
                "a SQLite store needs sqlalchemy and alembic: pip install sqlalchemy alembic"
            ) from None
        except MlflowException as err:
            raise ConfigError(
                f"tracker.name=mlflow could not start a run in {self.where}: {redact(first_line(err))}; "
                "check MLFLOW_TRACKING_URI (or use tracker.name=none)"
            ) from None

    def _run(self, output_dir: Path, cfg: TrackerConfig, artifacts: str | None) -> str:
        """The run output_dir/mlflow_run_id names, RUNNING again; a new one when the store lacks it."""
        from mlflow.exceptions import MlflowException

        id_file = output_dir / "mlflow_run_id"
        if id_file.exists():
            run_id = id_file.read_text().strip()
            try:
                if self.client.get_run(run_id).info.lifecycle_stage == "active":
                    if not self.afterwards:
                        self.client.update_run(run_id, status="RUNNING")
                    return run_id
            except MlflowException as err:
                if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            log.warning("MLflow run %s is not in %s (or was deleted); starting a new run", run_id, self.where)
        name = cfg.project or PACKAGE
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None and experiment.lifecycle_stage != "active":
            raise ConfigError(
                f"MLflow experiment {name!r} in {self.where} is deleted; restore it or set tracker.project"
            )
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name, artifacts)
        tags = dict(tag.split("=", 1) if "=" in tag else (tag, "") for tag in cfg.tags)  # key=value, or a label
        run = self.client.create_run(experiment_id, run_name=cfg.run_name or output_dir.name, tags=tags)
        id_file.write_text(run.info.run_id)
        self.started = True
        return run.info.run_id

    def _log_start(self, config: dict, run_info: dict | None) -> None:
        """The resolved config as params (a resumed run adds the new keys), and this start's provenance."""
        from mlflow.entities import Param, RunTag
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = {key: clip(value, MAX_PARAM_VAL_LENGTH) for key, value in flat_params(config).items()}
        logged = self.client.get_run(self.run_id).data.params
        if changed := [f"{k} {v} -> {params[k]}" for k, v in sorted(logged.items()) if params.get(k, v) != v]:
            log.warning("MLflow keeps a run's first params; config.yaml has the new values: %s", ", ".join(changed))
        new = [Param(key, value) for key, value in params.items() if key not in logged]
        for start in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[start : start + MAX_PARAMS_TAGS_PER_BATCH])
        if run_info:  # provenance.py's record of this start, one file per start as in run_info.json
            self.client.log_dict(self.run_id, run_info, f"run_info/{run_info['started'].replace(':', '')}.json")
            if run_info.get("git"):  # the MLflow UI shows it as the run's source version
                self.client.log_batch(self.run_id, tags=[RunTag("mlflow.source.git.commit", run_info["git"]["commit"])])

    def log(self, metrics: dict, step: int) -> None:
        """One log_batch of the finite values; metrics.jsonl's nulls (NaN, infinities) are left out."""
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException

        if self.client is None:
            return
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None and math.isfinite(v)]
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except MlflowException as err:  # after MLflow's own retries; training goes on without the tracker
            log.warning("MLflow failed at step %d, metrics.jsonl goes on: %s", step, redact(first_line(err)))
            self.client = None

    log_scores = log

    def close(self, error: BaseException | None = None) -> None:
        """End the run: FINISHED, KILLED (preempted, interrupted) or FAILED; after training (afterwards),
        only a run started here."""
        from mlflow.exceptions import MlflowException

        if self.client is None or (self.afterwards and not self.started):
            return
        killed = isinstance(error, (Preempted, KeyboardInterrupt))
        status = "FINISHED" if error is None else "KILLED" if killed else "FAILED"
        printed = io.StringIO()
        try:
            with redirect_stdout(printed):  # MLflow prints a server's run address, credentials included
                self.client.set_terminated(self.run_id, status)
        except MlflowException as err:
            log.warning("could not mark MLflow run %s %s: %s", self.run_id, status, redact(first_line(err)))
        sys.stdout.write(redact(printed.getvalue()))


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """{"optim.lr": "0.001", ...}: strings as they are, other values as JSON (null, true, [1, 2])."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return flat


def clip(text: str, limit: int) -> str:
    """text cut to `limit` characters, ending in ... when cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def redact(text: str) -> str:
    """text with the user:password@ of every URL in it replaced by ***@."""
    return re.sub(r"(?<=//)[^/@\s]+@", "***@", text)


def first_line(error: Exception) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
