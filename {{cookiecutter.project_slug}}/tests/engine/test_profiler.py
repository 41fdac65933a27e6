"""trainer.profile_steps: a trace of exactly the chosen optimizer steps, in the Chrome trace-event JSON
that Perfetto and chrome://tracing read, and nothing when off."""

import json
import re

import pytest

from {{ cookiecutter.package_name }}.engine.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.train import main

# The first test (a trace of the task's own model) runs in every task's bake; the rest are the same for every task.
CORE = pytest.mark.core


def profiled_steps(trace: dict) -> list[int]:
    """The optimizer steps a trace has a ProfilerStep#N span for."""
    steps = {int(m[1]) for e in trace["traceEvents"] if (m := re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", "")))}
    return sorted(steps)


def assert_trace_event_format(trace: dict) -> None:
    """What Perfetto's JSON importer needs: a traceEvents list of events with a phase, and complete
    ("X") events with a name, process, thread, start and duration in microseconds."""
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    assert all(isinstance(e, dict) and isinstance(e.get("ph"), str) for e in events)
    spans = [e for e in events if e["ph"] == "X"]
    assert spans
    for e in spans:
        assert isinstance(e["name"], str) and {"pid", "tid"} <= e.keys()
        assert isinstance(e["ts"], int | float) and isinstance(e["dur"], int | float) and e["dur"] >= 0


@pytest.mark.slow
def test_profile_steps_writes_a_perfetto_trace_of_exactly_those_steps(tiny, run_dir):
    """trainer.profile_steps=[2,3] records optimizer steps 2 and 3 only: operators with their input
    shapes and memory events, in a valid trace-event file; validation and the rest run as usual."""
    assert main([*tiny, "trainer.profile_steps=[2,3]"]) == 0
    files = sorted(p.name for p in (run_dir / "profile").iterdir())
    assert files == ["rank0.json"]
    trace = json.loads((run_dir / "profile" / "rank0.json").read_text())
    assert_trace_event_format(trace)
    assert profiled_steps(trace) == [2, 3]
    ops = [e for e in trace["traceEvents"] if e.get("name", "").startswith("aten::")]
    assert any(e.get("args", {}).get("Input Dims") for e in ops), "operator input shapes not recorded"
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"]), "memory events not recorded"


@pytest.mark.slow
@CORE
def test_a_run_that_ends_inside_the_window_writes_what_it_recorded(tiny, run_dir):
    """A window past the end of training: the steps that ran are written when the run ends."""
    assert main([*tiny, "trainer.max_steps=3", "trainer.profile_steps=[3,10]"]) == 0
    assert profiled_steps(json.loads((run_dir / "profile" / "rank0.json").read_text())) == [3]


@pytest.mark.slow
@CORE
def test_without_profile_steps_nothing_is_profiled(tiny, run_dir):
    assert main([*tiny, "trainer.max_steps=2"]) == 0
    assert not (run_dir / "profile").exists()


@CORE
@pytest.mark.parametrize("steps", ["[3]", "[0,2]", "[5,4]", "[1,2,3]"])
def test_profile_steps_must_be_a_window_of_optimizer_steps(steps, tiny):
    with pytest.raises(ConfigError, match=r"trainer.profile_steps=.* must be two optimizer steps \[a, b\]"):
        load_config(SPEC, [], [*tiny, f"trainer.profile_steps={steps}"])
