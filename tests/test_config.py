"""Config loading: typed fields, dotted overrides, every error reported at once, exit status 2."""

import os
import subprocess
import sys

import pytest

from fedddp import algorithms, checks, config, strategies
from fedddp.client import rules
from fedddp.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_overrides_are_typed_and_applied(tmp_path):
    path = write(tmp_path, "[run]\nrounds = 3\n[train]\nlr = 1\n")
    cfg = checks.load(path, ["run.rounds=7", "algorithm.name=fedavg", "run.resume=true", "train.lr=0.5"])
    assert cfg.run.rounds == 7 and cfg.run.resume is True and cfg.train.lr == 0.5
    assert isinstance(cfg.train.lr, float)


def test_int_in_toml_for_float_field_is_accepted(tmp_path):
    cfg = checks.load(write(tmp_path, "[train]\nlr = 1\n"))
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


def test_all_errors_reported_at_once_with_paths(tmp_path):
    path = write(tmp_path, "[run]\nrounds = 'x'\nbogus = 1\n[data]\nname = 'imagenet'\n[nope]\na = 1\n")
    with pytest.raises(ConfigError) as err:
        checks.load(path)
    msg = str(err.value)
    for fragment in ("run.rounds", "run.bogus", "nope", "valid:"):
        assert fragment in msg, msg
    assert "\n" not in msg


def test_choice_and_impossible_values(tmp_path):
    with pytest.raises(ConfigError) as err:
        checks.load(None, ["data.name=imagenet", "run.clients_per_round=50", "data.num_clients=10",
                           "algorithm.name=nope"])
    msg = str(err.value)
    assert "data.name: 'imagenet' is not one of synthetic" in msg
    assert "run.clients_per_round: 50 sampled clients but only data.num_clients = 10" in msg
    assert "algorithm.name: unknown algorithm 'nope' (valid: fedavg" in msg


def test_bool_must_be_true_or_false():
    with pytest.raises(ConfigError, match="run.resume: expected bool"):
        checks.load(None, ["run.resume=yes"])


def test_dumps_round_trips(tmp_path):
    cfg = checks.load(None, ["run.rounds=9", "run.out_dir=a \"b\"", "train.lr=0.25"])
    again = checks.load(write(tmp_path, config.dumps(cfg)))
    assert again == cfg


def test_parallel_clients_takes_an_int_or_auto(tmp_path):
    """auto is the default; a TOML file, an override and config.toml's dump take "auto" or an int,
    and a wrong value says both are taken."""
    assert checks.load(None, []).run.parallel_clients == "auto"
    assert checks.load(None, ["run.parallel_clients=auto"]).run.parallel_clients == "auto"
    assert checks.load(None, ["run.parallel_clients=4"]).run.parallel_clients == 4
    assert checks.load(write(tmp_path, '[run]\nparallel_clients = "auto"\n')).run.parallel_clients == "auto"
    assert checks.load(write(tmp_path, "[run]\nparallel_clients = 3\n")).run.parallel_clients == 3
    for cfg in (checks.load(None, []), checks.load(None, ["run.parallel_clients=5"])):
        assert checks.load(write(tmp_path, config.dumps(cfg))) == cfg
    assert 'parallel_clients = "auto"' in config.dumps(config.Config())
    for bad, words in (("run.parallel_clients=many", "expected int or \"auto\", got 'many'"),
                       ("run.parallel_clients=2.5", "expected int or \"auto\", got '2.5'"),
                       ("run.parallel_clients=0", "must be >= 1")):
        with pytest.raises(ConfigError) as err:
            checks.load(None, [bad])
        assert words in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match=r'expected int or "auto", got str \'3\' \(remove the quotes\)'):
        checks.load(write(tmp_path, '[run]\nparallel_clients = "3"\n'))


def test_every_field_has_a_doc():
    text = config.describe()
    assert "run.rounds" in text and "algorithm.params" in text
    for section_cls in config.SECTIONS.values():
        for f in section_cls.__dataclass_fields__.values():
            assert f.metadata.get("doc"), f.name


