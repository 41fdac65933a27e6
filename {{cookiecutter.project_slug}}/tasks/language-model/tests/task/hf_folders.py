"""Small random Hugging Face models and tokenizers, made here by `transformers` and `tokenizers`
(offline): the llama family's (Llama, Qwen2, Mistral) and a byte-level BPE tokenizer with a chat
template, saved as the folders a user downloads."""

import json
import re

import torch

CORPUS = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
# A ChatML template in Jinja, as tokenizer_config.json holds one, written with <% %> and << >> so
# that this file carries no template markup of its own (the template's bake checks for leftovers).
MARKUP = {"<%": "{" + "%", "%>": "%" + "}", "<<": "{" + "{", ">>": "}" + "}"}
CHAT_TEMPLATE = re.sub(
    "<%|%>|<<|>>",
    lambda found: MARKUP[found[0]],
    "<% for m in messages %><|im_start|><< m['role'] >>\n<< m['content'] >><|im_end|>\n<% endfor %>",
)
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96}


def transformers_model(model_type: str, keys: dict, vocab_size: int):
    """A random LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM (SDPA, float32) of SMALL's
    shape updated by keys; rope_theta and rope_scaling=(kind, factor) go into rope_parameters (an
    original context of 16). Biases are drawn at random: zero ones would hide a bias left out."""
    import transformers

    keys = {**SMALL, "vocab_size": vocab_size, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, **keys}
    theta = keys.pop("rope_theta", 10_000.0)
    rope = {"rope_type": "default", "rope_theta": theta}
    if "rope_scaling" in keys:
        kind, factor = keys.pop("rope_scaling")
        rope = {"rope_type": kind, "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0}
        rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    keys.setdefault("tie_word_embeddings", False)
    config = transformers.AutoConfig.for_model(model_type, rope_parameters=rope, **keys)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return model, config


def bpe_tokenizer(folder, corpus_file, chat_template: str = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer trained on CORPUS (written to corpus_file), saved in folder as
    tokenizer.json with a tokenizer_config.json naming <|endoftext|> its end and chat_template its
    chat template (what save_pretrained of a fast tokenizer writes). Returns the tokenizer."""
    import tokenizers
    import transformers

    corpus_file.write_text(CORPUS)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train([str(corpus_file)], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(folder))
    return tokenizer


def llama_folder(folder, model_type: str, keys: dict, vocab_size: int, shards: bool = False, v4: bool = False):
    """transformers_model saved with save_pretrained: model.safetensors, or shards of about 40 kB with
    model.safetensors.index.json; v4: config.json rewritten in transformers 4's keys (rope_theta,
    rope_scaling) as most downloaded folders have it. Returns the model."""
    model, _ = transformers_model(model_type, keys, vocab_size)
    model.save_pretrained(str(folder), max_shard_size="40kB" if shards else "5GB")
    if v4:
        config = json.loads((folder / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        (folder / "config.json").write_text(json.dumps(config))
    return model
