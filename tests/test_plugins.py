"""Your own data, model and rules by import path (fedddp.plugins, docs/extending.md): the example
plugin end to end, the checks on plugin models, rule parameters, and import failures."""

import os
import textwrap
import tomllib

import pytest
import torch
from torch import nn

import fedddp
from fedddp import algorithms, checkpoint, checks, config, registry
from fedddp.__main__ import main
from fedddp.errors import ConfigError
from fedddp.strategies import kernels
from fedrun import REPO, assert_same_state, client_rows, final_state, metrics, run_fedddp

EXAMPLE = os.path.join(REPO, "examples", "my_plugin.toml")
SHORT = ["run.rounds=3", "run.clients_per_round=4", "run.eval_every=3"]


@pytest.fixture(autouse=True)
def in_repo(monkeypatch, plugin_registries):
    """Import paths resolve from the working directory: the repository root, as in the README.
    The registries the plugins join are restored after each test (conftest's plugin_registries)."""
    monkeypatch.chdir(REPO)


def run_main(capsys, args: list[str]) -> tuple[int, list[str]]:
    """``python -m fedddp ARGS`` in this process: its exit status and its stderr lines."""
    status = main(args + ([] if "run.progress=true" in args else ["run.progress=false"]))
    return status, capsys.readouterr().err.strip().splitlines()


def refused(capsys, args: list[str], status: int, *words: str) -> str:
    got, lines = run_main(capsys, args)
    assert got == status and len(lines) == 1, (got, lines)
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_example_plugin_is_world_size_invariant(tmp_path, capsys):
    """The example's data, model, server and local rule give the same final.pt on 1 and 2 ranks
    and through the Python API, config.toml records the import paths and the parameters, and
    the start line says the plugin server rule ran in torch ops."""
    one, two = tmp_path / "one", tmp_path / "two"
    status, lines = run_main(capsys, [EXAMPLE, *SHORT, f"run.out_dir={one}", "run.progress=true"])
    assert status == 0, lines
    run_fedddp(SHORT + [f"run.out_dir={two}"], nproc=2, config=EXAMPLE)
    assert_same_state(final_state(one), final_state(two))
    result = fedddp.run(str(EXAMPLE), SHORT + ["run.progress=false"], out_dir=str(tmp_path / "api"))
    assert_same_state(result.state_dict, final_state(one))
    assert [row["train_loss"] for row in result.metrics] == [row["train_loss"] for row in metrics(one)]
    assert any("aggregation: torch ops (a plugin server rule" in line for line in lines), lines
    saved = checks.load(str(one / "config.toml"))
    assert saved.data.name == "examples.my_plugin:blobs"
    assert saved.algorithm.name == "examples.my_plugin:TRIMMED_MEAN"
    assert saved.algorithm.params == {"trim": 0.2, "clip": 5.0}
    assert metrics(one)[-1]["trimmed_per_side"] == 0  # int(0.2 * 4): nothing trimmed at K = 4


@pytest.mark.e2e
def test_plugin_server_rule_runs_in_torch_ops(tmp_path, capsys, monkeypatch):
    """A plugin rule that calls weighted_mean_P gets its torch-op form even where FedAvg takes
    the fused kernel (the start line's claim); a bare aggregate function is wrapped, with the
    module's LOCAL_RULE and WEIGHTING."""
    monkeypatch.setenv("FEDDDP_KERNELS", "c")
    (tmp_path / "fn_rule_mod.py").write_text(textwrap.dedent("""
        from fedddp.strategies import client_weights_K, kernels, weighted_mean_P
        LOCAL_RULE = "prox"
        WEIGHTING = "uniform"
        FORMS = []
        def mean(global_P, stacks, state, hp):
            FORMS.append(kernels.lib(stacks["params_KP"], rule="fedavg") is None)
            return weighted_mean_P(client_weights_K(stacks, hp), stacks["params_KP"]), state, {}
    """))
    monkeypatch.chdir(tmp_path)
    status, lines = run_main(capsys, SHORT + ["algorithm.name=fn_rule_mod:mean", f"run.out_dir={tmp_path / 'out'}",
                                              "run.progress=true"])
    assert status == 0, lines
    import fn_rule_mod

    assert fn_rule_mod.FORMS == [True] * 3
    assert "fn_rule_mod:mean: prox clients, fn_rule_mod:mean server rule, uniform weights" in lines[0]
    assert kernels.lib(torch.zeros(2, 3), rule="fedavg") is not None  # forced only inside the rule


