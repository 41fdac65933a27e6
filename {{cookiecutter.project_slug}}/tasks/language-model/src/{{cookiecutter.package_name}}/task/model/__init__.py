"""The model: a decoder-only transformer of one of two families, built from one ModelShape. What
lives where:

    build       ModelShape, the named sizes (PRESETS), build_model and architecture, lm_loss
    llama       the Llama family (Llama, SmolLM2, Qwen2, Mistral), in Hugging Face's layout
    gpt2        GPT-2's family
    blocks      what both share: attention (grouped-query, key/value cache), rotary embeddings, init
    hf          Hugging Face folders in (model.init_from) and out (export --format hf)
    lora        low-rank adapters over a frozen base (model.lora): LoRA, rsLoRA, DoRA

The names the task uses are imported from here (task.model); hf and lora are task.model.hf and .lora.
"""

from .blocks import init_module
from .build import INIT_TYPES, PRESETS, ModelShape, arch_of, architecture, build_model, lm_loss
from .gpt2 import GPT
from .llama import Llama

__all__ = ["GPT", "INIT_TYPES", "PRESETS", "Llama", "ModelShape", "arch_of", "architecture", "build_model"]
__all__ += ["init_module", "lm_loss"]