def test_every_built_in_rule_parameter_has_a_doc_and_its_old_key_maps_onto_it():
    """Each built-in rule declares its parameters with a doc (shown by --help); every old flat
    key (config.ALIASES) is declared, with the same default, by each rule it names, and by no other."""
    text = algorithms.describe_params()
    built_in = {**{n: s for n, s in strategies.SERVER_RULES.items() if ":" not in n},
                **{n: r for n, r in rules.RULES.items() if ":" not in n}}
    for rule in built_in.values():
        for key in rule.params:
            assert rule.param_docs.get(key), (rule, key)
            assert f"algorithm.params.{key} = " in text
    for key, owners in config.ALIASES.items():
        declaring = sorted(n for n, r in built_in.items() if key in r.params)
        assert declaring == sorted(owners), key


@pytest.mark.processes
def test_cli_bad_config_exits_2_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fedddp", "run.rounds=0", "data.name=x"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "run.rounds: must be > 0" in proc.stderr
    assert "data.name" in proc.stderr


@pytest.mark.processes
def test_cli_missing_config_file_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fedddp", "nope.toml"], capture_output=True,
                          text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "nope.toml: config file not found" in proc.stderr


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(os.path.dirname(__file__), "..", "configs"))
                                         if n.endswith(".toml")))  # configs/sweeps/: tests/test_sweep.py
def test_every_shipped_config_is_valid(name):
    cfg = checks.load(os.path.join(os.path.dirname(__file__), "..", "configs", name))
    assert cfg.run.rounds > 0


