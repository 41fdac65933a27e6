"""Low-rank adapters (model.lora): LoRA, rsLoRA and DoRA on the blocks' linear layers, over a frozen base.

    y = W x + b + s B A dropout(x),   s = alpha / r   (rsLoRA: alpha / sqrt(r))

A [r, in] starts Kaiming-uniform and B [out, r] at zero, as peft starts them, so a fresh adapter
leaves the base's output exactly as it was. DoRA (model.lora.dora) learns each output row's
magnitude m apart from its direction: y = (m / |W + s B A|) (W x + s B A dropout(x)) + b, the
row norm detached from the gradient (the paper's section 4.3, as peft computes it), m starting
at the base's row norms once its weights are loaded (set_magnitudes).

An adapted layer is a LoraLinear: an nn.Linear (the frozen W and b, under their own names, so the
base loads as it is) holding lora_A, lora_B and DoRA's lora_magnitude_vector, the names peft gives
them, so that an adapter's tensors are peft's by the base layer's Hugging Face name (hf.py). The
adapters are added on the meta device before the model is sharded (FSDP shards each block with
its frozen and trainable tensors together). Only the adapters train: every other parameter is
frozen, and a checkpoint holds the trainable tensors only (the engine leaves frozen ones out).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math

import torch
from torch import nn
from torch.nn import functional as F

from ...engine.errors import ConfigError
from . import blocks

# model.lora.targets as Hugging Face names its layers, per family; the default is all of them
# (every linear layer of the blocks: never the embedding or the output head).
TARGETS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}
# GPT-2's names of this project's gpt2 layers (hf.py renames the same way); the llama family's are its own.
GPT2_LAYERS = {"attn.qkv": "c_attn", "attn.proj": "c_proj", "mlp.0": "c_fc", "mlp.2": "c_proj"}
ADAPTER_NAMES = ("lora_A", "lora_B", "lora_magnitude_vector")


def hf_layer_name(arch: str, name: str) -> str | None:
    """The Hugging Face name (q_proj, c_attn, ...) of the block layer this project calls name, else None."""
    if arch == "gpt2":
        return next((hf for ours, hf in GPT2_LAYERS.items() if name.endswith(f".{ours}")), None)
    last = name.rsplit(".", 1)[-1]
    return last if last in TARGETS["llama"] and ".layers." in f".{name}" else None


class LoraLinear(nn.Linear):
    """A frozen nn.Linear plus a trainable low-rank update (and DoRA's magnitudes)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float, rslora: bool, dora: bool):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device=base.weight.device)
        self.weight, self.bias = base.weight, base.bias  # the base's own tensors (meta until built)
        self.r, self.scaling = r, alpha / (math.sqrt(r) if rslora else r)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=base.weight.device)
        magnitude = nn.Parameter(torch.ones(self.out_features, device=base.weight.device)) if dora else None
        self.register_parameter("lora_magnitude_vector", magnitude)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        dropped = self.lora_dropout(x)
        update = self.lora_B(self.lora_A(dropped))
        if self.lora_magnitude_vector is None:
            return result + update * self.scaling
        # DoRA: the row norms of W + s B A, detached; W x from the adapter's (dropped) input, as peft has it
        weight = dense(self.weight).to(self.lora_A.weight.dtype)
        norm = torch.linalg.norm(weight + self.scaling * (self.lora_B.weight @ self.lora_A.weight), dim=1)
        scale = (self.lora_magnitude_vector / norm.detach()).view(1, -1)
        if isinstance(self.lora_dropout, nn.Identity) or not self.training:
            base = result - self.bias if self.bias is not None else result
        else:
            base = F.linear(dropped, self.weight)
        return result + (scale - 1) * base + scale * update * self.scaling

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + s B A (DoRA: scaled to the magnitudes row by row), in float32."""
        weight = dense(self.weight).float() + self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())
        if self.lora_magnitude_vector is not None:
            weight = weight * (self.lora_magnitude_vector.float() / torch.linalg.norm(weight, dim=1))[:, None]
        return weight


@contextlib.contextmanager
def _quiet(logger: str):
    """The named logger's warnings held back inside."""
    level = logging.getLogger(logger).level
    logging.getLogger(logger).setLevel(logging.ERROR)
    try:
        yield
    finally:
        logging.getLogger(logger).setLevel(level)


NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # torchao's (and QLoRA's) blocks: 64 weights a scale, 256 scales a scale


