"""The two ways a rank trains its clients of a round, behind one interface: ``OneAfterAnother``
(run.parallel_clients = 1) and ``SideBySide`` (B > 1, client/batched.py). Each offers

- ``check_first(data, ids)``: the refusals it makes before round 1 on the built data and model
  (the run's setup and ``python -m fedddp --check`` both call it, so --check refuses what the
  run refuses);
- ``warm_up(data, server_view)``: its first call on throwaway inputs (fedddp/warmup.py);
- ``train(jobs)``: the round's clients of this rank.

The rest of the run reaches nothing inside a trainer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..data import ClientData
from ..flat import FlatLayout
from . import ClientContext, LocalTraining, check_one_sample_batches, train_client
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

    def __init__(self, model, layout: FlatLayout, training: LocalTraining, rule, needs: frozenset, task):
        self.model, self.layout, self.training, self.rule, self.needs, self.task = \
            model, layout, training, rule, needs, task

    def check_first(self, data, ids) -> None:
        """A train.batch_size that leaves a client a last batch of one sample for a model with
        BatchNorm (``data``: the built FederatedData; ``ids``: the clients this rank may train)."""
        check_one_sample_batches(self.model, data.input_shape, data.num_samples, self.training.train.batch_size,
                                 self.training.model_name)

    def warm_up(self, data: ClientData, server_view: dict | None = None) -> None:
        """One forward and backward of a full batch of ``data``, the model left as it was
        (``server_view``: what the clients read of the server's state, for a side-by-side warm-up)."""
        model, tc = self.model, self.training.train
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        width = min(tc.batch_size if tc.batch_size > 0 else len(data), len(data))
        try:
            model.train()
            self.task.loss(model(data.x[:width]), data.y[:width]).backward()
        finally:
            model.load_state_dict(saved)
            model.zero_grad(set_to_none=True)

    def train(self, jobs: list[Job]) -> None:
        for job in jobs:
            t_client = time.perf_counter()  # loading the client's start model is its training too
            self.layout.unflatten_into(job.ctx.global_P, self.model)
            train_client(self.model, job.ctx, job.data, self.training, self.rule, self.needs, job.seed, job.out,
                         job.work)
            if job.ctx.global_P.device.type == "cuda":  # the client's kernels, not their queueing
                torch.cuda.synchronize(job.ctx.global_P.device)
            job.out["train_time"] = time.perf_counter() - t_client


class SideBySide(OneAfterAnother):
    """The trainer of run.parallel_clients = B > 1: a group of up to B clients as one batched
    computation (client/batched.py). Its refusals before round 1 are one after another's plus a
    side-by-side step tried on a client's samples."""

    def __init__(self, model, layout: FlatLayout, training: LocalTraining, rule, needs: frozenset, task):
        super().__init__(model, layout, training, rule, needs, task)
        self.batched = BatchedTrainer(model, layout, training, rule, needs, task)

    def check_first(self, data, ids) -> None:
        """One after another's, then one step tried on the first client of ``ids`` with samples:
        what vmap cannot run is one line now, not round 1's traceback; with run.compile and
        full batches, every compiled step padded to the most samples of a client of ``ids``."""
        super().check_first(data, ids)
        self.batched.try_first_client(data.train, data.num_samples, ids)
        self.batched.widest = max((data.num_samples[c] for c in ids), default=0)

    def warm_up(self, data: ClientData, server_view: dict | None = None) -> None:
        """One gradient call of a full group's shape (``BatchedTrainer.warm_up``)."""
        self.batched.warm_up(data, server_view)

    def train(self, jobs: list[Job]) -> None:
        # each client's train_time is its share of the group's time, the group's kernels waited
        # for once (BatchedTrainer.train_group)
        self.batched.train_group([(job.ctx, job.data, job.seed, job.work, job.out) for job in jobs])


def trainer_of(model, layout: FlatLayout, training: LocalTraining, rule, needs: frozenset,
               task) -> OneAfterAnother | SideBySide:
    """The rank's trainer for ``training.clients`` (B, resolved): the run's setup and --check build
    it here."""
    return (SideBySide if training.clients > 1 else OneAfterAnother)(model, layout, training, rule, needs, task)
