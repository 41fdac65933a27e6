"""Hugging Face folders in and out: a local `transformers` model folder as the starting weights
(model.init_from), and a trained model written as one (`export --format hf`).

Two families load:
- GPT-2 (model_type gpt2): this project's gpt2 with Linear biases (model.bias=true): the same
  pre-norm blocks, tanh GELU, LayerNorm eps 1e-5, learned positions and the head tied to the token
  embedding. GPT-2 stores its Linear layers as Conv1D, weight (in, out): they are transposed on the
  way in and out.
- Llama, Qwen2 and Mistral (model_type llama, qwen2, mistral): this project's llama, whose modules
  carry their names: weights load by removing "model." (no permutation). config.json is read in
  the keys of transformers 5 (rope_parameters) and of 4 (rope_theta, rope_scaling). What the llama
  family cannot compute (another activation, MLP or output biases, a RoPE type other than default
  and llama3, a partial rotary, ...) is refused, naming the key. A sliding window (Mistral's,
  Qwen2's) caps the model's context (model.n_positions) at the window, where it changes nothing.
  Export writes a fine-tune as the class of the folder it started from (its config.json travels
  with the run), and a model trained here as qwen2 with q/k/v biases, llama otherwise.

Weights are read from model.safetensors, pytorch_model.bin, or either one sharded with its index
(model.safetensors.index.json). Reading needs only torch and safetensors; writing uses
`transformers` (the `hf` extra) for config.json and the tokenizer's files, so that what it writes
is what the installed `transformers` reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from ...engine.errors import ConfigError, DataError
from .lora import TARGETS, adapted, adapter_state, is_adapter, merged_state

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
WEIGHT_FILES += ("pytorch_model.bin.index.json",)
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # GELU, tanh approximation: this GPT's
LLAMA_TYPES = ("llama", "qwen2", "mistral")
EXTRA = "pip install -e '.[hf]'"


def _where(folder) -> str:
    return f"model.init_from={str(folder)!r}"


def read_config(folder: str | Path) -> dict:
    """config.json of a Hugging Face folder, checked to be a model this project can compute: its
    shape in the model keys (arch, n_layer, n_head, d_model, n_positions, vocab_size, ...)."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{_where(folder)}: cannot read config.json ({err})") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in ("gpt2", *LLAMA_TYPES):
        raise ConfigError(
            f"{_where(folder)}: config.json's model_type {kind!r} is not one this project computes "
            f"(gpt2, {', '.join(LLAMA_TYPES)})"
        )
    try:
        return _gpt2_config(config, folder) if kind == "gpt2" else _llama_config(config, folder)
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{_where(folder)}: config.json lacks or garbles {err}") from None


def _gpt2_config(config: dict, folder) -> dict:
    checks = {
        "activation_function": (config.get("activation_function", "gelu_new") in ACTIVATIONS, "gelu_new"),
        "layer_norm_epsilon": (config.get("layer_norm_epsilon", 1e-5) == 1e-5, "1e-5"),
        "n_inner": (config.get("n_inner") in (None, 4 * config.get("n_embd", 0)), "4 x n_embd"),
        "scale_attn_weights": (config.get("scale_attn_weights", True) is True, "true"),
        "scale_attn_by_inverse_layer_idx": (not config.get("scale_attn_by_inverse_layer_idx", False), "false"),
        "tie_word_embeddings": (config.get("tie_word_embeddings", True) is True, "true"),
    }
    for key, (holds, wanted) in checks.items():
        if not holds:
            raise ConfigError(f"{_where(folder)}: {key}={config.get(key)!r} in config.json; this GPT has {wanted}")
    return {
        "arch": "gpt2",
        "bias": True,
        "n_layer": int(config["n_layer"]),
        "n_head": int(config["n_head"]),
        "d_model": int(config["n_embd"]),
        "n_positions": int(config["n_positions"]),
        "vocab_size": int(config["vocab_size"]),
    }


