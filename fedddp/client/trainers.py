"""The two ways a rank trains its clients of a round, behind one ``train(jobs)``:
``OneAfterAnother`` (run.parallel_clients = 1) and ``SideBySide`` (B > 1, client/batched.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..data import ClientData
from ..flat import FlatLayout
from . import ClientContext, train_client
from .batched import BatchedTrainer


@dataclass
class Job:
    """One client's training this round: its report row, context, data, seed and local work;
    ``out`` holds the views of its row that training writes and the scalars it returns."""

    row: int
    ctx: ClientContext
    data: ClientData
    seed: int
    work: int
    out: dict


class OneAfterAnother:
    """The trainer of run.parallel_clients = 1: each client in turn on the rank's one model."""

    batched = None  # no side-by-side trainer

    def __init__(self, model, layout: FlatLayout, cfg, rule, needs: frozenset, task):
        self.model, self.layout, self.cfg, self.rule, self.needs = model, layout, cfg, rule, needs

    def train(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.layout.unflatten_into(job.ctx.global_P, self.model)
            t_client = time.perf_counter()
            train_client(self.model, job.ctx, job.data, self.cfg, self.rule, self.needs, job.seed, job.out, job.work)
            if job.ctx.global_P.device.type == "cuda":  # the client's kernels, not their queueing
                torch.cuda.synchronize(job.ctx.global_P.device)
            job.out["train_time"] = time.perf_counter() - t_client


class SideBySide:
    """The trainer of run.parallel_clients = B > 1: a group of up to B clients as one batched
    computation (client/batched.py)."""

    def __init__(self, model, layout: FlatLayout, cfg, rule, needs: frozenset, task):
        self.batched = BatchedTrainer(model, layout, cfg, rule, needs, task)

    def train(self, jobs: list[Job]) -> None:
        self.batched.train_group([(job.ctx, job.data, job.seed, job.work, job.out) for job in jobs])


def trainer_of(parallel_clients: int, *args) -> OneAfterAnother | SideBySide:
    """The rank's trainer for run.parallel_clients (resolved). ``args``: the trainers'."""
    return (SideBySide if parallel_clients > 1 else OneAfterAnother)(*args)
