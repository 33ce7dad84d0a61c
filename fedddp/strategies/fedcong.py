"""FedCong (Fernandes et al., seed 004, eq. 3): per coordinate, average only the clients whose
update agrees in sign, when enough of them do.

For coordinate j, u_kj = w_kj - w_j, P_j = #{k: u_kj > 0}, N_j = #{k: u_kj < 0} (zero counts as
neither). With alpha = hp.params["cong_alpha"]:
  P_j >= alpha K -> average the clients with u_kj > 0
  N_j >= alpha K -> average the clients with u_kj < 0
  otherwise      -> average all clients.
Our choices where the paper is silent:
  - both groups can qualify when alpha <= 0.5: the larger count wins, ties go to the positive
    group;
  - an empty group never qualifies (alpha = 0 would otherwise pick an empty group);
  - alpha K is taken as the integer ceil(alpha K) with a 1e-9 slack (0.28 * 25 means 7);
  - within the chosen group clients are weighted by p_k renormalised over the group
    (hp.weighting = "uniform" gives the plain mean of the group).

On CPU one fused kernel (kernels.c) does all of it in a single pass, with every per-column
count and sum in registers; on CUDA its Triton twin (triton_kernels.py). Elsewhere (the
torch-op form), per block of columns: a
matrix-vector product for the all-clients sum (it reads the block from memory), the 0/1
indicators of the two groups (one [2K, B] buffer, in cache), one matmul for the group counts
and p-sums, an in-place product with the params and one matmul for the group-weighted sums:
the params are read from memory once, every reduction is a matmul. The group choice then runs
over the statistics of a batch of blocks at once.
Diagnostics: the fraction of coordinates that took the positive group, the negative group, and
all clients.
Legend: K sampled clients, P flat parameters, B columns in a block.
"""

from __future__ import annotations

import torch

from . import kernels
from ..params import in_unit
from .base import Strategy, client_weights_K, column_block, min_agreeing, register


# Columns of the per-column statistics collected before the group choice runs over them: the
# choice is ~10 ops on [B]-sized rows, so at large K (narrow blocks) it runs once per several
# blocks and the per-op overhead is paid once per batch (about 1 MiB of statistics on CPU).
SELECT_COLUMNS_CPU = 1 << 15


def aggregate(global_P, stacks, state, hp):
    params_KP = stacks["params_KP"]
    need = max(1, min_agreeing(hp.params["cong_alpha"], params_KP.shape[0]))  # >= 1: an empty group never qualifies
    new_global_P, took_2 = _columns(global_P, params_KP, client_weights_K(stacks, hp), need)
    return new_global_P, state, _diagnostics(took_2 / params_KP.shape[1], params_KP.dtype)


def aggregate_span(global_P, stacks, state, hp, span):
    """Block by block over this rank's range; the groups' column counts added over every block
    (Strategy.aggregate_span)."""
    params_KP = stacks["params_KP"]
    need = max(1, min_agreeing(hp.params["cong_alpha"], params_KP.shape[0]))
    weights_K = client_weights_K(stacks, hp)
    new_P, took_rows = torch.empty_like(global_P), []
    for b in span.blocks:
        new_P[b], took_2 = _columns(global_P[b], params_KP[:, b], weights_K, need)
        took_rows.append(took_2)
    return new_P, state, _diagnostics(span.total(took_rows, 2) / span.numel, params_KP.dtype)


