"""Trackers: wandb and tensorboard get what metrics.jsonl gets, rank 0 only, never the API key.

Every test runs offline (WANDB_MODE=offline or disabled, or a stand-in wandb module): no network.
"""

import json
import math
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

from {{ cookiecutter.package_name }}.metrics import read_metrics
from {{ cookiecutter.package_name }}.train import main

from conftest import torchrun

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # the shape of a wandb API key


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
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            id = kwargs["id"]

            def log(self, metrics, step):
                fake.logged.append({"step": step, **metrics})

            def finish(self):
                fake.finished += 1

        return Run()


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
