"""Benchmark the generated training loop on CPU against raw PyTorch and Lightning.

    python bench/run.py                 # the full run (about 40 minutes on 2 cores), `make bench`
    python bench/run.py --quick         # one short repetition of everything: a correctness check
    python bench/run.py --docs          # also rewrite the results in docs/performance.md + plot
    python bench/run.py --only-lm       # the language model's figures alone (about 4 minutes)
    python bench/run.py --only-scale    # the scale figures (9) alone
    python bench/run.py --only-lm-demo --docs   # the language model's demo alone, into the docs

A timed run exits 1 when a figure misses its target (TARGETS), after a `target missed:` line for
each; --quick checks the benchmark, not the targets. --docs with an --only-* part merges that
part's figures into results/cpu.json (the newest value of each figure) before writing the docs.

It bakes the template's defaults (and, for 8, task=language-model), then measures, each figure
the median of --reps repetitions with the contenders alternating inside every repetition (so
drift in machine load hits all alike):

1. steady-state seconds per optimizer step (each run's median step; the ratio of mean steps too):
   the generated loop, a minimal raw PyTorch loop and Lightning's Trainer, on a tiny MLP
   (overhead-bound) and the default ResNet-18 (compute-bound); on ResNet-18 also the raw loop
   with the generated project's CPU allocator setting (raw_cached); each contender's page faults
   per step; on the MLP also the tensor operations per step, a count that this machine's timing
   noise does not move;
2. seconds from process start to the end of the first optimizer step, same three contenders;
3. DDP with trainer.grad_accum_steps=4 on 2 gloo processes: gradient all-reduce rounds per
   optimizer step and step time, with the sync skipped on the first 3 micro-batches (the
   generated loop) and without skipping;
4. 2 processes vs 1 at one thread each: samples/s;
5. the share of training time spent waiting for data (perf/data_wait) with 2 worker processes;
6. the README's demo (no arguments, 3 epochs): wall time, final val/acc and data wait, with the
   data on the device (data.loader=auto's choice) and with 2 worker processes, in 3 back-to-back
   pairs (full run only);
   and the language model's demo: wall time and final val/loss over its entropy floor (full run);
7. what a GPU would wait on: the training loader at 224x224, the project's uint8 hand-off vs
   per-sample float normalisation in the workers: worker CPU per sample, and normalised images/s
   through 2 workers with the uint8 batches normalised on this CPU;
8. the language model (a second bake, task=language-model; lm.py): steady-state seconds per
   optimizer step of its generated loop vs a minimal raw loop on the same tokens and the same GPT
   (micro preset, batch 32 x 128 tokens), paired as in 1, with tokens/s from the median step and
   from the generated run's own log (perf/tokens_per_s), and tensor operations per step;
9. scale (scale.py): the language model at about 302M parameters on 2 FSDP processes: rank 0's
   peak extra memory during a full vs a sharded checkpoint save, against the rank's own share of
   the state; the training stall of an asynchronous save vs a synchronous one; each rank's peak
   memory building the model on the meta device vs whole;
10. prepare (prepare.py): MB of text per second tokenized and written, a plain single-process loop
   vs prepare with 1 and 2 workers, with the bytes tokenizer and a BPE tokenizer.json (full run,
   --quick with 1 MB, --only-prepare alone);
11. nanoGPT (nanogpt.py; full run or --only-nanogpt, with --nanogpt DIR or a fresh clone): the
   final validation loss and median step time of this project and of nanoGPT's train.py at
   nanoGPT's CPU character-level recipe, on the same text and split;
12. transformers' Llama (hf_llama.py; --only-hf-llama alone; --quick: 2 steps, once): seconds
   per training step and the peak memory the steps add, this project's llama vs
   LlamaForCausalLM at the same shape, weights and tokens (float32, SDPA).

Prints one `name: value` line per figure, then a summary table against the targets; writes
bench/results/cpu.json (or --json FILE).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parent
CONTENDERS = ("generated", "raw", "lightning")
LM_CONTENDERS = ("generated", "raw")
DEMO_PAIRS = 3  # the demo, device vs workers (6): about 2 minutes a pair on 2 cores
LM_TOKENS_PER_STEP = 32 * 128  # the language model's batch x sequence length (lm.BATCH, SEQ_LEN)


def run_checked(command: list[str], cwd: Path, env: dict, timeout: float = 600) -> str:
    """Run a command; return its stdout (stop the benchmark with its stderr if it fails)."""
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def timed_train(
    project: Path, package: str, env: dict, out: Path, overrides: list[str], what: str
) -> tuple[float, str]:
    """Run `python -m PACKAGE.train` into out, start to finish; (wall seconds, its stderr).
    Stop the benchmark with its stderr if it fails."""
    command = [sys.executable, "-m", f"{package}.train", f"run.output_dir={out}", *overrides]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started, done.stderr


def last_json(stdout: str) -> dict:
    """The JSON object a measurement printed last."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"a measurement printed no result:\n{stdout[-2000:]}")
    return json.loads(lines[-1])


