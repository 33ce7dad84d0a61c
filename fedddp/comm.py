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
from .errors import ConfigError


class Comm:
    def __init__(self, env: ProcessEnv, device: str):
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        if device == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if env.local_rank >= count:
                raise ConfigError(f"run.device: cuda, but local rank {env.local_rank} sees {count} GPU(s); "
                                  "start one rank per GPU, or set run.device=cpu")
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

    def gather_rows(self, rows_MX: torch.Tensor, out_RMX: torch.Tensor | None) -> torch.Tensor | None:
        """[M, X] on every rank -> [world_size * M, X] on rank 0 (rank r's rows at r*M .. r*M+M-1),
        written into ``out_RMX`` (rank 0 only; None elsewhere). A gather, not an all-gather: rank 0
        is the only consumer, and over gloo an all-gather moves world_size times the bytes (on
        loopback with 2 ranks and the CNN's reports, 40 ms against 20 ms)."""
        if not self.distributed or self.world_size == 1:  # one rank (e.g. torchrun --nproc_per_node=1)
            return rows_MX
        rows_MX = rows_MX.contiguous()
        if self.is_main:
            dist.gather(rows_MX, list(out_RMX.chunk(self.world_size)), dst=0)
            return out_RMX
        dist.gather(rows_MX, None, dst=0)
        return None

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
