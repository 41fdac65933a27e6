"""The language model's declaration to the engine, SPEC (a TaskSpec, engine/seam.py): the data and
model sections (token windows, the transformer's shape), the keys' allowed values and checks,
validation metrics, what a resume may change and what a checkpoint restores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..engine.errors import ConfigError
from ..engine.seam import DataBase, ModelBase, TaskSpec

if TYPE_CHECKING:
    from ..engine.config import Config


@dataclass
class DataConfig(DataBase):
    name: str = "synthetic"
    """synthetic (text from a random Markov source with a known entropy rate, made in memory) or text
    (token files written by `python -m PACKAGE.prepare` in data.root)."""
    root: str = "data"
    """text: the directory PACKAGE.prepare wrote (meta.json and the token files it names)."""
    seq_len: int = 64
    """Tokens per training sequence (the model's context length)."""
    batch_size: int = 64
    """Sequences per process per micro-batch; the global batch is batch_size x world size x grad_accum_steps."""
    loader: str = "auto"
    """device (both token splits on the training device as one tensor each, windows gathered there, no
    workers), workers (a DataLoader, data.num_workers processes) or auto (device when the tokens take at
    most a quarter of the device's memory, of RAM on a CPU; the log says which it chose)."""
    num_workers: int = 0
    """DataLoader worker processes per training process (0: windows are cut in the main process)."""
    vocab_size: int = 32
    """synthetic: symbols of the source (each one letter or digit, so a token is one byte of text)."""
    order: int = 2
    """synthetic: tokens of context that decide the next token's distribution (a Markov chain of this order)."""
    concentration: float = 0.2
    """synthetic: Dirichlet concentration of each symbol's next-symbol distribution (lower: more predictable text)."""
    context_concentration: float = 0.5
    """synthetic: how closely a whole context's distribution follows its last symbol's (lower: the earlier
    symbols matter more, and the floor lies further below what the last symbol alone predicts)."""
    train_tokens: int = 1_000_000
    """synthetic: tokens of the training split."""
    val_tokens: int = 65_536
    """synthetic: tokens of the validation split (documents the training split never sees)."""


@dataclass
class LoraConfig:
    r: int = 0
    """Rank of the low-rank adapters (LoRA) on the blocks' linear layers: 0 (off) trains every weight; 8 to 64
    are usual. The weights of model.init_from stay frozen and only the adapters train: y = W x + s B A dropout(x),
    with s = alpha / r. Checkpoints hold the adapters and their optimizer state; export --format peft writes a
    PEFT adapter, --format hf the merged model."""
    alpha: float = 16.0
    """The adapters' scale numerator: s = alpha / r (alpha / sqrt(r) with model.lora.rslora)."""
    dropout: float = 0.0
    """Dropout on the adapters' input only (the frozen layer sees its input whole)."""
    targets: list[str] | None = None
    """The layers adapted, as Hugging Face names them: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj (llama) or c_attn, c_proj, c_fc (gpt2). null: all of them (never the embedding or the head)."""
    rslora: bool = False
    """Rank-stabilised LoRA: s = alpha / sqrt(r), so a higher rank does not shrink the update."""
    dora: bool = False
    """DoRA: each output row's magnitude learned apart from its direction (starting at the base's row norms)."""


@dataclass
class ModelConfig(ModelBase):
    arch: str | None = None
    """The family: llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention: Llama, Qwen2, Mistral,
    SmolLM2) or gpt2 (learned positions, LayerNorm, GELU). null: the preset's, llama for the size presets."""
    preset: str = "micro"
    """A named shape (model.PRESETS). Sizes for either family: nano, micro, mini (CPU sizes), small. Published
    models: gpt2 (GPT-2 small), smollm2-135m, smollm2-360m, qwen2.5-0.5b, llama3.2-1b (their vocabulary is
    the tokenizer's)."""
    n_layer: int | None = None
    """Transformer blocks (null: the preset's)."""
    n_head: int | None = None
    """Attention (query) heads per block (null: the preset's)."""
    d_model: int | None = None
    """Width of the residual stream, Hugging Face's hidden_size (null: the preset's)."""
    n_kv_head: int | None = None
    """llama: key/value heads, Hugging Face's num_key_value_heads (grouped-query attention: 1 to model.n_head,
    dividing it; null: the preset's, model.n_head without one)."""
    head_dim: int | None = None
    """llama: width of one head (null: model.d_model / model.n_head)."""
    intermediate_size: int | None = None
    """llama: width of the SwiGLU MLP (null: the preset's, or 8/3 x model.d_model rounded up to 32)."""
    rope_theta: float | None = None
    """llama: base period of the rotary embeddings (null: the preset's, 10000 without one)."""
    rope_scaling: str | None = None
    """llama: llama3 (Llama 3.1's frequency scaling, by the four keys below) or null (none)."""
    rope_factor: float | None = None
    """llama3 scaling: how much longer the long wavelengths get (null: the preset's, 8)."""
    rope_low_freq_factor: float | None = None
    """llama3 scaling: wavelengths above original context / this are divided by rope_factor (null: 1)."""
    rope_high_freq_factor: float | None = None
    """llama3 scaling: wavelengths below original context / this are kept (null: 4)."""
    rope_original_context: int | None = None
    """llama3 scaling: the context the model was first trained at, original_max_position_embeddings (null: 8192)."""
    norm_eps: float | None = None
    """llama: RMSNorm's epsilon, rms_norm_eps (null: the preset's, 1e-5)."""
    tie_embeddings: bool | None = None
    """The output layer is the token embedding (null: the preset's, true); false gives llama its own lm_head.
    gpt2 is always tied."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches (0 for pretraining-size data)."""
    bias: bool | None = None
    """gpt2: biases in every Linear layer, as GPT-2 has them; llama: in the q, k and v projections, as Qwen2
    has them (null: the preset's, false; model.init_from sets it from the folder)."""
    n_positions: int | None = None
    """The longest input the model takes; gpt2: rows of its position table (null: data.seq_len; model.init_from
    sets it from the folder's config.json, and data.seq_len may then be shorter)."""
    vocab_size: int | None = None
    """Rows of the token embedding (null: the tokenizer's vocabulary; model.init_from sets the folder's, which
    may be larger: Qwen2.5 pads its embedding to a multiple of 128, and the padding rows are never sampled)."""
    init_from: str | None = None
    """A local Hugging Face folder to start from (fine-tuning): GPT-2, Llama, Qwen2 or Mistral (config.json and
    model.safetensors, pytorch_model.bin or their shards with the index). Its shape sets the model keys
    (model.arch among them) and training begins from its weights. The data must be prepared with its tokenizer
    (prepare --tokenizer FOLDER/tokenizer.json), whose tokenizer_config.json and chat template travel with the
    run."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    quantize: str = "none"
    """nf4 (QLoRA): the frozen linear weights of the blocks stored in 4 bits (torchao's NF4, on CPU and GPU),
    computed in the activations' dtype, with adapters (model.lora.r > 0) training over them; none: as loaded."""


ARCHS = ("llama", "gpt2")
PRESET_NAMES = ("nano", "micro", "mini", "small", "gpt2", "smollm2-135m", "smollm2-360m", "qwen2.5-0.5b", "llama3.2-1b")
# Keys only the llama family reads.
LLAMA_KEYS = (
    "n_kv_head",
    "head_dim",
    "intermediate_size",
    "rope_theta",
    "rope_scaling",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_context",
    "norm_eps",
)
MAX_VOCAB_SYNTHETIC = 62  # letters and digits: each symbol prints as one character


def validate(cfg: Config) -> None:
    """Combinations of data and model keys that cannot work, named."""
    data, model = cfg.data, cfg.model
    if model.init_from:
        take_shape_from_folder(model)
    if cfg.trainer.eval_tasks and data.name == "synthetic":
        raise ConfigError("trainer.eval_tasks: benchmarks score text, and data.name=synthetic has none")
    if model.n_positions is not None and model.n_positions < data.seq_len:
        raise ConfigError(
            f"data.seq_len={data.seq_len} is longer than model.n_positions={model.n_positions}, the longest input "
            "the model takes"
        )
    if not 0.0 <= model.dropout < 1.0:
        raise ConfigError(f"model.dropout={model.dropout} must be at least 0 and below 1")
    keys = ("n_layer", "n_head", "d_model", "n_kv_head", "head_dim", "intermediate_size", "rope_original_context")
    for key in (*keys, "vocab_size"):
        if getattr(model, key) is not None and getattr(model, key) < 1:
            raise ConfigError(f"model.{key}={getattr(model, key)} must be at least 1, or null for the preset's")
    for key in ("rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "norm_eps"):
        if getattr(model, key) is not None and not 0 < getattr(model, key) < float("inf"):
            raise ConfigError(f"model.{key}={getattr(model, key)} must be a positive number, or null")
    if model.arch not in (None, *ARCHS):
        raise ConfigError(f"model.arch={model.arch!r} is not allowed; choose one of {', '.join(ARCHS)} (or null)")
    if model.rope_scaling not in (None, "llama3"):
        raise ConfigError(f"model.rope_scaling={model.rope_scaling!r} is not allowed; choose llama3 or null")
    from .model import ModelShape, arch_of  # the shape's own checks (sizes that do not fit together)

    if arch_of(model) == "gpt2":
        given = [key for key in LLAMA_KEYS if getattr(model, key) is not None]
        if given:
            raise ConfigError(f"model.{given[0]} is a key of model.arch=llama; this model is gpt2")
    ModelShape.of(model, vocab_size=1, seq_len=data.seq_len)
    model.arch = arch_of(model)  # stored resolved: the run's config names its family
    check_lora(model)
    if data.name == "synthetic":
        if not 2 <= data.vocab_size <= MAX_VOCAB_SYNTHETIC:
            raise ConfigError(f"data.vocab_size={data.vocab_size} must be between 2 and {MAX_VOCAB_SYNTHETIC}")
        if data.vocab_size**data.order > 2**20:
            raise ConfigError(
                f"data.vocab_size**data.order = {data.vocab_size}**{data.order} contexts is too many to tabulate "
                "(at most 2**20); lower data.order or data.vocab_size"
            )
        for key in ("concentration", "context_concentration"):
            if not getattr(data, key) > 0:
                raise ConfigError(f"data.{key}={getattr(data, key)} must be above 0")


def check_lora(model: ModelConfig) -> None:
    """model.lora's keys: a rank of 0 (off) with nothing else set, or adapters over model.init_from."""
    from .model.lora import TARGETS

    lora, defaults = model.lora, LoraConfig()
    if model.quantize != "none" and not lora.r:
        raise ConfigError(
            f"model.quantize={model.quantize} stores the frozen base in 4 bits for adapters to train over: set "
            "model.lora.r, e.g. 16 (a quantized model cannot itself be trained)"
        )
    if lora.r < 0:
        raise ConfigError(f"model.lora.r={lora.r} must be 0 (off) or a positive rank, e.g. 16")
    if not lora.r:
        changed = [key for key in ("dora", "rslora", "targets") if getattr(lora, key) != getattr(defaults, key)]
        if changed:
            raise ConfigError(f"model.lora.{changed[0]} is set, but model.lora.r=0 (adapters off); set a rank, e.g. 16")
        return
    if not model.init_from:
        raise ConfigError(
            f"model.lora.r={lora.r} trains adapters over the frozen weights of model.init_from, which is not set: "
            "name a Hugging Face folder (adapters over a random frozen model learn little)"
        )
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout={lora.dropout} must be at least 0 and below 1")
    if not 0 < lora.alpha < float("inf"):
        raise ConfigError(f"model.lora.alpha={lora.alpha} must be a positive number")
    known = TARGETS[model.arch]
    unknown = [name for name in lora.targets or () if name not in known]
    if unknown or lora.targets == []:
        what = f"{unknown[0]!r} matches no layer" if unknown else "names no layer"
        raise ConfigError(
            f"model.lora.targets: {what} of model.arch={model.arch}; choose among {', '.join(known)} (null: all)"
        )


def take_shape_from_folder(model: ModelConfig) -> None:
    """model.init_from's shape written into the model keys, so that the run's stored configuration
    rebuilds the model without the folder (evaluate, export, generate, a resume from elsewhere)."""
    from .model.hf import read_config

    shape = read_config(model.init_from)
    for key, value in shape.items():
        given = getattr(model, key)
        if given is not None and given != value:
            raise ConfigError(
                f"model.{key}={given}, but model.init_from={model.init_from!r} has {value}; leave model.{key} unset"
            )
        setattr(model, key, value)


PERPLEXITIES = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")  # the harness's metrics


SPEC = TaskSpec(
    data=DataConfig,
    model=ModelConfig,
    metrics={"val/loss": "min", "val/ppl": "min", "val/bpb": "min"},
    monitor="val/loss",
    validate=validate,
    choices={"data.name": ("synthetic", "text"), "model.preset": PRESET_NAMES, "model.quantize": ("none", "nf4")},
    at_least_one=("data.seq_len", "data.order", "data.train_tokens", "data.val_tokens"),
    # A run is measured in optimizer steps, with validations between them, rather than in epochs
    # of a fixed data set.
    defaults={
        "optim": {"lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "warmup_steps": 30},
        "trainer": {"max_epochs": 1000, "max_steps": 600, "val_every": 100, "checkpoint_every": 200},
    },
    # What a checkpoint's stored config sets in evaluate, export and generate: what rebuilds the
    # model and the data it was trained on. Nothing that names a place (data.root) comes from a
    # file that may have been written elsewhere.
    from_checkpoint={
        "model": (
            "arch",
            "preset",
            "n_layer",
            "n_head",
            "d_model",
            "bias",
            "n_positions",
            "tie_embeddings",
            "vocab_size",
            *LLAMA_KEYS,
            *(f"lora.{key}" for key in ("r", "alpha", "dropout", "targets", "rslora", "dora")),
            "quantize",
        ),
        "data": (
            "name",
            "seq_len",
            "vocab_size",
            "order",
            "concentration",
            "context_concentration",
            "train_tokens",
            "val_tokens",
        ),
        "trainer": ("precision",),
    },
    # The prepared tokens moved (the same tokens); the starting weights moved (the checkpoint holds
    # the weights, the stored model keys their shape; with the folder gone, a run resumes from its
    # config.yaml: --config RUN/config.yaml model.init_from=null).
    resume_may_change=("data.root", "model.init_from"),
    # Checkpoints from before model.arch were all of GPT-2's family.
    stored_defaults={"model.arch": "gpt2"},
    memory_hint="a smaller data.seq_len or model.preset",
    plot_panel=("bits per byte", (("val/bpb", "val bits/byte"),)),
    # trainer.eval_tasks and evaluate --tasks: lm-evaluation-harness tasks (benchmarks.py). Perplexities and
    # bits per byte improve downwards, the rest (accuracies, exact match, F1) upwards.
    benchmarks=lambda metric: "min" if metric.startswith(PERPLEXITIES) else "max",
    evaluate_options={
        "--tasks": "lm-evaluation-harness tasks, comma-separated (hellaswag,arc_easy,...): their scores as well",
        "--limit": "items per task: a count, or a fraction below 1 (default: all)",
        "--num-fewshot": "examples before each item (default: each task's own)",
        "--task-data": "local copies of tasks' data, NAME=PATH[,NAME=PATH]: a save_to_disk folder, .jsonl or .parquet",
        "--include": "a folder of your own task YAMLs (the harness's include path)",
    },
    evaluate_flags={"--apply-chat-template": "with --tasks: each item as a conversation in the run's chat template"},
)


def require_harness() -> None:
    """lm-evaluation-harness is importable, or a one-line error that names the extra installing it."""
    try:
        import lm_eval.api.model  # noqa: F401
    except ImportError:
        raise ConfigError("--tasks needs lm-evaluation-harness: pip install -e '.[eval]'") from None
