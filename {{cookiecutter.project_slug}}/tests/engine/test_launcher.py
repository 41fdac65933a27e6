"""accelerate launch's FSDP settings (launcher.py): those training honours become config keys, every other
one is refused by name, and nothing accelerate writes on its own is refused."""

import os
from pathlib import Path

import pytest
import yaml

from {{ cookiecutter.package_name }}.engine.errors import ConfigError
from {{ cookiecutter.package_name }}.engine.launcher import check_accelerate_fsdp

pytestmark = pytest.mark.core  # task-independent: the template runs it in one task's bake

ACCELERATE_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "accelerate"

# What accelerate launch (1.x) writes for an FSDP config file that names no fsdp_config option.
DEFAULTS = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "1",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_MIN_NUM_PARAMS": "100000000",
    "FSDP_FORWARD_PREFETCH": "false",
    "FSDP_USE_ORIG_PARAMS": "true",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_SYNC_MODULE_STATES": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "false",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
}
TWO_NODES = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
# accelerate's parallelism_config for HSDP: 2 replicas of 4 shards (FSDP2 only).
PARALLELISM = {
    "FSDP_VERSION": "2",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4",
    "PARALLELISM_CONFIG_TP_SIZE": "1",
    "PARALLELISM_CONFIG_CP_SIZE": "1",
}


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, {}),
        ({"ACCELERATE_USE_FSDP": "false", "FSDP_OFFLOAD_PARAMS": "true"}, {}),  # not an FSDP launch
        (DEFAULTS, {}),
        ({**DEFAULTS, "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}, {}),
        ({**DEFAULTS, "FSDP_USE_ORIG_PARAMS": "false", "FSDP_SYNC_MODULE_STATES": "false"}, {}),
        ({**DEFAULTS, "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE", "FSDP_RESHARD_AFTER_FORWARD": "full_shard"}, {}),
        (
            {**DEFAULTS, "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_ACTIVATION_CHECKPOINTING": "true"},
            {"trainer.checkpoint_format": "sharded", "model.activation_checkpointing": True},
        ),
        ({**DEFAULTS, "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}, {"trainer.checkpoint_format": "full"}),
        ({**DEFAULTS, "FSDP_STATE_DICT_TYPE": "3"}, {"trainer.checkpoint_format": "sharded"}),
        ({**DEFAULTS, **TWO_NODES, "FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"}, {"distributed.replicate_degree": 2}),
        ({**DEFAULTS, **TWO_NODES, "FSDP_RESHARD_AFTER_FORWARD": "hybrid_shard"}, {"distributed.replicate_degree": 2}),
        ({**DEFAULTS, **PARALLELISM}, {"distributed.replicate_degree": 2}),
    ],
)
def test_honoured_settings_become_config_keys(environ, expected):
    """accelerate's defaults and the options training does itself pass; the state dict type, activation
    checkpointing and hybrid sharding (replicas across machines) come back as config keys."""
    assert check_accelerate_fsdp(environ) == expected


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params=true"),
        ({"FSDP_VERSION": "3"}, "fsdp_version=3"),
        ({"FSDP_RESHARD_AFTER_FORWARD": "false"}, "fsdp_reshard_after_forward=false"),
        ({"FSDP_RESHARD_AFTER_FORWARD": "shard_grad_op"}, "fsdp_reshard_after_forward=shard_grad_op"),
        ({"FSDP_SHARDING_STRATEGY": "NO_SHARD"}, "fsdp_sharding_strategy=NO_SHARD"),
        ({"FSDP_SHARDING_STRATEGY": "5"}, "fsdp_sharding_strategy=5"),
        ({"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"}, "fsdp_sharding_strategy=HYBRID_SHARD"),  # machines unknown
        ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, "fsdp_auto_wrap_policy=SIZE_BASED_WRAP"),
        ({"FSDP_AUTO_WRAP_POLICY": "NO_WRAP"}, "fsdp_auto_wrap_policy=NO_WRAP"),
        ({"FSDP_TRANSFORMER_CLS_TO_WRAP": "Block"}, "fsdp_transformer_layer_cls_to_wrap=Block"),
        ({"FSDP_BACKWARD_PREFETCH": "BACKWARD_POST"}, "fsdp_backward_prefetch=BACKWARD_POST"),
        ({"FSDP_STATE_DICT_TYPE": "LOCAL_STATE_DICT"}, "fsdp_state_dict_type=LOCAL_STATE_DICT"),
        ({"FSDP_FORWARD_PREFETCH": "true"}, "fsdp_forward_prefetch=true"),
        ({"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"}, "fsdp_activation_checkpointing_offload=true"),
        ({"FSDP_IGNORED_MODULES": "head"}, "fsdp_ignored_modules=head"),
        (
            {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2"},
            "parallelism_config_tp_size=2",
        ),
    ],
)
def test_options_training_does_not_honour_are_refused_by_name(changes, named):
    """An option set to anything but what training does anyway is a ConfigError naming it with its value."""
    with pytest.raises(ConfigError) as refused:
        check_accelerate_fsdp({**DEFAULTS, **changes})
    assert named in str(refused.value)


