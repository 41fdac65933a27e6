"""Models that do not fit on one device: built on the meta device and sharded before any weight
exists, HSDP's 2-D layout, and checkpoints that move between layouts."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint, list_checkpoints, weights_metadata
from {{ cookiecutter.package_name }}.engine.config import load_config
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.task.task import Task
from {{ cookiecutter.package_name }}.train import main

from conftest import build_and_gather, in_full, read_metrics, torchrun
from tiny import BATCH_INDEPENDENT, VAL_COUNT

BUILD_SHARDED = build_and_gather("""
RECORD["on_meta"], real_build = [], meta_init.build

def build_and_record(*args, **kwargs):
    model, on_meta = real_build(*args, **kwargs)
    RECORD["on_meta"].append(on_meta)
    return model, on_meta

meta_init.build = build_and_record
""")


@pytest.mark.slow
def test_fsdp_builds_on_the_meta_device_and_equals_the_one_process_build(tiny, tmp_path):
    """Under FSDP each process materialises only its shards (together the whole model, once), and
    the gathered weights equal, bit for bit, those one process builds with the same seed."""
    script = tmp_path / "build_sharded.py"
    script.write_text(BUILD_SHARDED)
    weights = tmp_path / "weights.pt"
    torchrun(2, [*tiny, "distributed.strategy=fsdp", "run.seed=7"], script=[str(script)], WEIGHTS=str(weights))
    sharded = torch.load(weights, weights_only=True)

    cfg = load_config(SPEC, [], [*tiny, "run.seed=7"])
    task = Task(cfg, torch.device("cpu"))
    task.datasets()
    whole = task.build_model().state_dict()
    assert sharded.keys() == whole.keys()
    assert [k for k in whole if not torch.equal(sharded[k], whole[k])] == []
    total = sum(p.numel() for p in task.build_model().parameters())
    ranks = [json.loads(Path(f"{weights}.rank{r}.json").read_text()) for r in (0, 1)]
    assert all(rank["on_meta"] == [True] for rank in ranks)
    assert sum(rank["local"] for rank in ranks) == total  # each parameter's elements live on one process
    assert all(rank["local"] < 0.75 * total for rank in ranks)


def test_another_seed_builds_other_weights(tiny):
    """The weights come from run.seed: another seed, other weights (the equality above is not vacuous)."""
    built = []
    for seed in (0, 1):
        task = Task(load_config(SPEC, [], [*tiny, f"run.seed={seed}"]), torch.device("cpu"))
        task.datasets()
        built.append(task.build_model().state_dict())
    differ = [k for k, v in built[0].items() if v.is_floating_point() and v.std() > 0 and torch.equal(v, built[1][k])]
    assert not differ, differ


def distance(a: dict, b: dict) -> float:
    """Euclidean distance between two sets of floating-point weights."""
    return sum(((a[k].double() - b[k].double()) ** 2).sum().item() for k in a if a[k].is_floating_point()) ** 0.5


@pytest.mark.slow
@pytest.mark.core  # the 2-D layout is the core's; both tasks build and shard through it alike
def test_hsdp_on_four_processes_trains_like_one_and_resumes_on_other_layouts(tiny, run_dir, tmp_path):
    """distributed.replicate_degree=2 on 4 CPU processes (2 replicas x 2 shards, recomputing each
    block's activations) trains like 1 process with the same global batch (float rounding apart:
    20x closer than 3 steps move the weights), writes best.safetensors equal to its checkpoint of
    that step, and its checkpoint resumes on 2 FSDP processes and then on 1."""
    cfg = load_config(SPEC, [], [*tiny, *BATCH_INDEPENDENT])
    quarter = cfg.data.batch_size // 4
    common = [*BATCH_INDEPENDENT, "trainer.checkpoint_every=1", "trainer.keep_last=10", "trainer.max_steps=3"]
    one = tmp_path / "one"
    assert main([*tiny, *common, f"run.output_dir={one}"]) == 0
    torchrun(4, [*tiny, *common, f"data.batch_size={quarter}", "distributed.strategy=fsdp",
                 "distributed.replicate_degree=2", "model.activation_checkpointing=true"])  # fmt: skip
    assert [r[VAL_COUNT[0]] for r in read_metrics(run_dir) if VAL_COUNT[0] in r] == [VAL_COUNT[1]]
    hsdp = list_checkpoints(run_dir / "checkpoints")
    assert {p.name.split("_")[2] for p in hsdp[-1].glob("__*.distcp")} == {"0", "1", "2", "3"}

    task = Task(cfg, torch.device("cpu"))
    task.datasets()
    initial = task.build_model().state_dict()
    reference = in_full(latest_checkpoint(one / "checkpoints")[1])["model"]
    moved = distance(initial, reference)  # how far 3 steps take the weights
    hsdp_weights = in_full(latest_checkpoint(run_dir / "checkpoints")[1])["model"]
    assert distance(reference, hsdp_weights) < moved / 20
    best = load_file(str(run_dir / "best.safetensors"))  # gathered one tensor at a time
    assert weights_metadata(run_dir / "best.safetensors")["step"] == "3"  # the one validation, at the end
    assert best.keys() == hsdp_weights.keys()
    assert all(torch.equal(best[k], hsdp_weights[k]) for k in best)

    for later in hsdp[1:]:
        shutil.rmtree(later)  # as if the job died after step 1: resume on 2 FSDP processes, then on 1
    torchrun(2, [*tiny, *common, "trainer.max_steps=2", f"data.batch_size={2 * quarter}",
                 "distributed.strategy=fsdp"])  # fmt: skip
    assert main([*tiny, *common]) == 0
    resumed = in_full(latest_checkpoint(run_dir / "checkpoints")[1])["model"]
    assert distance(reference, resumed) < moved / 20
