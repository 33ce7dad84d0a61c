"""A new user's first afternoon (issue 24, points 4, 5, 6 and 10): the model's output checked
against the task before round 1, the user's own code failing as one line of its own status,
messages that say what was meant, and runs that end or resume with a word. In-process
``fedddp.__main__.main`` calls (capsys) wherever a subprocess is not the point."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from fedddp import algorithms, checks
from fedddp.__main__ import main
from fedddp.errors import ConfigError, PluginError
from fedddp.participation import drops_out
from fedrun import QUICKSTART, REPO, final_state, metrics

QUIET = ["run.progress=false"]
HINT = "(in your code, not fedddp; FEDDDP_TRACEBACK=1 prints its traceback)"


@pytest.fixture(autouse=True)
def own_registries(plugin_registries):
    """The plugins a test registers are gone after it (conftest's plugin_registries)."""


def fedddp_main(capsys, *argv) -> tuple[int, list[str]]:
    """main(argv) in this process: its status and its stderr lines."""
    status = main(list(argv))
    return status, capsys.readouterr().err.splitlines()


def plugin(tmp_path, monkeypatch, name: str, source: str) -> str:
    """A plugin module ``name`` in tmp_path, the working directory (where plugins are looked up).
    Each test's module has its own name: a module is imported once per process."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)
    return name


# -- 4. the model's output against the task; the user's code failing ---------------------------

WRONG_OUTPUT = """
    from torch import nn

    def make(input_shape, num_classes):
        return nn.Linear(input_shape[0], 5)  # 5 outputs, whatever the classes
"""
WRONG_LINE = ("fedddp: error: model.name: nc_wrong_out:make returns [2, 5] for a batch of 2 samples of shape [60]; "
              "the data are a classification task with 10 classes, so it must return [2, 10] (one logit per class)")


def test_check_refuses_a_model_with_the_wrong_output_shape(tmp_path, monkeypatch, capsys):
    """--check passed it and round 1 died in a 27-line torch traceback (exit 1)."""
    plugin(tmp_path, monkeypatch, "nc_wrong_out", WRONG_OUTPUT)
    out = tmp_path / "out"
    assert fedddp_main(capsys, "--check", QUICKSTART, "model.name=nc_wrong_out:make", f"run.out_dir={out}") == \
        (2, [WRONG_LINE])
    # the run itself refuses it where the model is built, before round 1 writes anything
    assert fedddp_main(capsys, QUICKSTART, "model.name=nc_wrong_out:make", f"run.out_dir={out}", *QUIET) == \
        (2, [WRONG_LINE])
    assert not (out / "metrics.jsonl").exists()


def test_output_check_knows_regression_and_leaves_the_model_as_it_was():
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    net[1].eval()  # a module the user left in eval mode stays so
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert algorithms.check_output("mine:net", net, (4,), 1, "regression") == [
        "model.name: mine:net returns [2, 3] for a batch of 2 samples of shape [4]; the data are a regression "
        "task, so it must return [2, 1] (one prediction each)"]
    assert algorithms.check_output("mine:net", net, (4,), 3, "classification") == []
    assert net.training and not net[1].training and net[0].training
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # no running statistic moved


@pytest.mark.parametrize("key,source,override,line", [
    ("data.name", "def make(root, seed):\n    raise ValueError(\"no column 'label'\")\n", "data.name=nc_data_raises:make",
     "data.name: nc_data_raises:make(root, seed) raised ValueError: no column 'label'"),
    ("model.name", "def make(input_shape, num_classes):\n    raise TypeError('bad layer')\n",
     "model.name=nc_model_raises:make", "model.name: nc_model_raises:make(input_shape, num_classes) raised "
     "TypeError: bad layer"),
])
def test_a_users_callable_that_raises_is_one_line_exit_7(tmp_path, monkeypatch, capsys, key, source, override, line):
    module = override.split("=")[1].split(":")[0]
    plugin(tmp_path, monkeypatch, module, source)
    out = tmp_path / "out"
    assert fedddp_main(capsys, "--check", QUICKSTART, override, f"run.out_dir={out}") == \
        (PluginError.exit_code, [f"fedddp: error: {line} {HINT}"])
    # FEDDDP_TRACEBACK=1: the user's traceback first, fedddp's line last
    monkeypatch.setenv("FEDDDP_TRACEBACK", "1")
    status, err = fedddp_main(capsys, "--check", QUICKSTART, override, f"run.out_dir={out}")
    assert status == 7 and err[0] == "Traceback (most recent call last):" and err[-1] == f"fedddp: error: {line} {HINT}"
    assert any(f"{module}.py" in e for e in err)


RULES = """
    from fedddp.client.rules import LocalRule

    def rule(global_P, stacks, state, hp):
        raise RuntimeError("stacks has no key 'grads_KP'")

    class Bad(LocalRule):
        def gradient(self, model, x, y, ctx):
            raise KeyError("beta")

    class BadDirection(LocalRule):
        def direction(self, step):
            raise KeyError("gamma")
"""


@pytest.mark.parametrize("override,line", [
    ("algorithm.name=nc_rules:rule", "algorithm.name: nc_rules:rule (its aggregate) raised RuntimeError: stacks has "
     "no key 'grads_KP'"),
    ("algorithm.local=nc_rules:Bad", "algorithm.local: nc_rules:Bad.gradient raised KeyError: 'beta'"),
    ("algorithm.local=nc_rules:BadDirection", "algorithm.local: nc_rules:BadDirection.direction raised KeyError: "
     "'gamma'"),
])
def test_a_plugin_rule_that_raises_is_one_line_exit_7(tmp_path, monkeypatch, capsys, override, line):
    plugin(tmp_path, monkeypatch, "nc_rules", RULES)
    assert fedddp_main(capsys, QUICKSTART, override, "run.rounds=1", f"run.out_dir={tmp_path / 'out'}", *QUIET) == \
        (PluginError.exit_code, [f"fedddp: error: {line} {HINT}"])


# -- 5. messages --------------------------------------------------------------------------------


def test_an_import_failure_is_said_once(tmp_path, monkeypatch, capsys):
    """It was two errors, the second a misleading "unknown algorithm"."""
    monkeypatch.chdir(tmp_path)
    status, err = fedddp_main(capsys, "--check", QUICKSTART, "algorithm.name=nc_missing:RULE")
    assert (status, err) == (2, [
        f"fedddp: error: 1 configuration error(s) in {QUICKSTART}: algorithm.name: cannot import 'nc_missing' for "
        "'nc_missing:RULE' (ModuleNotFoundError: No module named 'nc_missing'); it is looked up on sys.path from "
        f"the working directory {tmp_path}"])


def test_an_unknown_params_name_does_not_hide_the_other_values_errors():
    with pytest.raises(ConfigError) as info:
        checks.load(QUICKSTART, ["algorithm.name=fedadam", "algorithm.params.bta1=0.5", "algorithm.params.beta2=7"])
    assert str(info.value) == (
        f"2 configuration error(s) in {QUICKSTART}: algorithm.params.bta1: not a parameter of the fedadam server "
        "rule or the plain local rule, did you mean beta1? (theirs: eta (fedadam), beta1 (fedadam), beta2 "
        "(fedadam), tau (fedadam)); algorithm.params.beta2: must be in [0, 1), got 7.0")


def test_did_you_mean_for_a_misspelt_key_section_or_value():
    with pytest.raises(ConfigError) as info:
        checks.load(QUICKSTART, ["run.rouns=3", "ruun.seed=1", "data.name=mnsit", "algorithm.name=fedavgg"])
    msg = str(info.value)
    assert msg.startswith(f"4 configuration error(s) in {QUICKSTART}: "), msg
    for said in ("run.rouns: unknown key, did you mean run.rounds? (valid: rounds, seed, ",
                 "ruun: unknown section, did you mean run? (valid: run, data, model, train, algorithm)",
                 "data.name: 'mnsit' is not one of synthetic, mnist, ",
                 ", or module:attr (docs/extending.md), did you mean mnist?",
                 "algorithm.name: unknown algorithm 'fedavgg', did you mean fedavg? (valid: fedavg, "):
        assert said in msg, (said, msg)


def test_check_after_the_overrides_says_it_goes_first(capsys):
    assert fedddp_main(capsys, QUICKSTART, "run.rounds=2", "--check") == (2, [
        "fedddp: error: --check goes first, before the config file and the overrides: python -m fedddp --check "
        "CONFIG.toml [section.key=value ...]"])


def test_a_resume_refused_over_params_names_the_changed_entry(tmp_path, capsys):
    """It printed both whole [algorithm.params] tables."""
    out = tmp_path / "out"
    run = [QUICKSTART, "algorithm.name=fedadam", "run.ckpt_every=1", f"run.out_dir={out}", *QUIET]
    assert fedddp_main(capsys, *run, "run.rounds=1") == (0, [])
    assert fedddp_main(capsys, *run, "run.rounds=2", "run.resume=true", "algorithm.params.beta1=0.5") == (2, [
        f"fedddp: error: run.resume: the checkpoint {out}/checkpoints/round_000001 is of another run: "
        "algorithm.params.beta1 0.9 -> 0.5; resume with its values, or start a new run in another run.out_dir"])


# -- 6. runs that end or resume with a word ------------------------------------------------------


def test_resume_with_nothing_to_resume_says_so(tmp_path, capsys):
    out = tmp_path / "out"
    assert fedddp_main(capsys, QUICKSTART, "run.rounds=1", "run.resume=true", f"run.out_dir={out}", *QUIET) == (0, [
        f"fedddp: run.resume=true but {out}/checkpoints holds no checkpoint; starting from round 1"])
    assert (out / "final.pt").exists()


def test_stop_after_checkpoints_even_with_ckpt_every_0_and_resumes_to_the_same_bits(tmp_path, capsys):
    """--help says run.stop_after stops after checkpointing; with ckpt_every = 0 it wrote none."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    base = [QUICKSTART, "run.rounds=3", "run.ckpt_every=0", *QUIET]
    assert fedddp_main(capsys, *base, f"run.out_dir={whole}") == (0, [])
    assert fedddp_main(capsys, *base, "run.stop_after=2", f"run.out_dir={stopped}") == (0, [
        f"fedddp: stopped after round 2 (run.stop_after); continue from {stopped}/checkpoints/round_000002 with "
        "run.resume=true"])
    status, err = fedddp_main(capsys, *base, "run.resume=true", f"run.out_dir={stopped}")
    assert status == 0 and err == [f"fedddp: resuming from round 2 ({stopped}/checkpoints/round_000002)"], err
    a, b = final_state(whole), final_state(stopped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_finished_run_ends_with_a_line_naming_its_folder_and_files(tmp_path, capsys):
    out = tmp_path / "out"
    status, err = fedddp_main(capsys, QUICKSTART, "run.rounds=2", "run.ckpt_every=0", f"run.out_dir={out}")
    assert status == 0 and err[-1] == (f"fedddp: finished 2 rounds; {out} holds config.toml, metrics.jsonl, "
                                       "metrics.csv, clients.jsonl, final.pt"), err


def test_a_dp_run_closes_with_its_final_epsilon(tmp_path, capsys):
    pytest.importorskip("dp_accounting")
    out = tmp_path / "out"
    status, err = fedddp_main(capsys, QUICKSTART, "run.rounds=2", "algorithm.name=dpfedavg", "algorithm.dp_clip=1.0",
                              "algorithm.dp_noise=1.0", f"run.out_dir={out}")
    eps = metrics(out)[-1]["epsilon"]
    assert status == 0 and err[-1] == (f"fedddp: finished 2 rounds; {out} holds config.toml, metrics.jsonl, "
                                       f"metrics.csv, clients.jsonl, final.pt; epsilon {eps:.4g} at delta 1e-05"), err


def test_missed_deadline_tells_stragglers_from_dropouts(tmp_path, capsys):
    out = tmp_path / "out"
    assert fedddp_main(capsys, QUICKSTART, "run.rounds=4", "run.dropout=0.3", "run.deadline_steps=5",
                       "run.ckpt_every=0", f"run.out_dir={out}", *QUIET)[0] == 0
    rows = metrics(out)
    for row in rows:
        drawn = [c for c in row["clients"] if drops_out(0.3, 0, row["round"], c)]
        assert sorted(drawn + row["missed_deadline"]) == row["dropped"], row  # dropped kept as it was: both
    assert any(row["missed_deadline"] for row in rows) and any(set(row["dropped"]) - set(row["missed_deadline"])
                                                               for row in rows)


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_local_sh_starts_ranks_without_torchruns_omp_banner(tmp_path):
    """torchrun's "Setting OMP_NUM_THREADS environment variable for each process" opened every run."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHON=sys.executable, NPROC="2", CHECK="0", PYTHONPATH=REPO)
    proc = subprocess.run(["bash", os.path.join(REPO, "launch", "local.sh"), QUICKSTART, "run.rounds=1",
                           "run.progress=false", f"run.out_dir={tmp_path}"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OMP_NUM_THREADS" not in proc.stderr + proc.stdout, proc.stderr


# -- 10. Python versions --------------------------------------------------------------------------


def test_python_requirement_is_311_everywhere():
    """fedddp reads TOML with the standard library's tomllib, new in Python 3.11."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    assert cfg["options"]["python_requires"] == ">=3.11"
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "Python >= 3.11" in readme and "3.10" not in readme
    assert sys.version_info >= (3, 11)


# -- 7. the CPU install ---------------------------------------------------------------------------


def test_readme_says_how_to_get_the_cpu_build_without_naming_an_index_host():
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "install torch's CPU-only build first" in readme and "What a CPU user gives up" in readme
    assert "--index-url" not in readme and "download.pytorch.org" not in readme
