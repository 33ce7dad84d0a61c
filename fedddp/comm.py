"""The only module that calls torch.distributed.

``Comm`` wraps a process group: gloo when the run's device is the CPU, NCCL when it is CUDA (each
rank then binds ``cuda:LOCAL_RANK``). With one process and no launcher it is a fake twin that
never touches torch.distributed, so a laptop run needs no rendezvous. Collectives take and return
tensors on ``comm.device``.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .env import ProcessEnv


# Renamed in recent torch releases; the old name still works but warns.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    def __init__(self, env: ProcessEnv, device: str):
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        if device == "cuda":
            torch.cuda.set_device(env.local_rank)
            self.device = torch.device("cuda", env.local_rank)
        else:
            self.device = torch.device("cpu")
        self.backend = "nccl" if device == "cuda" else "gloo"
        self.distributed = env.source != "single"
        if self.distributed and not dist.is_initialized():
            dist.init_process_group(
                self.backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                rank=env.rank, world_size=env.world_size,
                device_id=self.device if device == "cuda" else None,
                timeout=datetime.timedelta(minutes=30))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather_rows(self, rows_MX: torch.Tensor) -> torch.Tensor:
        """[M, X] on every rank -> [world_size * M, X], rank r's rows at r*M .. r*M+M-1."""
        if not self.distributed:
            return rows_MX
        out = torch.empty((self.world_size * rows_MX.shape[0],) + tuple(rows_MX.shape[1:]),
                          dtype=rows_MX.dtype, device=rows_MX.device)
        _all_gather_single(out, rows_MX.contiguous())
        return out

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.distributed:
            dist.broadcast(tensor, src)
        return tensor

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if self.distributed:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
