"""FedCong (Fernandes et al., seed 004, eq. 3): per coordinate, average only the clients whose
update agrees in sign, when enough of them do.

For coordinate j, u_kj = w_kj - w_j, P_j = #{k: u_kj > 0}, N_j = #{k: u_kj < 0} (zero counts as
neither). With alpha = hp.cong_alpha:
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

Per block of columns: the 0/1 indicators of the two groups (one [2K, B] buffer, in cache), one
matmul for the group counts and p-sums, an in-place product with the params and one matmul for
the group-weighted sums: the params are read from memory once, every reduction is a matmul.
Diagnostics: the fraction of coordinates that took the positive group, the negative group, and
all clients.
Legend: K sampled clients, P flat parameters, B columns in a block.
"""

from __future__ import annotations

import torch

from . import Strategy, client_weights_K, column_block, min_agreeing, register


def aggregate(global_P, stacks, state, hp):
    params_KP = stacks["params_KP"]
    num_clients, num_params = params_KP.shape
    dtype, device = params_KP.dtype, params_KP.device
    weights_K = client_weights_K(stacks, hp)
    need = max(1, min_agreeing(hp.cong_alpha, num_clients))  # >= 1: an empty group never qualifies
    ones_K, zeros_K = torch.ones_like(weights_K), torch.zeros_like(weights_K)
    # [above; below] indicators (2K x B) -> #above, #below, sum p above, sum p below
    counts_4x2K = torch.stack([torch.cat([ones_K, zeros_K]), torch.cat([zeros_K, ones_K]),
                               torch.cat([weights_K, zeros_K]), torch.cat([zeros_K, weights_K])])
    sums_2x2K = counts_4x2K[2:]                 # [above; below] * params -> p-weighted group sums
    total = weights_K.sum()

    new_global_P = torch.empty_like(global_P)
    took_pos_P = torch.empty_like(global_P)     # 1. where the positive group was averaged
    took_neg_P = torch.empty_like(global_P)
    took_all_P = torch.empty_like(global_P)
    step = column_block(2 * num_clients, device)
    # One workspace for every block (fresh buffers per block cost page faults, not just time):
    # 2K indicator rows, then #+, #-, p+, p-, S+, S-, two qualified counts, a scratch row,
    # the (p, S) pair of the chosen group and the plain weighted sum.
    workspace = torch.empty((2 * num_clients + 12) * min(step, num_params), dtype=dtype,
                            device=device)
    for start in range(0, num_params, step):
        cols = slice(start, start + step)
        rows_KB, ref_B = params_KP[:, cols], global_P[cols]
        width = rows_KB.shape[1]
        side = workspace[:2 * num_clients * width].view(2 * num_clients, width)
        work = workspace[2 * num_clients * width:(2 * num_clients + 12) * width].view(12, width)
        stats_6B, qualified_2B, scratch_B = work[:6], work[6:8], work[8]
        ratio_2B, sum_all_B = work[9:11], work[11]
        # w_kj > w_j exactly when u_kj = w_kj - w_j > 0 (IEEE subtraction of distinct floats is
        # never 0), so no [K, B] difference is formed. Comparisons write float 0./1.: on CPU
        # that is several times faster than bool outputs, and `where` is avoided for the same
        # reason (the selection below is arithmetic on exact 0./1. factors).
        torch.gt(rows_KB, ref_B, out=side[:num_clients])
        torch.lt(rows_KB, ref_B, out=side[num_clients:])
        torch.mm(counts_4x2K, side, out=stats_6B[:4])
        side[:num_clients].mul_(rows_KB)
        side[num_clients:].mul_(rows_KB)
        torch.mm(sums_2x2K, side, out=stats_6B[4:])
        torch.mv(rows_KB.T, weights_K, out=sum_all_B)

        counts_2B = stats_6B[:2]
        torch.ge(counts_2B, need, out=qualified_2B).mul_(counts_2B)   # the count, or 0 if too few
        take_pos_B = torch.ge(qualified_2B[0], qualified_2B[1], out=took_pos_P[cols])
        take_pos_B.mul_(torch.gt(qualified_2B[0], 0, out=scratch_B))  # larger count, ties positive
        take_neg_B = torch.gt(qualified_2B[1], qualified_2B[0], out=took_neg_P[cols])
        take_all_B = torch.add(take_pos_B, take_neg_B, out=took_all_P[cols]).neg_().add_(1.0)
        # (sum p, sum p w) of the chosen group: positive, negative or all clients
        torch.mul(stats_6B[2::2], take_pos_B, out=ratio_2B)
        ratio_2B.addcmul_(stats_6B[3::2], take_neg_B)
        ratio_2B[0].addcmul_(take_all_B, total)
        ratio_2B[1].addcmul_(take_all_B, sum_all_B)
        torch.div(ratio_2B[1], ratio_2B[0], out=new_global_P[cols])

    diagnostics = {"cong_positive": took_pos_P.mean(), "cong_negative": took_neg_P.mean(),
                   "cong_all": took_all_P.mean()}
    return new_global_P, state, diagnostics


FEDCONG = register(Strategy("fedcong", aggregate, doc=__doc__))
