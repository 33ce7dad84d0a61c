"""Local rules: how a client turns a minibatch into parameter gradients.

A rule has three hooks, called by ``train_client``:
  begin(model, ctx)                  once, before the first step (take what the rule needs from
                                     ctx.global_P, ctx.server_view, ctx.state)
  gradient(model, x, y, ctx) -> loss fill each parameter's .grad for this minibatch; return the
                                     minibatch loss (detached use only)
  end(model, ctx, num_steps, lr)     once, after the last step (update ctx.state)
Rules hold no state across clients: everything persistent lives in ctx.state, which the round
loop keeps on the client's owner rank and checkpoints.
"""

from __future__ import annotations

import torch.nn.functional as F


class LocalRule:
    name = "plain"
    # persistent per-client state this rule keeps (names of tensors in ctx.state)
    client_state: tuple[str, ...] = ()

    def begin(self, model, ctx) -> None:
        pass

    def gradient(self, model, x, y, ctx):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def end(self, model, ctx, num_steps: int, lr: float) -> None:
        pass


RULES: dict[str, type[LocalRule]] = {"plain": LocalRule}


def get(name: str) -> LocalRule:
    return RULES[name]()
