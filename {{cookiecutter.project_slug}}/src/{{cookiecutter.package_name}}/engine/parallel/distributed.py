"""Process group, device and model wrapping. One process is world size 1 of the same code.

Rank, local rank and world size come from the launcher's environment (torchrun and accelerate
launch set RANK, LOCAL_RANK and WORLD_SIZE); the process group joins through the launcher's store
at MASTER_ADDR:MASTER_PORT. On one node, each restart of the group (torchrun --max-restarts) keys
its part of that store by the restart count (restart_store), so a restarted group never reads the
addresses of the group that died; across nodes that takes TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(docs/distributed.md, "Restarts").
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import os
import pickle
import platform
import re
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import ConfigError, DistributedConfig, RunConfig
from ..torch_private import forget_mesh_groups, uncompiled
from . import recompute
from .state_dicts import rebuilds_frozen

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Only the main process (rank 0) writes files, logs and progress bars."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer (set by the launcher)") from None


def setup(run: RunConfig, dcfg: DistributedConfig) -> DistEnv:
    """Read the launcher's variables, pick this process's device (run.device) and join the process group
    (distributed.strategy, backend and timeout_s)."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    missing = [name for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if world_size > 1 and missing:
        raise ConfigError(f"WORLD_SIZE={world_size} but {', '.join(missing)} not set; start with torchrun")
    if torch.cuda.is_available() and run.device != "cpu":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if run.cache_cpu_memory:
            cache_freed_memory()
    launched = "MASTER_ADDR" in os.environ  # by torchrun or accelerate, even with one process
    if world_size > 1 or (launched and dcfg.strategy in ("ddp", "fsdp")):
        backend = dcfg.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=dcfg.timeout_s)
        store = restart_store(world_size, timeout)
        if store is None:
            warn_if_restarts_share_a_store(world_size)
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return DistEnv(rank, local_rank, world_size, device)


def restart_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """The store this attempt of a one-node torchrun job joins through: the agent's, under a prefix
    named by the restart count. None where env:// is right (no agent store, or several nodes).

    Since torch 2.5 the elastic agent hosts the workers' store at MASTER_ADDR:MASTER_PORT once for
    the whole job, not once per restart, while env:// no longer keys it per attempt (pytorch#136768
    assumed a new store per retry; checked on torch 2.14.1). A restarted rank could then read the
    dead group's gloo/NCCL addresses and connect to a dead peer, in some runs only. This is what
    torch 2.4 and earlier did themselves. On one node every worker has the same restart count;
    across nodes each agent counts its own restarts, so the prefixes could differ and the group
    would never meet: there env:// stays (warn_if_restarts_share_a_store).
    """
    one_node = os.environ.get("LOCAL_WORLD_SIZE") == str(world_size)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not one_node:
        return None
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"/worker/attempt_{attempt}", agent)