def run_json(command: list[str], cwd: Path, env: dict) -> dict:
    """Run a command; return the JSON object it printed last."""
    return last_json(run_checked(command, cwd, env))


def read_records(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class Bench:
    def __init__(
        self,
        project: Path,
        package: str,
        work: Path,
        reps: int,
        quick: bool,
        lm_project: tuple[Path, str] | None = None,
    ):
        self.project, self.package, self.work, self.reps, self.quick = (
            project,
            package,
            work,
            reps,
            quick,
        )
        self.env = {**os.environ, "PYTHONPATH": str(project / "src")}
        # The language-model project (model "lm"): its directory, package and environment.
        self.lm = (
            (lm_project[0], lm_project[1], {**os.environ, "PYTHONPATH": str(lm_project[0] / "src")})
            if lm_project
            else None
        )
        self.figures: dict[str, float] = {}
        self.runs: dict[str, list[float]] = {}  # each run's value behind a median, for the JSON

    def record(self, name: str, value: float) -> None:
        self.figures[name] = value
        print(f"{name}: {value:.6g}", flush=True)

    def contender(self, what, contender, model, rep, warmup, steps, log_every=10, prefix=(), **env):
        """Run contenders.py WHAT in a fresh process (after the command prefix, with env added)."""
        project, package, base = (
            self.lm if model == "lm" else (self.project, self.package, self.env)
        )
        env = {**base, **env}
        out = self.work / f"{what}-{contender}-{model}-{rep}"
        command = [*prefix, sys.executable, str(HERE / "contenders.py"), what]
        command += ["--contender", contender]
        command += ["--model", model, "--package", package, "--output-dir", str(out)]
        command += ["--warmup", str(warmup), "--steps", str(steps), "--log-every", str(log_every)]
        started = time.time()
        result = run_json(command, project, env)
        return result, started, out

    def step_times(self, model: str, warmup: int, steps: int, log_every: int, reps: int) -> None:
        """1 (and 5, from the generated ResNet-18 runs' own log: its window of the timed steps).

        On ResNet-18 a fourth contender, raw_cached, is the raw loop with the generated project's
        CPU allocator setting: generated/raw_cached is what the loop itself costs. The language
        model ("lm") has two, generated and raw, which must also train on the same tokens; its
        tokens/s come from the median step and from the generated runs' own log (8).
        """
        contenders = {"resnet18": (*CONTENDERS, "raw_cached"), "lm": LM_CONTENDERS}.get(
            model, CONTENDERS
        )
        times, means = {c: [] for c in contenders}, {c: [] for c in contenders}
        faults: dict[str, list[float]] = {c: [] for c in contenders}
        waits, params, data, logged = [], {}, {}, []
        for rep in range(reps):
            # Alternate the order (g r l, l r g, ...): generated and raw always run back to back,
            # and neither always goes first.
            for contender in contenders if rep % 2 == 0 else contenders[::-1]:
                result, _, out = self.contender(
                    "steps", contender, model, rep, warmup, steps, log_every
                )
                times[contender].append(result["step_s"])
                means[contender].append(result["mean_step_s"])
                faults[contender].append(result["faults_per_step"])
                params.setdefault(contender, result["params"])
                if "data" in result:
                    data.setdefault(contender, result["data"])
                if contender == "generated" and model == "resnet18":
                    windows = [r for r in read_records(out) if "perf/data_wait" in r]
                    waits.append(windows[-1]["perf/data_wait"])  # the window of the timed steps
                if contender == "generated" and model == "lm":
                    # The log windows wholly inside the timed steps (validation is excluded).
                    windows = [
                        r["perf/tokens_per_s"]
                        for r in read_records(out)
                        if "perf/tokens_per_s" in r and r["step"] - log_every >= warmup
                    ]
                    logged.append(statistics.median(windows))
        if len(set(params.values())) != 1:
            raise SystemExit(f"the contenders train different {model} models: parameters {params}")
        if model == "lm" and (len(data) != len(contenders) or len(set(data.values())) != 1):
            raise SystemExit(f"the contenders train on different tokens: checksums {data}")
        self.record(f"params/{model}", params["raw"])
        medians = {c: statistics.median(v) for c, v in times.items()}
        for contender, value in medians.items():
            self.record(f"step_s/{model}/{contender}", value)
            self.runs[f"step_s/{model}/{contender}"] = times[contender]  # in repetition order
        for contender, values in faults.items():  # memory faulted in again each step
            self.record(f"faults_per_step/{model}/{contender}", statistics.median(values))
        others = [c for c in contenders if c != "generated"]
        for other in others:
            self.record(
                f"ratio/{model}/generated_over_{other}", medians["generated"] / medians[other]
            )
        # Paired: the ratio within each repetition, whose two runs are seconds apart, so a slow
        # spell of the machine that covers both cancels out; median and quartiles over repetitions.
        for other in others:
            paired = [g / o for g, o in zip(times["generated"], times[other], strict=True)]
            quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
            name = f"ratio/{model}/generated_over_{other}_paired"
            self.record(name, statistics.median(paired))
            self.record(f"{name}_q1", quartiles[0])
            self.record(f"{name}_q3", quartiles[2])
        by_mean = {
            c: statistics.median(v) for c, v in means.items()
        }  # log steps and slow spells in
        self.record(
            f"ratio/{model}/generated_over_raw_by_mean_step", by_mean["generated"] / by_mean["raw"]
        )
        if waits:
            self.record("data_wait/resnet18_workers", statistics.median(waits))
        if model == "lm":
            for contender in contenders:  # tokens per optimizer step over the median step
                self.record(f"tokens_per_s/lm/{contender}", LM_TOKENS_PER_STEP / medians[contender])
            self.record("tokens_per_s/lm/generated_logged", statistics.median(logged))
            self.runs["tokens_per_s/lm/generated_logged"] = logged

    def op_counts(self, model: str, warmup: int, steps: int) -> None:
        """1b: tensor operations per optimizer step (a count, so one run each)."""
        counts = {}
        for contender in LM_CONTENDERS if model == "lm" else CONTENDERS:
            result, _, _ = self.contender("ops", contender, model, 0, warmup, steps)
            counts[contender] = result["ops_per_step"]
            self.record(f"ops_per_step/{model}/{contender}", counts[contender])
        self.record(
            f"ops_per_step/{model}/generated_minus_raw", counts["generated"] - counts["raw"]
        )

    def instructions(self, model: str = "mlp", warmup: int = 20, steps: int = 50) -> None:
        """1c: instructions per optimizer step, generated vs raw, counted by callgrind (valgrind) at
        one thread over steps warmup+1 .. warmup+steps: the loop's own work, exactly (two runs of
        the raw loop differed by 0.13%), where the step times move by tens of percent between runs.
        About 2.5 minutes a contender; skipped, with a note, when valgrind is not installed."""
        if not shutil.which("valgrind"):
            print("instructions: skipped (valgrind is not installed)", flush=True)
            return
        counts = {}
        for contender in ("generated", "raw"):
            counted = self.work / f"callgrind-{contender}-{model}.out"
            valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
            valgrind += [f"--callgrind-out-file={counted}"]
            one = {"OMP_NUM_THREADS": "1"}
            self.contender("instructions", contender, model, 0, warmup, steps, 10, valgrind, **one)
            # "totals:" counts every instruction while the count was on ("summary:" stays 0 when
            # the count starts off).
            totals = next(
                line for line in counted.read_text().splitlines() if line.startswith("totals:")
            )
            counts[contender] = int(totals.split()[1]) / steps
            self.record(f"instructions_per_step/{model}/{contender}", counts[contender])
        self.record(f"instructions/{model}/generated_over_raw", counts["generated"] / counts["raw"])

    def language_model(self) -> None:
        """8: the language model's step times, tokens/s and tensor operations, generated vs raw.

        A micro step is about 0.17 s on 2 idle cores: 7 paired repetitions of 10 + 50 steps stay
        under 4 minutes.
        """
        if self.quick:
            self.step_times("lm", warmup=2, steps=4, log_every=2, reps=1)
            self.op_counts("lm", warmup=2, steps=2)
        else:
            self.step_times("lm", warmup=10, steps=50, log_every=10, reps=self.reps + 2)
            self.op_counts("lm", warmup=5, steps=5)

    def lm_script(self, script: str, arguments: list[str], timeout: float) -> dict:
        """Run a bench script on the language-model bake; its figures (its last JSON line)."""
        project, package, env = self.lm
        command = [
            sys.executable,
            str(HERE / script),
            "--project",
            str(project),
            "--package",
            package,
        ]
        command += [*arguments, "--json", str(self.work / f"{Path(script).stem}.json")]
        return last_json(run_checked(command, project, env, timeout=timeout))

    def prepare_throughput(self) -> None:
        """10: the language model's prepare, MB of text per second (prepare.py): a plain loop vs
        prepare with 1 and 2 workers, bytes and a BPE tokenizer.json. --quick: 1 MB, once."""
        quick = ["--mb", "1", "--reps", "1"] if self.quick else ["--reps", str(self.reps)]
        for name, value in self.lm_script("prepare.py", quick, timeout=3600).items():
            self.record(name, value)

    def nanogpt(self, checkout: Path | None) -> None:
        """11: the language model against nanoGPT's train.py at nanoGPT's CPU character-level
        recipe (nanogpt.py): final validation loss and median step time of each."""
        given = ["--nanogpt", str(checkout)] if checkout else []
        for name, value in self.lm_script("nanogpt.py", given, timeout=7200).items():
            if isinstance(value, int | float):
                self.record(name, value)

    def hf_llama(self) -> None:
        """12: this project's llama vs transformers' LlamaForCausalLM, step time and peak memory
        (hf_llama.py). --quick: 2 steps after 1, once (it checks that both compute one model)."""
        quick = ["--steps", "2", "--warmup", "1", "--reps", "1"] if self.quick else []
        for name, value in self.lm_script("hf_llama.py", quick, timeout=3600).items():
            self.record(name, value)

    def scale(self) -> None:
        """9: the language model at about 302M parameters on 2 FSDP processes (scale.py): rank 0's
        extra memory during a full vs a sharded save, the stall of an async save vs a sync one,
        and each rank's peak memory building on the meta device vs whole. --quick: a 3M model."""
        project, package, env = self.lm
        command = [sys.executable, str(HERE / "scale.py"), "--project", str(project)]
        command += ["--package", package, *(["--quick"] if self.quick else [])]
        found = last_json(run_checked(command, project, env, timeout=5400))
        for name, value in found.items():
            if isinstance(value, int | float):
                self.record(f"scale/{name}", value)

    def demo(self) -> None:
        """6: the README's demo: `python -m PACKAGE.train` with no arguments, start to finish, with
        data.loader=auto (it chooses the device for the demo's data) and with data.loader=workers
        (2 worker processes), in DEMO_PAIRS back-to-back pairs whose order alternates (device
        first, then workers first, ...). Two estimates, as in 1: the ratio of the medians, and the
        median of each pair's own ratio (`_paired`), whose two runs are back to back: runs a minute
        or more apart differ here by 5-10%, more than the difference measured.
        An untimed 10-step run goes first: right after the other measurements the first demo run
        trained its first steps at half speed (70 s against 53-58 s for the other three)."""
        walls: dict[str, list[float]] = {"device": [], "workers": []}
        last = {}
        warmup = ["trainer.max_steps=10"]
        timed_train(
            self.project, self.package, self.env, self.work / "demo-warmup", warmup, "warm-up"
        )
        for pair in range(DEMO_PAIRS):
            for loader in ("device", "workers") if pair % 2 == 0 else ("workers", "device"):
                out = self.work / f"demo-{loader}-{pair}"
                overrides = [] if loader == "device" else ["data.loader=workers"]
                wall, stderr = timed_train(
                    self.project, self.package, self.env, out, overrides, "the demo run"
                )
                walls[loader].append(wall)
                if loader == "device" and "data.loader=auto chose device" not in stderr:
                    chose = "data.loader=auto did not choose the device"
                    raise SystemExit(f"{chose}:\n{stderr[-3000:]}")
                last[loader] = read_records(out)
        for loader, suffix in (("device", ""), ("workers", "/workers")):
            self.record(f"demo/wall_s{suffix}", statistics.median(walls[loader]))
            self.runs[f"demo/wall_s{suffix}"] = walls[loader]  # pair by pair
            self.record(
                f"demo/val_acc{suffix}", [r for r in last[loader] if "val/acc" in r][-1]["val/acc"]
            )
            waits = [r["perf/data_wait"] for r in last[loader] if "perf/data_wait" in r]
            self.record(f"demo/data_wait{suffix}", statistics.median(waits))
        self.record(
            "demo/wall_s_device_over_workers",
            self.figures["demo/wall_s"] / self.figures["demo/wall_s/workers"],
        )
        paired = [d / w for d, w in zip(walls["device"], walls["workers"], strict=True)]
        self.record("demo/wall_s_device_over_workers_paired", statistics.median(paired))
        self.runs["demo/wall_s_device_over_workers_paired"] = paired

    def lm_demo(self) -> None:
        """6b: the language model's demo (`python -m PACKAGE.train` with no arguments in the
        task=language-model bake): wall time, and its final val/loss over the synthetic source's
        entropy rate (val/loss_floor, the lowest val/loss any model reaches); every validation must
        count the whole split."""
        project, package, env = self.lm
        out = self.work / "lm-demo"
        wall, _ = timed_train(project, package, env, out, [], "the language model's demo")
        self.record("lm_demo/wall_s", wall)
        vals = [r for r in read_records(out) if "val/loss_floor" in r]
        if len({r["val/tokens"] for r in vals}) != 1:
            raise SystemExit(f"validations counted different numbers of tokens: {vals}")
        self.record("lm_demo/val_loss", vals[-1]["val/loss"])
        self.record(
            "lm_demo/val_loss_over_floor", vals[-1]["val/loss"] / vals[-1]["val/loss_floor"]
        )

    def startup(self) -> None:
        """2: process start to the end of the first optimizer step, default model and data.

        A few seconds per run, of which the overheads compared are a few tenths: more runs.
        """
        times = {c: [] for c in CONTENDERS}
        for rep in range(self.reps if self.quick else 2 * self.reps + 1):
            for contender in CONTENDERS if rep % 2 == 0 else CONTENDERS[::-1]:
                result, started, _ = self.contender("startup", contender, "resnet18", rep, 0, 0)
                times[contender].append(result["first_step_at"] - started)
        medians = {c: statistics.median(v) for c, v in times.items()}
        for contender, value in medians.items():
            self.record(f"startup_s/{contender}", value)
        self.record("startup_overhead_s/generated", medians["generated"] - medians["raw"])
        self.record("startup_overhead_s/lightning", medians["lightning"] - medians["raw"])

    def torchrun(self, nproc: int, script: list[str], overrides: list[str], name: str):
        """Run script under torchrun on CPU into its own output directory; (stdout, directory)."""
        out = self.work / name
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
        ]
        command += [
            *script,
            f"run.output_dir={out}",
            "run.device=cpu",
            "trainer.resume=never",
            *overrides,
        ]
        env = {**self.env, "OMP_NUM_THREADS": "1"}
        return run_checked(command, self.project, env), out

    def ddp_accumulation(self) -> None:
        """3: all-reduce rounds per optimizer step and step time, with and without no_sync."""
        steps = 4 if self.quick else 8
        overrides = [
            "trainer.grad_accum_steps=4",
            "data.batch_size=16",
            f"trainer.max_steps={steps}",
            f"data.train_size={16 * 2 * 4 * (steps + 1)}",
            "data.val_size=64",
            "data.num_workers=0",
        ]
        runs = {"skip_sync": [], "sync_every_micro": []}
        for rep in range(self.reps):
            for variant in runs:
                script = [str(HERE / "ddp_accum.py"), "--package", self.package]
                script += ["--sync-every-micro"] if variant == "sync_every_micro" else []
                stdout, _ = self.torchrun(2, [*script, "--"], overrides, f"ddp-{variant}-{rep}")
                runs[variant].append(last_json(stdout))
        for variant, results in runs.items():
            self.record(
                f"ddp_accum4/{variant}/allreduce_rounds_per_step", results[0]["rounds_per_step"]
            )
            self.record(
                f"ddp_accum4/{variant}/step_s", statistics.median(r["step_s"] for r in results)
            )
        saved = runs["sync_every_micro"], runs["skip_sync"]
        ratio = statistics.median(r["step_s"] for r in saved[0]) / statistics.median(
            r["step_s"] for r in saved[1]
        )
        self.record("ddp_accum4/sync_every_micro_over_skip_sync", ratio)

    def scaling(self) -> None:
        """4: samples/s of 2 processes vs 1, one thread each, the same batch per process."""
        steps = 4 if self.quick else 20
        overrides = [
            "data.batch_size=32",
            f"trainer.max_steps={steps}",
            f"trainer.log_every={steps // 2}",
            "data.num_workers=0",
            "data.val_size=64",
        ]
        speeds = {1: [], 2: []}
        for rep in range(self.reps):
            for nproc in speeds:
                _, out = self.torchrun(
                    nproc, ["-m", f"{self.package}.train"], overrides, f"scale-{nproc}-{rep}"
                )
                windows = [r for r in read_records(out) if "perf/samples_per_s" in r]
                speeds[nproc].append(windows[-1]["perf/samples_per_s"])  # the second, warm window
        for nproc, values in speeds.items():
            self.record(f"samples_per_s/{nproc}_process", statistics.median(values))
        self.record(
            "scaling/2_over_1_process",
            self.figures["samples_per_s/2_process"] / self.figures["samples_per_s/1_process"],
        )

    def input_pipeline(self) -> None:
        """7: the 224x224 training loader, uint8 vs float hand-off: worker CPU and images/s."""
        batches = 4 if self.quick else 20
        runs = {"uint8": [], "float": []}
        for _ in range(self.reps):
            for handoff, results in runs.items():
                command = [sys.executable, str(HERE / "loader.py"), "--package", self.package]
                command += ["--handoff", handoff, "--batches", str(batches)]
                results.append(run_json(command, self.project, self.env))
        for handoff, results in runs.items():
            for key in ("worker_ms_per_sample", "images_per_s"):
                value = statistics.median(r[key] for r in results)
                self.record(f"loader_224px/{handoff}_handoff/{key}", value)
        f = self.figures
        self.record(
            "loader_224px/worker_cpu_float_over_uint8",
            f["loader_224px/float_handoff/worker_ms_per_sample"]
            / f["loader_224px/uint8_handoff/worker_ms_per_sample"],
        )
        self.record(
            "loader_224px/images_per_s_uint8_over_float",
            f["loader_224px/uint8_handoff/images_per_s"]
            / f["loader_224px/float_handoff/images_per_s"],
        )


