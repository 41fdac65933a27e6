"""The training core under a launcher, for any task: gradients all-reduced once per optimizer step."""

import json
from pathlib import Path

from {{ cookiecutter.package_name }}.config import load_config

from conftest import torchrun

COUNT_SYNCS = """
import json, os, sys
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from {{ cookiecutter.package_name }} import distributed, train

syncs, wrap_model = [], distributed.wrap_model

def counting_hook(state, bucket):
    syncs.append(bucket.is_last())  # one True per gradient all-reduce of the whole model
    return allreduce_hook(state, bucket)

def wrap_and_count(model, cfg, env):
    wrapped = wrap_model(model, cfg, env)
    wrapped.register_comm_hook(None, counting_hook)
    return wrapped

distributed.wrap_model = wrap_and_count
code = train.main(sys.argv[1:])
with open(os.environ["SYNC_COUNTS"] + os.environ["RANK"], "w") as f:
    json.dump(sum(syncs), f)
sys.exit(code)
"""


def test_accumulation_all_reduces_once_per_optimizer_step(tiny, tmp_path):
    """With 2 micro-batches per step under DDP, gradients are all-reduced 3 times in 3 steps, not 6
    (half the tiny batch per micro-batch, so each process's global batch matches the tiny run's)."""
    script = tmp_path / "count_syncs.py"
    script.write_text(COUNT_SYNCS)
    counts = tmp_path / "syncs-rank"
    torchrun(
        2,
        [
            *tiny,
            "trainer.grad_accum_steps=2",
            "trainer.max_steps=3",
            "trainer.max_epochs=3",
            f"data.batch_size={load_config([], tiny).data.batch_size // 2}",
            f"run.output_dir={tmp_path / 'run'}",
        ],
        script=[str(script)],
        SYNC_COUNTS=str(counts),
    )
    assert [json.loads(Path(f"{counts}{rank}").read_text()) for rank in (0, 1)] == [3, 3]