def warn_if_restarts_share_a_store(world_size: int) -> None:
    """Several nodes under --max-restarts share one store across restarts unless told otherwise."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if restarts and shared and os.environ.get("LOCAL_WORLD_SIZE") != str(world_size):
        log.warning(
            "torchrun --max-restarts on several nodes: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where each "
            "torchrun starts (with --rdzv-backend=c10d), or restarted workers can read the previous group's "
            "addresses and fail or hang (pytorch#135712)"
        )


def cache_freed_memory() -> bool:
    """On CPU, keep freed memory for the next step, as CUDA's caching allocator does on a GPU.

    glibc's malloc gives each large tensor its own mmap and unmaps it when the tensor is freed, so
    every step faults its activations in again, page by page: 5-11% of the default model's
    CPU step. With no mmap and no trimming, what a step frees serves the next one, and the process
    keeps its peak memory, except across a fork (see `_hand_back_freed_memory_before_fork`).
    Changes nothing (returns False) off glibc, or where MALLOC_*, GLIBC_TUNABLES or a preloaded
    allocator show that the user tuned the allocator themselves.
    """
    tuned = any(name.startswith("MALLOC_") for name in os.environ) or "glibc.malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    )
    if tuned or "malloc" in os.environ.get("LD_PRELOAD", "") or platform.libc_ver()[0] != "glibc":
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>; -1 as the threshold: never trim
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, -1)):
        return False
    _hand_back_freed_memory_before_fork()
    return True


@functools.cache  # one fork handler per process, however often the allocator is set up
def _hand_back_freed_memory_before_fork() -> None:
    """Return the cached free memory to the system (malloc_trim) before each fork.

    A forked process (a DataLoader worker) shares the parent's pages copy-on-write, so the parent
    reusing its cached memory after a fork would copy it page by page in copy-on-write faults: that
    made the first training steps measurably slower. Memory handed back is faulted in fresh instead,
    once; workers start once (persistent_workers), so steps keep caching.
    """
    os.register_at_fork(before=functools.partial(ctypes.CDLL(None).malloc_trim, 0))


# How gloo and NCCL report a peer that hung (the collective timed out) or died (its socket closed).
PEER_FAILURE = re.compile(
    r"timed? ?out|timeout|connection (reset|closed|refused)|pair closure|broken pipe|nccl|gloo", re.IGNORECASE
)


def is_peer_failure(err: BaseException) -> bool:
    """Whether an error means another process hung or died, rather than a bug in this one."""
    return isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and bool(PEER_FAILURE.search(str(err))))


def is_main() -> bool:
    """Whether this is the main process (rank 0), the one that writes files."""
    return not joined() or dist.get_rank() == 0


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if joined() else 0


def world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if joined() else 1


def joined() -> bool:
    """Whether this process is part of a process group (False for one process without a launcher)."""
    return dist.is_available() and dist.is_initialized()


_meshes: list[DeviceMesh] = []  # made by shard_model; teardown takes the process group back from them


def teardown() -> None:
    """Leave the process group and free it now, while Python still runs (safe when none was joined).

    destroy_process_group alone does not free a group that FSDP2 used: the DeviceMesh keeps it in a
    registry (and DTensor's sharding caches keep the mesh), and each sharded module's FSDP state
    keeps it until garbage collection frees the model. Its gloo threads then ran on into
    interpreter shutdown, where about 1 exit in 70 aborted with "terminate called without an
    active exception" (SIGABRT) after a run that had finished.
    """
    if not joined():
        return
    dist.destroy_process_group()
    for mesh in _meshes:
        forget_mesh_groups(mesh)
    _meshes.clear()
    free_finished_models()


def free_finished_models() -> None:
    """Collect the reference cycles of models no longer used, and with them the groups they held.

    Call it where no frame holds the model: after train() returns, or after its exception was handled.
    """
    gc.collect()


def resolve_strategy(dcfg: DistributedConfig) -> str:
    """distributed.strategy, with auto meaning fsdp under an accelerate FSDP config and ddp otherwise."""
    if dcfg.strategy != "auto":
        return dcfg.strategy
    return "fsdp" if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" else "ddp"


def build_model(
    task, env: DistEnv, dcfg: DistributedConfig, precision: str, recompute_activations: bool = False
) -> nn.Module:
    """The task's model on this process's device, ready to train: FSDP2 (built on the meta device
    and sharded before any weight exists, meta_init.py), DDP, or as it is for one process.

    precision is trainer.precision; recompute_activations (model.activation_checkpointing) makes each
    block recompute its activations in backward."""
    strategy = resolve_strategy(dcfg)
    replicate = dcfg.replicate_degree
    if replicate > 1 and (strategy != "fsdp" or env.world_size % replicate):
        raise ConfigError(
            f"distributed.replicate_degree={replicate} needs distributed.strategy=fsdp and a number of processes "
            f"it divides (HSDP; {env.world_size} processes here)"
        )
    if joined() and strategy == "fsdp":
        if precision == "fp16":
            raise ConfigError("distributed.strategy=fsdp supports trainer.precision=bf16 or fp32, not fp16")
        if dcfg.sync_batchnorm:
            raise ConfigError("distributed.sync_batchnorm=true needs distributed.strategy=ddp (FSDP shares rank 0's)")
        shard = functools.partial(
            shard_model, env=env, precision=precision, replicate=replicate, recompute_activations=recompute_activations
        )
        model = task.build_model(env.device, shard)
        rebuilds_frozen(model, task.frozen_weights() is not None)
        return model
    model = task.build_model(env.device)
    rebuilds_frozen(model, task.frozen_weights() is not None)
    if recompute_activations:
        recompute.enable(model)
    return wrap_model(model, dcfg, env)


def wrap_model(model: nn.Module, dcfg: DistributedConfig, env: DistEnv) -> nn.Module:
    """DDP when more than one process trains (build_model shards FSDP models itself)."""
    if not joined():
        return model  # one process without a launcher: nothing to replicate or shard
    if resolve_strategy(dcfg) == "none":
        raise ConfigError(
            f"distributed.strategy=none with {env.world_size} processes would train independent models; use ddp"
        )
    if dcfg.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    log.info("DDP over %d processes", env.world_size)
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def shard_model(
    model: nn.Module, env: DistEnv, precision: str, replicate: int = 1, recompute_activations: bool = False
) -> nn.Module:
    """FSDP2: shard every block (recompute.blocks: the model's repeated layers), then the root.

    replicate > 1 is HSDP: a 2-D mesh that shards within groups of world_size / replicate
    processes and replicates across the replicate groups. recompute_activations: activation
    checkpointing per block, set up before the blocks are sharded."""
    # Imported here, not at the top: FSDP (and DTensor, sympy with it) take half a second to import,
    # which every process of a run without FSDP would pay at start.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if replicate > 1:
        shape = (replicate, env.world_size // replicate)
        mesh = init_device_mesh(env.device.type, shape, mesh_dim_names=("replicate", "shard"))
        log.info("HSDP over %d processes: %d replicas, each sharded over %d", env.world_size, *shape)
    else:
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        log.info("FSDP2 over %d processes", env.world_size)
    _meshes.append(mesh)
    if recompute_activations:
        recompute.enable(model)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else None
    )
    options = {"mesh": mesh, "mp_policy": policy} if policy else {"mesh": mesh}
    if policy:
        # BatchNorm keeps fp32 weights beside its fp32 running statistics (cuDNN refuses bf16
        # weights with fp32 statistics) and takes the bf16 activations as they come, as under
        # plain autocast; FSDP1 excluded BatchNorm from mixed precision for the same reason.
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for norm in [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
            fully_shard(norm, mesh=mesh, mp_policy=fp32)
    # Innermost first: a block inside another (a block that is itself an nn.Sequential, within a
    # stage of blocks) is sharded before the block that holds it, and a module already sharded (a
    # BatchNorm above) is left as it is: FSDP2 shards a parameter once, bottom-up.
    for _, block in reversed(recompute.blocks(model)):
        if not is_fsdp(block):
            fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def is_fsdp(module: nn.Module) -> bool:
    """Whether module is sharded by FSDP2 (False, without importing FSDP, when nothing imported it: no
    module can be sharded then)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether tensor is a DTensor (a shard of FSDP2's), likewise without importing DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro-batch: with enabled=False, gradients are not all-reduced (accumulation)."""
    inner = uncompiled(model)
    if is_fsdp(inner):
        inner.set_requires_gradient_sync(enabled)
    elif isinstance(inner, DistributedDataParallel) and not enabled:
        return inner.no_sync()
    return contextlib.nullcontext()


def broadcast_buffers(model: nn.Module, ddp: bool = False) -> None:
    """FSDP: give every rank rank 0's floating-point buffers (e.g. BatchNorm statistics), like DDP.

    fully_shard shards parameters only; each rank's BatchNorm statistics would otherwise drift
    apart on its own batches, so ranks would validate different models and a checkpoint (rank 0's)
    would not restore the others. DDP broadcasts them before every forward; this does it once per
    optimizer step, as one flat tensor. A no-op without FSDP or without such buffers.

    ddp=True: under DDP too (the weight average, optim.ema_decay, averages every rank's buffers
    after the step, which must be rank 0's for the ranks to agree and a resume to be exact).
    """
    inner = uncompiled(model)
    if not (is_fsdp(inner) or (ddp and isinstance(inner, DistributedDataParallel))):
        return
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if buffers:
        flat = torch.cat([b.reshape(-1) for b in buffers])
        dist.broadcast(flat, src=0)
        if dist.get_rank() == 0:  # the source: its buffers already hold these values
            return
        for b, value in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
            b.copy_(value.view_as(b))


def all_gather_object(obj) -> list:
    """obj from every process, in rank order ([obj] for one process)."""
    if not joined():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj):
    """Rank 0's obj on every process (obj itself for one process)."""
    if not joined():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_main(fn, *args):
    """fn(*args) on the main process only, whose error, if any, is raised on every process.

    Files are written by rank 0 alone. Were that write to fail on rank 0 only, the other ranks
    would wait in their next collective until distributed.timeout_s (under NCCL, or a launcher
    that does not stop the others); here they learn it at once and stop with the same error.
    Returns fn's result on the main process and None on the others.
    """
    if not joined():
        return fn(*args)
    error = result = None
    if dist.get_rank() == 0:
        try:
            result = fn(*args)
        except Exception as err:  # every kind: the others must not wait, whatever went wrong
            error = err
    shared = broadcast_object(None if error is None else _portable(error))
    if error is not None:
        raise error  # the main process keeps its own traceback
    if shared is not None:
        raise shared
    return result


def _portable(error: Exception) -> Exception:
    """error itself if it survives pickling (the project's errors do), else its message as a RuntimeError."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"the main process failed: {type(error).__name__}: {error}")


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest value any process holds (the value itself for one process)."""
    if not joined():
        return value
    tensor = torch.tensor(value, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def without_ddp(model: nn.Module) -> nn.Module:
    """The module inside DDP: evaluation needs no gradient sync, and DDP's forward broadcasts buffers."""
    inner = uncompiled(model)
    return inner.module if isinstance(inner, DistributedDataParallel) else model


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all processes in place (no-op for one process)."""
    if joined():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    """Wait for every process (no-op for one process)."""
    if joined():
        dist.barrier()