TARGETS = [
    # (figure, target text, check)
    ("ratio/mlp/generated_over_raw", "<= 1.05", lambda v, f: v <= 1.05),
    ("ratio/mlp/generated_over_raw_paired", "<= 1.05", lambda v, f: v <= 1.05),
    ("ratio/resnet18/generated_over_raw", "<= 1.02", lambda v, f: v <= 1.02),
    ("ratio/resnet18/generated_over_raw_paired", "<= 1.02", lambda v, f: v <= 1.02),
    ("ratio/resnet18/generated_over_raw_cached", "<= 1.02", lambda v, f: v <= 1.02),
    ("ratio/resnet18/generated_over_raw_cached_paired", "<= 1.02", lambda v, f: v <= 1.02),
    ("ratio/lm/generated_over_raw", "<= 1.05", lambda v, f: v <= 1.05),
    ("ratio/lm/generated_over_raw_paired", "<= 1.05", lambda v, f: v <= 1.05),
    ("ratio/mlp/generated_over_lightning", "<= 1", lambda v, f: v <= 1.0),
    ("ratio/resnet18/generated_over_lightning", "<= 1", lambda v, f: v <= 1.0),
    ("ratio/mlp/generated_over_lightning_paired", "<= 1", lambda v, f: v <= 1.0),
    ("ratio/resnet18/generated_over_lightning_paired", "<= 1", lambda v, f: v <= 1.0),
    (
        "startup_overhead_s/generated",
        "<= half of Lightning's",
        lambda v, f: v <= 0.5 * f["startup_overhead_s/lightning"],
    ),
    ("ddp_accum4/skip_sync/allreduce_rounds_per_step", "== 1", lambda v, f: v == 1.0),
    ("data_wait/resnet18_workers", "< 0.05", lambda v, f: v < 0.05),
    ("scale/ratio/save_extra_over_share/sharded", "<= 1.2", lambda v, f: v <= 1.2),
    ("scale/ratio/async_stall_over_sync", "<= 0.1", lambda v, f: v <= 0.1),
    ("scale/ratio/build_peak_meta_over_eager", "< 1", lambda v, f: v < 1),
    ("demo/val_acc", ">= 0.9", lambda v, f: v >= 0.9),
    ("demo/wall_s", "< 180", lambda v, f: v < 180),
    ("demo/wall_s_device_over_workers", "<= 1", lambda v, f: v <= 1.0),
    ("demo/wall_s_device_over_workers_paired", "<= 1", lambda v, f: v <= 1.0),
    # What the READMEs promise of the language model's demo (report.DEMO_QUOTES quotes it).
    ("lm_demo/val_loss_over_floor", "<= 1.065", lambda v, f: v <= 1.065),
    ("lm_demo/wall_s", "<= 180", lambda v, f: v <= 180),
    ("prepare/bytes/workers1_over_plain", ">= 1", lambda v, f: v >= 1.0),
    ("prepare/bpe/workers1_over_plain", ">= 1", lambda v, f: v >= 1.0),
    (
        "nanogpt/ours_val_loss",
        "<= nanoGPT's",
        lambda v, f: v <= f["nanogpt/nanogpt_val_loss"],
    ),
    ("nanogpt/step_time_ratio", "<= 1", lambda v, f: v <= 1.0),
    ("hf_llama/step_time_ratio", "<= 1", lambda v, f: v <= 1.0),
]


