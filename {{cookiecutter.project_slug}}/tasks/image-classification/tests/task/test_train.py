"""Training end to end on CPU: the loss falls, resume continues exactly, accumulation is exact."""

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from {{ cookiecutter.package_name }} import train as train_module
from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint, list_checkpoints
from {{ cookiecutter.package_name }}.engine.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.engine.optim import warmup_cosine
from {{ cookiecutter.package_name }}.engine.parallel import distributed
from {{ cookiecutter.package_name }}.engine.torch_private import cpu_has_onednn_bf16
from {{ cookiecutter.package_name }}.task import task as task_module
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.train import main, train

from conftest import read_metrics, torchrun
from tiny import RECIPE, SMALL_MODEL, timm_folder

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "recipes"


def test_smoke_run_learns_and_writes_its_outputs(tiny, run_dir, capsys):
    """Two epochs on CPU: train/loss falls, validation counts all 101 samples, outputs are written."""
    assert main([*tiny, "trainer.max_epochs=2"]) == 0
    records = read_metrics(run_dir)
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 6 and sum(losses[-2:]) < sum(losses[:2])
    vals = [r for r in records if "val/acc" in r]
    assert [r["val/samples"] for r in vals] == [101, 101]
    assert all(k in records[0] for k in ("step", "epoch", "perf/samples_per_s"))
    assert load_config(SPEC, [run_dir / "config.yaml"]).trainer.max_epochs == 2  # the resolved config
    assert (run_dir / "best.safetensors").exists() and list_checkpoints(run_dir / "checkpoints")
    assert "final val/acc=" in capsys.readouterr().out


@pytest.mark.slow
def test_gradient_accumulation_equals_the_large_batch(tiny, tmp_path, final_weights):
    """2 micro-batches of 16 give the same weights as 1 batch of 32 (GroupNorm, fp32, no augmentation).

    "The same" up to float rounding, which AdamW turns into lr-sized steps wherever a gradient is
    near zero, so a bound on single weights depends on the CPU; the distance over all weights is
    bounded instead, against what a different batch gives, as the world-size tests do.
    """
    exact = [*tiny, "model.norm=group", "data.augment=false", "trainer.max_steps=3"]
    assert main([*exact, "data.batch_size=32", f"run.output_dir={tmp_path / 'big'}"]) == 0
    assert main([*exact, "data.batch_size=16", "trainer.grad_accum_steps=2", f"run.output_dir={tmp_path / 'acc'}"]) == 0
    assert main([*exact, "data.batch_size=16", f"run.output_dir={tmp_path / 'small'}"]) == 0
    big, acc, small = (final_weights(tmp_path / name) for name in ("big", "acc", "small"))
    rounding, other_batches = distance(big, acc), distance(big, small)
    print(f"distance to the large batch: accumulated {rounding:.3g}, batch of 16 {other_batches:.3g}")
    assert rounding < other_batches / 20
    steps = [r["step"] for r in read_metrics(tmp_path / "acc") if "val/acc" in r]
    assert steps == [3]  # the scheduler and max_steps count optimizer steps, not micro-batches


def test_scheduler_warms_up_then_decays():
    """The learning rate rises linearly during warmup and ends at min_lr_ratio of the peak."""
    lrs = [warmup_cosine(s, warmup=4, total=20, min_ratio=0.1) for s in range(21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False)) and lrs[20] == pytest.approx(0.1)


