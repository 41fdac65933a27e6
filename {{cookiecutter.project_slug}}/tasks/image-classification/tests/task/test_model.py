"""Model: torchvision by name, the 32x32 stem, GroupNorm, pretrained weights and timm folders, freezing,
the loss."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from {{ cookiecutter.package_name }}.engine.config import ConfigError, OptimConfig, load_config
from {{ cookiecutter.package_name }}.engine.optim import build_optimizer
from {{ cookiecutter.package_name }}.engine.step import train_mode
from {{ cookiecutter.package_name }}.task.augment import soft_cross_entropy
from {{ cookiecutter.package_name }}.task.config import SPEC, ModelConfig
from {{ cookiecutter.package_name }}.task.data import class_weights
from {{ cookiecutter.package_name }}.task.model import build_model, classification_loss, classifier_head
from {{ cookiecutter.package_name }}.task.task import Task
from {{ cookiecutter.package_name }}.train import main

from conftest import build_and_gather, read_metrics, torchrun
from tiny import timm_folder


def test_default_model_suits_32x32_images():
    """resnet18 gets a 3x3 stride-1 stem and num_classes outputs."""
    model = build_model(ModelConfig(), num_classes=7)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_group_norm_replaces_batch_norm():
    """model.norm=group leaves no BatchNorm, so results do not depend on the batch size."""
    model = build_model(ModelConfig(norm="group"), num_classes=10)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())


def test_unknown_model_is_a_config_error():
    """A name torchvision does not know is refused with a hint."""
    with pytest.raises(ConfigError, match="model.name='resnet1' is not a torchvision model"):
        build_model(ModelConfig(name="resnet1"), num_classes=10)


def _pretrained_file(tmp_path, num_classes=100, prefix="module."):
    source = build_model(ModelConfig(), num_classes=num_classes)
    path = tmp_path / "backbone.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    return source, path


def test_pretrained_weights_load_with_prefixes_and_a_new_head(tmp_path):
    """Weights saved from a DDP model with another head load; the head keeps its fresh init."""
    source, path = _pretrained_file(tmp_path)
    model = build_model(ModelConfig(pretrained=str(path)), num_classes=10)
    assert torch.equal(model.conv1.weight, source.conv1.weight)
    assert model.fc.weight.shape == (10, 512)


def test_frozen_backbone_trains_only_the_head_and_keeps_batchnorm_still(tmp_path):
    """Frozen parameters stay out of the optimizer and frozen BatchNorm keeps its statistics."""
    _, path = _pretrained_file(tmp_path)
    model = build_model(ModelConfig(pretrained=str(path), freeze_backbone=True), num_classes=10)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in classifier_head(model).parameters()}
    optimizer = build_optimizer(model, OptimConfig())
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == trainable

    train_mode(model)
    assert model.training and not model.bn1.training
    before = model.bn1.running_mean.clone()
    model(torch.randn(4, 3, 32, 32) * 5 + 3)
    assert torch.equal(model.bn1.running_mean, before)


def test_loss_refuses_one_hot_and_misshaped_targets():
    """Cross-entropy wants (N,) long class indices; (N,1) or one-hot floats would broadcast silently."""
    logits = torch.randn(4, 3)
    targets = torch.tensor([0, 2, 1, 0])
    assert torch.isclose(classification_loss(logits, targets), nn.functional.cross_entropy(logits, targets))
    with pytest.raises(ValueError, match="class indices"):
        classification_loss(logits, targets[:, None])
    with pytest.raises(ValueError, match="class indices"):
        classification_loss(logits, nn.functional.one_hot(targets, 3).float())


def test_label_smoothing_spreads_a_share_of_the_target_over_every_class():
    """With label smoothing e the loss is (1 - e) x the cross-entropy of the class plus e x the mean
    over all classes of -log p (computed here from the log-probabilities); e = 0 is plain cross-entropy."""
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([0, 3, 1, 1, 2])
    log_p = logits.log_softmax(dim=1)
    plain = -log_p[torch.arange(5), targets].mean()
    spread = -log_p.mean(dim=1).mean()
    assert torch.isclose(classification_loss(logits, targets, 0.1), 0.9 * plain + 0.1 * spread)
    assert torch.isclose(classification_loss(logits, targets, 0.0), plain)


@pytest.mark.parametrize("content", [[1, 2, 3], {"conv1.weight": "not a tensor"}, "text"])
def test_pretrained_file_that_is_not_a_dict_of_tensors_exits_2(content, tiny, tmp_path, capsys):
    """model.pretrained pointing at a torch file of something else than a state_dict is named, exit 2."""
    path = tmp_path / "weights.pt"
    torch.save(content, path)
    assert main([*tiny, f"model.pretrained={path}"]) == 2
    assert "not a state_dict of tensors" in capsys.readouterr().err


def test_a_timm_folder_sets_the_architecture_and_the_data_defaults_and_is_re_headed(tiny, tmp_path, caplog):
    """model.init_from=FOLDER: model.name, data.image_size, data.mean and data.std come from its config.json
    (each unless set, and said in the log), every weight but the classifier's comes from its file, and the
    classifier is a fresh one for the data's 10 classes (the folder's when the counts agree)."""
    source = timm_folder(tmp_path / "convnext")
    untouched = [arg for arg in tiny if not arg.startswith("data.image_size")]
    with caplog.at_level("INFO"):
        cfg = load_config(SPEC, [], [*untouched, f"model.init_from={tmp_path / 'convnext'}"])
    assert (cfg.model.name, cfg.data.image_size) == ("timm:test_convnext", 160)
    assert cfg.data.mean == [0.5, 0.5, 0.5] and cfg.data.std == [0.5, 0.5, 0.5]
    assert "data.image_size=160" in caplog.text and "model.name=timm:test_convnext" in caplog.text
    cfg = load_config(SPEC, [], [*tiny, f"model.init_from={tmp_path / 'convnext'}", "data.mean=[0.4,0.4,0.4]"])
    assert cfg.data.image_size == 16 and cfg.data.mean == [0.4, 0.4, 0.4] and cfg.data.std == [0.5, 0.5, 0.5]

    for classes in (10, 7):
        cfg.data.num_classes = classes
        task = Task(cfg, torch.device("cpu"))
        task.datasets()
        model, expected = task.build_model().state_dict(), source.state_dict()
        assert model.keys() == expected.keys()
        head = {"head.fc.weight", "head.fc.bias"}
        assert all(torch.equal(model[k], expected[k]) for k in expected if k not in head)
        assert model["head.fc.weight"].shape == (classes, 64)
        assert torch.equal(model["head.fc.weight"], expected["head.fc.weight"]) == (classes == 7)


def test_a_timm_folder_is_adapted_as_timm_adapts_it(tiny, tmp_path):
    """A ViT folder saved at 32 pixels, trained at 48: the position embeddings are resized by timm's own
    loader, so every weight but the classifier equals what timm.create_model('local-dir:...') loads."""
    import timm

    source = timm.create_model("test_vit", num_classes=7, img_size=32)
    config = {"architecture": "test_vit"}
    timm.models.save_for_hf(source, str(tmp_path / "vit"), model_config=config, safe_serialization=True)
    cfg = load_config(SPEC, [], [*tiny, f"model.init_from={tmp_path / 'vit'}", "data.image_size=48"])
    cfg.data.num_classes = 10
    task = Task(cfg, torch.device("cpu"))
    task.datasets()
    ours = task.build_model().state_dict()
    theirs = timm.create_model(f"local-dir:{tmp_path / 'vit'}", pretrained=True, num_classes=10, img_size=48)
    theirs = theirs.state_dict()
    assert ours.keys() == theirs.keys() and ours["pos_embed"].shape != source.pos_embed.shape
    assert [k for k in theirs if not k.startswith("head.") and not torch.equal(ours[k], theirs[k])] == []


def test_a_vit_is_made_for_the_training_size_and_validates_at_another(tiny, run_dir):
    """timm's ViTs take one image size: model.name=timm:test_vit is made for data.image_size=32 (its default
    is 160) and resizes its position embeddings for a validation at data.val_image_size=48 (FixRes)."""
    sizes = ["data.image_size=32", "data.val_image_size=48", "trainer.max_steps=2"]
    assert main([*tiny, "model.name=timm:test_vit", *sizes]) == 0
    assert [r["val/samples"] for r in read_metrics(run_dir) if "val/samples" in r] == [101]


BUILD_FROM_FOLDER = build_and_gather("""
def built_whole(*args, **kwargs):
    raise AssertionError("the folder's model was built whole")