def _rope(config: dict) -> dict:
    """The rotary settings in transformers 5's form ({rope_type, rope_theta, factor, ...}), from its
    rope_parameters or from transformers 4's rope_theta and rope_scaling."""
    if isinstance(config.get("rope_parameters"), dict):
        rope = dict(config["rope_parameters"])
    else:
        rope = dict(config.get("rope_scaling") or {})
        rope.setdefault("rope_theta", config.get("rope_theta", 10_000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def _llama_config(config: dict, folder) -> dict:
    kind, where, rope = config["model_type"], _where(folder), _rope(config)
    refusals = {  # key: (what this project's llama computes, the folder's value)
        "hidden_act": ("silu", config.get("hidden_act", "silu")),
        "mlp_bias": (False, config.get("mlp_bias", False)),
        "attention_bias": (False, config.get("attention_bias", False) if kind != "qwen2" else False),
        "partial_rotary_factor": (1.0, rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))),
        "num_experts": (None, config.get("num_experts", config.get("num_local_experts"))),
    }  # fmt: skip
    for key, (ours, theirs) in refusals.items():
        if theirs != ours:
            raise ConfigError(f"{where}: {key}={theirs!r} in config.json; this project's llama has {ours!r}")
    if rope["rope_type"] not in ("default", "llama3"):
        raise ConfigError(
            f"{where}: rope type {rope['rope_type']!r} in config.json; this project's llama has default and llama3"
        )
    n_head, d_model = int(config["num_attention_heads"]), int(config["hidden_size"])
    positions = int(config["max_position_embeddings"])
    window = config.get("sliding_window")
    layers = config.get("layer_types") or []
    in_use = {"mistral": window is not None, "qwen2": config.get("use_sliding_window", False)}.get(kind, False)
    if window and (in_use or "sliding_attention" in layers):
        positions = min(positions, int(window))  # within the window, sliding attention is full attention
    shape = {
        "arch": "llama",
        "bias": kind == "qwen2",
        "n_layer": int(config["num_hidden_layers"]),
        "n_head": n_head,
        "d_model": d_model,
        "n_kv_head": int(config.get("num_key_value_heads") or n_head),
        "head_dim": int(config.get("head_dim") or d_model // n_head),
        "intermediate_size": int(config["intermediate_size"]),
        "rope_theta": float(rope["rope_theta"]),
        "rope_scaling": None,
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "n_positions": positions,
        "vocab_size": int(config["vocab_size"]),
    }
    if rope["rope_type"] == "llama3":
        shape |= {
            "rope_scaling": "llama3",
            "rope_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_context": int(rope["original_max_position_embeddings"]),
        }
    return shape


def read_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight file, or of the shards its index names."""
    path = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if path is None:
        raise ConfigError(f"{_where(folder)}: no weights ({', '.join(WEIGHT_FILES)})")
    files = [path]
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
            files = [folder / name for name in dict.fromkeys(weight_map.values())]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise DataError(f"{path}: unreadable ({err!r})") from None
    state = {}
    for file in files:
        if not file.is_file():
            raise DataError(f"{path} names {file.name}, which is not in the folder")
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                state |= load_file(str(file))
            else:
                state |= torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # safetensors and torch.load raise their own kinds
            raise DataError(f"{file}: unreadable ({err})") from None
    return state


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The folder's weights by this project's parameter names (GPT-2's Conv1D weights transposed; a
    tied head, rotary tables and attention-mask buffers left out)."""
    folder = Path(folder)
    tied = read_config(folder).get("tie_embeddings", True)
    ours = {}
    for name, tensor in read_state(folder).items():
        if name == "lm_head.weight" and tied:
            continue  # the head is the token embedding
        if name.startswith(("model.", "lm_head.")):  # the llama family: the names are ours
            if not name.endswith("rotary_emb.inv_freq"):
                ours[name.removeprefix("model.")] = tensor
            continue
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers
        ours[_ours(name)] = tensor.t().contiguous() if _is_conv1d(name) else tensor
    return ours


def _is_conv1d(hf_name: str) -> bool:
    return hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))


RENAMES = (  # GPT-2's names (without "transformer.") -> this GPT's, by prefix within a block
    ("ln_1.", "norm1."),
    ("ln_2.", "norm2."),
    ("attn.c_attn.", "attn.qkv."),
    ("attn.c_proj.", "attn.proj."),
    ("mlp.c_fc.", "mlp.0."),
    ("mlp.c_proj.", "mlp.2."),
)
TOP = {"wte.weight": "tok_emb.weight", "wpe.weight": "pos_emb.weight", "ln_f.weight": "norm.weight"}
TOP |= {"ln_f.bias": "norm.bias"}
TOP_OURS = {ours: theirs for theirs, ours in TOP.items()}