def test_out_of_memory_ends_with_one_line_that_keeps_the_global_batch(tiny, monkeypatch, capsys):
    """A CUDA out-of-memory error exits 1 with one line: half the batch, twice the accumulation."""

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(task_module, "classification_loss", out_of_memory)
    assert main([*tiny, "trainer.grad_accum_steps=2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.endswith("data.batch_size=16 trainer.grad_accum_steps=4")


def test_out_of_memory_advice_divides_the_batch_exactly():
    """The suggested batch times accumulation always equals the current one."""
    assert train_module.out_of_memory_advice(24, 1).endswith("data.batch_size=12 trainer.grad_accum_steps=2")
    assert train_module.out_of_memory_advice(9, 2).endswith("data.batch_size=3 trainer.grad_accum_steps=6")
    assert "bf16" in train_module.out_of_memory_advice(1, 4)


@pytest.mark.gpu
def test_real_cuda_out_of_memory_is_one_line(tiny, capsys):
    """A real CUDA out-of-memory (memory capped to 1 GiB) ends with exit 1 and the advice line."""
    device = torch.device("cuda")
    torch.cuda.set_per_process_memory_fraction(2**30 / torch.cuda.get_device_properties(device).total_memory)
    try:
        big = ["run.device=cuda", "data.image_size=224", "data.batch_size=512", "data.train_size=1024"]
        assert main([*tiny, *big]) == 1
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert "data.batch_size=256 trainer.grad_accum_steps=2" in capsys.readouterr().err


@pytest.mark.slow
def test_bf16_autocast_on_cpu_trains_without_a_scaler(tiny, run_dir, caplog):
    """bf16 runs under autocast with the gradient scaler disabled (it is for fp16 only), and warns, on a CPU
    without oneDNN's bf16 kernels (torch's slow reference kernels compute bf16 there), that fp32 trains faster."""
    cfg = load_config(SPEC, [], [*tiny, *SMALL_MODEL, "trainer.precision=bf16", "trainer.max_steps=2"])
    result = train(cfg)
    assert result["val/samples"] == 101
    _, state = latest_checkpoint(run_dir / "checkpoints")
    assert state["scaler"] == {}  # a disabled GradScaler has no state
    warned = "trainer.precision=fp32 trains faster here" in caplog.text
    assert warned != cpu_has_onednn_bf16()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_single_gpu_smoke(tiny, run_dir, precision):
    """On one GPU, bf16 and fp16 (with GradScaler) train, validate every sample and log peak memory."""
    overrides = [o for o in tiny if o != "run.device=cpu"] + ["run.device=cuda", f"trainer.precision={precision}"]
    assert main([*overrides, "trainer.max_epochs=2"]) == 0
    records = read_metrics(run_dir)
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert losses[-1] < losses[0]
    train = [r for r in records if "train/loss" in r]
    assert all(0 < r["perf/max_mem_allocated_gib"] <= r["perf/max_mem_reserved_gib"] for r in train)
    assert [r["val/samples"] for r in records if "val/samples" in r] == [101, 101]
    _, state = latest_checkpoint(run_dir / "checkpoints")
    assert bool(state["scaler"]) == (precision == "fp16")


@pytest.mark.slow
def test_imagefolder_of_png_files_trains_well(tmp_path, run_dir):
    """A folder of real PNG files trains to high accuracy and counts every validation image once.

    The best validation, not the last: with BatchNorm this run's curve moves with the arithmetic
    (over 7 CPU settings, SIMD width and threads, epoch 5 ended between 0.75 and 1.0, the last
    epoch between 0.969 and 1.0, and the best at 0.97 or more), so only the best is portable."""
    from PIL import Image

    from {{ cookiecutter.package_name }}.task.data import SyntheticImages

    for split, size in (("train", 600), ("val", 97)):
        data = SyntheticImages(size, num_classes=4, image_size=32, split=split)
        for i, (image, label) in enumerate(zip(data.images, data.targets.tolist(), strict=True)):
            folder = tmp_path / "images" / split / f"class_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{i}.png")
    overrides = [
        "run.device=cpu",
        "data.name=imagefolder",
        f"data.root={tmp_path / 'images'}",
        "data.batch_size=32",
        "trainer.max_epochs=6",
        "data.num_workers=2",
        "tracker.name=none",
        f"run.output_dir={run_dir}",
    ]
    assert main(overrides) == 0
    final = [r for r in read_metrics(run_dir) if "val/acc" in r][-1]
    assert final["val/samples"] == 97
    assert final["val/best_acc"] >= 0.9


def distance(a: dict, b: dict) -> float:
    """Euclidean distance between two sets of weights."""
    return sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a).sqrt().item()


