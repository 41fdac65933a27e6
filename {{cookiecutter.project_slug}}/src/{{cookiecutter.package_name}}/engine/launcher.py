"""What accelerate launch's FSDP settings ask of training: the options honoured, as config keys, and
the others refused by name, so that none is silently ignored.

accelerate launch turns the fsdp_config of its config file (or its --fsdp_* flags) into FSDP_*
environment variables, meant for an Accelerator's FSDP plugin. Training here uses no Accelerator:
it shards with its own FSDP2 setup (distributed.shard_model), which does this and nothing else:
fully_shard per block and then the root, parameters resharded after every forward, no CPU
offload, mixed precision from trainer.precision, checkpoints as trainer.checkpoint_format says,
activation checkpointing per block (model.activation_checkpointing), HSDP across
distributed.replicate_degree groups. accelerate writes several variables even when its file does
not name them, with its own defaults; every one of those defaults passes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import ConfigError

TRUE = ("1", "t", "true", "y", "yes", "on")  # what accelerate's str_to_bool reads as true
FALSE = ("0", "f", "false", "n", "no", "off")
# accelerate's names of FSDP1's sharding strategies; it also takes their numbers, from 1.
SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# Why the strategies other than FULL_SHARD and HYBRID_SHARD are refused.
SHARDING_REFUSED = {
    "SHARD_GRAD_OP": "parameters are resharded after every forward",
    "NO_SHARD": "for replicas without sharding use distributed.strategy=ddp",
    "HYBRID_SHARD_ZERO2": "parameters are resharded after every forward; HSDP is distributed.replicate_degree",
}
# torch's StateDictType, by number, and what trainer.checkpoint_format calls the two it honours.
STATE_DICT_NUMBERS = {"1": "FULL_STATE_DICT", "2": "LOCAL_STATE_DICT", "3": "SHARDED_STATE_DICT"}
CHECKPOINT_FORMATS = {"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded"}
# Not read at all, so any value passes: FSDP_USE_ORIG_PARAMS (FSDP2 always keeps the original
# parameters), FSDP_SYNC_MODULE_STATES and FSDP_CPU_RAM_EFFICIENT_LOADING (every process builds the
# same model), FSDP_MIN_NUM_PARAMS (SIZE_BASED_WRAP's, refused) and PARALLELISM_CONFIG_DP_SHARD_SIZE
# (the processes that are not replicas shard).
# Switches that must stay off (accelerate's default), with what training does instead.
OFF = {
    "OFFLOAD_PARAMS": "parameters and gradients stay on the device",
    "FORWARD_PREFETCH": "FSDP2 has no forward prefetch option",
    "ACTIVATION_CHECKPOINTING_OFFLOAD": "recomputed blocks keep their inputs on the device",
}
# The config file's name of an option whose variable is named otherwise.
OPTION_NAMES = {"TRANSFORMER_CLS_TO_WRAP": "fsdp_transformer_layer_cls_to_wrap"}
# Set only when the file names them; any value is refused.
NEVER = {
    "TRANSFORMER_CLS_TO_WRAP": "blocks are the children of the model's nn.Sequential and nn.ModuleList, not classes",
    "IGNORED_MODULES": "every module is sharded",
}


def check_accelerate_fsdp(environ: Mapping[str, str] = os.environ) -> dict[str, object]:
    """The config keys that accelerate launch's FSDP settings set, e.g. {"trainer.checkpoint_format": "sharded",
    "model.activation_checkpointing": True}; {} unless ACCELERATE_USE_FSDP is true.

    Raises ConfigError, in one line naming each option and its value, when an option asks for
    anything the training's own FSDP2 does not do.
    """
    if environ.get("ACCELERATE_USE_FSDP", "").lower() != "true":
        return {}
    settings: dict[str, object] = {}
    refused: list[str] = []

    def fsdp(name: str) -> str | None:
        return environ.get(f"FSDP_{name}")

    def refuse(name: str, value: str, why: str) -> None:
        refused.append(f"{name.lower()}={value} ({why})")

    version = fsdp("VERSION")  # accelerate writes 1 when the file names no version: taken as FSDP2
    if version is not None and version.strip() not in ("1", "2"):
        refuse("fsdp_version", version, "training always uses FSDP2")

    for name in ("SHARDING_STRATEGY", "RESHARD_AFTER_FORWARD"):  # FSDP1 strategies, or FSDP2's bool
        value = fsdp(name)
        if value is None:
            continue
        strategy = _sharding_strategy(value)
        if strategy == "HYBRID_SHARD":  # shard within each machine, replicate across machines
            nodes = _nodes(environ)
            if nodes is None:
                refuse(f"fsdp_{name}", value, "set distributed.replicate_degree instead")
            else:
                settings["distributed.replicate_degree"] = nodes
        elif strategy != "FULL_SHARD":
            refuse(f"fsdp_{name}", value, SHARDING_REFUSED.get(strategy, "not a sharding strategy"))

    wrap = fsdp("AUTO_WRAP_POLICY")
    if wrap is not None and wrap.strip().upper() != "TRANSFORMER_BASED_WRAP":
        refuse("fsdp_auto_wrap_policy", wrap, "each block is sharded on its own, as TRANSFORMER_BASED_WRAP")
    prefetch = fsdp("BACKWARD_PREFETCH")
    if prefetch is not None and prefetch.strip().upper() not in ("BACKWARD_PRE", "1"):
        refuse("fsdp_backward_prefetch", prefetch, "FSDP2 prefetches the next block in backward, as BACKWARD_PRE")

    state_dict = fsdp("STATE_DICT_TYPE")
    if state_dict is not None:
        kind = STATE_DICT_NUMBERS.get(state_dict.strip(), state_dict.strip().upper())
        if kind in CHECKPOINT_FORMATS:
            settings["trainer.checkpoint_format"] = CHECKPOINT_FORMATS[kind]
        else:
            refuse("fsdp_state_dict_type", state_dict, "use FULL_STATE_DICT or SHARDED_STATE_DICT")

    checkpointing = fsdp("ACTIVATION_CHECKPOINTING")
    if checkpointing is not None:
        if checkpointing.strip().lower() in TRUE:
            settings["model.activation_checkpointing"] = True
        elif checkpointing.strip().lower() not in FALSE:  # false: accelerate's default, the config decides
            refuse("fsdp_activation_checkpointing", checkpointing, "not true or false")
    for name, instead in OFF.items():
        value = fsdp(name)
        if value is not None and value.strip().lower() not in FALSE:
            refuse(f"fsdp_{name}", value, instead)
    for name, why in NEVER.items():
        if fsdp(name) is not None:
            refuse(OPTION_NAMES.get(name, f"fsdp_{name}"), fsdp(name), why)

    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
        _check_parallelism(environ, settings, refuse)

    if refused:
        raise ConfigError(
            f"accelerate's FSDP settings ask for what training does not do: {'; '.join(refused)}. Remove them "
            "from the accelerate config file or --fsdp_* flags (training shards with its own FSDP2; docs: distributed)"
        )
    return settings


def _sharding_strategy(value: str) -> str | None:
    """accelerate's FSDP1 strategy name for a value of FSDP_SHARDING_STRATEGY or FSDP_RESHARD_AFTER_FORWARD
    (a name, its number, or FSDP2's true: FULL_SHARD, false: SHARD_GRAD_OP); None for anything else."""
    value = value.strip().upper()
    if value.isdigit() and 1 <= int(value) <= len(SHARDING):
        return SHARDING[int(value) - 1]
    if value.lower() in ("true", "false"):
        return "FULL_SHARD" if value.lower() == "true" else "SHARD_GRAD_OP"
    return value if value in SHARDING else None


def _nodes(environ: Mapping[str, str]) -> int | None:
    """Machines in the job, from torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE (None if either is missing)."""
    try:
        world, local = int(environ["WORLD_SIZE"]), int(environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return world // local if local > 0 and world % local == 0 else None


def _check_parallelism(environ: Mapping[str, str], settings: dict, refuse) -> None:
    """accelerate's parallelism_config (FSDP2 only): data-parallel replicas are HSDP's replicate degree;
    tensor, context and sequence parallelism are not done."""
    prefix = "PARALLELISM_CONFIG_"
    replicate = environ.get(prefix + "DP_REPLICATE_SIZE")
    if replicate is not None:
        if not replicate.strip().isdigit() or int(replicate) < 1:
            refuse("parallelism_config_dp_replicate_size", replicate, "not a whole number of at least 1")
        elif int(replicate) > 1:
            if settings.get("distributed.replicate_degree", int(replicate)) != int(replicate):
                refuse("parallelism_config_dp_replicate_size", replicate, "HYBRID_SHARD replicates across machines")
            settings["distributed.replicate_degree"] = int(replicate)
    for kind, parallelism in (("TP", "tensor"), ("CP", "context"), ("SP", "sequence")):
        value = environ.get(f"{prefix}{kind}_SIZE")
        if value is not None and value.strip() != "1":
            refuse(f"parallelism_config_{kind}_size", value, f"no {parallelism} parallelism, only data parallelism")
