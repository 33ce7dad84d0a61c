"""CMAPSS turbofan data (seed 004) and the regression path: tiny files written here in NASA's
format, parsed back; sensor selection, the health target, training-statistics scaling, engines to
clients, user errors, every local rule on MSE, and end-to-end runs of FedCong and FedMom (MAE
recorded, 1 rank bitwise equal to 2 ranks under torchrun).

Legend: N rows (engine cycles), F features (14 sensors), P flat parameters.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedddp import checks, config
from fedddp.__main__ import main as fedddp_main
from fedddp.client import ClientContext, LocalTraining, rules, train_client
from fedddp.comm import Comm
from fedddp.data import build
from fedddp.env import ProcessEnv
from fedddp.errors import ConfigError, DataError
from fedddp.flat import FlatLayout
from fedddp.algorithms import build_model
from fedddp.round import evaluate, run
from fedddp.tasks import get as get_task

from fedrun import REPO, assert_same_state, final_state, metrics, run_fedddp, run_here

SINGLE = ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")
COLUMNS = ["unit", "cycle", "setting1", "setting2", "setting3"] + [f"s{i}" for i in range(1, 22)]
KEPT = ["s2", "s3", "s4", "s7", "s8", "s9", "s11", "s12", "s13", "s14", "s15", "s17", "s20", "s21"]
# Sensor levels like FD001's, their drift towards failure, and their noise (s1, s5, s6, s10,
# s16, s18, s19 are constant, as in FD001: the paper's 14 are the others).
BASE = np.array([518.67, 642.0, 1589.0, 1400.0, 14.62, 21.61, 554.0, 2388.0, 9046.0, 1.3, 47.5,
                 521.7, 2388.0, 8138.0, 8.42, 0.03, 392.0, 2388.0, 100.0, 39.0, 23.4])
DRIFT = np.array([0, 1.5, 12, 20, 0, 0, -2.5, 0.2, 15, 0, 0.8, -2, 0.2, 10, 0.1, 0, 4, 0, 0, -0.6, -0.35])
NOISE = np.array([0, .5, 6, 9, 0, 0, .9, .07, 20, 0, .27, .7, .07, 19, .04, 0, 1.5, 0, 0, .18, .1])


def write_table(path, lifetimes, seed, stops=None):
    """A train/test file as NASA writes it: space-separated, two trailing spaces per line. Unit u
    fails at cycle lifetimes[u-1]; a test unit's rows stop at cycle stops[u-1]."""
    rng = np.random.default_rng(seed)
    lines = []
    for unit, life in enumerate(lifetimes, start=1):
        for cycle in range(1, (life if stops is None else stops[unit - 1]) + 1):
            sensors = BASE + DRIFT * (cycle / life) ** 2 + NOISE * rng.standard_normal(21)
            settings = f"{rng.normal(0, 0.002):.4f} {rng.normal(0, 0.0003):.4f} 100.0"
            lines.append(f"{unit} {cycle} {settings} " + " ".join(f"{v:.4f}" for v in sensors) + "  ")
    path.write_text("\n".join(lines) + "\n")


def make_cmapss(root, train_lives=(40, 52, 35, 61, 47, 38, 55, 44), test_lives=(50, 42, 58, 39),
                test_stops=(30, 20, 41, 12), subset="FD001", seed=0):
    folder = root / "CMAPSS"
    folder.mkdir(parents=True, exist_ok=True)
    write_table(folder / f"train_{subset}.txt", train_lives, seed)
    write_table(folder / f"test_{subset}.txt", test_lives, seed + 1, test_stops)
    (folder / f"RUL_{subset}.txt").write_text("".join(f"{life - stop}\n" for life, stop in
                                                      zip(test_lives, test_stops)))
    return folder


def parse(path) -> dict[str, np.ndarray]:
    """The file's columns by name, read with plain string splitting (not the loader's code)."""
    rows = [[float(v) for v in line.split()] for line in path.read_text().splitlines() if line.strip()]
    return {name: np.array([r[i] for r in rows]) for i, name in enumerate(COLUMNS)}


def cfg_for(root, num_clients=4, *extra):
    return checks.load(None, ["data.name=cmapss", f"data.root={root}", f"data.num_clients={num_clients}",
                              "model.name=ffnn", "run.clients_per_round=2", *extra])


@pytest.fixture(scope="module")
def cmapss_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmapss")
    make_cmapss(root)
    return root


# -- parsing, target, scaling, clients ----------------------------------------------------------

