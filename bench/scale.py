"""Scale figures of the generated language-model project on 2 CPU processes (FSDP2, gloo).

    python bench/scale.py --project PATH --package PKG    # a task=language-model bake
    python bench/scale.py ... --quick                     # a small model: a correctness check

Each measurement is a fresh `torchrun --nproc_per_node=2` of the project's own training command
(so peak memory is that of the measured phase, not of an earlier one), with this file as a driver
that wraps the project's functions to time them and sample rank 0's resident memory:

1. checkpoint saves, trainer.checkpoint_format=full against sharded: rank 0's peak extra resident
   memory during a save (the highest RSS while save() runs minus the RSS just before it), and
   the time training is blocked in save(); the rank's own share of the state (its shards of the
   weights and both Adam moments) for scale;
2. trainer.async_checkpoint=true against a synchronous sharded save: the time training is blocked
   in save() (the stall; the median of the saves at steps 2, 4 and 6, and the first one alone,
   which also allocates the host buffers the later ones reuse), and the median step time;
3. model construction under FSDP: built on the meta device and sharded before any weight exists
   (the project's way) against built whole on each process and then sharded (the old way): each
   rank's peak resident memory while building, above what it held before.

The model is the GPT at GPT-2 medium's shape (24 blocks, width 1024, 16 heads) with the byte-level
vocabulary (257) and 64-token windows: about 302M parameters, 3.6 GB of fp32 weights and Adam
moments together. Prints one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = ["model.arch=gpt2", "model.n_layer=24", "model.d_model=1024", "model.n_head=16"]
QUICK_MODEL = ["model.arch=gpt2", "model.n_layer=4", "model.d_model=256", "model.n_head=4"]
COMMON = [
    "run.device=cpu",
    "run.cache_cpu_memory=false",  # freed memory goes back: RSS shows each phase's own
    "data.seq_len=64",
    "data.batch_size=1",
    "data.train_tokens=20000",
    "data.val_tokens=200",
    "data.num_workers=0",
    "trainer.max_epochs=1",
    "trainer.val_every=null",
    "trainer.log_every=1",
    "trainer.keep_last=1",
    "tracker.name=none",
    "distributed.strategy=fsdp",
    "distributed.timeout_s=1800",
]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples this process's resident memory every millisecond while active."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()

    def __enter__(self):
        self.before = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def drive(mode: str, package: str, out: Path, argv: list[str]) -> int:
    """Under torchrun: the project's training command with timing and memory wrappers."""
    import importlib

    distributed = importlib.import_module(f"{package}.engine.parallel.distributed")
    state_module = importlib.import_module(f"{package}.engine.state")
    loop = importlib.import_module(f"{package}.engine.loop")  # the outer loop calls train_step
    train = importlib.import_module(f"{package}.train")
    rank = int(os.environ["RANK"])
    found: dict = {"saves": [], "steps": []}

    if mode == "build":
        real_build = distributed.build_model

        def measured_build(task, env, dcfg, precision, recompute_activations=False):
            with PeakRss() as rss:
                if os.environ.get("BUILD") == "eager":  # whole on every rank, then sharded
                    model = distributed.shard_model(task.build_model(env.device), env, precision)
                else:
                    model = real_build(task, env, dcfg, precision, recompute_activations)
            found["build_peak_extra"] = rss.peak - rss.before
            found["params"] = sum(p.numel() for p in model.parameters())
            found["local_params"] = sum(p.to_local().numel() for p in model.parameters())
            raise SystemExit(0)  # the build is all this mode measures

        distributed.build_model = measured_build
    else:
        real_save, real_step = state_module.TrainState.save, loop.train_step

        def measured_save(self, checkpoints, config, tcfg, wait=False):
            with PeakRss() as rss:
                started = time.perf_counter()
                real_save(self, checkpoints, config, tcfg, wait)
                blocked = time.perf_counter() - started
            local = sum(p.to_local().numel() * p.element_size() for p in self.model.parameters())
            found["share_bytes"] = 3 * local  # weights + Adam's two moments, this rank's shards
            found["saves"].append(
                {
                    "step": self.progress.step,
                    "wait": wait,
                    "blocked_s": blocked,
                    "extra_bytes": rss.peak - rss.before,
                }
            )

        def measured_step(*args, **kwargs):
            started = time.perf_counter()
            result = real_step(*args, **kwargs)
            found["steps"].append({"seconds": time.perf_counter() - started})
            return result

        state_module.TrainState.save = measured_save
        loop.train_step = measured_step
    try:
        code = train.main(argv)
    except SystemExit as stop:
        code = stop.code or 0
    if rank == 0:
        out.write_text(json.dumps(found))
    return code


