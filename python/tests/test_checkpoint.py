"""torch.distributed.checkpoint (DCP) with fairring as the only backend: a
DDP model and an FSDP2 (`fully_shard`) model are trained, saved, trained on
(so that they change), loaded back, and must hold exactly the saved state;
the optimizer state of the DDP model too. DCP's planning runs on the object
collectives (gather_object, scatter_object_list, broadcast_object_list,
all_gather_object) and barriers of the default group."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import fairring  # noqa: F401  (registers the backend)
from conftest import TIMEOUT, spawn
from test_ddp import batch, model


def step(m, opt, rank, k):
    x, y = batch(rank, k)
    opt.zero_grad()
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()


def snapshot(state):
    """A deep copy of a state dict, DTensors as their local shards."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = snapshot(v)
        elif isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v
            out[k] = local.detach().clone()
        else:
            out[k] = copy.deepcopy(v)
    return out


def same(a, b, where=""):
    assert a.keys() == b.keys(), where
    for k in a:
        if isinstance(a[k], dict):
            same(a[k], b[k], f"{where}.{k}")
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{where}.{k}"
        else:
            assert a[k] == b[k], f"{where}.{k}"


def save_and_load(rank, world, port, path, kind):
    dist.init_process_group(
        "fairring",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    assert dist.get_backend() == "fairring"
    if kind == "ddp":
        m = DDP(model())
    else:
        m = model()
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(m)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    for k in range(3):
        step(m, opt, rank, k)
    if kind == "ddp":
        model_state, optim_state = get_state_dict(m, opt)
        state = {"model": model_state, "optim": optim_state}
    else:
        state = {"model": get_model_state_dict(m)}
    saved = snapshot(state)
    dcp.save(state, checkpoint_id=path)
    for k in range(3, 5):
        step(m, opt, rank, k)
    changed = snapshot({"model": get_model_state_dict(m)})
    with pytest.raises(AssertionError):
        same(changed["model"], saved["model"])
    if kind == "ddp":
        model_state, optim_state = get_state_dict(m, opt)
        target = {"model": model_state, "optim": optim_state}
        dcp.load(target, checkpoint_id=path)
        set_state_dict(m, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
        loaded_model, loaded_optim = get_state_dict(m, opt)
        same(snapshot({"model": loaded_model, "optim": loaded_optim}), saved)
    else:
        target = {"model": get_model_state_dict(m)}
        dcp.load(target, checkpoint_id=path)
        set_model_state_dict(m, target["model"])
        same(snapshot({"model": get_model_state_dict(m)}), saved)
    # Training goes on from the loaded state, on the same group.
    step(m, opt, rank, 9)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
@pytest.mark.parametrize("world", [2, 3])
def test_dcp_save_and_load_with_fairring_alone(tmp_path, world, kind):
    spawn(save_and_load, world, str(tmp_path / "checkpoint"), kind)