def missed(figures: dict[str, float]) -> list[str]:
    """A `target missed:` line for each figure measured that misses its target."""
    return [
        f"target missed: {name} = {figures[name]:.4g}, wanted {text}"
        for name, text, check in TARGETS
        if name in figures and not check(figures[name], figures)
    ]


def merged_into_cpu_results(part: dict) -> dict:
    """results/cpu.json with an --only-* run's figures and runs in it."""
    whole = json.loads((HERE / "results" / "cpu.json").read_text())
    whole["figures"].update(part["figures"])
    whole["runs"].update(part["runs"])
    return whole


def summary(figures: dict[str, float]) -> str:
    """The markdown table of targets, then every figure."""
    lines = ["| figure | value | target | holds |", "|---|---|---|---|"]
    for name, text, check in TARGETS:
        if name in figures:
            value = figures[name]
            lines.append(
                f"| {name} | {value:.4g} | {text} | {'yes' if check(value, figures) else 'NO'} |"
            )
    lines += ["", "| figure | value |", "|---|---|"]
    lines += [f"| {name} | {value:.4g} |" for name, value in figures.items()]
    return "\n".join(lines)


def add_project_options(parser: argparse.ArgumentParser) -> None:
    """--project and --package: a baked task=language-model project (default: bake one)."""
    parser.add_argument(
        "--project", type=Path, help="a baked task=language-model project (default: bake one)"
    )
    parser.add_argument("--package", help="its package name (with --project)")


