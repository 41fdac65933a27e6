"""The llama family against transformers' own Llama, Qwen2 and Mistral: the same logits from the
same weights (renamed, never permuted), grouped-query attention, rotary scaling, published sizes,
and generation with a key/value cache giving the tokens of generation without one."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint, list_checkpoints
from {{ cookiecutter.package_name }}.engine.ckpt.restore import load_model_weights
from {{ cookiecutter.package_name }}.engine.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.export import main as export_main
from {{ cookiecutter.package_name }}.generate import main as generate_main
from {{ cookiecutter.package_name }}.prepare import main as prepare_main
from {{ cookiecutter.package_name }}.task.config import SPEC, ModelConfig
from {{ cookiecutter.package_name }}.task.model import PRESETS, ModelShape, architecture, build_model, hf
from {{ cookiecutter.package_name }}.task.sampling import sample
from {{ cookiecutter.package_name }}.task.task import Task
from {{ cookiecutter.package_name }}.train import main

from conftest import TINY, in_full, torchrun
from hf_folders import bpe_tokenizer, llama_folder, transformers_model

transformers = pytest.importorskip("transformers")

VOCAB = 61
# name: (transformers model_type, config.json keys); positions go beyond original contexts of 16.
CASES = {
    "llama-kv1": ("llama", {"num_key_value_heads": 1}),
    "llama-kv2": ("llama", {"num_key_value_heads": 2}),
    "llama-kv4-untied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": False}),
    "llama-theta500k": ("llama", {"num_key_value_heads": 2, "rope_theta": 500_000.0}),
    "llama3-factor8": ("llama", {"num_key_value_heads": 2, "rope_scaling": ("llama3", 8.0)}),
    "llama3-factor32": ("llama", {"num_key_value_heads": 2, "rope_scaling": ("llama3", 32.0)}),
    "qwen2-tied": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "mistral": ("mistral", {"num_key_value_heads": 2, "sliding_window": None}),
}


def _ours_for(config) -> ModelConfig:
    rope = config.rope_parameters
    scaled = rope.get("rope_type") == "llama3"
    return ModelConfig(
        arch="llama",
        n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads,
        d_model=config.hidden_size,
        n_kv_head=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        rope_theta=rope["rope_theta"],
        rope_scaling="llama3" if scaled else None,
        rope_factor=rope.get("factor") if scaled else None,
        rope_original_context=rope.get("original_max_position_embeddings") if scaled else None,
        norm_eps=config.rms_norm_eps,
        bias=config.model_type == "qwen2",
        tie_embeddings=config.tie_word_embeddings,
    )


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers_from_the_same_weights(case):
    """Element-wise equal logits (float32 defaults of assert_close) at 48 positions, past the
    original context of the llama3 cases, with the state dict loaded by names alone."""
    theirs, config = transformers_model(*CASES[case], vocab_size=VOCAB)
    ours = build_model(_ours_for(config), vocab_size=VOCAB, seq_len=48).eval()
    state = {name.removeprefix("model."): tensor for name, tensor in theirs.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    assert sorted(state) == sorted(ours.state_dict())
    ours.load_state_dict(state)
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits)


def test_published_presets_have_their_models_parameter_counts():
    """Each model preset, built on the meta device with its vocabulary, has the parameters
    transformers' own class of that shape has (SmolLM2-135M: 134,515,008)."""
    vocabularies = {"smollm2-135m": 49152, "smollm2-360m": 49152, "qwen2.5-0.5b": 151936, "llama3.2-1b": 128256}
    counts = {}
    for preset, vocab in vocabularies.items():
        with torch.device("meta"):
            model = architecture(ModelShape.of(ModelConfig(preset=preset), vocab_size=vocab, seq_len=2048))
        counts[preset] = sum(p.numel() for p in model.parameters())
    assert counts["smollm2-135m"] == 134_515_008
    assert counts["smollm2-360m"] == 361_821_120
    assert counts["qwen2.5-0.5b"] == 494_032_768
    assert counts["llama3.2-1b"] == 1_235_814_400


