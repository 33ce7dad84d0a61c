"""NASA's C-MAPSS turbofan engine degradation data (Saxena et al. 2008), as seed 004 uses it.

Files, as NASA distributes them (CMAPSSData.zip), unpacked into ``ROOT/CMAPSS/``:

  train_FD00x.txt  one row per engine cycle, 26 space-separated columns: unit, cycle,
                   3 operational settings, sensors s1..s21; every unit runs until it fails
  test_FD00x.txt   the same columns; every unit's series stops some cycles before its failure
  RUL_FD00x.txt    one integer per test unit, in unit order: its cycles left after its last row

What the loader makes of them (the paper leaves the definitions open; docs/datasets.md):

  features  the 14 sensors s2 s3 s4 s7 s8 s9 s11 s12 s13 s14 s15 s17 s20 s21, standardised with
            the mean and std of every row of the training file (test rows use the same statistics)
  target    health percentage h = 1 - t / T in [0, 1): t the row's cycle, T the unit's failure
            cycle (train: its last cycle, so h = 0 at failure; test: its last cycle + its RUL)
  clients   two engines each, in unit order: client k holds the (2k+1)-th and (2k+2)-th units of
            the training file; with an odd engine count the last client holds one engine
  test set  every row of the test file (the official held-out engines, target from the RUL file)

Every rank reads the whole training file (at most 61,249 rows): the scaling statistics and every
client's row count come from it. Features are made only for the clients the rank owns, and the
scaling is elementwise with float64 statistics computed identically everywhere, so a client's
tensors are bitwise the same whichever rank builds them.

Legend: N rows (engine cycles), F features (14 sensors), U units (engines).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from .clients import ClientData, FederatedData
from ..errors import ConfigError, DataError

FOLDER = "CMAPSS"
NUM_COLUMNS = 26  # unit, cycle, 3 settings, 21 sensors
SENSORS = (2, 3, 4, 7, 8, 9, 11, 12, 13, 14, 15, 17, 20, 21)
SENSOR_COLUMNS = [4 + s for s in SENSORS]  # sensor s1 is column 5 (0-based)
ENGINES_PER_CLIENT = 2
HOW_TO_GET = ("download NASA's 'Turbofan Engine Degradation Simulation' data set (CMAPSSData.zip, "
              "NASA Prognostics Center of Excellence data repository) and unpack its .txt files into "
              "{folder}, or set data.root / FEDDDP_DATA to the folder that holds CMAPSS/ "
              "(fedddp does not download it)")


def files(root: str, subset: str) -> dict[str, str]:
    folder = os.path.join(root, FOLDER)
    return {kind: os.path.join(folder, f"{kind}_{subset}.txt") for kind in ("train", "test", "RUL")}


def _load(path: str, what: str, expected: str, ndmin: int) -> np.ndarray:
    """np.loadtxt, with an unreadable or unparsable file as a one-line DataError."""
    try:
        return np.loadtxt(path, dtype=np.float64, ndmin=ndmin)
    except OSError as exc:
        raise DataError(f"{path}: cannot read {what} ({exc})") from None
    except ValueError as exc:
        raise DataError(f"{path}: not a {what} ({exc}); expected {expected}, fetch it again") from None


def read_table(path: str) -> np.ndarray:
    """One train/test file -> float64 [N, 26]; a file that is not in that format raises DataError."""
    table = _load(path, "CMAPSS file", f"{NUM_COLUMNS} space-separated numbers per line", ndmin=2)
    if table.shape[0] == 0 or table.shape[1] != NUM_COLUMNS:
        raise DataError(f"{path}: not a CMAPSS file ({table.shape[0]} rows of {table.shape[1]} columns; "
                        f"expected {NUM_COLUMNS} columns: unit, cycle, 3 settings, 21 sensors); fetch it again")
    _check_finite(path, table)
    units_N, cycles_N = table[:, 0], table[:, 1]
    if (units_N != np.round(units_N)).any() or (cycles_N != np.round(cycles_N)).any() \
            or units_N.min() < 1 or cycles_N.min() < 1:
        raise DataError(f"{path}: not a CMAPSS file (unit and cycle columns must be integers >= 1); "
                        "fetch it again")
    return table


def _check_finite(path: str, table: np.ndarray) -> None:
    """np.loadtxt reads 'nan' and 'inf' as numbers: a damaged file would train a NaN model."""
    bad = np.argwhere(~np.isfinite(table))
    if len(bad):
        line, column = (int(i) + 1 for i in bad[0])
        raise DataError(f"{path}: {len(bad)} non-finite value(s) (NaN or infinity), the first at line "
                        f"{line}, column {column}; the file is damaged, fetch it again")


def read_rul(path: str, num_units: int) -> np.ndarray:
    """RUL file -> float64 [U]: the true remaining cycles of each test unit, in unit order."""
    rul_U = _load(path, "CMAPSS RUL file", "one integer per line", ndmin=2)
    if rul_U.shape[1] != 1 or rul_U.shape[0] != num_units:
        raise DataError(f"{path}: expected one integer per line for each of the {num_units} test units, "
                        f"got {rul_U.shape[0]} line(s) of {rul_U.shape[1]} value(s); fetch it again")
    rul_U = rul_U[:, 0]
    _check_finite(path, rul_U[:, None])
    wrong = np.flatnonzero((rul_U < 0) | (rul_U != np.round(rul_U)))
    if len(wrong):
        raise DataError(f"{path}: line {wrong[0] + 1} holds {rul_U[wrong[0]]:g}, but a remaining useful "
                        "life is a whole number of cycles >= 0; fetch it again")
    return rul_U


def health_N(table: np.ndarray, extra_cycles_U: np.ndarray | None = None) -> np.ndarray:
    """h = 1 - t / T per row, T = the unit's last cycle (+ its RUL for a test unit); float64 [N].
    Units are numbered in sorted order; ``extra_cycles_U`` follows that order."""
    units, unit_idx_N = np.unique(table[:, 0], return_inverse=True)
    cycles_N = table[:, 1]
    last_U = np.zeros(len(units))
    np.maximum.at(last_U, unit_idx_N, cycles_N)
    failure_U = last_U + (0.0 if extra_cycles_U is None else extra_cycles_U)
    return 1.0 - cycles_N / failure_U[unit_idx_N]


def scaling_stats(features_NF: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std (float64) over the training rows. A sensor constant over the training file
    (some are, in FD001 and FD003 taken alone) gets std 1: centred to 0 rather than divided by 0."""
    mean_F = features_NF.mean(axis=0)
    std_F = features_NF.std(axis=0)
    return mean_F, np.where(std_F > 0, std_F, 1.0)


