"""What ``python -m fedddp`` says about itself (fedddp.__main__.main, in this process): the usage in a
few lines without arguments, --version, --help with the algorithms, --help NAME with one rule's
parameters (a plugin's too), a wrong NAME in one line."""

import fedddp
from fedddp.__main__ import main
from fedddp.registry import ALGORITHMS
from fedrun import REPO


def test_no_arguments_print_the_usage_in_a_few_lines(capsys):
    """Guards the 229 lines of --help that a bare ``python -m fedddp`` printed."""
    assert main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.splitlines()) <= 10
    assert "python -m fedddp configs/quickstart.toml" in out.err and "python -m fedddp --help" in out.err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"fedddp {fedddp.__version__}\n"


def test_help_lists_the_algorithms_and_a_rules_parameters(capsys, monkeypatch):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "Algorithms (algorithm.name" in text and "run.rounds = 20" in text and "algorithm.params.prox_mu" in text
    assert all(name in text for name in ALGORITHMS if ":" not in name)
    assert main(["--help", "fedprox"]) == 0
    assert capsys.readouterr().out.splitlines()[:3] == [
        "fedprox: algorithm.name; its clients train with the prox local rule, its server aggregates with the "
        "fedavg server rule", "  algorithm.params.prox_mu = 0.1  (prox local rule)", "      FedProx proximal weight mu."]
    monkeypatch.chdir(REPO)  # where examples/ is importable, as for a run
    assert main(["--help", "examples.my_plugin:TRIMMED_MEAN"]) == 0
    text = capsys.readouterr().out
    assert "  algorithm.params.trim = 0.5  (examples.my_plugin:TRIMMED_MEAN server rule)" in text
    assert '[algorithm.params."examples.my_plugin:TRIMMED_MEAN"]' in text
    assert main(["--help", "examples.my_plugin:ClippedSGD"]) == 0
    assert "algorithm.params.clip = 1.0  (examples.my_plugin:ClippedSGD local rule)" in capsys.readouterr().out
    assert main(["--help", "fedprx"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean fedprox?" in err
