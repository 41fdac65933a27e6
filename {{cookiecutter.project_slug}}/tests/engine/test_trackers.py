"""Trackers: wandb, tensorboard and mlflow get what metrics.jsonl gets, rank 0 only, never a secret.

Every test runs offline (WANDB_MODE=offline or disabled, or a stand-in wandb module; MLflow stores in
SQLite files under tmp_path, read back with MlflowClient): no network.
"""

import json
import math
import socket
import sys
import time
import types
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from {{ cookiecutter.package_name }}.engine.config import TrackerConfig
from {{ cookiecutter.package_name }}.engine.errors import Preempted
from {{ cookiecutter.package_name }}.engine.metrics import MetricsLogger
from {{ cookiecutter.package_name }}.engine.trackers import log_scores
from {{ cookiecutter.package_name }}.train import main

from conftest import killed_when, read_metrics, torchrun

pytestmark = pytest.mark.core  # task-independent: the template runs it in one task's bake

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # the shape of a wandb API key
SECRET = "s3cret-pa55word"  # a password that must never reach a store, a file or the terminal
SCORES = {"eval/hellaswag/acc_norm": 0.25, "eval/hellaswag/acc_norm_stderr": 0.01}  # evaluate's, afterwards


@pytest.fixture
def offline(monkeypatch):
    """wandb runs offline with an API key in the environment, as on a user's machine."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_SILENT", "true")


class FakeWandb(types.ModuleType):
    """Records what the project hands to wandb.init and run.log."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.summaries, self.finished, self.step = [], [], [], 0, 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            id = kwargs["id"]
            step = fake.step  # the step the run's history is at
            summary = types.SimpleNamespace(update=fake.summaries.append)

            def log(self, metrics, step):
                fake.logged.append({"step": step, **metrics})

            def finish(self):
                fake.finished += 1

        return Run()


@pytest.mark.slow
def test_wandb_gets_the_resolved_config_and_every_logged_scalar(tiny, run_dir, monkeypatch):
    """wandb.init receives the config as config.yaml holds it (and run_info.json's record of that start),
    and every metrics.jsonl value at its step."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = [*tiny, "tracker.name=wandb", "tracker.project=proj", "tracker.entity=team", "tracker.tags=[a,b]"]
    assert main([*args, "trainer.max_steps=4"]) == 0
    assert main([*args, "trainer.max_steps=6"]) == 0  # resumes the same run

    first, resumed = fake.inits
    assert first["id"] == resumed["id"] == (run_dir / "wandb_run_id").read_text()
    assert first["resume"] == "allow" and first["mode"] == "offline"
    assert (first["project"], first["entity"], first["tags"]) == ("proj", "team", ["a", "b"])
    assert first["name"] == run_dir.name
    runs = json.loads((run_dir / "run_info.json").read_text())["runs"]  # provenance, beside the config
    assert (first["config"].pop("run_info"), resumed["config"].pop("run_info")) == tuple(runs)
    assert first["config"] == yaml.safe_load((run_dir / "config.yaml").read_text()) | {
        "trainer": first["config"]["trainer"]  # max_steps differs between the two runs
    }
    assert resumed["config"]["trainer"]["max_steps"] == 6
    records = [{k: v for k, v in r.items() if k != "epoch"} for r in read_metrics(run_dir)]
    assert fake.logged == records and fake.finished == 2
    assert any("perf/data_wait" in r for r in records)


@pytest.mark.slow
def test_a_fresh_start_in_the_same_directory_is_a_new_wandb_run(tiny, run_dir, monkeypatch):
    """trainer.resume=never in a used directory starts a new wandb run instead of appending to the old one."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main([*tiny, "tracker.name=wandb", "trainer.max_steps=2"]) == 0
    assert main([*tiny, "tracker.name=wandb", "trainer.max_steps=2", "trainer.resume=never"]) == 0
    first, second = (init["id"] for init in fake.inits)
    assert first != second and (run_dir / "wandb_run_id").read_text() == second
    assert (run_dir / "wandb_run_id.superseded").read_text() == first


@pytest.mark.slow
def test_wandb_offline_run_continues_after_resume_and_never_stores_the_api_key(tiny, run_dir, offline):
    """A resumed run logs into the same offline wandb run, and no file of the run holds the API key."""
    assert main([*tiny, "tracker.name=wandb", "tracker.tags=[baseline]", "trainer.max_steps=2"]) == 0
    time.sleep(1.1)  # wandb names an offline run's folder by the second it starts: two starts, two folders
    assert main([*tiny, "tracker.name=wandb", "tracker.tags=[baseline]", "trainer.max_steps=4"]) == 0

    run_id = (run_dir / "wandb_run_id").read_text()
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2, runs  # one per start, both the same wandb run
    data = b"".join((run / f"run-{run_id}.wandb").read_bytes() for run in runs)
    missing = [t for t in (b"train/loss", b"perf/samples_per_s", b"baseline", b"batch_size") if t not in data]
    assert not missing, f"not in wandb's record files: {missing}"  # metrics, tags and the config
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert not leaked, leaked