def test_features_targets_and_training_scaling(cmapss_root):
    data = build(cfg_for(cmapss_root), 0, [0, 1, 2, 3])
    assert data.task == "regression" and data.num_classes == 1 and data.input_shape == (14,)
    train, test = parse(cmapss_root / "CMAPSS" / "train_FD001.txt"), parse(cmapss_root / "CMAPSS" / "test_FD001.txt")
    raw_train_NF = np.stack([train[s] for s in KEPT], 1)
    mean_F, std_F = raw_train_NF.mean(0), raw_train_NF.std(0)
    features_NF = torch.cat([data.train[k].x for k in range(4)])
    target_N = torch.cat([data.train[k].y for k in range(4)])
    assert features_NF.dtype == torch.float32 and target_N.dtype == torch.float32
    # units are in file order and every client's rows keep it, so the concatenation is the file
    torch.testing.assert_close(features_NF, torch.tensor((raw_train_NF - mean_F) / std_F, dtype=torch.float32))
    life_N = np.array([train["cycle"][train["unit"] == u].max() for u in train["unit"]])
    torch.testing.assert_close(target_N, torch.tensor(1 - train["cycle"] / life_N, dtype=torch.float32))
    assert target_N.min() == 0 and target_N.max() < 1  # 0 at each failure cycle

    # test rows: the training file's statistics, and T = last cycle + RUL
    raw_test_NF = np.stack([test[s] for s in KEPT], 1)
    torch.testing.assert_close(data.test.x, torch.tensor((raw_test_NF - mean_F) / std_F, dtype=torch.float32))
    assert data.test.x.mean(0).abs().max() > 0.1  # test rows are not standardised on themselves
    rul = np.loadtxt(cmapss_root / "CMAPSS" / "RUL_FD001.txt")
    failure_N = np.array([test["cycle"][test["unit"] == u].max() + rul[int(u) - 1] for u in test["unit"]])
    torch.testing.assert_close(data.test.y, torch.tensor(1 - test["cycle"] / failure_N, dtype=torch.float32))
    assert 0 < data.test.y.min() and data.test.y.max() < 1


def test_two_engines_per_client_in_unit_order(tmp_path):
    lives = (30, 31, 32, 33, 34, 35, 36)  # 7 engines: the last client holds one
    make_cmapss(tmp_path, train_lives=lives)
    data = build(cfg_for(tmp_path, num_clients=4), 0, [1, 3])
    assert data.num_samples == [30 + 31, 32 + 33, 34 + 35, 36]
    assert sorted(data.train) == [1, 3]  # only the owned clients are materialised
    everything = build(cfg_for(tmp_path, num_clients=4), 0, [0, 1, 2, 3])
    for k in (1, 3):  # bitwise the same whichever clients a rank owns
        assert torch.equal(data.train[k].x, everything.train[k].x)
        assert torch.equal(data.train[k].y, everything.train[k].y)
    # client 1 = units 3 and 4: their targets restart at 1 - 1/T at each unit's first cycle
    y = data.train[1].y
    assert y[0].item() == pytest.approx(1 - 1 / 32) and y[32].item() == pytest.approx(1 - 1 / 33)


def test_constant_sensor_is_centred_not_divided_by_zero(tmp_path):
    folder = make_cmapss(tmp_path)
    path = folder / "train_FD001.txt"
    lines = [line.split() for line in path.read_text().splitlines()]
    for fields in lines:
        fields[COLUMNS.index("s9")] = "9046.0000"
    path.write_text("\n".join(" ".join(f) for f in lines) + "\n")
    data = build(cfg_for(tmp_path), 0, [0])
    assert torch.isfinite(data.train[0].x).all()
    assert data.train[0].x[:, KEPT.index("s9")].abs().max() == 0


# -- user errors ------------------------------------------------------------------------------