def scale(features_NF: np.ndarray, mean_F: np.ndarray, std_F: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(((features_NF - mean_F) / std_F).astype(np.float32))


def client_rows(units_N: np.ndarray, num_clients: int, subset: str) -> list[np.ndarray]:
    """Row indices (file order) of each client: engines in sorted unit order, two per client."""
    units_U, unit_idx_N = np.unique(units_N, return_inverse=True)
    expected = math.ceil(len(units_U) / ENGINES_PER_CLIENT)
    if num_clients != expected:
        raise ConfigError(f"data.num_clients: CMAPSS {subset} has {len(units_U)} training engines, "
                          f"{ENGINES_PER_CLIENT} per client; set data.num_clients = {expected}")
    client_N = unit_idx_N // ENGINES_PER_CLIENT
    return [np.flatnonzero(client_N == k) for k in range(num_clients)]


def build(data_cfg, root: str, owned_ids: list[int]) -> FederatedData:
    subset = data_cfg.cmapss_subset
    paths = files(root, subset)
    missing = [os.path.basename(p) for p in paths.values() if not os.path.isfile(p)]
    if missing:
        folder = os.path.join(root, FOLDER)
        raise DataError(f"{folder}: CMAPSS files missing: {', '.join(missing)} (expected "
                        f"{', '.join(os.path.basename(p) for p in paths.values())}); "
                        + HOW_TO_GET.format(folder=folder))
    train = read_table(paths["train"])
    test = read_table(paths["test"])
    rul_U = read_rul(paths["RUL"], len(np.unique(test[:, 0])))

    parts = client_rows(train[:, 0], data_cfg.num_clients, subset)
    features_NF, target_N = train[:, SENSOR_COLUMNS], health_N(train)
    mean_F, std_F = scaling_stats(features_NF)
    train_data = {k: ClientData(scale(features_NF[parts[k]], mean_F, std_F),
                                torch.from_numpy(target_N[parts[k]].astype(np.float32)))
                  for k in sorted(set(owned_ids))}
    test_data = ClientData(scale(test[:, SENSOR_COLUMNS], mean_F, std_F),
                           torch.from_numpy(health_N(test, rul_U).astype(np.float32)))
    return FederatedData(num_classes=1, input_shape=(len(SENSORS),), num_samples=[len(p) for p in parts],
                         train=train_data, test=test_data, task="regression")