# The recipe's random draws on (TrivialAugment, mixup, cutmix, random erasing): each sample is augmented and
# mixed alike whichever process takes it.
EXACT = ["model.norm=group", *RECIPE, "trainer.max_epochs=2", "trainer.checkpoint_every=2", "trainer.keep_last=10"]


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """Weights of 1 process x batch 64 (the reference) and the distance to 1 x batch 32 (other batches)."""
    from conftest import TINY

    runs = tmp_path_factory.mktemp("one_process")
    for name, batch in (("one", 64), ("other", 32)):
        overrides = [*TINY, *EXACT, f"data.batch_size={batch}", "trainer.max_steps=6", f"run.output_dir={runs / name}"]
        assert main(overrides) == 0
    read = lambda run: latest_checkpoint(runs / run / "checkpoints")[1]["model"]  # noqa: E731
    return read("one"), distance(read("one"), read("other"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_and_resume_on_one(tiny, run_dir, final_weights, one_process_runs, strategy):
    """2 processes x batch 32 train like 1 x batch 64 (with TrivialAugment, mixup, cutmix and random erasing
    on), count each validation sample once, and resume on 1.

    "Like" means: the weights differ by float rounding only (Adam amplifies it a little), at least
    20x less than after a run that sees other batches (1 process x batch 32). Each process writes its
    own profile of the steps trainer.profile_steps names.
    """
    reference, other_batches = one_process_runs
    torchrun(
        2, [*tiny, *EXACT, "data.batch_size=32", f"distributed.strategy={strategy}", "trainer.profile_steps=[2,2]"]
    )
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["rank0.json", "rank1.json"]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "val/acc" in r] == [3, 6]  # 192 samples / (2 x 32) per step
    assert [r["val/samples"] for r in records if "val/samples" in r] == [101, 101]
    assert distance(reference, final_weights(run_dir)) < other_batches / 20
    if strategy == "fsdp":  # sharded checkpoints: each process wrote its own shards of the step-2 one
        written = {p.name.split("_")[2] for p in list_checkpoints(run_dir / "checkpoints")[0].glob("__*.distcp")}
        assert written == {"0", "1"}

    for later in list_checkpoints(run_dir / "checkpoints")[1:]:
        shutil.rmtree(later) if later.is_dir() else later.unlink()  # as if the job died after step 2, mid-epoch
    assert main([*tiny, *EXACT, "data.batch_size=64"]) == 0
    assert distance(reference, final_weights(run_dir)) < other_batches / 20


def test_fsdp_bf16_keeps_batchnorm_weights_in_fp32(tmp_path):
    """FSDP with bf16 computes convolutions with bf16 weights while BatchNorm keeps fp32 weights
    beside its fp32 statistics (cuDNN refuses bf16 weights with fp32 statistics)."""
    import torch.distributed as dist
    from torch import nn

    from {{ cookiecutter.package_name }}.task.config import ModelConfig
    from {{ cookiecutter.package_name }}.task.model import build_model

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = build_model(ModelConfig(), num_classes=10)
        distributed.shard_model(model, distributed.DistEnv(0, 0, 1, torch.device("cpu")), "bf16")
        seen: dict[str, set] = {"conv": set(), "norm": set()}
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.BatchNorm2d)):
                kind = "norm" if isinstance(module, nn.BatchNorm2d) else "conv"
                module.register_forward_pre_hook(lambda m, args, kind=kind: seen[kind].add(m.weight.dtype))
        model(torch.randn(2, 3, 16, 16)).float().sum().backward()
    finally:
        distributed.teardown()
    assert seen == {"conv": {torch.bfloat16}, "norm": {torch.float32}}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp_shards_a_model_whose_blocks_nest_once_each(precision, tmp_path):
    """MobileNetV3's blocks nest (each Conv2dNormActivation is an nn.Sequential inside the stage of
    blocks, and holds a BatchNorm that bf16 shards on its own first): every parameter is sharded
    once, and the model trains a step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from {{ cookiecutter.package_name }}.task.config import ModelConfig
    from {{ cookiecutter.package_name }}.task.model import build_model

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = build_model(ModelConfig(name="mobilenet_v3_small"), num_classes=10)
        distributed.shard_model(model, distributed.DistEnv(0, 0, 1, torch.device("cpu")), precision)
        model(torch.randn(2, 3, 32, 32)).float().sum().backward()
        params = dict(model.named_parameters())
        assert all(isinstance(p, DTensor) and not isinstance(p.to_local(), DTensor) for p in params.values())
        assert all(p.grad is not None for p in params.values())
    finally:
        distributed.teardown()


COMPARE_BUFFERS = """
import json, os, sys
import torch
import torch.distributed as dist
from {{ cookiecutter.package_name }}.engine.parallel import distributed
from {{ cookiecutter.package_name }} import train

broadcast_buffers, seen = distributed.broadcast_buffers, {"differed_before": 0, "differ_after": 0, "steps": 0}

def same_on_every_rank(model):
    mine = torch.cat([b.detach().reshape(-1).float() for b in model.buffers() if b.is_floating_point()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], other) for other in everyone)

def broadcast_and_compare(model, **options):
    seen["steps"] += 1
    seen["differed_before"] += not same_on_every_rank(model)
    broadcast_buffers(model, **options)
    seen["differ_after"] += not same_on_every_rank(model)