@pytest.mark.e2e
def test_wrong_num_clients_names_the_key_and_the_value(cmapss_root, capsys, tmp_path):
    with pytest.raises(ConfigError, match=r"data.num_clients: CMAPSS FD001 has 8 training engines, "
                                          r"2 per client; set data.num_clients = 4"):
        build(cfg_for(cmapss_root, num_clients=5), 0, [0])
    status = fedddp_main(["data.name=cmapss", f"data.root={cmapss_root}", "data.num_clients=6",
                          "model.name=ffnn", "run.clients_per_round=2", "run.progress=false",
                          f"run.out_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and "data.num_clients = 4" in err


@pytest.mark.processes
def test_missing_file_exits_3_naming_folder_and_file(tmp_path):
    folder = make_cmapss(tmp_path / "data")
    os.remove(folder / "RUL_FD001.txt")
    proc = run_fedddp([f"data.root={tmp_path / 'data'}", f"run.out_dir={tmp_path / 'out'}"],
                      config=os.path.join(REPO, "configs", "fedcong_cmapss.toml"), check=False)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(folder) in lines[0] and "RUL_FD001.txt" in lines[0] and "CMAPSSData.zip" in lines[0]


def test_malformed_files_are_data_errors_naming_the_file(tmp_path):
    folder = make_cmapss(tmp_path)
    train = folder / "train_FD001.txt"
    good = train.read_text()
    train.write_text("\n".join(" ".join(line.split()[:20]) for line in good.splitlines()) + "\n")
    with pytest.raises(DataError, match=r"train_FD001.txt: not a CMAPSS file \(.*20 columns"):
        build(cfg_for(tmp_path), 0, [0])
    train.write_text(good.replace("1 1 ", "1 x ", 1))
    with pytest.raises(DataError, match=r"train_FD001.txt: not a CMAPSS file"):
        build(cfg_for(tmp_path), 0, [0])
    train.write_text(good)
    (folder / "RUL_FD001.txt").write_text("10\n20\n")
    with pytest.raises(DataError, match=r"RUL_FD001.txt: expected one integer per line for each of the 4 "
                                        r"test units, got 2 line\(s\)"):
        build(cfg_for(tmp_path), 0, [0])


@pytest.mark.parametrize("kind,value", [("train", "nan"), ("train", "inf"), ("test", "-inf"), ("test", "NaN")])
def test_non_finite_sensor_is_a_data_error_naming_file_and_line(tmp_path, kind, value):
    """np.loadtxt reads 'nan' and 'inf' as numbers: such a file used to train (or test) a NaN
    model to the end with exit 0."""
    folder = make_cmapss(tmp_path)
    path = folder / f"{kind}_FD001.txt"
    lines = path.read_text().splitlines()
    fields = lines[2].split()
    fields[9] = value  # sensor s5 of the third row
    lines[2] = " ".join(fields)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"{kind}_FD001.txt: 1 non-finite value\(s\) \(NaN or infinity\), "
                                        r"the first at line 3, column 10"):
        build(cfg_for(tmp_path), 0, [0])


@pytest.mark.parametrize("value,shown", [("-5", "-5"), ("12.5", "12.5"), ("nan", "nan")])
def test_bad_rul_value_says_what_is_wrong(tmp_path, value, shown):
    """A negative RUL used to be reported as 'got 4 values' for a file of 4 values: the count
    was right, the value was not."""
    folder = make_cmapss(tmp_path)
    (folder / "RUL_FD001.txt").write_text(f"10\n{value}\n20\n30\n")
    with pytest.raises(DataError) as info:
        build(cfg_for(tmp_path), 0, [0])
    msg = str(info.value)
    assert "RUL_FD001.txt: " in msg and "got 4 values" not in msg, msg
    assert (f"line 2 holds {shown}, but a remaining useful life is a whole number" in msg
            or "non-finite value(s) (NaN or infinity), the first at line 2" in msg), msg


@pytest.mark.parametrize("overrides,fragment", [
    (["data.name=cmapss", "model.name=ffnn", "algorithm.name=moon"], "MOON is defined for classification"),
    (["data.name=cmapss", "model.name=ffnn", "algorithm.local=moon"], "MOON is defined for classification"),
    (["data.name=cmapss", "model.name=cnn"], "model.name: cnn needs images; data.name = cmapss"),
    (["data.name=synthetic", "model.name=ffnn"], "model.name: ffnn is a regressor"),
    (["data.name=cmapss", "data.cmapss_subset=FD005"], "data.cmapss_subset: 'FD005' is not one of FD001"),
])
def test_configuration_errors(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        checks.load(None, ["data.num_clients=4", "run.clients_per_round=2", *overrides])


# -- the regression path through the local rules -----------------------------------------------

def test_plain_step_is_sgd_on_mse_and_evaluation_gives_mse_and_mae(cmapss_root):
    """Slow twin: one full-batch SGD step on the MSE of the sigmoid output, by hand."""
    cfg = cfg_for(cmapss_root, 4, "train.batch_size=0", "train.local_steps=1", "train.lr=0.5")
    data = build(cfg, 0, [0])
    torch.manual_seed(0)
    model = build_model(cfg, data.input_shape, data.num_classes)
    layout = FlatLayout(model)
    w_P = layout.flatten(model).clone()
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]

    def forward(ps, x):
        h = x
        for i in range(0, 6, 2):
            h = torch.tanh(h @ ps[i].T + ps[i + 1])
        return torch.sigmoid(h @ ps[6].T + ps[7]).squeeze(1)

    x, y = data.train[0].x, data.train[0].y
    loss = ((forward(params, x) - y) ** 2).mean()
    expected_P = torch.cat([(p - 0.5 * g).reshape(-1) for p, g in
                            zip(params, torch.autograd.grad(loss, params))]).detach()
    ctx = ClientContext(0, 1, w_P, layout, cfg.algorithm, task=get_task("regression"))
    out = {"params_P": torch.zeros(layout.numel)}
    train_client(model, ctx, data.train[0], LocalTraining.of(cfg), rules.get("plain"), frozenset(), 1, out)
    torch.testing.assert_close(out["params_P"], expected_P, rtol=1e-5, atol=1e-6)
    assert out["train_loss"].item() == pytest.approx(loss.item(), rel=1e-5)

    test_loss, test_mae = evaluate(model, data.test, Comm(SINGLE, "cpu"), get_task("regression"))
    with torch.no_grad():
        pred_N = model(data.test.x).squeeze(1)
    assert test_loss == pytest.approx(F.mse_loss(pred_N, data.test.y).item(), rel=1e-5)
    assert test_mae == pytest.approx((pred_N - data.test.y).abs().mean().item(), rel=1e-5)


# every algorithm except MOON (classification only) and FedER (needs conv layers)
ALGORITHMS = ["fedavg", "fedprox", "fedmom", "fedcong", "fedgma", "cgw", "scaffold", "fednova",
              "fedsam", "fedgam", "fedgam_cv", "fedsmoo"]


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.e2e
def test_every_algorithm_trains_the_regressor(cmapss_root, tmp_path, name):
    cfg = cfg_for(cmapss_root, 4, f"algorithm.name={name}", "run.rounds=2", "run.progress=false",
                  "train.lr=0.1", f"run.out_dir={tmp_path}")
    global_P = run(cfg, Comm(SINGLE, "cpu"))["global_P"]
    assert torch.isfinite(global_P).all()
    rows = metrics(tmp_path)
    assert all(math.isfinite(r["test_mae"]) and math.isfinite(r["test_loss"]) for r in rows)
    assert all(r["test_accuracy"] is None for r in rows)


# -- end to end: one rank in this process, two under torchrun ----------------------------------

E2E = ["data.num_clients=4", "run.clients_per_round=4", "run.rounds=5", "train.lr=0.1", "run.ckpt_every=0"]


@pytest.fixture(scope="module")
def fedcong_single(cmapss_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("fedcong1")
    run_here(E2E + [f"data.root={cmapss_root}", f"run.out_dir={out}"],
               config=os.path.join(REPO, "configs", "fedcong_cmapss.toml"))
    return out


@pytest.mark.parametrize("name", ["fedcong", "fedmom"])
@pytest.mark.e2e
def test_paper_configs_run_and_record_test_mae(cmapss_root, fedcong_single, tmp_path, name):
    out = fedcong_single
    if name == "fedmom":
        out = tmp_path / name
        run_here(E2E + [f"data.root={cmapss_root}", f"run.out_dir={out}"],
                   config=os.path.join(REPO, "configs", "fedmom_cmapss.toml"))
    rows = metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5]
    mae = [r["test_mae"] for r in rows]
    assert all(math.isfinite(m) for m in mae) and mae[-1] < mae[0], mae
    assert all(r["test_accuracy"] is None and math.isfinite(r["test_loss"]) for r in rows)
    assert set(final_state(out)) == {f"features.{i}.{p}" for i in (1, 3, 5) for p in ("weight", "bias")} \
        | {"head.0.weight", "head.0.bias"}


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_world_size_invariance_regression(cmapss_root, fedcong_single, tmp_path):
    run_fedddp(E2E + [f"data.root={cmapss_root}", f"run.out_dir={tmp_path}"], nproc=2,
               config=os.path.join(REPO, "configs", "fedcong_cmapss.toml"))
    assert_same_state(final_state(fedcong_single), final_state(tmp_path))
    assert [r["test_mae"] for r in metrics(tmp_path)] == pytest.approx(
        [r["test_mae"] for r in metrics(fedcong_single)], rel=1e-5)