def test_every_refused_option_is_named_in_one_line():
    """Several refused options at once: one line names each, beside nothing that was honoured."""
    environ = {**DEFAULTS, "FSDP_OFFLOAD_PARAMS": "true", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
               "FSDP_ACTIVATION_CHECKPOINTING": "true"}  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        check_accelerate_fsdp(environ)
    message = str(refused.value)
    assert "\n" not in message and "fsdp_activation_checkpointing=" not in message
    assert "fsdp_offload_params=true" in message and "fsdp_auto_wrap_policy=SIZE_BASED_WRAP" in message


def accelerate_env(config: Path, monkeypatch) -> dict[str, str]:
    """The environment accelerate launch gives the training processes for a config file, built by its own
    code (what `accelerate launch --config_file config` runs before it starts torchrun)."""
    launch = pytest.importorskip("accelerate.commands.launch")
    from accelerate.utils.launch import prepare_multi_gpu_env

    for name in [n for n in os.environ if n.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_"))]:
        monkeypatch.delenv(name)
    args = launch.launch_command_parser().parse_args(["--config_file", str(config), "train.py"])
    args, _, _ = launch._validate_launch_command(args)
    return prepare_multi_gpu_env(args)


def test_what_accelerate_writes_for_a_bare_fsdp_file_is_honoured(tmp_path, monkeypatch):
    """What accelerate itself writes for a file naming no fsdp_config option (the defaults above) passes;
    offloading written into the file reaches the environment and is refused."""
    config = tmp_path / "fsdp.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 2\n")
    environ = accelerate_env(config, monkeypatch)
    assert check_accelerate_fsdp(environ) == {}
    # The table above is accelerate's (a version may write fewer variables, or more).
    assert {name: environ.get(name) for name in DEFAULTS if name in environ} == {
        name: value for name, value in DEFAULTS.items() if name in environ
    }
    assert environ["ACCELERATE_USE_FSDP"] == "true"

    config.write_text(config.read_text() + "fsdp_config:\n  fsdp_version: 2\n  fsdp_offload_params: true\n")
    with pytest.raises(ConfigError, match="fsdp_offload_params=true"):
        check_accelerate_fsdp(accelerate_env(config, monkeypatch))


@pytest.mark.parametrize("config", sorted(ACCELERATE_CONFIGS.glob("*.yaml")), ids=lambda path: path.name)
def test_the_projects_accelerate_configs_pass(config, monkeypatch):
    """Each file in configs/accelerate/, turned into an environment by accelerate, passes the check; the
    FSDP ones (fsdp.yaml) really make an FSDP launch, which the check reads."""
    environ = accelerate_env(config, monkeypatch)
    assert check_accelerate_fsdp(environ) == {}
    is_fsdp = yaml.safe_load(config.read_text())["distributed_type"] == "FSDP"
    assert (environ.get("ACCELERATE_USE_FSDP") == "true") == is_fsdp
    assert is_fsdp or config.name != "fsdp.yaml"