def test_size_presets_give_llama_grouped_query_attention_and_as_many_parameters():
    for preset in ("nano", "micro", "mini", "small"):
        llama = ModelShape.of(ModelConfig(preset=preset, arch="llama"), vocab_size=257, seq_len=64)
        assert llama.n_kv_head == PRESETS[preset]["n_kv_head"] < llama.n_head
        with torch.device("meta"):
            sizes = [
                sum(p.numel() for p in build_model(ModelConfig(preset=preset, arch=arch), 257, 64).parameters())
                for arch in ("llama", "gpt2")
            ]
        assert 0.85 < sizes[0] / sizes[1] < 1.05, (preset, sizes)  # gpt2 adds a position table and biases of norms


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cached_generation_gives_the_tokens_of_uncached_generation(arch):
    """Greedy generation with a key/value cache equals generation that reruns the window for each
    token, past the end of the context (where both run the last seq_len tokens afresh)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="nano", arch=arch), vocab_size=VOCAB, seq_len=24).eval()
    prompt = [3, 14, 15, 9, 2]
    cached = sample(model, prompt, 40, seq_len=24, temperature=0)
    uncached = sample(model, prompt, 40, seq_len=24, temperature=0, cache=False)
    assert cached == uncached and len(cached) == 40
    drawn = [sample(model, prompt, 20, 24, 1.0, 5, torch.Generator().manual_seed(7), cache=c) for c in (True, False)]
    assert drawn[0] == drawn[1]


def test_llama_keys_are_checked_and_refused_for_gpt2():
    """Sizes that cannot fit, and llama's keys on a gpt2 model, are one-line configuration errors."""
    refused = {
        "model.arch=llama model.n_kv_head=3": "model.n_kv_head=3 does not divide model.n_head=4",
        "model.arch=gpt2 model.n_kv_head=2": "model.n_kv_head is a key of model.arch=llama",
        "model.preset=gpt2 model.rope_theta=1e6": "model.rope_theta is a key of model.arch=llama",
        "model.arch=mamba": "model.arch='mamba' is not allowed",
        "model.arch=llama model.rope_scaling=yarn": "model.rope_scaling='yarn' is not allowed",
        "model.arch=gpt2 model.tie_embeddings=false": "GPT-2's output layer is its token embedding",
    }
    for overrides, says in refused.items():
        with pytest.raises(ConfigError, match=says):
            load_config(SPEC, [], overrides.split())
    assert load_config(SPEC, [], ["model.preset=smollm2-135m"]).model.arch == "llama"


def test_a_llama_run_resumes_exactly_exports_and_generates(tmp_path, capsys):
    """A nano llama trains; a run stopped after step 2 resumes to the very weights of a run never
    stopped; torch.export's program gives the model's logits; generate samples from it."""
    settings = [*TINY, "model.arch=llama", "trainer.checkpoint_every=2", "trainer.keep_last=10"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main([*settings, f"run.output_dir={straight}"]) == 0
    assert main([*settings, f"run.output_dir={resumed}", "trainer.max_steps=2"]) == 0
    assert len(list_checkpoints(resumed / "checkpoints")) == 1
    assert main([*settings, f"run.output_dir={resumed}"]) == 0
    final = [latest_checkpoint(run / "checkpoints")[1] for run in (straight, resumed)]
    assert final[0]["progress"] == final[1]["progress"]
    assert final[0]["model"].keys() == final[1]["model"].keys()
    assert all(torch.equal(final[0]["model"][k], final[1]["model"][k]) for k in final[0]["model"])
    assert "layers.0.self_attn.k_proj.weight" in final[0]["model"]

    assert export_main([f"run.output_dir={straight}"]) == 0
    model = build_model(ModelConfig(preset="nano", arch="llama"), vocab_size=32, seq_len=16).eval()
    model.load_state_dict(final[0]["model"])
    program = torch.export.load(straight / "export" / "model.pt2").module()
    tokens = torch.randint(0, 32, (3, 7))
    torch.testing.assert_close(program(tokens), model(tokens))
    capsys.readouterr()
    assert generate_main([f"run.output_dir={straight}", "--prompt", "abc", "--max-new-tokens", "20"]) == 0
    assert len(capsys.readouterr().out.strip()) == 23


RUNS = ("one", "other", "two")


@pytest.mark.slow
def test_fsdp_on_two_processes_trains_a_llama_like_one_process(tmp_path):
    """FSDP2 shards each decoder layer of a llama over 2 gloo processes (batch 4 each) and trains
    like 1 process with batch 8: float rounding only, 20x closer than other batches."""
    settings = [*TINY, "model.arch=llama", "trainer.max_steps=4"]
    for name, batch in (("one", 8), ("other", 4)):
        assert main([*settings, f"data.batch_size={batch}", f"run.output_dir={tmp_path / name}"]) == 0
    torchrun(2, [*settings, "data.batch_size=4", "distributed.strategy=fsdp", f"run.output_dir={tmp_path / 'two'}"])
    one, other, two = (in_full(latest_checkpoint(tmp_path / run / "checkpoints")[1])["model"] for run in RUNS)
    gap = lambda a, b: sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a).sqrt().item()  # noqa: E731
    assert gap(one, two) < gap(one, other) / 20


