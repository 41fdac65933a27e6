"""One benchmark measurement in a fresh process: the generated loop, raw PyTorch, or Lightning.

    python bench/contenders.py steps   --contender raw --model mlp --warmup 5 --steps 50
    python bench/contenders.py startup --contender generated --package my_trainer

`steps` prints the steady-state seconds per optimizer step: the median duration of steps
warmup+1 .. warmup+steps (robust to the slow spells of a shared machine), and their mean, and the
process's minor page faults per step over the same steps.
`ops` prints the tensor operations per optimizer step over the same steps (no timing).
`instructions` switches callgrind's instruction count on and off around the same steps (the
caller runs it under valgrind at one thread and reads the count).
`startup` prints the wall-clock time at which the first optimizer step finished; the caller
subtracts the moment it started this process. Both time every contender the same way, with a
global optimizer-step hook, so no contender measures itself.

The raw and Lightning contenders build the same data (the generated project's synthetic images
and transforms, rewritten here without the project's code: uint8 from the loader, normalised a
batch at a time), the same model, the same AdamW (fused, no weight decay on biases and norm
weights), warmup-cosine schedule, gradient clipping at 1.0 and a loss read every 10 steps.
`raw_cached` is the raw loop with the allocator setting the generated project makes on CPU
(`run.cache_cpu_memory`): the two then differ by their loops alone.

`--model lm` is the language-model project (baked with task=language-model): its generated loop
against a raw loop on the same tokens, model, optimizer and schedule, written out in lm.py without
the project's code (no Lightning; raw_cached as above). Its `steps` result also carries `data`, a
checksum of the training tokens, which the caller compares like `params`.
Nothing is imported at module level beyond the standard library, so `startup` counts every
import a contender makes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time

DEFAULT_TRAIN_SIZE = 4000  # the generated project's default data.train_size
LR, WEIGHT_DECAY, WARMUP, CLIP = 0.002, 0.05, 50, 1.0
# (image size, batch size, data.augment, data.num_workers) per model: the MLP case keeps the data
# cheap (no augmentation, in-process loading) so the loop's own overhead shows.
SHAPES = {"mlp": (16, 64, False, 0), "resnet18": (32, 128, True, 2)}


PARAMS: list[int] = []
FAULTS: list[int] = []
DATA: list[int] = []  # the language model's training tokens' checksum (lm.fingerprint)


def steps_hook(first: int, total: int):
    """Record the time after every optimizer step; return the list the hook fills.

    Also counts the process's minor page faults (all threads) over steps first+1 .. total into
    FAULTS: memory that malloc handed back to the system and the next step faults in again.
    """
    import resource

    from torch.optim.optimizer import register_optimizer_step_post_hook

    times: list[float] = []

    def hook(optimizer, args, kwargs):
        times.append(time.perf_counter())
        if len(times) in (first, total):
            FAULTS.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        if len(times) == 1:  # a fingerprint of the model: every contender must train the same one
            PARAMS.append(
                sum(p.numel() for group in optimizer.param_groups for p in group["params"])
            )

    register_optimizer_step_post_hook(hook)
    return times


def cache_freed_memory() -> None:
    """What the generated project does on CPU (run.cache_cpu_memory), for raw_cached: glibc's malloc
    without mmap and without trimming, so memory a step frees serves the next one."""
    import ctypes

    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, -1)):
        sys.exit("mallopt failed")


def ops_hook(first: int, last: int) -> dict:
    """Count the tensor operations (aten ops through the dispatcher) of steps first+1 .. last.

    Timing on a shared machine moves by tens of percent between runs; this count does not, so it
    shows what a loop itself adds per step. The ops of DataLoader workers (other processes) are
    not counted; with in-process loading, the data's are.
    """
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"steps": 0, "ops": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["ops"] += 1
            return func(*args, **(kwargs or {}))

    mode = Count()

    def hook(optimizer, args, kwargs):
        counts["steps"] += 1
        if counts["steps"] == first:
            mode.__enter__()
        elif counts["steps"] == last:
            mode.__exit__(None, None, None)

    register_optimizer_step_post_hook(hook)
    return counts


def callgrind_hook(first: int, last: int) -> None:
    """Switch callgrind's instruction count on after optimizer step first and off after step last.

    For `instructions`: the caller runs this process under
    `valgrind --tool=callgrind --instr-atstart=no` and reads the count from callgrind's output file.
    callgrind_control returns once callgrind has answered, so the count covers steps first+1 ..
    last (two runs of the raw loop's 50 steps differed by 0.13%).
    """
    import subprocess

    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = [0]

    def hook(optimizer, args, kwargs):
        steps[0] += 1
        if steps[0] in (first, last):
            switch = "on" if steps[0] == first else "off"
            command = ["callgrind_control", "--instr=" + switch, str(os.getpid())]
            try:
                done = subprocess.run(command, capture_output=True, text=True)
                said = f"{done.stdout}{done.stderr}".strip()
            except FileNotFoundError:
                done, said = None, "callgrind_control is not installed (it comes with valgrind)"
            if done is None or done.returncode or said.startswith("Error"):  # it exits 0 on errors
                sys.exit(f"could not switch callgrind's count {switch}: {said}")

    register_optimizer_step_post_hook(hook)


def startup_hook():
    """Print the wall-clock time of the first optimizer step and end the process there."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def hook(optimizer, args, kwargs):
        print(json.dumps({"first_step_at": time.time()}), flush=True)
        os._exit(0)

    register_optimizer_step_post_hook(hook)


def build_mlp(image_size: int, num_classes: int = 10):
    from torch import nn

    return nn.Sequential(
        nn.Flatten(), nn.Linear(3 * image_size**2, 256), nn.ReLU(), nn.Linear(256, num_classes)
    )


def raw_dataset(size: int, image_size: int, augment: bool, num_classes: int = 10, seed: int = 0):
    """The generated project's synthetic training images and transforms, written out by hand."""
    import torch
    from torchvision.transforms import v2

    prototypes = torch.rand(num_classes, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    prototypes = torch.nn.functional.interpolate(prototypes, size=image_size, mode="bicubic")
    samples = torch.Generator().manual_seed(seed + 1)
    targets = torch.randint(num_classes, (size,), generator=samples)
    contrast = 0.2 + 0.4 * torch.rand(size, 1, 1, 1, generator=samples)
    noise = 0.3 * torch.randn(size, 3, image_size, image_size, generator=samples)
    images = (
        ((0.5 + contrast * (prototypes[targets] - 0.5) + noise).clamp(0, 1) * 255)
        .round()
        .to(torch.uint8)
    )
    steps = [v2.ToImage()]
    if augment:
        steps += [
            v2.RandomCrop(image_size, padding=image_size // 8, padding_mode="reflect"),
            v2.RandomHorizontalFlip(),
        ]
    transform = v2.Compose(steps)  # uint8 out: the loop normalises whole batches (normalise())

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return size

        def __getitem__(self, index):
            return transform(images[index]), int(targets[index])

    return Images()


def normalise(images):
    """A uint8 batch, normalised with the synthetic data's statistics as the project does."""
    return images.float().sub_(127.5).div_(63.75)


def raw_parts(model_name: str, total_steps: int, dataset_size: int):
    """Model, loader, optimizer and schedule as a hand-written script would build them."""
    import torch
    import torchvision

    image_size, batch, augment, workers = SHAPES[model_name]
    if model_name == "mlp":
        model = build_mlp(image_size)
    else:
        model = torchvision.models.resnet18(num_classes=10)
        # The project's small-input stem: 3x3 stride 1 (the max-pool stays).
        model.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    dataset = raw_dataset(dataset_size, image_size, augment)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    # The project's AdamW: no weight decay on biases and norm weights (two parameter groups).
    groups = [
        {"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, fused=True)

    def schedule(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.01 + 0.99 * 0.5 * (
            1 + math.cos(math.pi * min(1.0, (step - WARMUP) / max(1, total_steps - WARMUP)))
        )

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return model, loader, optimizer, scheduler


def run_raw(model_name: str, total_steps: int, dataset_size: int, log_every: int) -> None:
    """The minimal loop: zero_grad, forward, loss, backward, clip, step."""
    import torch
    import torch.nn.functional as F

    model, loader, optimizer, scheduler = raw_parts(model_name, total_steps, dataset_size)
    model.train()
    for step, (images, targets) in enumerate(loader):
        if step == total_steps:
            break
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(normalise(images)), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        if (step + 1) % log_every == 0:
            loss.item()


def run_lightning(model_name: str, total_steps: int, dataset_size: int, log_every: int) -> None:
    """The same work as a LightningModule under lightning.Trainer."""
    import lightning as L
    import torch.nn.functional as F

    model, loader, optimizer, scheduler = raw_parts(model_name, total_steps, dataset_size)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            images, targets = batch
            loss = F.cross_entropy(self.model(normalise(images)), targets)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        gradient_clip_val=CLIP,
        log_every_n_steps=log_every,
    )
    trainer.fit(Module(), loader)


def run_generated(
    package: str, model_name: str, total_steps: int, output_dir: str, startup: bool, log_every: int
) -> None:
    """The baked project's own `train` entry point (the MLP replaces its model builder)."""
    import importlib
    import runpy

    if startup:  # exactly what `python -m PACKAGE.train` does, defaults and all
        sys.argv = ["train", f"run.output_dir={output_dir}", "trainer.resume=never"]
        sys.argv += ["run.device=cpu"]
        runpy.run_module(f"{package}.train", run_name="__main__", alter_sys=True)
    train = importlib.import_module(f"{package}.train")
    if model_name == "lm":
        run_generated_lm(package, train, total_steps, output_dir, log_every)
        return
    image_size, batch, augment, workers = SHAPES[model_name]
    if model_name == "mlp":  # the task builds its model's layers through this module-level name
        task = importlib.import_module(f"{package}.task.task")
        task.architecture = lambda cfg, num_classes, sizes=None: build_mlp(image_size, num_classes)
    overrides = [
        f"run.output_dir={output_dir}",
        "run.device=cpu",
        "trainer.resume=never",
        f"trainer.max_steps={total_steps}",
        f"trainer.log_every={log_every}",
        f"data.image_size={image_size}",
        f"data.batch_size={batch}",
        f"data.augment={str(augment).lower()}",
        f"data.num_workers={workers}",
        # The raw loop's pipeline (a DataLoader): the loops are compared, not the input pipelines
        # (the demo measures the data on the device against workers).
        "data.loader=workers",
        f"data.train_size={batch * (total_steps + 1)}",
        "data.val_size=64",  # validation follows the timed steps; keep it short
    ]
    code = train.main(overrides)
    if code:
        sys.exit(code)


def run_generated_lm(package: str, train, total_steps: int, output_dir: str, log_every: int):
    """The language-model project's train.main, its data fingerprinted on the way (no timing)."""
    import importlib

    import lm

    task = importlib.import_module(f"{package}.task.task")
    build_datasets = task.build_datasets  # the task builds its data through this module-level name

    def fingerprinted(cfg, seed):
        train_set, val_set, info = build_datasets(cfg, seed)
        DATA.append(lm.fingerprint(train_set.tokens.read(0, len(train_set.tokens))))
        return train_set, val_set, info

    task.build_datasets = fingerprinted
    overrides = [
        f"run.output_dir={output_dir}",
        "run.device=cpu",
        "trainer.resume=never",
        *lm.generated_overrides(total_steps, log_every),
    ]
    code = train.main(overrides)
    if code:
        sys.exit(code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["steps", "startup", "ops", "instructions"])
    parser.add_argument(
        "--contender", choices=["generated", "raw", "lightning", "raw_cached"], required=True
    )
    parser.add_argument("--model", choices=[*sorted(SHAPES), "lm"], default="resnet18")
    parser.add_argument("--package", default="my_trainer")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default="bench-run")
    parser.add_argument("--log-every", type=int, default=10, help="steps between loss reads")
    args = parser.parse_args()

    total = args.warmup + args.steps
    if args.model == "lm" and args.contender == "lightning":
        sys.exit("--model lm has the generated, raw and raw_cached contenders")
    dataset_size = SHAPES[args.model][1] * (total + 1) if args.model in SHAPES else 0
    if args.what == "startup":
        startup_hook()
        total, dataset_size = (
            10**6,
            DEFAULT_TRAIN_SIZE,
        )  # the hook ends the process at the first step
    elif args.what == "ops":
        counts = ops_hook(args.warmup, total)
    elif args.what == "instructions":
        callgrind_hook(args.warmup, total)
    else:
        times = steps_hook(args.warmup, total)
    if args.contender == "generated":
        startup = args.what == "startup"
        run_generated(args.package, args.model, total, args.output_dir, startup, args.log_every)
    elif args.model == "lm":
        import lm

        if args.contender == "raw_cached":
            cache_freed_memory()
        DATA.append(lm.run_raw(total, args.log_every))
    elif args.contender in ("raw", "raw_cached"):
        if args.contender == "raw_cached":
            cache_freed_memory()
        run_raw(args.model, total, dataset_size, args.log_every)
    else:
        run_lightning(args.model, total, dataset_size, args.log_every)
    if args.what == "steps":
        if len(times) < total:
            sys.exit(f"only {len(times)} of {total} optimizer steps ran")
        steps = [b - a for a, b in itertools.pairwise(times[args.warmup - 1 : total])]
        result = {"step_s": statistics.median(steps), "mean_step_s": statistics.mean(steps)}
        result["faults_per_step"] = (FAULTS[1] - FAULTS[0]) / args.steps
        result["params"] = PARAMS[0]
        if DATA:
            result["data"] = DATA[0]
        print(json.dumps(result), flush=True)
    elif args.what == "ops":
        print(json.dumps({"ops_per_step": counts["ops"] / args.steps}), flush=True)
    elif args.what == "instructions":
        print(json.dumps({"steps": args.steps}), flush=True)


if __name__ == "__main__":
    main()
