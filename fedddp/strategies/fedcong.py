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
  - alpha K is taken as the integer ceil(alpha K) with a 1e-9 slack (0.3 * 10 means 3);
  - within the chosen group clients are weighted by p_k renormalised over the group
    (hp.weighting = "uniform" gives the plain mean of the group).

The signs are evaluated a block of columns at a time so the [K, block] temporaries stay in
cache and each stack is read from memory once. Diagnostics: the fraction of coordinates that
took the positive group, the negative group, and all clients.
Legend: K sampled clients, P flat parameters, B columns in a block.
"""

from __future__ import annotations

import torch

from . import Strategy, client_weights_K, register, weighted_mean_P
from .fedgma import column_block, min_agreeing


def aggregate(global_P, stacks, state, hp):
    params_KP = stacks["params_KP"]
    num_clients, num_params = params_KP.shape
    weights_K = client_weights_K(stacks, hp)
    need = max(1, min_agreeing(hp.cong_alpha, num_clients))  # >= 1: an empty group never qualifies

    new_global_P = torch.empty_like(global_P)
    choice_P = torch.empty_like(global_P)  # +1 positive group, -1 negative group, 0 all
    step = column_block(num_clients, params_KP.device)
    for start in range(0, num_params, step):
        cols = slice(start, start + step)
        rows_KB = params_KP[:, cols]
        sign_KB = torch.sub(rows_KB, global_P[cols]).sign_()
        balance_B = sign_KB.sum(0)                                 # P - N
        nonzero_B = torch.count_nonzero(sign_KB, dim=0).to(balance_B.dtype)  # P + N
        num_pos_B = (nonzero_B + balance_B) * 0.5
        num_neg_B = (nonzero_B - balance_B) * 0.5
        pos_ok_B = num_pos_B >= need
        neg_ok_B = num_neg_B >= need
        take_pos_B = pos_ok_B & (~neg_ok_B | (num_pos_B >= num_neg_B))
        take_neg_B = neg_ok_B & ~take_pos_B
        choice_B = torch.sub(take_pos_B.to(balance_B.dtype), take_neg_B.to(balance_B.dtype),
                             out=choice_P[cols])
        member_KB = torch.eq(sign_KB, choice_B).logical_or_(choice_B == 0).to(rows_KB.dtype)
        total_B = weighted_mean_P(weights_K, member_KB)            # sum of p_k over the group
        torch.div(weighted_mean_P(weights_K, member_KB.mul_(rows_KB)), total_B,
                  out=new_global_P[cols])

    diagnostics = {"cong_positive": (choice_P > 0).to(global_P.dtype).mean(),
                   "cong_negative": (choice_P < 0).to(global_P.dtype).mean(),
                   "cong_all": (choice_P == 0).to(global_P.dtype).mean()}
    return new_global_P, state, diagnostics


FEDCONG = register(Strategy("fedcong", aggregate, doc=__doc__))