task_module.build_model = built_whole
""")


@pytest.mark.slow
def test_a_timm_folder_under_fsdp_goes_into_each_process_shards_as_one_process_loads_it(tiny, tmp_path):
    """model.init_from under FSDP on 2 processes: the model is never whole (built on the meta device, then
    sharded), each process holds only its shards of the parameters (together the model, once), and the
    gathered weights, new classifier included, equal one process's bit for bit."""
    timm_folder(tmp_path / "convnext")
    overrides = [*tiny, f"model.init_from={tmp_path / 'convnext'}", "run.seed=3"]
    script, weights = tmp_path / "build.py", tmp_path / "weights.pt"
    script.write_text(BUILD_FROM_FOLDER)
    torchrun(2, [*overrides, "distributed.strategy=fsdp"], script=[str(script)], WEIGHTS=str(weights))
    sharded = torch.load(weights, weights_only=True)
    task = Task(load_config(SPEC, [], overrides), torch.device("cpu"))
    task.datasets()
    whole = task.build_model()
    assert sharded.keys() == whole.state_dict().keys()
    assert [k for k, v in whole.state_dict().items() if not torch.equal(sharded[k], v)] == []
    total = sum(p.numel() for p in whole.parameters())
    ranks = [json.loads((tmp_path / f"weights.pt.rank{r}.json").read_text()) for r in (0, 1)]
    assert sum(rank["local"] for rank in ranks) == total and all(r["local"] < 0.75 * total for r in ranks)