def test_a_plugin_server_rule_pairs_with_plain_clients_and_sample_weights_by_default():
    path = "examples.my_plugin:TRIMMED_MEAN"
    cfg = checks.load(None, PLUGIN_DATA + [f"algorithm.name={path}"])
    assert registry.resolve(cfg.algorithm) == ("plain", path) and cfg.algorithm.weighting == "samples"
    assert algorithms.describe(cfg.algorithm) == f"{path}: plain clients, {path} server rule, samples weights"


# -- what FedER and MOON need of the model, read from the built model ------------------------

class FlatNet(nn.Module):
    """No conv layer and no features/head split."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.body(x)


class SplitNoLinearHead(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(64, 16))
        self.head = nn.Sequential(nn.Linear(16, num_classes))

    def forward(self, x):
        return self.head(self.features(x))


class SplitWithExtra(SplitNoLinearHead):
    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes)
        self.scale = nn.Parameter(torch.ones(1))


def not_a_model(input_shape, num_classes):
    return "model"


PLUGIN_DATA = ["data.name=examples.my_plugin:blobs", "data.num_clients=12", "data.partition=natural"]


@pytest.mark.parametrize("algorithm, model", [("feder", "examples.my_plugin:SmallCNN"),
                                              ("moon", "examples.my_plugin:SmallCNN")])
@pytest.mark.e2e
def test_feder_and_moon_train_a_plugin_model_that_has_what_they_need(tmp_path, capsys, algorithm, model):
    status, lines = run_main(capsys, PLUGIN_DATA + ["run.rounds=2", "run.clients_per_round=3",
                                                    f"algorithm.name={algorithm}", f"model.name={model}",
                                                    f"run.out_dir={tmp_path}"])
    assert status == 0, lines
    state = final_state(tmp_path)
    assert ("projection.0.weight" in state) == (algorithm == "moon")  # MOON's head between the two
    if algorithm == "feder":
        assert len(client_rows(tmp_path)[-1]["feder_alpha"]) == 1  # one conv layer, weighed


@pytest.mark.parametrize("args, words", [
    (["algorithm.name=feder", "model.name=test_plugins:FlatNet"], ("model.name", "no torch.nn.Conv2d")),
    (["algorithm.name=feder", "model.name=logistic"], ("model.name", "no torch.nn.Conv2d")),
    (["algorithm.name=moon", "model.name=test_plugins:FlatNet"], ("model.name", "has no features and no head")),
    (["algorithm.name=moon", "model.name=test_plugins:SplitNoLinearHead"], ("must be a torch.nn.Linear",
                                                                           "moon_proj_dim = 0")),
    (["algorithm.name=moon", "model.name=test_plugins:SplitWithExtra"], ("outside .features and .head", "scale")),
    (["model.name=test_plugins:not_a_model"], ("returned a str, not a torch.nn.Module",)),
])
def test_a_model_without_what_the_rules_need_is_refused(tmp_path, capsys, args, words):
    """FedER's conv layer and MOON's features/head split are read from the built model (a name
    check let a conv plugin model be refused and MOON run without its projection head)."""
    refused(capsys, ["--check"] + PLUGIN_DATA + args + [f"run.out_dir={tmp_path}"], 2, *words)


def test_moon_with_proj_dim_zero_takes_any_head(tmp_path, capsys):
    status, lines = run_main(capsys, ["--check"] + PLUGIN_DATA + [
        "algorithm.name=moon", "model.name=test_plugins:SplitNoLinearHead", "algorithm.moon_proj_dim=0",
        f"run.out_dir={tmp_path}"])
    assert status == 0, lines


# -- plugin local rules side by side ----------------------------------------------------------

@pytest.mark.e2e
def test_a_plugin_local_rule_written_as_a_direction_runs_side_by_side(tmp_path):
    """The example's ClippedSGD has one direction for one client and for stacks: side by side
    (B = 4) it trains each client as one after another does (test_parallel_clients' tolerance), and
    the clip acts."""
    from test_parallel_clients import SYNTHETIC, assert_close, final_P

    mlp = SYNTHETIC + ["model.name=mlp", "model.hidden=16"]
    clipped_P = assert_close(tmp_path, mlp + ["algorithm.local=examples.my_plugin:ClippedSGD",
                                              "algorithm.params.clip=0.5"])
    assert (clipped_P - final_P(tmp_path / "plain", 1, mlp)).abs().max() > 1e-3


ONE_CLIENT_RULE = """
    from fedddp.client.rules import LocalRule, backward

    class OneClientClip(LocalRule):
        def gradient(self, model, x, y, ctx):
            loss = ctx.task.loss(model(x), y)
            backward(loss, list(model.parameters()))
            for p in model.parameters():
                p.grad.clamp_(-1.0, 1.0)
            return loss
"""


def test_a_plugin_local_rule_with_only_the_one_client_step_is_refused_side_by_side(tmp_path, monkeypatch):
    """A rule that overrides gradient() (the one-client hook, as plugins were written before
    direction) trains one after another; side by side is one line saying what to write instead."""
    (tmp_path / "one_client_rule_mod.py").write_text(textwrap.dedent(ONE_CLIENT_RULE))
    monkeypatch.chdir(tmp_path)
    local = "algorithm.local=one_client_rule_mod:OneClientClip"
    assert checks.load(None, [local]).algorithm.local == "one_client_rule_mod:OneClientClip"
    with pytest.raises(ConfigError) as err:
        checks.load(None, [local, "run.parallel_clients=3"])
    assert str(err.value) == (
        "1 configuration error(s): run.parallel_clients: the local rule one_client_rule_mod:OneClientClip "
        "overrides gradient(), which trains one client at a time; to run side by side, write its step as "
        "direction(step) (and loss(net, x, y, hp) if it changes the objective) instead (docs/extending.md, "
        "\"Local rules\"); set run.parallel_clients=1")
    checks.load(None, ["algorithm.local=examples.my_plugin:ClippedSGD", "run.parallel_clients=3"])


# -- [algorithm.params] ----------------------------------------------------------------------

@pytest.mark.parametrize("override, words", [
    ("algorithm.params.trim=0.7", ("algorithm.params.trim: must be in [0, 0.5], got 0.7",)),
    ("algorithm.params.trm=0.1", ("algorithm.params.trm: not a parameter", "trim (examples.my_plugin:TRIMMED_MEAN)",
                                  "clip (examples.my_plugin:ClippedSGD)")),
    ("algorithm.params.clip=fast", ("algorithm.params.clip", "takes a float", "'fast'")),
    ("algorithm.params.clip=0", ("algorithm.params.clip: must be > 0",)),
])
def test_rule_params_are_checked_by_the_rules(tmp_path, capsys, override, words):
    refused(capsys, ["--check", EXAMPLE, override, f"run.out_dir={tmp_path}"], 2, *words)


def test_builtin_rules_take_no_params(tmp_path, capsys):
    refused(capsys, ["--check", "algorithm.params.mu=1", f"run.out_dir={tmp_path}"], 2,
            "algorithm.params.mu: not a parameter of the fedavg server rule or the plain local rule (theirs: none)")


def test_params_defaults_are_filled_in_and_an_int_is_taken_for_a_float():
    cfg = checks.load(EXAMPLE, ["algorithm.params.clip=2"])
    assert cfg.algorithm.params == {"trim": 0.2, "clip": 2.0} and type(cfg.algorithm.params["clip"]) is float
    cfg = checks.load(None, PLUGIN_DATA + ["algorithm.name=examples.my_plugin:TRIMMED_MEAN",
                                           "algorithm.local=examples.my_plugin:ClippedSGD"])
    assert cfg.algorithm.params == {"trim": 0.5, "clip": 1.0}
    assert tomllib.loads(config.dumps(cfg))["algorithm"]["params"] == {"trim": 0.5, "clip": 1.0}


@pytest.mark.e2e
def test_resume_with_plugins_is_exact_and_refuses_a_changed_rule_param(tmp_path, capsys):
    """[algorithm.params] is part of the run identity: a resume with another trim is refused; with
    the same one it ends with the uninterrupted run's model."""
    full, part = tmp_path / "full", tmp_path / "part"
    common = [EXAMPLE, "run.rounds=3", "run.clients_per_round=3", "run.ckpt_every=1"]
    assert run_main(capsys, common + [f"run.out_dir={full}"])[0] == 0
    assert run_main(capsys, common + [f"run.out_dir={part}", "run.stop_after=2"])[0] == 0
    refused(capsys, common + [f"run.out_dir={part}", "run.resume=true", "algorithm.params.trim=0.4"], 2,
            "run.resume", "algorithm.params", "0.2", "0.4")
    status, lines = run_main(capsys, common + [f"run.out_dir={part}", "run.resume=true"])
    assert status == 0, lines
    assert_same_state(final_state(full), final_state(part))
    assert checkpoint.identity(checks.load(EXAMPLE, []))["algorithm.params"] == {"trim": 0.2, "clip": 5.0}


# -- import paths that fail: one line, exit 2 ------------------------------------------------

@pytest.mark.parametrize("override, words", [
    ("data.name=no_such_module_xyz:make", ("data.name", "cannot import 'no_such_module_xyz'", "ModuleNotFoundError")),
    ("data.name=examples.my_plugin:nothing", ("data.name", "has no attribute 'nothing'")),
    ("data.name=examples.my_plugin:CLIENTS", ("data.name", "is a int, not callable")),
    ("model.name=examples.my_plugin", ("model.name", "not one of")),
    ("model.name=examples.my_plugin:", ("model.name", "not an import path", "module:attr")),
    ("algorithm.name=examples.my_plugin:CLASSES", ("algorithm.name", "it must be a server rule")),
    ("algorithm.local=examples.my_plugin:SmallCNN", ("algorithm.local", "subclass of fedddp.client.rules.LocalRule")),
    ("algorithm.local=broken_plugin_mod:Rule", ("algorithm.local", "SyntaxError")),
])
def test_an_import_path_that_fails_is_one_line(tmp_path, capsys, monkeypatch, override, words):
    (tmp_path / "broken_plugin_mod.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    refused(capsys, ["--check", override, f"run.out_dir={tmp_path / 'out'}"], 2, *words)


def test_a_sweep_axis_over_a_rule_param(tmp_path):
    from fedddp.study import sweep

    _, _, points = sweep.plan(EXAMPLE, ["algorithm.params.trim=0.1,0.5"], str(tmp_path))
    assert [p.cfg.algorithm.params for p in points] == [{"clip": 5.0, "trim": 0.1}, {"clip": 5.0, "trim": 0.5}]


@pytest.mark.parametrize("hook, args", [("check_config", (None, "plain", {})), ("closing_words", ({}, {})),
                                        ("start_words", ({}, 10.0, 610))])
def test_a_plugin_rules_hooks_raise_as_one_plugin_error(hook, args):
    """A plugin server rule's optional hooks run under plugins.calling, as its aggregate does:
    what they raise is the user's (exit 7), one line naming the rule and the hook."""
    from fedddp.errors import PluginError
    from fedddp.strategies.base import Strategy, plugin_form

    def broken(*_):
        raise RuntimeError("boom")
    rule = plugin_form(Strategy("x", lambda *a: None, **{hook: broken}), "my_rules:X")
    with pytest.raises(PluginError, match=f"my_rules:X \\(its {hook}\\) raised RuntimeError: boom"):
        getattr(rule, hook)(*args)
