"""The private PyTorch names engine/torch_private.py relies on still exist and mean what it assumes:
an upgrade that moves one fails here, by name, instead of somewhere in a run."""

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from {{ cookiecutter.package_name }}.engine import torch_private


def test_a_compiled_model_keeps_the_original_in_orig_mod():
    """torch.compile's wrapper holds the model in _orig_mod (the prefix its state_dict keys carry)."""
    model = nn.Linear(2, 2)
    compiled = torch.compile(model)
    assert torch_private.uncompiled(compiled) is model
    assert torch_private.unwrap(compiled) is model
    assert all(key.startswith("_orig_mod.") for key in compiled.state_dict())


def test_unwrap_reaches_the_model_inside_ddp_and_compile(tmp_path):
    """unwrap goes through torch.compile's wrapper and DDP's (gloo, one process)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.Linear(2, 2)
        wrapped = torch.compile(nn.parallel.DistributedDataParallel(model))
        assert torch_private.unwrap(wrapped) is model
    finally:
        dist.destroy_process_group()


def test_a_device_mesh_keeps_its_groups_in_pg_registry(tmp_path):
    """DeviceMesh keeps its process groups in _pg_registry, which forget_mesh_groups empties."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        assert isinstance(mesh._pg_registry, dict)
        torch_private.forget_mesh_groups(mesh)
        assert not mesh._pg_registry
    finally:
        dist.destroy_process_group()


def test_a_dataloader_iterator_can_shut_its_workers_down():
    """A multi-process DataLoader iterator has _shutdown_workers, and shut_down_loader_workers ends them."""
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)
    next(iter(loader))
    workers = loader._iterator._workers
    assert hasattr(loader._iterator, "_shutdown_workers")
    torch_private.shut_down_loader_workers(loader)
    assert loader._iterator is None
    for worker in workers:
        worker.join(timeout=10)
        assert not worker.is_alive()


def test_dcp_reads_the_stager_flag_through_should_synchronize_after_execute():
    """torch.distributed.checkpoint decides whether to wait for a stager after a save starts from
    should_synchronize_after_execute, backed by the private _synchronize_after_execute."""
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.staging import AsyncStager

    assert "should_synchronize_after_execute" in inspect.getsource(state_dict_saver)
    assert "_synchronize_after_execute" in inspect.getsource(AsyncStager)
    assert torch_private.UnsynchronizedStager.should_synchronize_after_execute is False


def test_the_cuda_memory_snapshot_functions_exist():
    """The memory-snapshot recorder torch documents under underscored names is still there."""
    assert callable(torch.cuda.memory._record_memory_history)
    assert "max_entries" in inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert callable(torch.cuda.memory._dump_snapshot)


@pytest.mark.parametrize("persistent", [True, False])
def test_setattr_replaces_a_buffer_and_keeps_whether_it_is_persistent(persistent):
    """meta_init swaps parameters and buffers with setattr, the public way, which keeps a buffer's
    persistence (what module._buffers did before)."""
    module = nn.Module()
    module.register_buffer("stat", torch.zeros(2), persistent=persistent)
    module.stat = torch.ones(2)
    assert torch.equal(module.stat, torch.ones(2))
    assert ("stat" in module.state_dict()) == persistent


def test_bf16_convolutions_take_the_slow_reference_kernels_where_onednn_lacks_bf16():
    """cpu_has_onednn_bf16 says which kernels compute a bf16 convolution's gradients on this
    CPU: oneDNN's, or torch's slow reference ones (aten::_slow_conv2d_backward) where it says no."""
    from torch.profiler import ProfilerActivity, profile

    conv, images = nn.Conv2d(3, 4, 3), torch.randn(2, 3, 8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = conv(images)
        out.float().sum().backward()
    slow = any(event.key == "aten::_slow_conv2d_backward" for event in prof.key_averages())
    assert slow != torch_private.cpu_has_onednn_bf16()
