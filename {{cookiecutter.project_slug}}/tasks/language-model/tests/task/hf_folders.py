"""Small random Hugging Face models and tokenizers, made here by `transformers` and `tokenizers`
(offline): the llama family's (Llama, Qwen2, Mistral), a byte-level BPE tokenizer with a chat
template, and a tokenizer of each style that checkpoints ship (STYLES) with the chat template of a
family (TEMPLATES), saved as the folders a user downloads; and the conversations the chat tests
prepare (CONVERSATION, arithmetic)."""

import json
import random
import re

import torch

CORPUS = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
# A ChatML template in Jinja, as tokenizer_config.json holds one, written with <% %> and << >> so
# that this file carries no template markup of its own (the template's bake checks for leftovers).
MARKUP = {"<%": "{" + "%", "%>": "%" + "}", "<<": "{" + "{", ">>": "}" + "}"}


def jinja(spelled: str) -> str:
    return re.sub("<%|%>|<<|>>", lambda found: MARKUP[found[0]], spelled)


CHAT_TEMPLATE = jinja("<% for m in messages %><|im_start|><< m['role'] >>\n<< m['content'] >><|im_end|>\n<% endfor %>")
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


# Chat templates of the families, as their tokenizer_config.json holds them (the parts that decide the
# text: headers, what is stripped, the end of turn), each with the special tokens it names.
TEMPLATES = {
    "llama3": (
        jinja(
            "<<bos_token>><% for m in messages %><<'<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + "
            "m['content'] | trim + '<|eot_id|>'>><% endfor %><% if add_generation_prompt %>"
            "<<'<|start_header_id|>assistant<|end_header_id|>\\n\\n'>><% endif %>"
        ),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
    "llama2": (  # Llama 2 chat and Mistral v0.1: no generation prompt, the answer after "[/INST]" and a space
        jinja(
            "<% if messages[0]['role'] == 'system' %><% set system = messages[0]['content'] %>"
            "<% set turns = messages[1:] %><% else %><% set system = false %><% set turns = messages %><% endif %>"
            "<% for m in turns %><% if loop.index0 == 0 and system %><% set content = '<' + '<SYS>' + '>\\n' + "
            "system + '\\n<' + '</SYS>' + '>\\n\\n' + m['content'] %><% else %><% set content = m['content'] %>"
            "<% endif %><% if m['role'] == 'user' %>"
            "<<bos_token + '[INST] ' + content.strip() + ' [/INST]'>><% elif m['role'] == 'assistant' %>"
            "<<' ' + content.strip() + ' ' + eos_token>><% endif %><% endfor %>"
        ),
        {"bos_token": "<s>", "eos_token": "</s>"},
    ),
    "gemma": (
        jinja(
            "<<bos_token>><% for m in messages %><% set role = 'model' if m['role'] == 'assistant' else m['role'] %>"
            "<<'<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n'>><% endfor %>"
            "<% if add_generation_prompt %><<'<start_of_turn>model\\n'>><% endif %>"
        ),
        {"bos_token": "<bos>", "eos_token": "<end_of_turn>"},
    ),
}
CHATML_SPECIAL = {"eos_token": "<|im_end|>"}
SPECIAL = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
SPECIAL += ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Tokenizer styles by the checkpoints that ship them, and the template each is tried with first.
STYLES = {
    "gpt2": "chatml",  # byte-level BPE, GPT-2's pre-tokenizer, no prefix space (GPT-2, SmolLM2)
    "gpt2-prefix": "chatml",  # the same with add_prefix_space (a space before each text)
    "qwen2": "chatml",  # byte-level, Qwen2's regex (digits one by one)
    "llama3": "llama3",  # byte-level, Llama 3's regex
    "metaspace-first": "llama2",  # SentencePiece as transformers converts Llama 2 and Mistral today
    "metaspace-always": "chatml",  # Metaspace that puts its "▁" before every text
    "legacy": "llama2",  # the legacy Llama normalizer: Prepend("▁") + Replace (Llama 2, TinyLlama, Mistral v0.1)
    "gemma": "gemma",  # spaces as "▁", no prefix at all (Gemma)
}


def style_tokenizer(style: str, folder, corpus: list[str], template: str, special: dict, vocab_size: int = 600):
    """A BPE tokenizer of a STYLES style trained on corpus, saved in folder with chat_template (and the
    special tokens it names) as save_pretrained writes it; SentencePiece styles fall back to bytes
    (<0x00>..<0xFF>) as Llama's do. Returns the folder's tokenizer.json."""
    import tokenizers
    import transformers
    from tokenizers import decoders, normalizers, pre_tokenizers

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", byte_fallback=True))
    llama_decoder = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    alphabet = []
    if style in ("gpt2", "gpt2-prefix", "qwen2", "llama3"):
        level = pre_tokenizers.ByteLevel(add_prefix_space=style == "gpt2-prefix", use_regex=False)
        split = {"qwen2": QWEN2_SPLIT, "llama3": LLAMA3_SPLIT}.get(style, GPT2_SPLIT)
        split = pre_tokenizers.Split(tokenizers.Regex(split), "isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, level])
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif style.startswith("metaspace"):
        scheme = style.split("-")[1]
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme, split=scheme == "always")
        tokenizer.decoder = decoders.Sequence([*llama_decoder, decoders.Strip(" ", 1, 0)])
    elif style == "legacy":
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tokenizer.decoder = decoders.Sequence([*llama_decoder, decoders.Strip(" ", 1, 0)])
    elif style == "gemma":
        tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
        tokenizer.decoder = decoders.Sequence(llama_decoder)
    else:
        raise ValueError(f"unknown tokenizer style {style!r}")
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=alphabet)
    if alphabet:
        tokenizer.train_from_iterator(corpus, trainer)
    else:  # trained as SentencePiece trains Llama's: pieces start at a space ("▁the"), digits one by one
        kept = tokenizer.pre_tokenizer
        words = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([words, pre_tokenizers.Digits(individual_digits=True)])
        tokenizer.train_from_iterator(corpus, trainer)
        tokenizer.pre_tokenizer = kept
    if not alphabet:  # byte fallback: the 256 byte tokens in the vocabulary
        config = json.loads(tokenizer.to_str())
        vocab = config["model"]["vocab"]
        for byte in range(256):
            vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
        tokenizer = tokenizers.Tokenizer.from_str(json.dumps(config))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", **special)
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder / "tokenizer.json"


CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "what is 17+25?"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "and 2+2?"},
    {"role": "assistant", "content": "4"},
]


def arithmetic(count: int, seed: int) -> list[dict]:
    """Single-exchange sums, some with a system turn: conversations of uneven lengths."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        messages = [{"role": "user", "content": f"what is {a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer with the number only." * (1 + i % 4)})
        records.append({"messages": messages})
    return records
