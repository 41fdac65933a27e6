"""Adapters (model.lora): LoRA, rsLoRA and DoRA over a frozen Hugging Face folder. A fresh adapter
leaves the base's logits as they were and only adapters learn; the PEFT export loads in peft with
our logits and the merged export equals peft's merge_and_unload(); a run checkpoints the adapters
only, resumes bit-exactly, refuses another base, and trains alike on 1 and 2 processes (DDP,
FSDP). QLoRA (model.quantize=nf4): the NF4 base dequantizes within the format's error, and a QLoRA run
learns as a LoRA run does. The folders are small random ones made here, offline."""

import json
import random
import time

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }}.engine.config import load_config
from {{ cookiecutter.package_name }}.evaluate import main as evaluate_main
from {{ cookiecutter.package_name }}.export import main as export_main
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.task.model import lora
from {{ cookiecutter.package_name }}.task.task import Task
from {{ cookiecutter.package_name }}.train import main as train_main

from conftest import newest
from hf_folders import llama_folder

transformers = pytest.importorskip("transformers")

VOCAB = 32  # the synthetic source's symbols: the folders have this vocabulary
BASE = ["run.device=cpu", "tracker.name=none", "data.seq_len=16", "data.batch_size=4", f"data.vocab_size={VOCAB}",
        "data.train_tokens=4000", "data.val_tokens=500", "trainer.val_every=null", "trainer.log_every=1",
        "optim.warmup_steps=1", "optim.lr=1e-2"]  # fmt: skip
VARIANTS = {"lora": [], "rslora": ["model.lora.rslora=true"], "dora": ["model.lora.dora=true"]}


def folder(path, family: str, seed: int = 0, init_range: float = 0.02):
    """A random Llama (grouped-query attention, untied head; weights of std init_range) or GPT-2 (biases
    drawn at random), saved with save_pretrained; returns the transformers model."""
    if family == "llama":
        keys = {"num_key_value_heads": 2, "initializer_range": init_range}
        return llama_folder(path, "llama", keys, vocab_size=VOCAB)
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.02)
    model.save_pretrained(str(path))
    return model


def built(overrides: list[str]):
    task = Task(load_config(SPEC, [], [*BASE, *overrides]), torch.device("cpu"))
    task.datasets()
    return task.build_model().eval(), task


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


def test_a_fresh_adapter_keeps_the_base_logits_and_only_adapters_learn(tmp_path):
    """LoRA and DoRA, r=4 on every linear layer: the logits equal those without adapters exactly; after a
    backward, only adapter tensors hold gradients; the run names its base by the weights' hash."""
    theirs = folder(tmp_path / "base", "llama")
    init = [f"model.init_from={tmp_path / 'base'}"]
    plain, _ = built(init)
    for variant in ("lora", "dora"):
        adapted, task = built([*init, "model.lora.r=4", *VARIANTS[variant]])
        with torch.no_grad():
            assert torch.equal(adapted(tokens()), plain(tokens())), variant
            torch.testing.assert_close(adapted(tokens()), theirs(tokens()).logits, rtol=1e-5, atol=1e-5)
        adapted.train()
        adapted(tokens()).logsumexp(-1).mean().backward()
        with_grad = {name for name, param in adapted.named_parameters() if param.grad is not None}
        assert with_grad == {name for name, _ in adapted.named_parameters() if lora.is_adapter(name)}
        assert len([name for name in with_grad if name.endswith("lora_A.weight")]) == 2 * 7  # 2 layers x 7 targets
        assert ("lora_magnitude_vector" in " ".join(with_grad)) == (variant == "dora")
        assert task.frozen_weights()["sha256"] == lora.weights_hash(task._pretrained())