distributed.broadcast_buffers = broadcast_and_compare
code = train.main(sys.argv[1:])
with open(os.environ["BUFFER_COUNTS"] + os.environ["RANK"], "w") as f:
    json.dump(seen, f)
sys.exit(code)
"""


@pytest.mark.slow
def test_fsdp_ranks_keep_one_set_of_batchnorm_statistics(tiny, tmp_path):
    """Under FSDP each rank's BatchNorm statistics move on its own batches; after every optimizer
    step all ranks hold rank 0's (as DDP keeps them), checked by gathering every buffer."""
    script = tmp_path / "compare_buffers.py"
    script.write_text(COMPARE_BUFFERS)
    counts = tmp_path / "buffers-rank"
    overrides = ["distributed.strategy=fsdp", "trainer.max_steps=3", f"run.output_dir={tmp_path / 'run'}"]
    torchrun(2, [*tiny, *overrides], script=[str(script)], BUFFER_COUNTS=str(counts))
    for rank in (0, 1):
        seen = json.loads(Path(f"{counts}{rank}").read_text())
        assert seen == {"differed_before": 3, "differ_after": 0, "steps": 3}, (rank, seen)


THREADS_AT_EXIT = """
import json, os, sys
from {{ cookiecutter.package_name }} import train

code = train.main(sys.argv[1:])
threads = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
with open(os.environ["THREADS_AT_EXIT"] + os.environ["RANK"], "w") as f:
    json.dump({"code": code, "threads": threads}, f)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through /proc (Linux)")
@pytest.mark.parametrize("ending", ["finished", "diverged"])
def test_fsdp_process_group_threads_end_before_python_exits(ending, tiny, tmp_path):
    """After an FSDP run, finished or stopped by an error, no gloo thread is left when main()
    returns. The DeviceMesh and the sharded model keep the process group past destroy_process_group;
    its threads running into interpreter shutdown aborted about 1 exit in 70 (SIGABRT)."""
    script = tmp_path / "threads_at_exit.py"
    script.write_text(THREADS_AT_EXIT)
    found = tmp_path / "threads-rank"
    overrides = ["distributed.strategy=fsdp", "trainer.max_steps=2", f"run.output_dir={tmp_path / 'run'}"]
    if ending == "diverged":
        overrides += ["optim.lr=1e12", "trainer.grad_clip=0"]
    torchrun(2, [*tiny, *overrides], script=[str(script)], THREADS_AT_EXIT=str(found))
    for rank in (0, 1):
        seen = json.loads(Path(f"{found}{rank}").read_text())
        assert seen["code"] == (0 if ending == "finished" else 1), (rank, seen)
        assert not [name for name in seen["threads"] if "gloo" in name], (rank, seen["threads"])


ALLOCATE_AND_FREE = """
import resource, sys
import torch
from {{ cookiecutter.package_name }}.engine.parallel.distributed import cache_freed_memory

cached = cache_freed_memory() if sys.argv[1] == "cache" else False
faults = []
for _ in range(10):  # a step's activations: 64 MiB written, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(2**24)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(cached, min(faults[1:]))  # small allocations in between can split a freed block: not every time
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    """After cache_freed_memory() a freed 64 MiB tensor's pages serve a later one: no page faults."""
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def fewest_faults(mode: str, **env) -> tuple[bool, int]:
        command = [sys.executable, "-c", ALLOCATE_AND_FREE, mode]
        done = subprocess.run(command, capture_output=True, text=True, check=True, env={**plain_env, **env})
        cached, faults = done.stdout.split()
        return cached == "True", int(faults)

    pages = 2**26 // resource.getpagesize()
    cached, faults = fewest_faults("cache")
    assert cached and faults < pages // 100
    _, faults_by_default = fewest_faults("plain")
    assert faults_by_default > 10 * faults  # glibc's default unmaps it and faults every page in again
    applied, faults_with_own_setting = fewest_faults("cache", MALLOC_ARENA_MAX="2")
    assert not applied and faults_with_own_setting > 10 * faults  # a user's own malloc setting is left alone


