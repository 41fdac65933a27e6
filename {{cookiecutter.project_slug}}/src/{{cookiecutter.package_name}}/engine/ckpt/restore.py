"""Rebuilding a trained model from a checkpoint, for the evaluate and export commands.

The model is rebuilt from the checkpoint: its stored config gives only the model's and the
task's shape (the task's TaskSpec.from_checkpoint). --config files and key=value overrides win. Everything else,
places above all, comes from the command line or the defaults: a checkpoint copied from
elsewhere never decides where data is read from or anything is written. Outputs go under
run.output_dir as given on the command line or, for --checkpoint PATH alone, beside it (see beside()).

Which weights: a checkpoint of a run with optim.ema_decay > 0 holds the weights' moving average
beside them; the commands use the average (what validation measured and best.safetensors holds)
unless `--weights raw` asks for the trained weights themselves.

One place does come from a checkpoint: one that holds only what trained over frozen weights the task
rebuilds (adapters over a base folder: its "frozen" entry, Task.frozen_weights) names the keys that
rebuild them, and they are taken unless the command line names others; the SHA-256 of the weights
rebuilt must equal the stored one, so a folder that changed since is refused rather than used.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf
from torch import nn

from ..config import Config, load_config, parse_args, with_stored_defaults
from ..ema import load_average_into
from ..errors import CheckpointError, ConfigError
from ..parallel import state_dicts
from .checkpoint import latest_checkpoint, load_checkpoint
from .names import strip_prefixes
from .sharded import ShardedWeights, load_weights_into

if TYPE_CHECKING:
    from ..seam import TaskSpec

# Training-only settings a --config file may carry (a resume path) that may be gone where a trained
# model is restored; the task adds its own (TaskSpec.inference_only).
INFERENCE_ONLY = ("trainer.resume=never",)


def restore_trained(spec: TaskSpec, argv: list[str], program: str) -> tuple[Config, Path, dict]:
    """Config (of the task spec declares), checkpoint path and checkpoint state for --checkpoint PATH or
    the run's newest one.

    Defaults < the checkpoint's TaskSpec.from_checkpoint keys < --config files < key=value overrides.
    run.output_dir is the command line's; with --checkpoint PATH alone, the folder beside it.
    """
    checkpoint_arg, weights, rest = _checkpoint_option(argv)
    files, overrides = parse_args(spec, rest, program)
    overrides = [*INFERENCE_ONLY, *spec.inference_only, *overrides]
    cfg = load_config(spec, files, overrides)
    if checkpoint_arg:
        path, state = Path(checkpoint_arg), load_checkpoint(Path(checkpoint_arg))
    else:
        found = latest_checkpoint(Path(cfg.run.output_dir) / "checkpoints")
        if found is None:
            raise ConfigError(
                f"run.output_dir={cfg.run.output_dir!r} holds no usable checkpoint; train first "
                "or pass --checkpoint PATH"
            )
        path, state = found
    base = model_and_task(state, path, spec)
    for section, values in frozen_config(state, path).items():
        base.setdefault(section, {}).update(values)
    cfg = load_config(spec, files, overrides, base=base)
    if checkpoint_arg and not _output_dir_given(files, overrides):
        cfg.run.output_dir = str(beside(path))  # set here, not as an override: a path is never parsed
    if weights == "raw":
        state.pop("ema", None)
    elif weights == "ema" and "ema" not in state:
        raise ConfigError(f"--weights ema: {path} holds no weight average (it was trained with optim.ema_decay=0)")
    return cfg, path, state


WEIGHTS = ("ema", "raw")


def take_options(
    argv: list[str], names: tuple[str, ...], joined: bool = False
) -> tuple[dict[str, str | None], list[str]]:
    """The values of the options named (as --name VALUE or --name=VALUE; None when absent), and the
    other arguments. An option given twice keeps its last value, or with joined both, comma-separated
    (--task-data a=x --task-data b=y: "a=x,b=y")."""
    found: dict[str, str | None] = dict.fromkeys(names)
    rest = []
    args = iter(argv)
    for arg in args:
        option, equals, value = arg.partition("=")
        if option not in found:
            rest.append(arg)
            continue
        value = value if equals else next(args, None)
        if value is None:
            raise ConfigError(f"{option} needs a value")
        found[option] = f"{found[option]},{value}" if joined and found[option] is not None else value
    return found, rest


def _checkpoint_option(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """--checkpoint PATH and --weights ema|raw, and the other arguments."""
    found, rest = take_options(argv, ("--checkpoint", "--weights"))
    if found["--weights"] not in (None, *WEIGHTS):
        raise ConfigError(f"--weights {found['--weights']!r}: choose ema (the moving average) or raw")
    return found["--checkpoint"], found["--weights"], rest


def model_and_task(state: dict, path: Path, spec: TaskSpec) -> dict:
    """The spec.from_checkpoint part of a checkpoint's stored config, as {section: {key: value}}."""
    stored = state.get("config")
    stored = with_stored_defaults(stored, spec.stored_defaults) if isinstance(stored, dict) else {}
    taken: dict = {}
    for section, keys in spec.from_checkpoint.items():
        for key in keys:  # a key of a group is dotted within its section (lora.r)
            *groups, leaf = (section, *key.split("."))
            values, into = stored, taken
            for group in groups:
                values = values.get(group) if isinstance(values.get(group), dict) else {}
                into = into.setdefault(group, {})
            if leaf in values:
                into[leaf] = _plain(values[leaf], f"{section}.{key}", path)
    return taken