def randomised(model) -> None:
    """Adapters as after training: B no longer zero, DoRA's magnitudes moved off the row norms."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if lora.is_adapter(name):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_peft_export_loads_in_peft_with_our_logits(tmp_path, family, variant):
    """export_as peft: PeftModel.from_pretrained over the original folder computes our logits; export_as
    hf (merged in float32) holds the weights of peft's merge_and_unload() and computes the same logits."""
    peft = pytest.importorskip("peft")
    folder(tmp_path / "base", family)
    model, task = built([f"model.init_from={tmp_path / 'base'}", "model.lora.r=4", "model.lora.alpha=8",
                         *VARIANTS[variant]])  # fmt: skip
    randomised(model)
    task.export_as("peft", model, tmp_path / "export")
    task.export_as("hf", model, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "peft" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] == (family == "gpt2") and config["use_dora"] == (variant == "dora")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "export" / "peft")).eval()
    with torch.no_grad():
        ours = model(tokens())
        torch.testing.assert_close(theirs(tokens()).logits, ours, rtol=1e-5, atol=1e-5)
        merged = theirs.merge_and_unload()
        exported = load_file(str(tmp_path / "export" / "hf" / "model.safetensors"))
        for name, tensor in merged.state_dict().items():
            if name in exported:
                torch.testing.assert_close(exported[name], tensor, rtol=1e-5, atol=1e-6)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export" / "hf")).eval()
        torch.testing.assert_close(loaded(tokens()).logits, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_an_adapter_checkpoint_holds_the_adapters_and_names_its_base(tmp_path, capsys):
    """LoRA on a GPT-2 folder: the checkpoint holds the adapters and their optimizer state only, with the
    base's hash; a resume over another base (another seed's weights) and targets of the other family are
    refused in one line each; evaluate,
    export and generate take the base from the checkpoint, and generate applies the adapters."""
    from {{ cookiecutter.package_name }}.task.generate import main as generate_main

    folder(tmp_path / "base", "gpt2")
    run = tmp_path / "run"
    common = [*BASE, "trainer.max_steps=2", f"model.init_from={tmp_path / 'base'}", "model.lora.r=4",
              f"run.output_dir={run}"]  # fmt: skip
    assert train_main(common) == 0
    state = newest(run)
    assert set(state["model"]) == {name for name in state["model"] if lora.is_adapter(name)}
    assert len(state["model"]) == 2 * 4 * 2  # 2 blocks x 4 layers (c_attn, c_proj twice, c_fc) x A, B
    assert len(state["optimizer"]["state"]) == len(state["model"])
    assert state["frozen"]["config"] == {"model.init_from": str(tmp_path / "base")}

    folder(tmp_path / "other", "gpt2", seed=1)
    capsys.readouterr()
    assert train_main([*common, "trainer.max_steps=4", f"model.init_from={tmp_path / 'other'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was trained over model.init_from=" in err[0] and "sha256" in err[0], err

    capsys.readouterr()
    targets = [*common, "model.lora.targets=[q_proj]", f"run.output_dir={tmp_path / 'targets'}"]
    assert train_main(targets) == 2  # a name of the other family's
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'q_proj' matches no layer of model.arch=gpt2; choose among c_attn" in err[0], err

    assert evaluate_main([f"run.output_dir={run}"]) == 0  # the base from the checkpoint
    assert export_main([f"run.output_dir={run}", "--format", "peft"]) == 0
    assert (run / "export" / "peft" / "adapter_model.safetensors").is_file()
    assert generate_main([f"run.output_dir={run}", "--max-new-tokens", "4", "--prompt", "a"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [0, 2])
def test_sigkill_then_resume_gives_the_adapters_bit_for_bit(tmp_path, nproc):
    """SIGKILL at a random moment after a checkpoint, then the same command: the adapters and their
    moments end equal to an uninterrupted run's, bit for bit. One process: bf16, activation
    checkpointing and 2 accumulation steps; FSDP on 2 processes: DoRA's magnitudes and the adapters'
    weight average too, every process's shards of them."""
    from engine.test_faults import assert_bit_identical, completed, kill_everything, start, wait_for_checkpoint

    folder(tmp_path / "base", "llama")
    args = [*BASE, f"model.init_from={tmp_path / 'base'}", "model.lora.r=4", "model.lora.dropout=0.1",
            "trainer.max_steps=16", "trainer.checkpoint_every=2", "trainer.log_every=3"]  # fmt: skip
    if nproc:
        args += ["data.batch_size=2", "distributed.strategy=fsdp", "model.lora.dora=true", "optim.ema_decay=0.9"]
    else:
        args += ["trainer.precision=bf16", "model.activation_checkpointing=true", "data.batch_size=2",
                 "trainer.grad_accum_steps=2"]  # fmt: skip
    completed(nproc, [*args, f"run.output_dir={tmp_path / 'straight'}"])
    run = [*args, f"run.output_dir={tmp_path / 'killed'}"]
    process = start(nproc, run)
    wait_for_checkpoint(tmp_path / "killed", process, step=random.randrange(2, 12, 2))
    time.sleep(random.uniform(0, 0.2))
    assert process.poll() is None, "the run finished before the kill; give it more steps"
    kill_everything(process)
    completed(nproc, run)
    assert_bit_identical(tmp_path / "straight", tmp_path / "killed")
    assert all(lora.is_adapter(name) for name in newest(tmp_path / "killed")["model"])


# How 2 processes share a global batch of 4: DDP with 2 accumulation steps of 1, FSDP2 (with DoRA: the
# magnitudes sharded with their layers), HSDP (2 replicas).
TWO_PROCESSES = {
    "ddp": ["distributed.strategy=ddp", "data.batch_size=1", "trainer.grad_accum_steps=2"],
    "fsdp": ["distributed.strategy=fsdp", "data.batch_size=2"],
    "hsdp": ["distributed.strategy=fsdp", "distributed.replicate_degree=2", "data.batch_size=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(TWO_PROCESSES))
def test_two_processes_make_the_update_of_one(tmp_path, strategy):
    """LoRA on 2 gloo processes (TWO_PROCESSES) and on 1 x batch 4: the same adapters after 3 steps, to
    float32 summation order. AdamW turns that rounding into lr-sized steps wherever a gradient is near
    zero (lora_A's are, while lora_B leaves zero), so a bound on single weights depends on the CPU; each
    tensor's distance is bounded instead, against its size (lora_B's is all update: it starts at zero)."""
    from conftest import torchrun

    folder(tmp_path / "base", "llama")
    common = [*BASE, f"model.init_from={tmp_path / 'base'}", "model.lora.r=4", "trainer.max_steps=3"]
    if strategy == "fsdp":
        common.append("model.lora.dora=true")
    assert train_main([*common, f"run.output_dir={tmp_path / 'one'}"]) == 0
    torchrun(2, [*common, *TWO_PROCESSES[strategy], f"run.output_dir={tmp_path / 'two'}"])
    one, two = newest(tmp_path / "one"), newest(tmp_path / "two")
    assert set(one["model"]) == set(two["model"])
    for key in one["model"]:
        distance = torch.linalg.vector_norm(two["model"][key] - one["model"][key])
        assert distance <= 1e-4 * torch.linalg.vector_norm(one["model"][key]), key
    assert one["model"]["layers.0.self_attn.q_proj.lora_B.weight"].abs().sum() > 0  # the adapters did train


@pytest.mark.slow
def test_the_nf4_base_dequantizes_within_the_format_s_error(tmp_path):
    """model.quantize=nf4 stores each linear weight of the blocks in 4 bits (half a byte a weight): every
    weight dequantizes to within half the widest gap between NF4's 16 levels times its block's absolute
    maximum, plus the 8-bit error of that maximum; embeddings, norms and adapters stay float32. FSDP is
    refused in one line."""
    from {{ cookiecutter.package_name }}.engine.errors import ConfigError

    folder(tmp_path / "base", "llama")
    init = [f"model.init_from={tmp_path / 'base'}", "model.lora.r=4"]
    plain, _ = built(init)
    quantized, task = built([*init, "model.quantize=nf4"])
    weights = dict(plain.named_parameters())
    checked = 0
    for name, param in quantized.named_parameters():
        if not hasattr(param, "get_original_weight"):
            assert param.dtype == torch.float32, name
            continue
        whole = weights[name].detach()
        levels = param.nf4.sort().values
        half_gap = (levels[1:] - levels[:-1]).max() / 2
        blocks = whole.reshape(-1, 64).abs().amax(dim=1)
        bound = half_gap * blocks + blocks.max() / 127  # the level's rounding, then the scale's
        error = (lora.dense(param).reshape(-1, 64) - whole.reshape(-1, 64)).abs().amax(dim=1)
        assert (error <= bound).all(), name
        assert param.quantized_data.numel() == whole.numel() // 2
        checked += 1
    assert checked == 2 * 7
    with pytest.raises(ConfigError, match="model.quantize=nf4 with distributed.strategy=fsdp"):
        task.build_model(shard=lambda model: model)


@pytest.mark.slow
def test_a_qlora_run_learns_as_lora_does_and_exports_the_dequantized_merge(tmp_path, capsys):
    """40 steps of QLoRA and of LoRA from one Llama folder (weights of std 0.2: a frozen head of std 0.02
    caps what adapters can change in the logits): QLoRA's training loss falls by more than 0.5 nats,
    ending within a tenth of a nat of LoRA's; export --format hf writes the dequantized base plus the
    adapters, which transformers loads with our logits; the default export, which cannot hold NF4
    weights, is refused in one line."""
    from conftest import read_metrics

    folder(tmp_path / "base", "llama", init_range=0.2)
    common = [*BASE, f"model.init_from={tmp_path / 'base'}", "model.lora.r=8", "optim.lr=3e-2",
              "trainer.max_steps=40", "trainer.log_every=5"]  # fmt: skip
    losses = {}
    for name, extra in {"qlora": ["model.quantize=nf4"], "lora": []}.items():
        assert train_main([*common, *extra, f"run.output_dir={tmp_path / name}"]) == 0
        losses[name] = [record["train/loss"] for record in read_metrics(tmp_path / name) if "train/loss" in record]
    assert losses["qlora"][-1] < losses["qlora"][0] - 0.5, losses
    assert abs(losses["qlora"][-1] - losses["lora"][-1]) < 0.1, losses

    run = tmp_path / "qlora"
    assert export_main([f"run.output_dir={run}", "--format", "hf"]) == 0
    model, _ = built([f"model.init_from={tmp_path / 'base'}", "model.lora.r=8", "model.quantize=nf4"])
    from {{ cookiecutter.package_name }}.engine.ckpt.restore import load_model_weights

    state = newest(run)
    load_model_weights(model, state, run, state["frozen"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(run / "export" / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()).logits, model(tokens()), rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert export_main([f"run.output_dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NF4Tensor weights (a quantized base)" in err[0] and "hf, peft" in err[0], err


@pytest.mark.slow
def test_adapters_fine_tune_on_packed_conversations(tmp_path):
    """prepare --chat, then LoRA over a Llama folder of the data's vocabulary on packed conversations:
    the run trains (its loss on the answers falls) and checkpoints the adapters only."""
    from {{ cookiecutter.package_name }}.prepare import main as prepare_main

    from conftest import read_metrics
    from hf_folders import arithmetic

    source = tmp_path / "sums.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in arithmetic(200, 0)))
    assert prepare_main(["--chat", "--val-fraction", "0.1", "--out", str(tmp_path / "data"), str(source)]) == 0
    vocab = json.loads((tmp_path / "data" / "meta.json").read_text())["vocab_size"]
    keys = {"num_key_value_heads": 2, "initializer_range": 0.2, "max_position_embeddings": 128}
    llama_folder(tmp_path / "base", "llama", keys, vocab_size=vocab)
    run = tmp_path / "run"
    args = ["run.device=cpu", "tracker.name=none", "data.name=text", f"data.root={tmp_path / 'data'}",
            "data.seq_len=128", "data.batch_size=4", "trainer.max_steps=20", "trainer.log_every=5",
            "trainer.val_every=null", "optim.lr=3e-2", "optim.warmup_steps=1", f"model.init_from={tmp_path / 'base'}",
            "model.lora.r=8", f"run.output_dir={run}"]  # fmt: skip
    assert train_main(args) == 0
    losses = [record["train/loss"] for record in read_metrics(run) if "train/loss" in record]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(lora.is_adapter(name) for name in newest(run)["model"])