def command_line(script: str, args: argparse.Namespace) -> str:
    """The command that made a result, without --project/--package: a bake's path is this machine's,
    not the benchmark's."""
    dropped = {"--project", "--package", str(args.project), args.package}
    return " ".join([f"bench/{script}", *(a for a in sys.argv[1:] if a not in dropped)])


def lm_project(args: argparse.Namespace, work: Path) -> tuple[Path, str]:
    """The project --project names, or a fresh task=language-model bake under work."""
    if args.project:
        return args.project, args.package
    return bake(work / "lm", "language-model")


def shallow_clone(url: str, folder: Path, option: str) -> Path:
    """A depth-1 clone of url into folder (a peer run beside the project, never committed); when the
    clone fails, the benchmark stops naming option (its flag for a checkout of one's own)."""
    done = subprocess.run(
        ["git", "clone", "-q", "--depth", "1", url, str(folder)], capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(
            f"cannot clone {url} ({done.stderr.strip()}); pass {option} DIR, a checkout of it"
        )
    return folder


def report(result: dict, path: Path) -> None:
    """Print result["figures"] as name: value lines and write the whole result to path as JSON."""
    for key, value in result["figures"].items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def bake(work: Path, task: str = "image-classification") -> tuple[Path, str]:
    from cookiecutter.main import cookiecutter

    work.mkdir(parents=True, exist_ok=True)
    project = Path(
        cookiecutter(
            str(TEMPLATE), no_input=True, output_dir=str(work), extra_context={"task": task}
        )
    )
    package = next(p.parent.name for p in (project / "src").glob("*/train.py"))
    # Compiled once here, so no timed run compiles the package (PYTHONDONTWRITEBYTECODE may be set).
    compileall.compile_dir(project / "src", quiet=1)
    return project, package


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 short repetition: checks, not timings"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--only-lm", action="store_true", help="the language model's figures (8) alone"
    )
    parser.add_argument("--only-scale", action="store_true", help="the scale figures (9) alone")
    parser.add_argument(
        "--only-prepare", action="store_true", help="prepare's throughput (10) alone"
    )
    parser.add_argument(
        "--only-nanogpt", action="store_true", help="the nanoGPT comparison (11) alone"
    )
    parser.add_argument(
        "--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT (default: clone one)"
    )
    parser.add_argument(
        "--only-hf-llama", action="store_true", help="the transformers Llama comparison (12) alone"
    )
    parser.add_argument("--only-demo", action="store_true", help="the two demos' figures (6) alone")
    parser.add_argument(
        "--only-lm-demo", action="store_true", help="the language model's demo (6) alone"
    )
    parser.add_argument(
        "--only-instructions",
        action="store_true",
        help="instructions per tiny-MLP step under callgrind (1c; needs valgrind), alone",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="default: results/cpu.json (--only-lm: cpu_lm.json, --only-scale: cpu_scale.json, "
        "--only-demo: cpu_demo.json, --only-instructions: cpu_instructions.json, --only-prepare: "
        "cpu_prepare.json, --only-nanogpt: cpu_nanogpt.json, --only-hf-llama: cpu_hf_llama.json)",
    )
    parser.add_argument(
        "--docs", action="store_true", help="rewrite docs/performance.md results and plot"
    )
    args = parser.parse_args()
    only = (
        args.only_lm
        or args.only_scale
        or args.only_demo
        or args.only_instructions
        or args.only_prepare
        or args.only_nanogpt
        or args.only_lm_demo
        or args.only_hf_llama
    )
    if args.quick and args.docs:
        parser.error("--docs needs timed figures, not --quick")
    if args.json is None:
        parts = {
            "cpu_lm": args.only_lm,
            "cpu_scale": args.only_scale,
            "cpu_demo": args.only_demo,
            "cpu_instructions": args.only_instructions,
            "cpu_prepare": args.only_prepare,
            "cpu_nanogpt": args.only_nanogpt,
            "cpu_lm_demo": args.only_lm_demo,
            "cpu_hf_llama": args.only_hf_llama,
        }
        name = next((part for part, chosen in parts.items() if chosen), "cpu")
        args.json = HERE / "results" / f"{name}.json"
    reps = 1 if args.quick else args.reps
    with tempfile.TemporaryDirectory() as tmp:
        project, package = bake(Path(tmp))
        lm_project = bake(Path(tmp) / "lm", "language-model")
        bench = Bench(project, package, Path(tmp), reps, args.quick, lm_project)
        if args.only_lm:
            bench.language_model()
        elif args.only_scale:
            bench.scale()
        elif args.only_demo:
            bench.demo()
            bench.lm_demo()
        elif args.only_lm_demo:
            bench.lm_demo()
        elif args.only_instructions:
            bench.instructions()
        elif args.only_prepare:
            bench.prepare_throughput()
        elif args.only_nanogpt:
            bench.nanogpt(args.nanogpt)
        elif args.only_hf_llama:
            bench.hf_llama()
        elif args.quick:
            bench.step_times("mlp", warmup=2, steps=3, log_every=10, reps=1)
            bench.op_counts("mlp", warmup=2, steps=10)
            bench.step_times("resnet18", warmup=5, steps=2, log_every=2, reps=1)
            bench.language_model()
        else:
            # A tiny-MLP step is 2-3 ms, where this machine's slow spells weigh most: more runs.
            bench.step_times("mlp", warmup=20, steps=300, log_every=10, reps=2 * reps + 1)
            bench.op_counts("mlp", warmup=20, steps=100)
            bench.step_times("resnet18", warmup=10, steps=10, log_every=10, reps=reps + 2)
            bench.language_model()
        if not only:
            bench.startup()
            bench.ddp_accumulation()
            bench.scaling()
            bench.input_pipeline()
            bench.scale()
            bench.hf_llama()
        if not (args.quick or only):
            bench.demo()
            bench.lm_demo()
            bench.prepare_throughput()
            bench.nanogpt(args.nanogpt)
    import torch

    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores",
        "torch": torch.__version__,
        "reps": reps,
        "quick": args.quick,
        "figures": bench.figures,
        "runs": bench.runs,
    }
    print()
    print(summary(bench.figures))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.docs:
        from report import with_parts, write_docs

        if only:
            results = merged_into_cpu_results(results)
            (HERE / "results" / "cpu.json").write_text(json.dumps(results, indent=2) + "\n")
            results = with_parts(results)
        write_docs(results)
    misses = [] if args.quick else missed(bench.figures)
    for line in misses:
        print(line, file=sys.stderr)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