# Hugging Face folders of the llama family. name: (model_type, config.json keys, embedding rows
# beyond the tokenizer's, sharded weights, config.json in transformers 4's keys).
FOLDERS = {
    "llama-v4-llama3-untied": ("llama", {"num_key_value_heads": 2, "rope_scaling": ("llama3", 8.0)}, 0, False, True),
    "qwen2-sharded-padded-tied": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}, 5, True, False),
    "mistral-window": ("mistral", {"num_key_value_heads": 1, "sliding_window": 32}, 0, False, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", FOLDERS)
def test_a_folder_gives_its_logits_exports_bit_for_bit_and_loads_back(tmp_path, capsys, case):
    """model.init_from reads the folder (config.json of transformers 4 or 5, sharded safetensors, a
    tied head not written, an embedding padded beyond the tokenizer, a sliding window capping the
    context): our logits equal transformers'. Written out again (export's writer), its tensors are the
    folder's bit for bit, under the same names, and load (with the configuration this project writes
    for a model of its own: Llama, or Qwen2 for q/k/v biases) with the same logits. After training,
    `export --format hf` loads in AutoModelForCausalLM as the folder's class with our logits, and
    AutoTokenizer loads the tokenizer with
    its end token and chat template; generate samples only the tokenizer's ids, cached as uncached."""
    model_type, keys, padding, shards, v4 = FOLDERS[case]
    folder, data, corpus = tmp_path / "folder", tmp_path / "data", tmp_path / "corpus.txt"
    tokenizer = bpe_tokenizer(folder, corpus)
    vocab = tokenizer.get_vocab_size() + padding
    theirs = llama_folder(folder, model_type, keys, vocab, shards=shards, v4=v4)
    assert prepare_main(["--out", str(data), "--tokenizer", str(folder / "tokenizer.json"), str(corpus)]) == 0
    settings = ["run.device=cpu", "tracker.name=none", "data.name=text", f"data.root={data}", "data.seq_len=16",
                "data.batch_size=4", "trainer.val_every=null", "optim.warmup_steps=1",
                f"model.init_from={folder}"]  # fmt: skip
    task = Task(load_config(SPEC, [], settings), torch.device("cpu"))
    task.datasets()
    model = task.build_model().eval()
    window = 32 if "sliding_window" in keys else 64
    assert (task.cfg.model.arch, task.cfg.model.vocab_size, task.cfg.model.n_positions) == ("llama", vocab, window)
    tokens = torch.randint(0, vocab - padding, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs(tokens).logits)
    hf.write_folder(model, tmp_path / "again", task.data.tokenizer, task.data.tokenizer.eot)
    source, again = hf.read_state(folder), load_file(tmp_path / "again" / "model.safetensors")
    assert source.keys() == again.keys() and ("lm_head.weight" in again) != theirs.config.tie_word_embeddings
    assert all(torch.equal(source[name], again[name]) for name in source)
    rebuilt = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).eval()  # no source config:
    assert type(rebuilt).__name__ == ("Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM")  # ours
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(tokens).logits, theirs(tokens).logits)

    run = tmp_path / "run"
    assert main([*settings, f"run.output_dir={run}", "trainer.max_steps=2"]) == 0
    assert export_main([f"run.output_dir={run}", "--format", "hf"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(run / "export" / "hf")).eval()
    classes = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    assert type(exported).__name__ == classes[model_type]  # the class the fine-tune started from
    path, state = latest_checkpoint(run / "checkpoints")
    load_model_weights(model, state, path)
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, model(tokens))
    loaded = transformers.AutoTokenizer.from_pretrained(str(run / "export" / "hf"))
    chat = [{"role": "user", "content": "the quick brown fox"}]
    assert loaded.apply_chat_template(chat, tokenize=False) == "<|im_start|>user\nthe quick brown fox<|im_end|>\n"
    assert loaded("line 7: the fox")["input_ids"] == tokenizer.encode("line 7: the fox").ids
    assert loaded.eos_token == "<|endoftext|>"
    capsys.readouterr()
    outputs = []
    for flags in ([], ["--no-cache"]):
        assert generate_main([f"run.output_dir={run}", "--prompt", "line", "--temperature", "0", *flags]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0]) > len("line")