FREE_THEN_FORK = """
import os, resource
import torch
from {{ cookiecutter.package_name }}.engine.parallel.distributed import cache_freed_memory

def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20

assert cache_freed_memory()
torch.ones(2**24)  # 64 MiB written and freed: the process keeps it
cached = resident_mib()
pid = os.fork()  # as a DataLoader worker starts
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print(cached - resident_mib())
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not Path("/proc/self/statm").exists(), reason="glibc, Linux")
def test_freed_memory_is_handed_back_before_a_fork():
    """The cached memory goes back to the system before a fork: a worker would share it copy-on-write, and
    the parent's next step would copy it page by page."""
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", FREE_THEN_FORK], capture_output=True, text=True, env=plain_env)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) > 48  # MiB of the freed 64 no longer resident after the fork


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "calls"), [([], 1), (["run.cache_cpu_memory=false"], 0)])
def test_cpu_training_caches_freed_memory_unless_turned_off(tiny, monkeypatch, overrides, calls):
    """A CPU run sets up the allocator once, unless run.cache_cpu_memory=false."""
    called = []
    monkeypatch.setattr(distributed, "cache_freed_memory", lambda: called.append(True))
    assert main([*tiny, "trainer.max_steps=1", *overrides]) == 0
    assert len(called) == calls


def test_channels_last_trains(tiny, run_dir):
    """model.channels_last=true trains and validates on CPU."""
    assert main([*tiny, "model.channels_last=true", "trainer.max_steps=2"]) == 0
    assert [r["val/samples"] for r in read_metrics(run_dir) if "val/samples" in r] == [101]


@pytest.mark.gpu
@pytest.mark.parametrize(("strategy", "precision"), [("ddp", "bf16"), ("ddp", "fp16"), ("fsdp", "bf16")])
def test_one_gpu_under_torchrun_with_nccl(tiny, run_dir, strategy, precision):
    """torchrun with 1 process on a GPU: nccl, DDP (bf16 and fp16) and FSDP2 (bf16) train and validate."""
    on_gpu = [o for o in tiny if o != "run.device=cpu"]
    torchrun(1, [*on_gpu, f"distributed.strategy={strategy}", f"trainer.precision={precision}", "trainer.max_epochs=2"])
    records = read_metrics(run_dir)
    assert [r["val/samples"] for r in records if "val/samples" in r] == [101, 101]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert losses[-1] < losses[0]


def test_the_recipes_load_and_the_fine_tuning_one_needs_a_timm_model(tmp_path):
    """configs/recipes/: torchvision's ResNet-50 recipe sets its keys; the fine-tuning recipe takes the
    model from model.init_from, and without one its timm-only keys are refused in one line."""
    resnet = load_config(SPEC, [RECIPES / "torchvision-resnet50.yaml"], ["data.name=synthetic"])
    assert (resnet.model.name, resnet.data.augment, resnet.data.image_size) == ("resnet50", "trivial", 176)
    assert (resnet.data.val_image_size, resnet.data.val_resize, resnet.optim.ema_decay) == (224, 232, 0.99997)
    finetune = RECIPES / "timm-finetune.yaml"
    with pytest.raises(ConfigError, match="applies to timm models .model.name=timm:NAME., not to torchvision's"):
        load_config(SPEC, [finetune], ["data.name=synthetic"])
    timm_folder(tmp_path / "convnext")
    cfg = load_config(SPEC, [finetune], ["data.name=synthetic", f"model.init_from={tmp_path / 'convnext'}"])
    assert (cfg.model.name, cfg.optim.layer_decay, cfg.data.image_size) == ("timm:test_convnext", 0.75, 160)


@pytest.mark.slow
def test_the_fine_tuning_recipe_learns_a_small_image_folder(tmp_path, run_dir):
    """configs/recipes/timm-finetune.yaml over a timm folder (timm's test ConvNeXt, re-headed) learns a
    two-class image folder of dark and bright noisy squares: validation accuracy ends above 90%."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 48), ("val", 16)):
        for label, base in (("dark", 70), ("bright", 180)):
            folder = tmp_path / "images" / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(base + rng.normal(0, 40, (40, 36, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    timm_folder(tmp_path / "convnext")
    args = [
        *("--config", str(RECIPES / "timm-finetune.yaml"), f"model.init_from={tmp_path / 'convnext'}"),
        *(f"data.root={tmp_path / 'images'}", "data.image_size=32", "data.batch_size=16", "data.num_workers=0"),
        *("run.device=cpu", f"run.output_dir={run_dir}", "trainer.max_epochs=4", "optim.warmup_steps=4"),
        "tracker.name=none",
    ]
    assert main(args) == 0
    assert [r["val/acc"] for r in read_metrics(run_dir) if "val/acc" in r][-1] > 0.9
