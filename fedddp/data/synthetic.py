"""FedProx Synthetic(alpha, beta) (Li et al. 2020; litian96/FedProx
``data/synthetic_*/generate_synthetic.py``), seeded per client.

For client k, every draw comes from one generator seeded by (seed, k), so a client's samples are
the same whichever rank makes them and whichever other clients exist:

    n_k = int(lognormal(4, 2)) + 50           samples (train = int(0.9 n_k), test = the rest)
    u_k ~ N(0, alpha),  B_k ~ N(0, beta)      (standard deviations, as in the reference)
    W_k ~ N(u_k, 1) [D, C],  b_k ~ N(u_k, 1) [C],  v_k ~ N(B_k, 1) [D]
    x ~ N(v_k, Sigma), Sigma = diag(j^-1.2), j = 1..D
    y = argmax(x W_k + b_k)                   (the reference's softmax does not change the argmax)

IID variant: one W, b ~ N(0, 1) shared by all clients (their own generator, seeded by seed) and
v_k = 0. The per-client draws still happen in the same order, so switching the variant changes
only the model and the input mean.

The sample counts are heavy-tailed and kept exactly as the reference, uncapped: lognormal(4, 2)
has median e^4 ~ 55 but e^(4 + 2*3) ~ 22,000 at three sigma, so among 30 clients the largest
typically holds a few thousand samples and, for some seeds, tens of thousands. The imbalance is
part of the benchmark (it is what sample-count weighting is tested against).

Legend: N samples of one client, D input dimension, C classes.
"""

from __future__ import annotations

import numpy as np
import torch

from .clients import ClientData, FederatedData

# Domain tags keep the generator streams of different uses apart (a plain [seed, k] could
# coincide with another module's [seed, something]).
_CLIENT_STREAM = 0x5359_4E01
_SHARED_STREAM = 0x5359_4E02
TRAIN_FRACTION = 0.9


def shared_model(seed: int, dim: int, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The IID variant's (W [D, C], b [C]) ~ N(0, 1), the same for every client."""
    rng = np.random.default_rng([_SHARED_STREAM, seed])
    return rng.normal(0.0, 1.0, (dim, num_classes)), rng.normal(0.0, 1.0, num_classes)


def client_samples(seed: int, client_id: int, alpha: float, beta: float, dim: int, num_classes: int,
                   shared: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """All n_k samples of one client: (x_ND float32, y_N int64); ``shared`` = IID variant's (W, b)."""
    rng = np.random.default_rng([_CLIENT_STREAM, seed, client_id])
    num = int(rng.lognormal(4.0, 2.0)) + 50
    u = rng.normal(0.0, alpha)
    B = rng.normal(0.0, beta)
    v_D = rng.normal(B, 1.0, dim)
    W_DC = rng.normal(u, 1.0, (dim, num_classes))
    b_C = rng.normal(u, 1.0, num_classes)
    if shared is not None:
        W_DC, b_C = shared
        v_D = np.zeros(dim)
    std_D = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # sqrt of the diagonal j^-1.2
    x_ND = v_D + rng.standard_normal((num, dim)) * std_D
    y_N = np.argmax(x_ND @ W_DC + b_C, axis=1).astype(np.int64)
    return x_ND.astype(np.float32), y_N


def build(data_cfg, seed: int, owned_ids: list[int]) -> FederatedData:
    """Every client is generated (its last 10% joins the global test set, which every rank needs;
    the data are small), but only owned clients keep their training 90%."""
    owned = set(owned_ids)
    shared = (shared_model(seed, data_cfg.synthetic_dim, data_cfg.synthetic_classes)
              if data_cfg.synthetic_iid else None)
    train, num_samples, test_x, test_y = {}, [], [], []
    for k in range(data_cfg.num_clients):
        x_ND, y_N = client_samples(seed, k, data_cfg.synthetic_alpha, data_cfg.synthetic_beta,
                                   data_cfg.synthetic_dim, data_cfg.synthetic_classes, shared)
        num_train = int(TRAIN_FRACTION * len(y_N))  # the reference's split, first 90% (draws are iid)
        num_samples.append(num_train)
        if k in owned:
            train[k] = ClientData(torch.from_numpy(x_ND[:num_train].copy()),
                                  torch.from_numpy(y_N[:num_train].copy()))
        test_x.append(x_ND[num_train:])
        test_y.append(y_N[num_train:])
    test = ClientData(torch.from_numpy(np.concatenate(test_x)), torch.from_numpy(np.concatenate(test_y)))
    return FederatedData(num_classes=data_cfg.synthetic_classes, input_shape=(data_cfg.synthetic_dim,),
                         num_samples=num_samples, train=train, test=test)