@pytest.mark.slow
def test_wandb_disabled_mode_trains_without_a_wandb_run(tiny, run_dir, offline, monkeypatch):
    """WANDB_MODE=disabled turns wandb off and training goes on, with metrics.jsonl as always."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert main([*tiny, "tracker.name=wandb", "trainer.max_steps=2"]) == 0
    assert not list((run_dir / "wandb").glob("*run-*"))
    assert read_metrics(run_dir)


def test_bad_wandb_mode_is_a_clear_error(tiny, monkeypatch, capsys):
    """An unknown WANDB_MODE exits 2 and names the allowed modes."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offfline")
    assert main([*tiny, "tracker.name=wandb"]) == 2
    assert "WANDB_MODE='offfline' is not one of online, offline, disabled" in capsys.readouterr().err


def test_api_key_in_the_config_is_refused_without_echoing_it(tiny, capsys):
    """tracker.api_key=... exits 2, says where the key belongs, and does not print it."""
    assert main([*tiny, "tracker.name=wandb", f"tracker.api_key={FAKE_KEY}"]) == 2
    err = capsys.readouterr().err
    assert "WANDB_API_KEY" in err and FAKE_KEY not in err


@pytest.mark.slow
def test_tensorboard_logs_the_same_scalars_as_metrics_jsonl(tiny, run_dir):
    """tracker.name=tensorboard writes every metrics.jsonl value under the same name and step."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main([*tiny, "tracker.name=tensorboard"]) == 0
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    expected = {
        (key, r["step"]): value
        for r in read_metrics(run_dir)
        for key, value in r.items()
        if key not in ("step", "epoch")
    }
    assert logged.keys() == expected.keys()
    assert all(math.isclose(logged[k], v, rel_tol=1e-6, abs_tol=1e-9) for k, v in expected.items())


@pytest.mark.slow
def test_only_rank_0_reports_to_wandb(tiny, run_dir, offline):
    """Under torchrun with 2 processes, one wandb run is created, by rank 0."""
    torchrun(2, [*tiny, "tracker.name=wandb", "trainer.max_steps=2"])
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert Path(run_dir / "wandb_run_id").read_text()


@pytest.fixture
def mlflow_client():
    """MlflowClient, to read a store back (skips without mlflow, or without the SQLite store's sqlalchemy)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow import MlflowClient

    return MlflowClient


def local_store(output_dir: Path) -> str:
    """The tracking URI of the MLflow store a run keeps in its output directory."""
    return f"sqlite:///{(output_dir / 'mlruns' / 'mlflow.db').as_posix()}"


def flat(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys, strings as they are, other values as JSON."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value if isinstance(value, str) else json.dumps(value)
    return out


def mlflow_values(client, run_id: str) -> dict[tuple[str, int], set[float]]:
    """{(metric, step): every value MLflow holds for it}."""
    values = defaultdict(set)
    for key in client.get_run(run_id).data.metrics:
        for point in client.get_metric_history(run_id, key):
            values[key, point.step].add(point.value)
    return values


@pytest.mark.slow
def test_mlflow_gets_every_logged_value_and_the_config_and_a_resume_continues_its_run(
    tiny, run_dir, tmp_path, mlflow_client, monkeypatch
):
    """Killed after the step-3 checkpoint and resumed, training logs into one MLflow run in
    output_dir/mlruns/: every metrics.jsonl value at its step (steps after the checkpoint twice, the
    same values), the resolved config as params, tracker.tags as tags, each start's run_info record,
    and nothing from the environment."""
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)  # credentials for a server: never stored
    args = [*tiny, "tracker.name=mlflow", "tracker.project=proj", "tracker.tags=[baseline,team=vision]",
            "trainer.checkpoint_every=3"]  # fmt: skip
    killed_when(lambda metrics, step: step >= 6, args)
    run_id = (run_dir / "mlflow_run_id").read_text()
    assert main(args) == 0
    assert (run_dir / "mlflow_run_id").read_text() == run_id

    client = mlflow_client(local_store(run_dir))
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert (run.info.run_id, run.info.status, run.info.run_name) == (run_id, "FINISHED", run_dir.name)
    assert {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")} == {"baseline": "", "team": "vision"}
    assert run.data.params == flat(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert run.data.params["trainer.checkpoint_every"] == "3"
    assert run.data.params["tracker.tags"] == '["baseline", "team=vision"]'

    logged = mlflow_values(client, run_id)
    expected = {(k, r["step"]): v for r in read_metrics(run_dir) for k, v in r.items() if k not in ("step", "epoch")}
    assert logged.keys() == expected.keys()
    assert all(expected[key] in logged[key] for key in expected)
    assert all(logged[key] == {value} for key, value in expected.items() if not key[0].startswith("perf/"))
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [2, 4, 4, 6]  # 4 logged again

    assert run.info.artifact_uri.startswith((run_dir / "mlruns").resolve().as_uri())
    downloaded = Path(client.download_artifacts(run_id, "run_info", str(tmp_path)))
    starts = [json.loads(path.read_text()) for path in sorted(downloaded.iterdir())]
    assert starts == json.loads((run_dir / "run_info.json").read_text())["runs"]
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked


@pytest.mark.slow
def test_mlflow_tracking_uri_is_honoured_and_a_run_it_lacks_starts_anew(
    tiny, run_dir, tmp_path, mlflow_client, monkeypatch, caplog
):
    """MLFLOW_TRACKING_URI replaces the local store; resuming into a store without the run's MLflow run
    starts a new one there and says so."""
    monkeypatch.chdir(tmp_path)  # MLflow keeps the artifacts of a SQLite store it did not create in ./mlruns
    assert main([*tiny, "tracker.name=mlflow", "trainer.max_steps=2"]) == 0
    local_id = (run_dir / "mlflow_run_id").read_text()
    elsewhere = f"sqlite:///{(tmp_path / 'shared.db').as_posix()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    assert main([*tiny, "tracker.name=mlflow", "trainer.max_steps=4"]) == 0

    new_id = (run_dir / "mlflow_run_id").read_text()
    assert new_id != local_id and f"MLflow run {local_id} is not in {elsewhere}" in caplog.text
    shared, local = mlflow_client(elsewhere), mlflow_client(local_store(run_dir))
    assert shared.get_run(new_id).info.status == "FINISHED"
    assert [m.step for m in shared.get_metric_history(new_id, "train/loss")] == [4]  # resumed from step 2
    assert [m.step for m in local.get_metric_history(local_id, "train/loss")] == [2]


def test_mlflow_run_status_says_how_training_ended_and_non_finite_values_stay_out(
    tmp_path, mlflow_client, monkeypatch, capsys
):
    """A run ends KILLED when preempted, FAILED on an error, FINISHED otherwise (scores evaluate adds afterwards
    leave the status as it is); NaN, infinities and None
    (null in metrics.jsonl) are not logged, a param over MLflow's length limit is cut, and the run address
    MLflow prints for a server has its credentials masked."""
    config = {"data": {"root": "x" * 7000}, "optim": {"lr": 0.1}}
    first = MetricsLogger(tmp_path, TrackerConfig(name="mlflow"), config)
    first.log({"train/loss": math.nan, "train/grad_norm": math.inf, "val/acc": None, "train/lr": 0.1}, 1, 0)
    first.close(Preempted("stopped by SIGTERM after step 1"))
    client = mlflow_client(local_store(tmp_path))
    run_id = (tmp_path / "mlflow_run_id").read_text()
    assert client.get_run(run_id).info.status == "KILLED"

    resumed = MetricsLogger(tmp_path, TrackerConfig(name="mlflow"), config)
    assert client.get_run(run_id).info.status == "RUNNING"
    resumed.close(RuntimeError("CUDA out of memory"))
    assert client.get_run(run_id).info.status == "FAILED"
    log_scores(tmp_path, TrackerConfig(name="mlflow"), SCORES, 1)  # evaluate's, afterwards: the status stays
    assert client.get_run(run_id).info.status == "FAILED"
    assert {key: value for (key, step), value in mlflow_values(client, run_id).items() if step == 1} == {
        "train/lr": {0.1},
        **{key: {value} for key, value in SCORES.items()},
    }

    real = mlflow_client.set_terminated

    def printing_an_address(self, run_id, status=None):  # as MLflow does for a tracking server
        print(f"View run at: http://alice:{SECRET}@mlflow.example/#/experiments/1/runs/{run_id}")
        real(self, run_id, status)

    monkeypatch.setattr(mlflow_client, "set_terminated", printing_an_address)
    MetricsLogger(tmp_path, TrackerConfig(name="mlflow"), config).close()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics == {"train/lr": 0.1, **SCORES}
    assert read_metrics(tmp_path)[0]["train/loss"] is None
    assert run.data.params == {"data.root": "x" * 5997 + "...", "optim.lr": "0.1"}
    out = capsys.readouterr().out
    assert "View run at: http://***@mlflow.example/" in out and SECRET not in out


@pytest.mark.slow
def test_scores_after_training_for_a_directory_without_an_mlflow_run_make_a_finished_one(tmp_path, mlflow_client):
    """log_scores (evaluate's) in a directory that trained without MLflow starts a run, holding the scores at
    the checkpoint's step, and finishes it."""
    log_scores(tmp_path, TrackerConfig(name="mlflow"), SCORES, 3)
    run = mlflow_client(local_store(tmp_path)).get_run((tmp_path / "mlflow_run_id").read_text())
    assert run.info.status == "FINISHED" and run.data.metrics == SCORES
    assert mlflow_values(mlflow_client(local_store(tmp_path)), run.info.run_id).keys() == {(k, 3) for k in SCORES}


def test_scores_after_training_join_the_run_s_tensorboard_and_wandb_runs(tmp_path, monkeypatch):
    """log_scores writes TensorBoard scalars at the checkpoint's step; for wandb it resumes the run
    wandb_run_id names and puts the scores in its summary, and in its history unless that has passed the step
    (wandb drops a step it has passed); tracker.name=none writes nothing."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_scores(tmp_path, TrackerConfig(name="none"), SCORES, 8)
    assert not any(tmp_path.iterdir())
    log_scores(tmp_path, TrackerConfig(name="tensorboard"), SCORES, 8)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert logged.keys() == {(key, 8) for key in SCORES}
    assert all(math.isclose(logged[key, 8], value, rel_tol=1e-6) for key, value in SCORES.items())

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (tmp_path / "wandb_run_id").write_text("trainedrun")
    for history_step in (20, 3):  # evaluated after training went on to step 20; evaluated where it stopped
        fake.step = history_step
        log_scores(tmp_path, TrackerConfig(name="wandb"), SCORES, 8)
    assert [init["id"] for init in fake.inits] == ["trainedrun"] * 2 and fake.finished == 2
    assert fake.summaries == [SCORES] * 2 and fake.logged == [{"step": 8, **SCORES}]


def test_mlflow_failing_during_training_is_one_warning_and_training_goes_on(
    tmp_path, mlflow_client, monkeypatch, caplog
):
    """When the server goes away mid-run, one warning (credentials masked) says so, MLflow is left alone
    from then on, and metrics.jsonl gets every line."""
    from mlflow.exceptions import MlflowException

    logger = MetricsLogger(tmp_path, TrackerConfig(name="mlflow"), {})

    def unreachable(*args, **kwargs):
        raise MlflowException(f"API request to http://alice:{SECRET}@mlflow.example/api failed")

    monkeypatch.setattr(mlflow_client, "log_batch", unreachable)
    monkeypatch.setattr(mlflow_client, "set_terminated", unreachable)
    logger.log({"train/loss": 1.0}, 2, 0)
    logger.log({"train/loss": 0.5}, 4, 0)
    logger.close()
    assert [r["train/loss"] for r in read_metrics(tmp_path)] == [1.0, 0.5]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "http://***@mlflow.example" in warned[0] and SECRET not in caplog.text


def test_unreachable_mlflow_server_exits_2_in_one_line_without_its_password(tiny, monkeypatch, capsys):
    """An MLflow server nobody answers at stops training before it starts, naming it with its password masked."""
    pytest.importorskip("mlflow")
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{SECRET}@127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    assert main([*tiny, "tracker.name=mlflow"]) == 2
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: tracker.name=mlflow could not start a run in http://***@127.0.0.1:{port}")
    assert SECRET not in out + err


@pytest.mark.parametrize(
    ("missing", "says"),
    [
        ("mlflow", ["tracker.name=mlflow needs the mlflow-skinny package: pip install mlflow-skinny"]),
        ("sqlalchemy", ["tracker.name=mlflow could not open the store at", "pip install sqlalchemy alembic"]),
    ],
)
def test_mlflow_without_its_packages_is_a_clear_error(missing, says, tiny, monkeypatch, capsys):
    """Without mlflow, or the sqlalchemy its local SQLite store needs, training exits 2 saying what to install."""
    pytest.importorskip("mlflow")
    monkeypatch.setitem(sys.modules, missing, None)
    monkeypatch.delitem(sys.modules, "mlflow.store.tracking.sqlalchemy_store", raising=False)  # imported again
    assert main([*tiny, "tracker.name=mlflow"]) == 2
    err = capsys.readouterr().err
    assert all(part in err for part in says), err


@pytest.mark.slow
def test_only_rank_0_reports_to_mlflow(tiny, run_dir, mlflow_client):
    """Under torchrun with 2 processes, one MLflow run is created, by rank 0, and each step is logged once."""
    torchrun(2, [*tiny, "tracker.name=mlflow", "trainer.max_steps=2"])
    client = mlflow_client(local_store(run_dir))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [(run_dir / "mlflow_run_id").read_text()]
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")] == [2]