@pytest.mark.processes
def test_cuda_without_a_gpu_is_a_config_error(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "-m", "fedddp", "run.device=cuda", f"run.out_dir={tmp_path}"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "run.device: cuda, but local rank 0 sees 0 GPU(s)" in proc.stderr


# Each paper's (or its reference code's) client weights, written out here rather than read from
# fedddp.registry.WEIGHTING, so that a wrong entry there fails (sources: docs/algorithms.md).
PAPER_WEIGHTING = {"fedavg": "samples", "fedmom": "samples", "fedcong": "samples", "fedgma": "samples",
                   "cgw": "samples", "feder": "uniform", "fedprox": "samples", "scaffold": "uniform",
                   "fednova": "samples", "moon": "samples", "fedsam": "uniform", "fedgam": "uniform",
                   "fedgam_cv": "uniform", "fedsmoo": "uniform", "dpfedavg": "uniform", "dpfedmom": "uniform",
                   "fedadam": "samples", "fedyogi": "samples", "fedadagrad": "samples", "fedmedian": "uniform",
                   "fedtrimmedavg": "uniform", "krum": "uniform", "bulyan": "uniform",
                   "feddyn": "uniform"}


def test_every_algorithm_has_a_paper_weighting():
    from fedddp.registry import ALGORITHMS
    # a plugin registered by an earlier test in this process (module:attr) is not built in
    assert set(PAPER_WEIGHTING) == {name for name in ALGORITHMS if ":" not in name}


@pytest.mark.parametrize("name", sorted(PAPER_WEIGHTING))
def test_auto_weighting_resolves_to_the_papers(name):
    """weighting = auto (the default) is resolved at load time to the algorithm's own, so that
    config.toml and every consumer see samples or uniform; an explicit choice overrides it. Every
    algorithm used to get sample-count weights, which FedGAM's Alg. 1 and SCAFFOLD do not use."""
    extra = {"feder": ["data.name=mnist", "model.name=cnn"], "dpfedavg": ["algorithm.dp_clip=1"],
             "dpfedmom": ["algorithm.dp_clip=1"]}.get(name, [])
    cfg = checks.load(None, [f"algorithm.name={name}", *extra])
    assert cfg.algorithm.weighting == PAPER_WEIGHTING[name]
    assert f'weighting = "{PAPER_WEIGHTING[name]}"' in config.dumps(cfg)
    # DP-FedAvg's clip bound holds for equal weights only (samples is refused: tests/test_federations.py)
    for choice in ("uniform",) if name.startswith("dp") else ("samples", "uniform"):
        assert checks.load(None, [f"algorithm.name={name}", f"algorithm.weighting={choice}",
                                  *extra]).algorithm.weighting == choice


@pytest.mark.e2e
def test_config_toml_and_start_line_show_the_resolved_algorithm(tmp_path, capsys):
    """The start line names the local rule as well as the server rule (a FedGAM run used to say
    only "fedavg aggregation") and the weighting as resolved; config.toml never says auto."""
    from fedrun import run_here
    capsys.readouterr()
    run_here(["algorithm.name=fedgam", "run.rounds=1", "run.ckpt_every=0", f"run.out_dir={tmp_path}",
              "run.progress=true"])
    stderr = capsys.readouterr().err
    start = [line for line in stderr.splitlines() if line.startswith("fedddp:") and "rank(s) on" in line]
    assert len(start) == 1, stderr
    assert "fedgam: gam clients, fedavg server rule, uniform weights; 10 of 30 clients a round; aggregation:" in start[0], start[0]
    written = (tmp_path / "config.toml").read_text()
    assert 'weighting = "uniform"' in written and 'weighting = "auto"' not in written

# -- every mistake in a config file is one line, exit 2 ------------------------------------------

def test_type_error_does_not_hide_the_other_errors_of_the_file(tmp_path):
    """A wrong type used to stop the check before validate(): the file's other errors (here an
    impossible batch size and an unknown choice) were reported only on the next attempt."""
    path = write(tmp_path, "[run]\nrounds = 'x'\n[train]\nbatch_size = -1\n[data]\nname = 'imagenet'\n")
    with pytest.raises(ConfigError) as err:
        checks.load(path)
    msg = str(err.value)
    assert msg.startswith("3 configuration error(s)"), msg
    for fragment in ("run.rounds: expected int", "train.batch_size: must be >= 0", "data.name: 'imagenet'"):
        assert fragment in msg, msg


def test_toml_string_for_a_number_is_refused_but_overrides_are_parsed(tmp_path):
    """TOML values are typed: ``rounds = "3"`` was silently read as 3. Overrides on the command
    line are strings by nature and stay parsed."""
    with pytest.raises(ConfigError, match=r"run.rounds: expected int, got str '3' \(remove the quotes\)"):
        checks.load(write(tmp_path, '[run]\nrounds = "3"\n'))
    with pytest.raises(ConfigError, match="run.resume: expected bool"):
        checks.load(write(tmp_path, '[run]\nresume = "true"\n'))
    with pytest.raises(ConfigError, match="train.lr: expected float"):
        checks.load(write(tmp_path, '[train]\nlr = "0.1"\n'))
    assert checks.load(None, ["run.rounds=3"]).run.rounds == 3


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN"])
def test_non_finite_number_is_a_config_error(tmp_path, text):
    """``train.lr=nan`` was accepted and trained a NaN model to the end with exit 0."""
    with pytest.raises(ConfigError, match="train.lr: must be a finite number, got -?inf|train.lr: must be a finite number, got nan"):
        checks.load(None, [f"train.lr={text}"])
    with pytest.raises(ConfigError, match="algorithm.server_momentum: must be a finite number"):
        checks.load(write(tmp_path, f"[algorithm]\nserver_momentum = {text.lower()}\n"))


def test_out_of_range_integer_is_a_config_error(tmp_path):
    """``run.seed=99999999999999999999999`` ended in an OverflowError traceback (exit 1)."""
    with pytest.raises(ConfigError, match="run.seed: 99999999999999999999999 is out of range"):
        checks.load(None, ["run.seed=99999999999999999999999"])
    with pytest.raises(ConfigError, match="data.num_clients: .* is out of range"):
        checks.load(write(tmp_path, "[data]\nnum_clients = 99999999999999999999999\n"))


def test_collective_timeout_must_be_positive():
    assert checks.load(None, ["run.collective_timeout_s=2.5"]).run.collective_timeout_s == 2.5
    with pytest.raises(ConfigError, match="run.collective_timeout_s: must be > 0"):
        checks.load(None, ["run.collective_timeout_s=0"])


@pytest.mark.parametrize("kind", ["directory", "binary", "ls"])
@pytest.mark.processes
def test_unreadable_config_file_is_one_line_exit_2(tmp_path, kind):
    """A directory or a binary file as the config ended in IsADirectoryError /
    UnicodeDecodeError tracebacks (exit 1)."""
    path = {"directory": str(tmp_path), "ls": "/bin/ls"}.get(kind)
    if kind == "binary":
        path = str(tmp_path / "model.pt")
        with open(path, "wb") as fh:
            fh.write(bytes(range(256)) * 4)
    proc = subprocess.run([sys.executable, "-m", "fedddp", path], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"fedddp: error: {path}: "), proc.stderr


@pytest.mark.processes
def test_cli_out_of_range_seed_exits_2_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fedddp", "run.seed=99999999999999999999999",
                           f"run.out_dir={tmp_path}"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "run.seed: 99999999999999999999999 is out of range" in proc.stderr


@pytest.mark.parametrize("overrides", [["train.nesterov=true"],
                                       ["train.nesterov=true", "train.momentum=0.9", "train.optimizer=adam"]])
def test_nesterov_without_sgd_momentum_is_refused(overrides):
    """torch's SGD raises on Nesterov without momentum, and the other optimizers have none: one
    line naming train.nesterov, not a traceback when the first client builds its optimizer."""
    with pytest.raises(ConfigError, match="train.nesterov: needs train.optimizer = sgd and train.momentum > 0"):
        checks.load(None, overrides)
    checks.load(None, ["train.nesterov=true", "train.momentum=0.9"])


@pytest.mark.parametrize("overrides,words", [
    (["train.lr_schedule=steplr", "train.lr_gamma=-0.5"], "train.lr_gamma: must be >= 0, got -0.5"),
    (["data.synthetic_classes=0"], "data.synthetic_classes: must be > 0, got 0"),
    (["data.synthetic_alpha=-1"], "data.synthetic_alpha: must be >= 0, got -1.0"),
    (["data.synthetic_beta=-1"], "data.synthetic_beta: must be >= 0, got -1.0"),
    (["data.synthetic_dim=0"], "data.synthetic_dim: must be > 0, got 0"),
], ids=lambda v: v[-1] if isinstance(v, list) else None)
def test_values_that_broke_a_run_are_config_errors_before_anything_starts(overrides, words, tmp_path, capsys):
    """Regression: a negative StepLR gamma was a ValueError traceback once the rate turned
    negative mid-run, 0 synthetic classes or a negative synthetic alpha (or beta) a traceback
    while building the data, and synthetic_dim = 0 trained a model with a [10, 0] weight and
    exited 0. Each is now one line, exit 2, before the run folder is made or any data built."""
    from fedddp.__main__ import main as fedddp_main
    out = tmp_path / "out"
    capsys.readouterr()
    assert fedddp_main(overrides + [f"run.out_dir={out}", "run.progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedddp: error: 1 configuration error(s): ") and words in err[0], err
    assert not out.exists()


# -- the rules' own parameters ---------------------------------------------------------------------

def test_old_flat_keys_are_the_rules_parameters():
    """algorithm.cong_alpha (the key before rules owned their parameters) and
    algorithm.params.cong_alpha give the same resolved config; config.toml records the new form."""
    old = checks.load(None, ["algorithm.name=fedcong", "algorithm.cong_alpha=0.5"])
    new = checks.load(None, ["algorithm.name=fedcong", "algorithm.params.cong_alpha=0.5"])
    table = checks.load({"algorithm": {"name": "fedcong", "params": {"fedcong": {"cong_alpha": 0.5}}}})
    assert old == new == table and new.algorithm.params == {"cong_alpha": 0.5}
    assert "params = {cong_alpha = 0.5}" in config.dumps(new)


def test_a_rules_table_applies_when_it_runs_and_is_ignored_otherwise():
    tables = ["algorithm.params.fedprox.prox_mu=0.3", "algorithm.params.fedcong.cong_alpha=0.4",
              "algorithm.sam_rho=0.05"]
    assert checks.load(None, ["algorithm.name=fedavg"] + tables).algorithm.params == {}
    assert checks.load(None, ["algorithm.name=fedprox"] + tables).algorithm.params == {"prox_mu": 0.3}
    # a table by the local rule's name, the server rule's or the algorithm's
    smoo = checks.load(None, ["algorithm.name=fedsmoo"] + tables).algorithm.params
    assert smoo == {"sam_rho": 0.05, "smoo_lambda": 0.1}
    assert checks.load(None, ["algorithm.name=fedgma", "algorithm.local=prox"] + tables).algorithm.params == {
        "prox_mu": 0.1, "gma_threshold": 0.8, "gma_grad": "last", "gma_mask": "hard"}
    # the most specific wins: the algorithm's table over the local rule's, plain names over both
    both = ["algorithm.name=fedprox", "algorithm.params.prox.prox_mu=0.2", "algorithm.params.fedprox.prox_mu=0.3"]
    assert checks.load(None, both).algorithm.params == {"prox_mu": 0.3}
    assert checks.load(None, both + ["algorithm.params.prox_mu=0.4"]).algorithm.params == {"prox_mu": 0.4}


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.params.prox_mu=0.3"],
     "algorithm.params.prox_mu: not a parameter of the fedavg server rule or the plain local rule (theirs: none)"),
    (["algorithm.name=fedprox", "algorithm.params.fedprox.prox_m=0.3"],
     "algorithm.params.fedprox.prox_m: not a parameter of the fedavg server rule or the prox local rule, did you "
     "mean prox_mu? (theirs: prox_mu (prox))"),
    (["algorithm.params.fedcong.cong_alpa=0.3"],
     "algorithm.params.fedcong.cong_alpa: not a parameter of fedcong, did you mean cong_alpha? (theirs: "
     "cong_alpha (fedcong))"),
    (["algorithm.params.fedcong.cong_alpha=true"],
     "algorithm.params.fedcong.cong_alpha: fedcong takes a float (default 0.7), got bool True"),
    (["algorithm.params.fedcon.cong_alpha=0.3"],
     "algorithm.params.fedcon: a table [algorithm.params.RULE] is for an algorithm, server or local rule, and no "
     "rule is called 'fedcon', did you mean fedcong?"),
    (["algorithm.name=fedcong", "algorithm.cong_alpha=1.5"], "algorithm.params.cong_alpha: must be in [0, 1], got 1.5"),
])
def test_rule_parameter_mistakes_are_one_line_each(overrides, message):
    with pytest.raises(ConfigError) as info:
        checks.load(None, overrides)
    assert str(info.value) == f"1 configuration error(s): {message}"