def _plain(value, key: str, path: Path):
    """A stored value as data, never as configuration to evaluate.

    OmegaConf would resolve "${...}" in a stored string, and "${oc.env:HOME}" reads the
    environment: a checkpoint written elsewhere must not run resolvers here.
    """
    if isinstance(value, str) and "${" in value:
        raise CheckpointError(f"{path}: stored {key}={value!r} is an interpolation, which is never resolved")
    if isinstance(value, list):  # a list of plain values (model.lora.targets)
        return [_plain(item, key, path) for item in value]
    if value is not None and not isinstance(value, str | int | float | bool):
        raise CheckpointError(f"{path}: stored {key}={value!r} is not a number, flag or string")
    return value


def _output_dir_given(files: list[str], overrides: list[str]) -> bool:
    """Whether run.output_dir was set by a key=value override or a --config file."""
    if any(item.split("=", 1)[0] == "run.output_dir" for item in overrides):
        return True
    return any("output_dir" in (OmegaConf.load(file).get("run") or {}) for file in files)


def beside(checkpoint: Path) -> Path:
    """Where --checkpoint PATH alone writes: the run directory for a run's checkpoints/step_N(.pt)
    (where train wrote metrics.jsonl and where evaluate would write given run.output_dir), else
    the checkpoint's own folder."""
    folder = checkpoint.parent
    return folder.parent if folder.name == "checkpoints" else folder


def trained_step(state: dict) -> int | None:
    """The optimizer step a checkpoint was written at; None for weights saved without progress."""
    progress = state.get("progress")
    return progress.get("step") if isinstance(progress, dict) else None


def load_model_weights(model: nn.Module, state: dict, source: Path, frozen: dict | None = None) -> None:
    """Load a checkpoint's weights, saved by any wrapper (DDP, compile), into a plain model, and over
    them its weight average when it holds one (see restore_trained's --weights; integer buffers stay
    the model's). A sharded checkpoint's tensors are read from its shards, without the optimizer state.
    A checkpoint of adapters holds no frozen base: frozen (Task.frozen_weights) must name the base it
    was trained over. A mismatch names the file."""
    check_frozen(state.get("frozen"), frozen, source)
    state_dicts.rebuilds_frozen(model, frozen is not None)
    for key in ("model", "ema") if "ema" in state else ("model",):
        weights = state[key]
        try:
            if isinstance(weights, ShardedWeights):
                load_weights_into(model, weights.path, weights.key)
            elif key == "ema":
                load_average_into(model, weights)
            else:
                weights = strip_prefixes(weights)
                state_dicts.check_names(set(state_dicts.saved(model, model.state_dict())), set(weights))
                model.load_state_dict(weights, strict=frozen is None)
        except (RuntimeError, KeyError) as err:
            raise CheckpointError(f"{source}: does not fit the configured model ({mismatch(err)})") from None


def check_frozen(stored: dict | None, now: dict | None, path: Path) -> None:
    """Refuse a checkpoint whose trainable tensors were trained over other frozen weights than the ones
    built now (each a Task.frozen_weights(): what rebuilds them and the SHA-256 of their values)."""
    if stored is None and now is None:
        return
    if now is None:
        raise CheckpointError(
            f"{path} holds only what trained over the frozen {describe_frozen(stored)}; the model configured "
            "now freezes nothing for it to go on"
        )
    if stored is None:
        raise CheckpointError(
            f"{path} holds every weight, but the model configured now trains over the frozen "
            f"{describe_frozen(now)}: it is another model"
        )
    if stored.get("sha256") != now.get("sha256"):
        raise CheckpointError(
            f"{path} was trained over {describe_frozen(stored)}, but the frozen weights now are "
            f"{describe_frozen(now)}; name the same base (its folder may have moved)"
        )


def describe_frozen(frozen: dict) -> str:
    """'model.init_from='...' (sha256 0123456789ab)'."""
    where = ", ".join(f"{key}={value!r}" for key, value in (frozen.get("config") or {}).items())
    return f"{where} (sha256 {str(frozen.get('sha256'))[:12]})"


def frozen_config(state: dict, path: Path) -> dict:
    """The keys that rebuild a checkpoint's frozen weights (its "frozen" entry), as {section: {key: value}}:
    an adapter checkpoint is useless without its base, so evaluate, export and generate take them from it
    unless the command line names them (check_frozen compares the hashes then)."""
    taken: dict = {}
    for key, value in ((state.get("frozen") or {}).get("config") or {}).items():
        section, _, leaf = key.partition(".")
        taken.setdefault(section, {})[leaf] = _plain(value, key, path)
    return taken


def mismatch(err: Exception) -> str:
    """The informative part of torch's state-dict error: the first missing, unexpected or mis-sized key."""
    for line in str(err).splitlines():
        if "Missing key" in line or "Unexpected key" in line or "size mismatch" in line:
            return line.strip()[:240]
    return str(err).strip().splitlines()[-1][:240]
