"""Hugging Face GPT-2 in and out: model.init_from starts from a `transformers` GPT-2 folder (our
logits equal its logits), `export --format hf` writes a folder `transformers` loads back (equal
logits, and the tokenizer); a fine-tuning run from a GPT-2 or Llama folder resumes bit-exactly, and
two processes (FSDP, DDP) start from its weights. The models are small random ones made here,
offline (test_llama.py has the llama family's own folder tests)."""

import json
import sys

import pytest
import torch

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint
from {{ cookiecutter.package_name }}.engine.ckpt.restore import load_model_weights, model_and_task
from {{ cookiecutter.package_name }}.engine.config import load_config
from {{ cookiecutter.package_name }}.export import main as export_main
from {{ cookiecutter.package_name }}.prepare import main as prepare_main
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.task.task import Task
from {{ cookiecutter.package_name }}.train import main as train_main

from hf_folders import llama_folder

transformers = pytest.importorskip("transformers")

VOCAB = 32  # the synthetic source's symbols: a GPT-2 of this vocabulary trains on it
BASE = ["run.device=cpu", "tracker.name=none", "data.seq_len=16", "data.batch_size=4", f"data.vocab_size={VOCAB}",
        "data.train_tokens=4000", "data.val_tokens=500", "trainer.val_every=null", "trainer.log_every=1",
        "optim.warmup_steps=1"]  # fmt: skip


