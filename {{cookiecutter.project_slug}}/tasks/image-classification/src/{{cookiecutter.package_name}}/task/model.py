"""The model: a torchvision classifier by name, or any timm model (model.name=timm:NAME), the loss,
and what freezing means.

Parallelism (DDP/FSDP) is applied in distributed.py, never here.
"""

from __future__ import annotations

import difflib
import math
import shutil
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.module import _IncompatibleKeys

from ..engine.ckpt.checkpoint import load_weights
from ..engine.errors import ConfigError
from .config import TIMM, ModelConfig, import_timm


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with up to 32 groups: statistics per sample, so independent of the batch size."""
    return nn.GroupNorm(min(32, channels), channels)


def build_model(cfg: ModelConfig, num_classes: int, sizes: tuple[int, int] | None = None) -> nn.Module:
    """The classifier with num_classes outputs, from a timm folder (model.init_from) or local weights
    (model.pretrained), optionally frozen; sizes: the training and validation image sizes, for timm
    models made for one (a ViT's position embeddings)."""
    model = from_folder(cfg, num_classes, sizes) if cfg.init_from else architecture(cfg, num_classes, sizes)
    if cfg.pretrained:
        load_pretrained(model, cfg.pretrained)
    if cfg.freeze_backbone:
        freeze_backbone(model)
    return model


# The modules init_module initialises; a model with parameters in any other kind of module (a
# ViT's class embedding, say) keeps torchvision's own initialisation and is built whole.
INIT_TYPES = (nn.Conv2d, nn.Linear, nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


def init_module(name: str, module: nn.Module, generator: torch.Generator) -> None:
    """torchvision's initialisation of its CNNs, drawn from generator: convolutions He-normal (fan
    out), norms weight 1 and bias 0 with fresh statistics, linear layers torch's default uniform."""
    if isinstance(module, nn.Conv2d):
        nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu", generator=generator)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Linear):
        nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
        if module.bias is not None:
            bound = 1 / math.sqrt(module.in_features)
            nn.init.uniform_(module.bias, -bound, bound, generator=generator)
    else:  # BatchNorm, GroupNorm, LayerNorm
        if getattr(module, "weight", None) is not None:
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()


def timm_model(name: str, num_classes: int, drop_path: float, sizes: tuple[int, int] | None = None) -> nn.Module:
    """timm's model `name` with num_classes outputs and stochastic depth drop_path, initialised as timm
    initialises it; a name timm lacks is refused with the closest ones it has."""
    timm = import_timm(f"model.name={TIMM}{name}: timm models")
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(TIMM + c for c in close)}?" if close else "see timm.list_models()"
        raise ConfigError(f"model.name={TIMM}{name}: timm has no such model; {hint}")
    return _create(timm, name, False, num_classes, drop_path, sizes)


def _create(timm, name: str, pretrained: bool, num_classes: int, drop_path: float, sizes: tuple[int, int] | None):
    """timm.create_model with num_classes and, where the model takes them, stochastic depth and the image
    sizes: a model made for one size (a ViT) is made for the training size, and resizes its position
    embeddings at run time when validation's differs (FixRes)."""
    kwargs = {"num_classes": num_classes} | ({"drop_path_rate": drop_path} if drop_path else {})
    attempts = [{}]
    if sizes:
        train, val = sizes
        attempts.insert(0, {"img_size": train} | ({"dynamic_img_size": True} if val != train else {}))
    for sized in attempts:
        try:
            return timm.create_model(name, pretrained=pretrained, **kwargs, **sized)
        except TypeError as err:  # an argument this model does not take
            error = err
    if drop_path:
        raise ConfigError(f"model.drop_path={drop_path}: timm's {name} has no stochastic depth") from None
    raise error


def from_folder(cfg: ModelConfig, num_classes: int, sizes: tuple[int, int] | None = None) -> nn.Module:
    """The model of a timm folder with its weights, whole, through timm's own loader: the classifier is a
    fresh one when num_classes differs. (For models meta_init cannot fill: see folder_model.)"""
    import timm

    with _folder_errors(cfg):
        return _create(timm, f"local-dir:{cfg.init_from}", True, num_classes, cfg.drop_path, sizes)


def folder_model(
    cfg: ModelConfig, num_classes: int, sizes: tuple[int, int] | None = None
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model of a timm folder on the meta device (shapes only), and the folder's weights as timm's own
    loader adapts them to it (a ViT's position embeddings resized, the classifier left out when num_classes
    differs). timm loads the folder as always, but its last step, the model's load_state_dict, is taken
    over: the weights then go into each process's shards (meta_init.load), never into a whole model."""
    import timm

    taken = {}

    def take(module: nn.Module, state_dict: dict, strict: bool = True, assign: bool = False) -> _IncompatibleKeys:
        taken.update(weights=dict(state_dict), strict=strict)
        return _IncompatibleKeys([], [])

    with _folder_errors(cfg), torch.device("meta"), mock.patch.object(nn.Module, "load_state_dict", take):
        model = _create(timm, f"local-dir:{cfg.init_from}", True, num_classes, cfg.drop_path, sizes)
    weights, expected = taken["weights"], model.state_dict()
    unexpected, missing = sorted(set(weights) - set(expected)), sorted(set(expected) - set(weights))
    reshaped = [key for key in weights if key in expected and weights[key].shape != expected[key].shape]
    if unexpected or reshaped or (missing and taken["strict"]):
        wrong = [f"unexpected {unexpected[:3]}"] if unexpected else []
        wrong += [f"missing {missing[:3]}"] if missing and taken["strict"] else []
        wrong += [f"{key} is {tuple(weights[key].shape)}, the model's {tuple(expected[key].shape)}" for key in reshaped]
        wrong = ", ".join(wrong[:3])
        raise ConfigError(f"model.init_from={cfg.init_from!r}: its weights do not fit timm's model ({wrong})")
    return model, weights


@contextmanager
def _folder_errors(cfg: ModelConfig):
    """timm's errors on a folder it cannot load (weights that do not fit, a damaged file) as one line."""
    try:
        yield
    except (RuntimeError, ValueError, OSError, KeyError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"model.init_from={cfg.init_from!r}: timm cannot load it ({reason})") from None


def architecture(cfg: ModelConfig, num_classes: int, sizes: tuple[int, int] | None = None) -> nn.Module:
    """The classifier's layers, with torchvision's (or timm's) initialisation (on the meta device:
    shapes only)."""
    if cfg.name.startswith(TIMM):
        return timm_model(cfg.name.removeprefix(TIMM), num_classes, cfg.drop_path, sizes)
    kwargs = {"num_classes": num_classes}
    if cfg.norm == "group":
        kwargs["norm_layer"] = group_norm
    try:
        model = torchvision.models.get_model(cfg.name, weights=None, **kwargs)
    except (ValueError, KeyError):
        raise ConfigError(
            f"model.name={cfg.name!r} is not a torchvision model; try resnet18, resnet50, efficientnet_b0, "
            "or see torchvision.models.list_models(module=torchvision.models)"
        ) from None
    if cfg.small_input and isinstance(model, torchvision.models.ResNet):
        # 32x32 images: a 3x3 stride-1 stem keeps 4x more spatial detail than the 7x7 stride-2 one.
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, 3, stride=1, padding=1, bias=False)
    return model


def classifier_head(model: nn.Module) -> nn.Linear:
    """The last Linear layer: fc for ResNets, classifier[-1] or heads.head for others."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError("model.freeze_backbone=true: the model has no Linear classifier head")
    return linears[-1]


def load_pretrained(model: nn.Module, path: str) -> None:
    """Load local weights; tensors whose shape differs (a head for other classes) keep their init."""
    weights = load_weights(path)
    own = model.state_dict()
    usable = {k: v for k, v in weights.items() if k in own and own[k].shape == v.shape}
    if not usable:
        raise ConfigError(f"model.pretrained={path!r}: none of its tensors fit model.name's layers")
    head = classifier_head(model)
    head_keys = {f"{name}.{p}" for name, m in model.named_modules() if m is head for p, _ in m.named_parameters()}
    missing = sorted(k for k in own if k not in usable and k not in head_keys)
    if missing:
        shown = ", ".join(missing[:3])
        raise ConfigError(f"model.pretrained={path!r} does not fit model.name (missing e.g. {shown})")
    model.load_state_dict(usable, strict=False)


def freeze_backbone(model: nn.Module) -> None:
    """Stop gradients everywhere but the classifier head."""
    head = classifier_head(model)
    for param in model.parameters():
        param.requires_grad_(False)
    for param in head.parameters():
        param.requires_grad_(True)


def timm_param_settings(model: nn.Module, layer_decay: float) -> dict:
    """{parameter: (lr_scale, decays)} of a timm model, as timm's own training groups them: layers ordered by
    the model's group_matcher (or timm's automatic grouping), the head at scale 1 and each layer below at
    layer_decay times the one above; no weight decay for biases, norms and what model.no_weight_decay()
    names (a ViT's position and class embeddings)."""
    from timm.optim import param_groups_layer_decay

    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    groups = param_groups_layer_decay(model, weight_decay=1.0, no_weight_decay_list=skip, layer_decay=layer_decay)
    return {param: (group["lr_scale"], group["weight_decay"] > 0) for group in groups for param in group["params"]}


def write_timm_folder(model: nn.Module, name: str, folder: Path, preprocessing: dict) -> None:
    """export --format timm: config.json (the architecture, the classes, and as timm's preprocessing settings
    the run's: preprocessing's input_size, mean and std) and model.safetensors, as timm.models.save_for_hf
    writes them: timm.create_model('local-dir:FOLDER') loads the trained model, head included,
    timm.data.resolve_data_config prepares images as training did, and the hub takes the folder as it is."""
    timm = import_timm("export --format timm: timm folders")
    if not name.startswith(TIMM):
        raise ConfigError(f"export --format timm: model.name={name} is torchvision's; train a model.name=timm:NAME")
    staging = folder.with_name(f".{folder.name}.partial")  # the folder appears complete or not at all
    shutil.rmtree(staging, ignore_errors=True)
    classes = classifier_head(model).out_features
    settings = {**getattr(model, "pretrained_cfg", {}), **preprocessing, "num_classes": classes}
    settings = {key: value for key, value in settings.items() if value is not None}
    config = {"architecture": name.removeprefix(TIMM), "num_classes": classes, "pretrained_cfg": settings}
    timm.models.save_for_hf(model, str(staging), model_config=config, safe_serialization=True)
    if folder.exists():
        shutil.rmtree(folder)  # an earlier export of this run, written again
    staging.rename(folder)


def classification_loss(
    logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean cross-entropy over integer class targets (label_smoothing e: against (1 - e) on the class
    and e spread evenly over every class); refuses shapes that would silently broadcast. weight: a
    weight per class (data.balance=weights), each sample's loss weighted by its class's and the plain
    mean taken, so the loss of a batch does not depend on what else is in it."""
    if targets.dtype != torch.long or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"targets must be class indices of shape {tuple(logits.shape[:1])} and dtype long, "
            f"got shape {tuple(targets.shape)} and dtype {targets.dtype}"
        )
    if weight is None:
        return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing)
    losses = F.cross_entropy(logits.float(), targets, weight=weight, label_smoothing=label_smoothing, reduction="none")
    return losses.mean()
