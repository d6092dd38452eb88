"""DeepSpeed's CPU all-reduce buffers (/dev/shm, one per rank, never unlinked by DeepSpeed 0.19.8) are released by
ds_loongforge.initialize once every rank has mapped them, and the shared-memory all-reduce still works after it
(one and two gloo processes, as the deepspeed launcher starts them: LOCAL_SIZE set)."""

import glob
import os

import pytest
import torch

from tests._dist import spawn_with_deadline


def _worker(rank, world, port, out_dir):
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    import ds_loongforge

    pattern = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    created = len(glob.glob(pattern))
    torch.distributed.barrier()
    net = torch.nn.Linear(4, 4)
    engine, *_ = ds_loongforge.initialize(model=net, model_parameters=net.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "loongforge": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}})
    left = len(glob.glob(pattern))
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    summed = torch.full((5,), float(rank + 1))
    ds_comm.inference_all_reduce(summed, torch.distributed.ReduceOp.SUM)  # through the shared buffers
    torch.save({"created": created, "left": left, "summed": summed, "level": ds_comm.cdb.shm_vector_kernel_level},
               f"{out_dir}/rank{rank}.pt")


@pytest.mark.parametrize("world", [1, 2])  # one process from the launcher has a buffer too
def test_initialize_releases_deepspeeds_cpu_allreduce_buffers(tmp_path, world):
    spawn_with_deadline(_worker, world, str(tmp_path), timeout_s=300)
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["created"] == world, result  # DeepSpeed made one per rank at init
        assert result["left"] == 0, result         # released after initialize
        assert torch.equal(result["summed"], torch.full((5,), world * (world + 1) / 2)), result