@pytest.mark.slow
def test_folders_that_cannot_be_computed_are_one_line_errors(tmp_path, capsys):
    """Another architecture, a setting the llama family does not compute (an activation, output
    biases, a RoPE type, a partial rotary), a missing weight, a missing shard and data prepared with
    another tokenizer than the folder's each exit 2 with one line naming what is wrong."""
    llama_folder(tmp_path / "base", "llama", {"num_key_value_heads": 2}, vocab_size=32, shards=True)
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    index = json.loads((tmp_path / "base" / "model.safetensors.index.json").read_text())
    edits = {
        "phi3": ({"model_type": "phi3"}, "model_type 'phi3' is not one this project computes"),
        "gelu": ({"hidden_act": "gelu"}, "hidden_act='gelu' in config.json; this project's llama has 'silu'"),
        "obias": ({"attention_bias": True}, "attention_bias=True in config.json"),
        "yarn": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope type 'yarn'"),
        "partial": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 in config.json"),
    }
    for name, (changes, _) in edits.items():
        shutil.copytree(tmp_path / "base", tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **changes}))
    shutil.copytree(tmp_path / "base", tmp_path / "noshard")
    (tmp_path / "noshard" / sorted(set(index["weight_map"].values()))[-1]).unlink()
    shutil.copytree(tmp_path / "base", tmp_path / "noweight")
    one = next(name for name, file in index["weight_map"].items() if name.endswith("layers.1.mlp.down_proj.weight"))
    shard = tmp_path / "noweight" / index["weight_map"][one]
    save_file({k: v for k, v in load_file(shard).items() if k != one}, shard, metadata={"format": "pt"})
    shutil.copytree(tmp_path / "base", tmp_path / "tokenized")
    bpe_tokenizer(tmp_path / "tokenized", tmp_path / "corpus.txt")
    cases = {name: says for name, (_, says) in edits.items()}
    cases |= {
        "noshard": "model.safetensors.index.json names model-",
        "noweight": "its weights do not fit this model (missing ['layers.1.mlp.down_proj.weight']",
        "tokenized": "comes with the tokenizer tokenizer.json",
    }
    capsys.readouterr()
    for name, says in cases.items():
        out = f"run.output_dir={tmp_path / f'run-{name}'}"
        assert main([*TINY, "data.vocab_size=32", f"model.init_from={tmp_path / name}", out]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], (name, err)