def _ours(hf_name: str) -> str:
    if hf_name in TOP:
        return TOP[hf_name]
    if hf_name.startswith("h."):
        _, index, rest = hf_name.split(".", 2)
        for old, new in RENAMES:
            if rest.startswith(old):
                return f"blocks.{index}.{new}{rest.removeprefix(old)}"
    return hf_name  # unknown: load_into names it


def _hf(our_name: str) -> str:
    if our_name in TOP_OURS:
        return "transformer." + TOP_OURS[our_name]
    _, index, rest = our_name.split(".", 2)
    for old, new in RENAMES:
        if rest.startswith(new):
            return f"transformer.h.{index}.{old}{rest.removeprefix(new)}"
    raise ValueError(f"no GPT-2 name for {our_name}")


def hf_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights by Hugging Face's names (float32). gpt2: Linear weights transposed to
    Conv1D's (in, out), zero biases where the model has none (model.bias=false: GPT-2 always has
    them); llama: "model." before all but lm_head, which a tied model does not write."""
    state = merged_state(model) if adapted(model) else model.state_dict()  # adapters merged into their layers
    return hf_names({name: tensor.detach().float().cpu().contiguous() for name, tensor in state.items()}, model)


def hf_names(params: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors by this project's names -> by Hugging Face's (see hf_state); an adapter's tensors
    (layer.lora_A.weight, ...) take their layer's name, as peft names them (A [r, in] and B [out, r]
    are Linear layers in peft for GPT-2's Conv1D too: they are not transposed)."""
    if model.shape.arch == "llama":
        return {name if name == "lm_head.weight" else f"model.{name}": tensor for name, tensor in params.items()}
    out = {}
    for name, tensor in params.items():
        hf_name = _hf(name)
        out[hf_name] = tensor.t().contiguous() if _is_conv1d(hf_name) else tensor
        if name.endswith(".weight") and _is_conv1d(hf_name) and name.removesuffix("weight") + "bias" not in params:
            out[hf_name.removesuffix("weight") + "bias"] = torch.zeros(tensor.shape[0])
    return out


@torch.no_grad()
def load_into(model: nn.Module, weights: dict[str, torch.Tensor], folder: str | Path) -> None:
    """Copy the folder's weights into the model's parameters (this process's shards of them under FSDP)."""
    from ...engine.parallel.meta_init import copy_into

    params = {name: param for name, param in model.named_parameters() if not is_adapter(name)}
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise DataError(
            f"model.init_from={str(folder)!r}: its weights do not fit this model "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for name, param in params.items():
        if tuple(weights[name].shape) != tuple(param.shape):
            raise DataError(
                f"model.init_from={str(folder)!r}: {name} has shape {tuple(weights[name].shape)}, "
                f"config.json says {tuple(param.shape)}"
            )
        copy_into(param, weights[name].to(param.dtype))


def hf_config(shape, eot: int | None):
    """The `transformers` configuration of a model's shape: GPT2Config, or for the llama family
    Qwen2Config (q/k/v biases) or LlamaConfig. Rotary settings go in transformers 4's keys, which
    transformers 5 reads as well."""
    import transformers

    if shape.arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=shape.vocab_size,
            n_positions=shape.positions,
            n_embd=shape.d_model,
            n_layer=shape.n_layer,
            n_head=shape.n_head,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=1e-5,
            bos_token_id=eot,
            eos_token_id=eot,
            tie_word_embeddings=True,
            architectures=["GPT2LMHeadModel"],
        )
    scaling = None
    if shape.rope_scaling:
        factor, low, high, original = shape.rope_scaling
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high}
        scaling["original_max_position_embeddings"] = original
    keys = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.d_model,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.n_layer,
        "num_attention_heads": shape.n_head,
        "num_key_value_heads": shape.n_kv_head,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.positions,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": scaling,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "tie_word_embeddings": shape.tie_embeddings,
        "bos_token_id": eot,
        "eos_token_id": eot,
    }
    if shape.bias:
        return transformers.Qwen2Config(**keys, use_sliding_window=False, architectures=["Qwen2ForCausalLM"])
    return transformers.LlamaConfig(**keys, attention_bias=False, mlp_bias=False, architectures=["LlamaForCausalLM"])


STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _source_config(source: bytes | None, arch: str, keep_dtype: bool = False) -> dict | None:
    """The starting folder's config.json, if it is of the model's family, with float32 weights (keep_dtype:
    with its own dtype, which the weights are stored in)."""
    if source is None:
        return None
    config = json.loads(source)
    kind = config.get("model_type")
    if (kind == "gpt2") != (arch == "gpt2") or kind not in ("gpt2", *LLAMA_TYPES):
        return None
    for key in ("torch_dtype", "dtype"):  # transformers 4's name, 5's
        if key in config and not (keep_dtype and config[key] in STORED_DTYPES):
            config[key] = "float32"
    return config


def stored_dtype(config: dict | None) -> torch.dtype:
    """The dtype a config.json says its weights are stored in (float32 when it says none)."""
    config = config or {}
    return STORED_DTYPES.get(config.get("dtype") or config.get("torch_dtype"), torch.float32)


PEFT_PREFIX = "base_model.model."


def peft_config(lora, arch: str, base: str) -> dict:
    """adapter_config.json of a LoRA run (lora: model.lora), as peft's LoraConfig writes it."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.targets or TARGETS[arch]),
        "bias": "none",
        "use_rslora": lora.rslora,
        "use_dora": lora.dora,
        "fan_in_fan_out": arch == "gpt2",  # GPT-2's Conv1D layers hold their weights (in, out)
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft(model: nn.Module, folder: Path, lora, base: str) -> None:
    """A PEFT adapter folder of the model's adapters (export --format peft): adapter_config.json and
    adapter_model.safetensors with peft's names, which PeftModel.from_pretrained loads over the base."""
    from safetensors.torch import save_file

    if not adapted(model):
        raise ConfigError("export --format peft: this run trained no adapters (model.lora.r=0); use --format hf")
    staging = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tensors = {PEFT_PREFIX + name: tensor for name, tensor in hf_names(adapter_state(model), model).items()}
    save_file(tensors, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_config(lora, model.shape.arch, base)
    (staging / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)


def write_folder(model: nn.Module, folder: Path, tokenizer, eot: int | None, source: bytes | None = None) -> None:
    """A `transformers` folder of the model: config.json, model.safetensors and, for a tokenizer.json
    run, the tokenizer's files (AutoTokenizer loads them): the files it came with
    (tokenizer_config.json: special tokens, chat template) as they are, else a tokenizer_config.json
    naming its end-of-text token. config.json is source's (the config.json of the folder a fine-tune
    started from: its class, Mistral's sliding window, its token ids; the weights' dtype now
    float32), else hf_config's: GPT-2, Llama or Qwen2."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise ConfigError(f"export --format hf needs the transformers package: {EXTRA}") from None
    from safetensors.torch import save_file

    staging = folder.with_name(f".{folder.name}.partial")  # the folder appears complete or not at all
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    merged = adapted(model)  # adapters merged in float32, stored in the base's dtype
    source_config = _source_config(source, model.shape.arch, keep_dtype=merged)
    if source_config is not None:
        (staging / "config.json").write_text(json.dumps(source_config, indent=2) + "\n", encoding="utf-8")
    else:
        hf_config(model.shape, eot).save_pretrained(str(staging))
    dtype = stored_dtype(source_config) if merged else torch.float32
    state = {name: tensor.to(dtype) for name, tensor in hf_state(model).items()}
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    if getattr(tokenizer, "companions", None):
        (staging / "tokenizer.json").write_bytes(tokenizer.json)
        for name, content in tokenizer.companions.items():
            (staging / name).write_bytes(content)
    elif getattr(tokenizer, "json", None) is not None:
        from tokenizers import Tokenizer

        end = tokenizer.tokenizer.id_to_token(eot) if eot is not None else None
        fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.json.decode("utf-8")))
        if end is not None:
            fast.add_special_tokens({"eos_token": end, "bos_token": end})
        fast.save_pretrained(str(staging))
    if folder.exists():
        shutil.rmtree(folder)  # an earlier export of this run, written again
    staging.rename(folder)
