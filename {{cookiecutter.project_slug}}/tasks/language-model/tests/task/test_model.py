"""The transformer: causal, tied, sized by presets, and its loss refuses shapes that would broadcast."""

import pytest
import torch
from torch import nn

from {{ cookiecutter.package_name }}.engine.config import ConfigError
from {{ cookiecutter.package_name }}.task.config import PRESET_NAMES, ModelConfig
from {{ cookiecutter.package_name }}.task.model import GPT, PRESETS, ModelShape, build_model, init_module, lm_loss


def test_a_token_never_sees_the_tokens_after_it():
    """Changing the token at position 5 leaves the logits of positions 0..4 unchanged and changes 5.."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="nano"), vocab_size=20, seq_len=12).eval()
    tokens = torch.randint(0, 20, (2, 12))
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 20
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5:], after[:, 5:])


@pytest.mark.parametrize(("arch", "embedding"), [("llama", "embed_tokens"), ("gpt2", "tok_emb")])
def test_the_output_layer_is_the_token_embedding(arch, embedding):
    """Tied weights: one matrix, in the state dict once, and a step on the output moves the embedding."""
    model = build_model(ModelConfig(preset="nano", arch=arch), vocab_size=20, seq_len=8)
    assert [k for k in model.state_dict() if k.startswith((embedding, "lm_head"))] == [f"{embedding}.weight"]
    tokens = torch.zeros(1, 1, dtype=torch.long)  # only token 0 is embedded
    lm_loss(model(tokens), torch.full((1, 1), 7)).backward()
    assert getattr(model, embedding).weight.grad[7].abs().sum() > 0  # row 7 gets a gradient from the output only


def test_presets_span_a_cpu_model_to_gpt2_small():
    """The gpt2 preset with GPT-2's vocabulary and context has GPT-2 small's 124M parameters; the
    CPU presets are a few million or fewer. Built on the meta device: no memory is allocated."""
    with torch.device("meta"):
        gpt2 = GPT(ModelShape.of(ModelConfig(preset="gpt2"), vocab_size=50257, seq_len=1024))
        mini = build_model(ModelConfig(preset="mini"), vocab_size=257, seq_len=256)
    assert 124_000_000 < sum(p.numel() for p in gpt2.parameters()) < 124_700_000
    assert 1_000_000 < sum(p.numel() for p in mini.parameters()) < 5_000_000
    assert list(PRESETS) == list(PRESET_NAMES)  # what model.preset may name


def test_bias_puts_gpt2_s_biases_on_every_linear_starting_at_zero():
    """model.bias=true gives the gpt2 preset GPT-2 small's exact parameter count (its biases, no more, no
    fewer), and both initialisations (the constructor's and init_module's, module by module on the meta
    device) start them at zero, where torch's Linear draws them at random."""
    with torch.device("meta"):
        gpt2 = GPT(ModelShape.of(ModelConfig(preset="gpt2", bias=True), vocab_size=50257, seq_len=1024))
    assert sum(p.numel() for p in gpt2.parameters()) == 124_439_808  # transformers' GPT2LMHeadModel
    model = build_model(ModelConfig(preset="nano", arch="gpt2", bias=True), vocab_size=20, seq_len=8)
    biases = {name: p for name, p in model.named_parameters() if name.endswith("bias") and "norm" not in name}
    assert len(biases) == 4 * model.shape.n_layer and all(torch.count_nonzero(p) == 0 for p in biases.values())
    linear = nn.Linear(8, 24)
    assert torch.count_nonzero(linear.bias) > 0
    init_module("blocks.0.attn.qkv", linear, torch.Generator().manual_seed(0), n_layer=2)
    assert torch.count_nonzero(linear.bias) == 0


def test_explicit_sizes_override_the_preset_and_are_checked():
    shape = ModelShape.of(ModelConfig(preset="micro", n_layer=3), vocab_size=10, seq_len=8)
    assert (shape.n_layer, shape.n_head, shape.d_model) == (3, 4, 128)
    for arch in ("llama", "gpt2"):
        with pytest.raises(ConfigError, match="model.d_model=100 is not divisible by model.n_head=3"):
            ModelShape.of(ModelConfig(arch=arch, d_model=100, n_head=3, n_kv_head=1), vocab_size=10, seq_len=8)
    with pytest.raises(ConfigError, match="model.n_head=3 is not a multiple of the preset's model.n_kv_head=2"):
        ModelShape.of(ModelConfig(preset="micro", n_head=3, d_model=96), vocab_size=10, seq_len=8)


def test_loss_refuses_targets_that_would_broadcast():
    logits = torch.randn(2, 5, 10)
    with pytest.raises(ValueError, match="shape"):
        lm_loss(logits, torch.zeros(2, 5, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="dtype"):
        lm_loss(logits, torch.zeros(2, 5))
    ignored = torch.full((2, 5), -100)
    ignored[0, 0] = 3
    assert lm_loss(logits, ignored) == pytest.approx(lm_loss(logits[:1, :1], torch.tensor([[3]])).item())


def test_adamw_uses_gpt2_style_betas_by_default():
    """The language model's AdamW runs with beta2 0.95 (GPT-2-style training), not torch's 0.999."""
    from {{ cookiecutter.package_name }}.engine.config import load_config
    from {{ cookiecutter.package_name }}.engine.optim import build_optimizer
    from {{ cookiecutter.package_name }}.task.config import SPEC

    cfg = load_config(SPEC, [], [])
    optimizer = build_optimizer(build_model(cfg.model, vocab_size=32, seq_len=16), cfg.optim)
    assert [group["betas"] for group in optimizer.param_groups] == [(0.9, 0.95), (0.9, 0.95)]
