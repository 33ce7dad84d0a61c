"""How much local work each sampled client does this round, and which clients fail to report.

Like the sample itself (fedddp.sampling), every draw here is a pure function of (seed, round,
client id) on its own stream: every rank draws the same work and the same dropouts without
communicating, whichever rank owns the client, so runs stay bitwise the same for any number of
ranks.

- Uneven work (``train.local_work_min > 0``): each sampled client's local epochs (or local
  steps, when ``train.local_steps > 0``) are drawn each round uniformly from
  ``[local_work_min, local_epochs]`` (or ``local_steps``), as in FedNova's experiments. Work
  proportional to the client's size needs no draw: fixed ``local_epochs`` already give
  ceil(n_k / B) steps per epoch.
- Dropouts (``run.dropout``): each sampled client fails to report with that probability; it
  does not train, and its client state is untouched.
- Stragglers (``run.deadline_steps > 0``): a client whose drawn work exceeds the deadline in
  local steps is dropped as well; it does not train (its client state does not leave its owner
  rank), its row carries the count and rank 0 leaves it out (``reporting_rows``).
"""

from __future__ import annotations

import torch

from .sampling import _mix

_WORK_STREAM = 0x3057
_DROP_STREAM = 0xD809


def local_work(tc, seed: int, round_idx: int, client_id: int) -> int:
    """The client's local epochs (or steps, when train.local_steps > 0) this round; ``tc`` is the
    TrainConfig, ``seed`` run.seed."""
    most = tc.local_steps if tc.local_steps > 0 else tc.local_epochs
    if tc.local_work_min <= 0 or tc.local_work_min >= most:
        return most
    gen = torch.Generator().manual_seed(_mix(_WORK_STREAM, seed, round_idx, client_id))
    return int(torch.randint(tc.local_work_min, most + 1, (1,), generator=gen).item())


def drops_out(p: float, seed: int, round_idx: int, client_id: int) -> bool:
    """Whether the client fails to report this round (probability ``p``, run.dropout; ``seed``
    run.seed)."""
    if p <= 0.0:
        return False
    gen = torch.Generator().manual_seed(_mix(_DROP_STREAM, seed, round_idx, client_id))
    return bool(torch.rand((), generator=gen, dtype=torch.float64).item() < p)


def reporting_rows(num_steps_K: torch.Tensor, deadline_steps: int) -> torch.Tensor:
    """Indices of the rows whose client met the deadline (all rows when there is none)."""
    if deadline_steps <= 0:
        return torch.arange(num_steps_K.shape[0], device=num_steps_K.device)
    return torch.nonzero(num_steps_K <= deadline_steps).flatten()


def check(rc, tc) -> list[str]:
    """Configuration errors of the fields above (``rc``, ``tc``: the RunConfig and TrainConfig),
    each naming its dotted path."""
    errors = []
    if not 0.0 <= rc.dropout <= 1.0:
        errors.append(f"run.dropout: must be in [0, 1], got {rc.dropout}")
    if rc.deadline_steps < 0:
        errors.append(f"run.deadline_steps: must be >= 0 (0: no deadline), got {rc.deadline_steps}")
    most, key = (tc.local_steps, "train.local_steps") if tc.local_steps > 0 else (tc.local_epochs, "train.local_epochs")
    if not 0 <= tc.local_work_min <= most:
        errors.append(f"train.local_work_min: must be in [0, {key} = {most}] (0: equal work), got {tc.local_work_min}")
    if tc.local_work_min > 0 and tc.lr_schedule == "steplr" and tc.lr_schedule_unit == "epoch":
        errors.append("train.local_work_min: uneven local epochs have no common epoch clock for "
                      "train.lr_schedule_unit = epoch; use lr_schedule_unit = round")
    return errors