def torchrun(project: Path, package: str, mode: str, args: list[str], work: Path, **env) -> dict:
    out = work / f"{mode}-{env.get('BUILD', '')}-{len(list(work.iterdir()))}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [__file__, "--drive", mode, "--package", package, "--out", str(out), "--", *args]
    environment = {**os.environ, "PYTHONPATH": str(project / "src"), "OMP_NUM_THREADS": "1", **env}
    done = subprocess.run(
        command, cwd=project, env=environment, capture_output=True, text=True, timeout=3600
    )
    if done.returncode != 0 or not out.exists():
        raise SystemExit(
            f"{mode} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def measure(project: Path, package: str, quick: bool) -> dict:
    model = QUICK_MODEL if quick else MODEL
    figures: dict = {"model": " ".join(model), "processes": 2}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as scratch:
        work = Path(scratch)
        for build in ("meta", "eager"):
            args = [*COMMON, *model, f"run.output_dir={work / build}"]
            found = torchrun(project, package, "build", args, work, BUILD=build)
            figures[f"build_peak_extra_gb/{build}"] = found["build_peak_extra"] / 1e9
            figures["params"] = found["params"]
        steps = ["trainer.max_steps=7", "trainer.checkpoint_every=2"]  # saves at 2, 4, 6 and 7
        for name, options in {
            "full": ["trainer.checkpoint_format=full"],
            "sharded": ["trainer.checkpoint_format=sharded"],
            "async": ["trainer.checkpoint_format=sharded", "trainer.async_checkpoint=true"],
        }.items():
            args = [*COMMON, *model, *steps, *options, f"run.output_dir={work / name}"]
            found = torchrun(project, package, "save", args, work)
            mid = [save for save in found["saves"] if not save["wait"]]  # not the final save
            figures["share_gb"] = found["share_bytes"] / 1e9
            figures[f"save_extra_gb/{name}"] = max(save["extra_bytes"] for save in mid) / 1e9
            blocked = sorted(save["blocked_s"] for save in mid)
            figures[f"save_blocked_s/{name}"] = blocked[len(blocked) // 2]  # the median
            figures[f"save_blocked_s/{name}_first"] = mid[0]["blocked_s"]
            figures[f"step_s/{name}"] = sorted(step["seconds"] for step in found["steps"])[
                len(found["steps"]) // 2
            ]
    figures["ratio/save_extra_over_share/sharded"] = (
        figures["save_extra_gb/sharded"] / figures["share_gb"]
    )
    figures["ratio/save_extra_over_share/full"] = (
        figures["save_extra_gb/full"] / figures["share_gb"]
    )
    figures["ratio/async_stall_over_sync"] = (
        figures["save_blocked_s/async"] / figures["save_blocked_s/sharded"]
    )
    figures["ratio/build_peak_meta_over_eager"] = (
        figures["build_peak_extra_gb/meta"] / figures["build_peak_extra_gb/eager"]
    )
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path)
    parser.add_argument("--package", default="my_trainer")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--drive")
    parser.add_argument("--out", type=Path)
    args, rest = parser.parse_known_args()
    if args.drive:
        return drive(args.drive, args.package, args.out, [a for a in rest if a != "--"])
    if args.project is None:
        parser.error("--project: a task=language-model bake")
    print(json.dumps(measure(args.project.resolve(), args.package, args.quick)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