def test_a_config_written_before_rules_owned_their_parameters_loads_the_same(tmp_path):
    """A config.toml of an older fedddp names every rule's flat key, used or not."""
    old = ('[algorithm]\nname = "fedgma"\nlocal = "auto"\nparams = {}\nweighting = "samples"\n'
           'scaffold_control = "II"\nserver_lr = 0.5\nserver_momentum = 0.9\ncong_alpha = 0.7\n'
           'gma_threshold = 0.6\ngma_grad = "last"\ngma_mask = "hard"\ncgw_alpha = 0.1\nfeder_unfold = "average"\n'
           'prox_mu = 0.1\nmoon_mu = 1.0\nmoon_tau = 0.5\nmoon_proj_dim = 256\nsam_rho = 0.1\ngam_rho = 0.02\n'
           'gam_alpha = 0.2\nsmoo_lambda = 0.1\ndp_clip = 0.0\ndp_noise = 1.0\ndp_delta = 1e-05\n')
    cfg = checks.load(write(tmp_path, old))
    assert cfg == checks.load(None, ["algorithm.name=fedgma", "algorithm.weighting=samples",
                                     "algorithm.server_lr=0.5", "algorithm.params.gma_threshold=0.6"])


def test_a_checkpoint_identity_with_the_old_flat_keys_resumes():
    """A checkpoint's identity written with the flat keys reads as today's: the keys of the run's
    rules become its params entries, the others (which no rule of the run read) drop out."""
    from fedddp import checkpoint
    now = checkpoint.identity(checks.load(None, ["algorithm.name=fedcong"]))
    old = {k: v for k, v in now.items() if k != "algorithm.params"}
    old.update({"algorithm.params": {}, "algorithm.cong_alpha": 0.7, "algorithm.prox_mu": 0.5,
                "algorithm.scaffold_control": "II"})
    assert checkpoint.identity_changes(old, now) == []
    assert checkpoint.identity_changes({**old, "algorithm.cong_alpha": 0.6}, now) == [
        "algorithm.params.cong_alpha 0.6 -> 0.7"]