def quantize_base(model: nn.Module, arch: str) -> tuple[int, int]:
    """model.quantize=nf4 (QLoRA): every linear weight of the blocks, frozen, stored as torchao's NF4 (4 bits
    a weight and a scale per 64, the scales themselves quantized to 8 bits per 256), computed in the
    activations' dtype; embeddings, norms, the head and the adapters stay as they are. Returns the bytes
    those weights took before and take now."""
    try:
        with _quiet("torch.utils._pytree"):  # torchao's import warns about torch internals, not about this run
            from torchao.quantization import to_nf4
    except ImportError:
        raise ConfigError("model.quantize=nf4 needs the torchao package: pip install -e '.[lora]'") from None

    before = after = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and hf_layer_name(arch, name) is not None:
            weight = module.weight.detach()
            blocks = weight.numel() // NF4_BLOCK
            if weight.numel() % NF4_BLOCK:
                raise ConfigError(
                    f"model.quantize=nf4: {name} has {weight.numel()} weights, not a multiple of NF4's block of "
                    f"{NF4_BLOCK}"
                )
            quantized = to_nf4(weight, NF4_BLOCK, math.gcd(blocks, NF4_SCALER_BLOCK))
            module.weight = nn.Parameter(quantized, requires_grad=False)
            before += weight.numel() * weight.element_size()
            parts = (quantized.quantized_data, quantized.quantized_scalers, quantized.quantization_factor)
            after += sum(part.numel() * part.element_size() for part in parts)
    return before, after


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor: an NF4 one (model.quantize) dequantized (its .to() of its own dtype is itself)."""
    return weight.get_original_weight() if hasattr(weight, "get_original_weight") else weight


def add_adapters(model: nn.Module, arch: str, lora) -> list[str]:
    """Replace the targeted linear layers (lora: model.lora) by LoraLinear and freeze everything but the
    adapters; returns the names of the layers adapted. Called on the meta device, before sharding."""
    targets = set(lora.targets or TARGETS[arch])
    adapted = []
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and hf_layer_name(arch, name) in targets:
            parent_name, _, child = name.rpartition(".")
            adapter = LoraLinear(module, lora.r, lora.alpha, lora.dropout, lora.rslora, lora.dora)
            setattr(model.get_submodule(parent_name), child, adapter)
            adapted.append(name)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return adapted


def is_adapter(name: str) -> bool:
    """Whether a parameter (by state-dict name) is an adapter's."""
    return any(f".{part}" in f".{name}" for part in ADAPTER_NAMES)


def init_module(name: str, module: nn.Module, generator: torch.Generator | None, n_layer: int) -> None:
    """blocks.init_module, with the adapters initialised as peft does: A Kaiming-uniform, B zeros, DoRA's
    magnitudes one (set_magnitudes sets them once the base is loaded)."""
    if name.endswith(".lora_A"):
        nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
    elif name.endswith(".lora_B"):
        nn.init.zeros_(module.weight)
    else:
        blocks.init_module(name, module, generator, n_layer)
        if isinstance(module, LoraLinear) and module.lora_magnitude_vector is not None:
            nn.init.ones_(module.lora_magnitude_vector)


@torch.no_grad()
def set_magnitudes(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """DoRA: each magnitude vector starts at its layer's row norms in the base weights (whole tensors,
    by this project's names: each process copies its shard under FSDP)."""
    from ...engine.parallel.meta_init import copy_into

    for name, module in model.named_modules():
        if isinstance(module, LoraLinear) and module.lora_magnitude_vector is not None:
            norms = torch.linalg.norm(weights[f"{name}.weight"].float(), dim=1)
            copy_into(module.lora_magnitude_vector, norms.to(module.lora_magnitude_vector.dtype))


def weights_hash(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a state dict (names, dtypes, shapes and bytes in name order): what identifies a base."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights with every adapter merged into its layer (float32, an NF4 base dequantized; no
    adapter tensors): the plain model's state dict, for export --format hf."""
    state = {name: dense(t.detach()).float() for name, t in model.state_dict().items() if not is_adapter(name)}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            state[f"{name}.weight"] = module.merged_weight()
    return state


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by this project's names (float32)."""
    return {name: tensor.detach().float() for name, tensor in model.state_dict().items() if is_adapter(name)}


def adapted(model: nn.Module) -> bool:
    return any(isinstance(module, LoraLinear) for module in model.modules())