def _columns(global_P, params_KP, weights_K, need: int):
    """(the new columns, float64 [2]: how many columns took the positive group, the negative)."""
    num_clients, num_params = params_KP.shape
    dtype, device = params_KP.dtype, params_KP.device
    lib = kernels.lib(params_KP, global_P, rule="fedcong")
    if lib is not None:
        new_global_P, took_pos, took_neg = kernels.fedcong(lib, params_KP, weights_K, global_P, need)
        return new_global_P, torch.stack([torch.as_tensor(took, dtype=torch.float64) for took in (took_pos, took_neg)])
    # alpha > 1/2: at most one group can qualify, so the choice is just the two thresholds
    exclusive = 2 * need > num_clients
    ones_K, zeros_K = torch.ones_like(weights_K), torch.zeros_like(weights_K)
    # [above; below] indicators (2K x B) -> #above, #below, sum p above, sum p below
    counts_4x2K = torch.stack([torch.cat([ones_K, zeros_K]), torch.cat([zeros_K, ones_K]),
                               torch.cat([weights_K, zeros_K]), torch.cat([zeros_K, weights_K])])
    sums_2x2K = counts_4x2K[2:]                 # [above; below] * params -> p-weighted group sums

    new_global_P = torch.empty_like(global_P)
    step = min(column_block(2 * num_clients, device), num_params)
    batch = step * max(1, SELECT_COLUMNS_CPU // step) if device.type == "cpu" else step
    batch = min(batch, num_params)
    # One workspace for every block (fresh buffers per block cost page faults, not just time):
    # the 2K indicator rows of a block, then 15 rows of per-column values over a batch of blocks
    #   0 #above  1 #below  2 p above  3 p below  4 p.w above  5 p.w below  6 sum p  7 p.w all
    # (rows (2, 4), (3, 5) and (6, 7) are the (weight, weighted sum) pairs of the positive
    # group, the negative group and all clients), 8-10 take positive, take negative, scratch,
    # 11-12 the chosen pair, 13-14 how often each group was taken, for the diagnostics (not
    # [P] 0/1 vectors: three fresh P-sized outputs cost more than the rule itself at small K).
    side_2KB = torch.empty(2 * num_clients, step, dtype=dtype, device=device)
    work = torch.empty(15, batch, dtype=dtype, device=device)
    work[6].fill_(weights_K.sum())              # the weight of "all clients", constant
    work[13:15].zero_()
    for outer in range(0, num_params, batch):
        outer_width = min(batch, num_params - outer)
        for start in range(outer, outer + outer_width, step):
            width = min(step, outer + outer_width - start)
            rows_KB, ref_B = params_KP[:, start:start + width], global_P[start:start + width]
            side = side_2KB[:, :width] if width < step else side_2KB
            stats_8B = work[:8, start - outer:start - outer + width]
            # The matrix-vector product reads the block from memory first: MKL streams it about
            # 1.5x faster than an elementwise op, and the ops below then find it in cache.
            torch.mv(rows_KB.T, weights_K, out=stats_8B[7])
            # w_kj > w_j exactly when u_kj = w_kj - w_j > 0 (IEEE subtraction of distinct
            # floats is never 0), so no [K, B] difference is formed. Comparisons write float
            # 0./1.: on CPU that is several times faster than bool outputs, and `where` is
            # avoided for the same reason (the choice below is arithmetic on exact 0./1.).
            torch.gt(rows_KB, ref_B, out=side[:num_clients])
            torch.lt(rows_KB, ref_B, out=side[num_clients:])
            torch.mm(counts_4x2K, side, out=stats_8B[:4])
            # both indicator halves times the params in one op; each group's p-weighted sum is
            # then formed directly (not as a difference from the total, which would lose the
            # digits of a light group)
            side.view(2, num_clients, width).mul_(rows_KB)
            torch.mm(sums_2x2K, side, out=stats_8B[4:6])

        work_B = work[:, :outer_width] if outer_width < batch else work
        stats_8B, select_3B, chosen_2B = work_B[:8], work_B[8:11], work_B[11:13]
        take_2B = select_3B[:2]                 # [take positive; take negative], 0./1.
        torch.ge(stats_8B[:2], need, out=take_2B)                     # count >= need
        if not exclusive:
            # both may qualify: the larger qualified count wins, ties positive
            qualified_2B = take_2B.mul_(stats_8B[:2])                 # the count, or 0 if too few
            scratch_B = torch.clamp_min(qualified_2B[1], 1.0, out=select_3B[2])
            torch.gt(qualified_2B[1], qualified_2B[0], out=qualified_2B[1])
            torch.ge(qualified_2B[0], scratch_B, out=qualified_2B[0])  # >= the other, and >= 1
        take_pos_B, take_neg_B = take_2B[0], take_2B[1]
        # (sum p, sum p w) of the chosen group: positive, negative or all clients
        torch.mul(stats_8B[2:5:2], take_pos_B, out=chosen_2B)
        chosen_2B.addcmul_(stats_8B[3:6:2], take_neg_B)
        minus_all_B = torch.add(take_pos_B, take_neg_B, out=select_3B[2]).sub_(1.0)  # -1: all
        chosen_2B.addcmul_(stats_8B[6:8], minus_all_B, value=-1.0)
        torch.div(chosen_2B[1], chosen_2B[0], out=new_global_P[outer:outer + outer_width])
        work_B[13:15].add_(take_2B)

    return new_global_P, work[13:15].sum(1, dtype=torch.float64)


def _diagnostics(took_2: torch.Tensor, dtype) -> dict[str, torch.Tensor]:
    """Fractions of the coordinates that took the positive group, the negative one, all."""
    return {"cong_positive": took_2[0].to(dtype), "cong_negative": took_2[1].to(dtype),
            "cong_all": (1.0 - took_2.sum()).to(dtype)}


FEDCONG = register(Strategy("fedcong", aggregate, doc=__doc__, aggregate_span=aggregate_span,
                            params={"cong_alpha": 0.7}, check_params=lambda params: in_unit(params, "cong_alpha"),
                            param_docs={"cong_alpha": "FedCong: fraction of clients that must agree in sign."}))