@pytest.mark.parametrize(
    "config, error",
    [
        ({"architecture": "no_such_net"}, "has no architecture 'no_such_net'"),
        ({"architectures": ["ResNetForImageClassification"]}, "is a transformers model (ResNetForImageClassification)"),
        (None, "not a timm model folder (config.json and model.safetensors)"),
        ({"architecture": "test_convnext"}, "its weights do not fit timm's model (unexpected ['w'], missing ["),
    ],
)
def test_a_folder_timm_cannot_build_is_refused_in_one_line(config, error, tiny, tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
        save_file({"w": torch.zeros(1)}, folder / "model.safetensors")
    assert main([*tiny, f"model.init_from={folder}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and error in err[0], err


def test_layer_decay_slows_each_layer_below_the_head_and_spares_norms_biases_and_embeddings(tiny):
    """optim.layer_decay=0.5 on timm's test ViT (6 blocks): the head trains at optim.lr, block i at
    0.5 ** (6 - i) of it, the patch embedding at 0.5 ** 7; biases, norms, the position embedding and the
    class embedding get no weight decay; the schedule scales every group alike. A torchvision model is refused."""
    cfg = load_config(SPEC, [], [*tiny, "model.name=timm:test_vit", "optim.layer_decay=0.5"])
    task = Task(cfg, torch.device("cpu"))
    task.datasets()
    model = task.build_model()
    optimizer = build_optimizer(model, cfg.optim, task.param_settings(model, 0.5))
    groups = optimizer.param_groups
    settings = {id(p): (group["lr"], group["weight_decay"]) for group in groups for p in group["params"]}
    named = dict(model.named_parameters())
    lr, decay = cfg.optim.lr, cfg.optim.weight_decay
    assert settings[id(named["head.weight"])] == (lr, decay)
    assert settings[id(named["head.bias"])] == (lr, 0.0)
    for block in range(6):
        assert settings[id(named[f"blocks.{block}.attn.qkv.weight"])] == pytest.approx((lr * 0.5 ** (6 - block), decay))
        assert settings[id(named[f"blocks.{block}.norm1.weight"])] == pytest.approx((lr * 0.5 ** (6 - block), 0.0))
    for embedding in ("patch_embed.proj.weight", "pos_embed", "cls_token"):
        assert settings[id(named[embedding])][0] == pytest.approx(lr * 0.5**7)
    assert settings[id(named["pos_embed"])][1] == settings[id(named["cls_token"])][1] == 0.0
    assert len(settings) == len(named)

    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1)
    assert all(group["lr"] == pytest.approx(0.1 * group["initial_lr"]) for group in optimizer.param_groups)
    assert len({round(group["lr"] / group["lr_scale"], 12) for group in optimizer.param_groups}) == 1
    with pytest.raises(ConfigError, match="optim.layer_decay=0.5: torchvision's resnet18 does not say how its layers"):
        load_config(SPEC, [], [*tiny, "optim.layer_decay=0.5"])


def test_balanced_class_weights_make_each_class_weigh_alike_in_training():
    """data.balance=weights: N / (classes x the class's samples) from the training labels (the mean weight of
    a sample is 1), each sample's loss weighted by its class's and the plain mean of the batch taken, alike
    with hard and with soft (mixed) targets."""

    class Labels:
        targets = [0] * 6 + [1] * 3 + [2]

    weights = class_weights(Labels(), 4)
    assert torch.allclose(weights, torch.tensor([10 / 18, 10 / 9, 10 / 3, 0.0]))  # 3 classes have samples
    assert torch.isclose(weights[torch.tensor(Labels.targets)].mean(), torch.tensor(1.0))
    logits, targets = torch.randn(5, 4), torch.tensor([0, 1, 2, 2, 0])
    expected = (weights[targets] * nn.functional.cross_entropy(logits, targets, reduction="none")).mean()
    assert torch.isclose(classification_loss(logits, targets, 0.0, weights), expected)
    soft = nn.functional.one_hot(targets, 4).double()
    assert torch.isclose(soft_cross_entropy(logits, soft, weights), expected, atol=1e-6)