def gpt2_folder(path, vocab_size: int = VOCAB, layout: str = "model.safetensors"):
    """A random GPT-2 (2 layers, 2 heads, width 32, 64 positions) saved with save_pretrained, as
    model.safetensors, as pytorch_model.bin, or as the original GPT-2 on the hub has it ("hub": a .bin
    with names without "transformer.", its causal-mask buffers and the tied head written out)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # GPT-2 starts its biases at zero: random ones make the comparison bite
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.02)
    model.save_pretrained(str(path))  # config.json and model.safetensors (transformers 5 writes no .bin)
    if layout != "model.safetensors":
        state = dict(model.state_dict())  # what transformers 4 wrote to pytorch_model.bin
        if layout == "hub":
            state = {name.removeprefix("transformer."): tensor for name, tensor in state.items()}
            for layer in range(config.n_layer):
                state[f"h.{layer}.attn.bias"] = torch.ones(64, 64).tril().view(1, 1, 64, 64)
                state[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
        torch.save(state, path / "pytorch_model.bin")
        (path / "model.safetensors").unlink()
    return model


def our_model(overrides: list[str]):
    task = Task(load_config(SPEC, [], overrides), torch.device("cpu"))
    task.datasets()
    return task.build_model().eval(), task


@pytest.mark.parametrize("layout", ["model.safetensors", "pytorch_model.bin", "hub"])
def test_init_from_gives_the_logits_of_transformers(tmp_path, layout):
    """The folder's shape becomes the model keys (biases on, 64 positions), and our GPT computes the
    logits `transformers` computes, in float32 to 1e-5."""
    theirs = gpt2_folder(tmp_path / "gpt2", layout=layout)
    model, task = our_model([*BASE, f"model.init_from={tmp_path / 'gpt2'}"])
    shape = task.cfg.model
    assert (shape.n_layer, shape.n_head, shape.d_model, shape.n_positions, shape.bias) == (2, 2, 32, 64, True)
    tokens = torch.randint(VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the fast tier holds its 90 s (make test-all runs it)
def test_export_hf_loads_back_into_transformers(tmp_path):
    """`export --format hf` of a fine-tuned run and of a new model without biases (zeros are written
    for GPT-2's): AutoModelForCausalLM loads each, with the logits of our model from the checkpoint."""
    gpt2_folder(tmp_path / "gpt2")
    runs = {"finetuned": [f"model.init_from={tmp_path / 'gpt2'}"], "new": ["model.preset=nano", "model.arch=gpt2"]}
    for name, extra in runs.items():
        run = tmp_path / name
        assert train_main([*BASE, *extra, f"run.output_dir={run}", "trainer.max_steps=2"]) == 0
        assert export_main([f"run.output_dir={run}", "--format", "hf"]) == 0
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(run / "export" / "hf")).eval()
        path, state = latest_checkpoint(run / "checkpoints")  # rebuilt as evaluate and export do it
        task = Task(load_config(SPEC, [], BASE, base=model_and_task(state, path, SPEC)), torch.device("cpu"))
        task.datasets()
        model = task.build_model().eval()
        load_model_weights(model, state, path)
        tokens = torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(loaded(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
        config = json.loads((run / "export" / "hf" / "config.json").read_text())
        assert config["model_type"] == "gpt2" and config["n_positions"] == (64 if name == "finetuned" else 16)


@pytest.mark.slow  # the fast tier holds its 90 s (make test-all runs it)
def test_export_hf_carries_a_tokenizer_json(tmp_path):
    """A run prepared with a tokenizer.json exports it beside the weights: AutoTokenizer loads it and
    encodes as the run's tokenizer does."""
    tokenizers = pytest.importorskip("tokenizers")
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    (tmp_path / "corpus.txt").write_text(text)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet
    )
    tokenizer.train([str(tmp_path / "corpus.txt")], trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    data, run = tmp_path / "data", tmp_path / "run"
    tokens = ["--out", str(data), "--tokenizer", str(tmp_path / "tokenizer.json"), str(tmp_path / "corpus.txt")]
    assert prepare_main(tokens) == 0
    overrides = [*BASE[:2], "data.name=text", f"data.root={data}", "data.seq_len=16", "data.batch_size=4",
                 "model.preset=nano", "trainer.max_steps=1", f"run.output_dir={run}"]  # fmt: skip
    assert train_main(overrides) == 0
    assert export_main([f"run.output_dir={run}", "--format=hf"]) == 0
    loaded = transformers.AutoTokenizer.from_pretrained(str(run / "export" / "hf"))
    sample = "line 7: the quick brown fox"
    assert loaded(sample)["input_ids"] == tokenizer.encode(sample).ids
    assert loaded.eos_token == "<|endoftext|>"


@pytest.mark.slow  # the fast tier holds its 90 s (make test-all runs it)
def test_bad_folders_and_formats_are_one_line_errors(tmp_path, capsys, monkeypatch):
    """A folder without config.json, a GPT-2 this GPT cannot be (another LayerNorm epsilon), one of another
    vocabulary than the data's, one too short for data.seq_len, one whose weights are missing or garbled,
    an unknown export format, and export --format hf without transformers each exit 2 with one line that
    says what to do."""
    gpt2_folder(tmp_path / "wide", vocab_size=50)
    config = json.loads((tmp_path / "wide" / "config.json").read_text())
    for name, changes, weights in [("eps", {"layer_norm_epsilon": 1e-6}, b""), ("bare", {"vocab_size": VOCAB}, None),
                                   ("garbled", {"vocab_size": VOCAB}, b"not a safetensors file")]:  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **changes}))
        if weights is not None:
            (tmp_path / name / "model.safetensors").write_bytes(weights)
    capsys.readouterr()  # transformers' progress bars
    cases = [
        ([f"model.init_from={tmp_path / 'none'}"], "cannot read config.json"),
        ([f"model.init_from={tmp_path / 'eps'}"], "layer_norm_epsilon=1e-06 in config.json; this GPT has 1e-5"),
        ([f"model.init_from={tmp_path / 'wide'}"], "has a vocabulary of 50 tokens, the data's tokenizer 32"),
        ([f"model.init_from={tmp_path / 'wide'}", "model.n_layer=3"], "model.n_layer=3, but model.init_from"),
        ([f"model.init_from={tmp_path / 'wide'}", "data.seq_len=65"], "data.seq_len=65 is longer than model.n_pos"),
        ([f"model.init_from={tmp_path / 'bare'}"], "no weights (model.safetensors, model.safet"),
        ([f"model.init_from={tmp_path / 'garbled'}"], "model.safetensors: unreadable"),
    ]
    for number, (extra, message) in enumerate(cases):
        assert train_main([*BASE, *extra, f"run.output_dir={tmp_path / f'r{number}'}", "trainer.max_steps=1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert train_main([*BASE, "model.preset=nano", f"run.output_dir={tmp_path / 'ok'}", "trainer.max_steps=1"]) == 0
    capsys.readouterr()
    assert export_main([f"run.output_dir={tmp_path / 'ok'}", "--format", "onnx"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--format 'onnx': choose one of pt2" in err[0] and "hf:" in err[0], err
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: importing it fails
    assert export_main([f"run.output_dir={tmp_path / 'ok'}", "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the transformers package: pip install -e '.[hf]'" in err[0], err


def a_folder(path, family: str):
    """A random GPT-2, or Llama with grouped-query attention (2 key/value heads for 4 heads)."""
    if family == "gpt2":
        return gpt2_folder(path)
    return llama_folder(path, "llama", {"num_key_value_heads": 2}, vocab_size=VOCAB)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_fine_tuning_run_resumes_bit_exactly(tmp_path, final_weights, family):
    """From a GPT-2 or Llama folder: 6 steps straight, and 6 steps stopped after the checkpoint of
    step 3 and resumed by the same command with the folder moved (model.init_from may change on
    resume: the checkpoint holds the weights): the same weights."""
    from conftest import killed_when

    a_folder(tmp_path / "gpt2", family)
    common = [*BASE, "trainer.max_steps=6", "trainer.checkpoint_every=3"]
    assert train_main([*common, f"model.init_from={tmp_path / 'gpt2'}", f"run.output_dir={tmp_path / 'straight'}"]) == 0
    first = [*common, f"model.init_from={tmp_path / 'gpt2'}", f"run.output_dir={tmp_path / 'resumed'}"]
    killed_when(lambda metrics, step: step == 4, first)
    (tmp_path / "gpt2").rename(tmp_path / "moved")
    assert train_main([*common, f"model.init_from={tmp_path / 'moved'}", f"run.output_dir={tmp_path / 'resumed'}"]) == 0
    assert json.loads((tmp_path / "resumed" / "run_info.json").read_text())["runs"][-1]["resumed_from_step"] == 3
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "family"), [("fsdp", "llama"), ("ddp", "gpt2")])
def test_two_processes_start_from_the_folder_s_weights(tmp_path, strategy, family):
    """On 2 gloo processes, under FSDP (built on the meta device, each process copying in its shards;
    a Llama folder) and DDP (a GPT-2 folder), the first training loss is the one-process run's: both
    start from the folder's weights."""
    from conftest import torchrun

    a_folder(tmp_path / "gpt2", family)
    common = [*BASE, f"model.init_from={tmp_path / 'gpt2'}", "trainer.max_steps=1", "data.batch_size=2"]
    assert train_main([*common, "data.batch_size=4", f"run.output_dir={tmp_path / 'one'}"]) == 0
    torchrun(2, [*common, f"distributed.strategy={strategy}", f"run.output_dir={tmp_path / strategy}"])
    losses = {}
    for name in ("one", strategy):
        lines = [json.loads(s) for s in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = next(line["train/loss"] for line in lines if "train/loss" in line)
    assert losses[strategy] == pytest.approx(losses["one"], rel=1e-5)
