"""Hugging Face GPT-2 in and out: a local `transformers` GPT-2 folder as the starting weights
(model.init_from), and a trained model written as one (`export --format hf`).

A GPT-2 folder holds config.json and model.safetensors (or pytorch_model.bin). Its transformer is
this project's GPT with Linear biases (model.bias=true): the same pre-norm blocks, tanh GELU,
LayerNorm eps 1e-5, learned positions and the head tied to the token embedding. GPT-2 stores its
Linear layers as Conv1D, weight (in, out): they are transposed on the way in and out. Reading
needs only torch and safetensors; writing uses `transformers` (the `hf` extra) for config.json and
the tokenizer's files, so that what it writes is what the installed `transformers` reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from ..engine.errors import ConfigError, DataError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # GELU, tanh approximation: this GPT's
EXTRA = "pip install -e '.[hf]'"


def read_config(folder: str | Path) -> dict:
    """config.json of a GPT-2 folder, checked to be a model this GPT can be: its shape as
    {n_layer, n_head, d_model, n_positions, vocab_size}."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.init_from={str(folder)!r}: cannot read config.json ({err})") from None
    where = f"model.init_from={str(folder)!r}"
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise ConfigError(f"{where}: config.json is not a GPT-2 model (model_type {kind!r}); only gpt2 loads")
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
            raise ConfigError(f"{where}: {key}={config.get(key)!r} in config.json; this GPT has {wanted}")
    try:
        return {
            "arch": "gpt2",
            "bias": True,
            "n_layer": int(config["n_layer"]),
            "n_head": int(config["n_head"]),
            "d_model": int(config["n_embd"]),
            "n_positions": int(config["n_positions"]),
            "vocab_size": int(config["vocab_size"]),
        }
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(
            f"{where}: config.json lacks {err} (n_layer, n_head, n_embd, n_positions, vocab_size)"
        ) from None


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The folder's weights by this GPT's parameter names (Conv1D weights transposed, the tied head
    and attention-mask buffers left out)."""
    folder = Path(folder)
    path = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if path is None:
        raise ConfigError(f"model.init_from={str(folder)!r}: no {' or '.join(WEIGHT_FILES)}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and torch.load raise their own kinds
        raise DataError(f"{path}: unreadable ({err})") from None
    ours = {}
    for name, tensor in state.items():
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the head is the token embedding; the rest are causal-mask buffers
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
    """The model's weights by GPT-2's names, Linear weights transposed to Conv1D's (in, out), zero
    biases where the model has none (model.bias=false): GPT-2 always has them."""
    params = {name: tensor.detach().float().cpu() for name, tensor in model.state_dict().items()}
    out = {}
    for name, tensor in params.items():
        hf_name = _hf(name)
        out[hf_name] = tensor.t().contiguous() if _is_conv1d(hf_name) else tensor.contiguous()
        if name.endswith(".weight") and _is_conv1d(hf_name) and name.removesuffix("weight") + "bias" not in params:
            out[hf_name.removesuffix("weight") + "bias"] = torch.zeros(tensor.shape[0])
    return out


@torch.no_grad()
def load_into(model: nn.Module, weights: dict[str, torch.Tensor], folder: str | Path) -> None:
    """Copy the folder's weights into the model's parameters (this process's shards of them under FSDP)."""
    from ..engine.parallel.meta_init import copy_into

    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise DataError(
            f"model.init_from={str(folder)!r}: its weights do not fit this GPT "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for name, param in params.items():
        if tuple(weights[name].shape) != tuple(param.shape):
            raise DataError(
                f"model.init_from={str(folder)!r}: {name} has shape {tuple(weights[name].shape)}, "
                f"config.json says {tuple(param.shape)}"
            )
        copy_into(param, weights[name].to(param.dtype))


def write_folder(model: nn.Module, folder: Path, tokenizer, eot: int | None) -> None:
    """A `transformers` GPT-2 folder of the model: config.json, model.safetensors, and for a
    tokenizer.json run the tokenizer's files (AutoTokenizer loads them)."""
    try:
        from transformers import GPT2Config, PreTrainedTokenizerFast
    except ImportError:
        raise ConfigError(f"export --format hf needs the transformers package: {EXTRA}") from None
    from safetensors.torch import save_file

    shape = model.shape
    config = GPT2Config(
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
    staging = folder.with_name(f".{folder.name}.partial")  # the folder appears complete or not at all
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config.save_pretrained(str(staging))
    save_file(hf_state(model), str(staging / "model.safetensors"), metadata={"format": "pt"})
    if getattr(tokenizer, "json", None) is not None:
        from tokenizers import Tokenizer

        end = tokenizer.tokenizer.id_to_token(eot) if eot is not None else None
        fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.json.decode("utf-8")))
        if end is not None:
            fast.add_special_tokens({"eos_token": end, "bos_token": end})
        fast.save_pretrained(str(staging))
    if folder.exists():
        shutil.rmtree(folder)  # an earlier export of this run, written again
    staging.rename(folder)
