"""python -m fedddp.study.plot draws runs' metrics and names a missing metric; the options for a
paper's figure (names of the series, titles, size, style, line styles and hatching, the legend's
place, the rounds drawn, pdf and svg) are checked on the Figure it builds and the files it writes,
not on pixels."""

import subprocess
import sys

import pytest

from fedddp.errors import ConfigError
from fedddp.study import plot
from fedrun import REPO, run_here
from test_summary import fake_run

matplotlib = pytest.importorskip("matplotlib")
import matplotlib.colors  # noqa: E402
import matplotlib.style  # noqa: E402


@pytest.mark.processes
@pytest.mark.e2e
def test_plot_two_runs(tmp_path):
    for name in ("fedavg", "fedmom"):
        run_here([f"algorithm.name={name}", "run.rounds=3", "run.eval_every=1",
                  f"run.out_dir={tmp_path / name}"])
    out = tmp_path / "cmp.png"
    proc = subprocess.run([sys.executable, "-m", "fedddp.study.plot", str(tmp_path / "fedavg"),
                           str(tmp_path / "fedmom"), "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "fedddp.study.plot", str(tmp_path / "fedavg"), "--metric", "nope",
                          "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "no run has values of 'nope'" in bad.stderr and "test_accuracy" in bad.stderr


# -- options for a paper's figure ------------------------------------------------------------------


@pytest.fixture
def two_groups(tmp_path):
    """fedavg and fedmom, 2 seeds each, test accuracy every round for 6 rounds; bands overlap."""
    root = tmp_path / "runs"
    for name, base in (("fedavg", 0.5), ("fedmom", 0.52)):
        for seed in (0, 1):
            fake_run(root / f"name={name},seed={seed}", [base + 0.05 * r + 0.02 * seed for r in range(6)],
                     algorithm__name=name, run__seed=seed)
    return root


def draw(runs, *options):
    args = plot.parser().parse_args([str(runs), *options])
    warned = []
    return plot.figure(args, warned.append), warned


def legend_of(fig):
    return fig.axes[0].get_legend() or (fig.legends[0] if fig.legends else None)


def test_title_axis_labels_and_figure_size(two_groups):
    fig, _ = draw(two_groups, "--group-by", "algorithm.name", "--title", "Synthetic(1, 1)", "--xlabel", "Round",
                  "--ylabel", "Test accuracy", "--figsize", "3.5,2.6")
    ax = fig.axes[0]
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("Synthetic(1, 1)", "Round", "Test accuracy")
    assert tuple(fig.get_size_inches()) == pytest.approx((3.5, 2.6))
    default, _ = draw(two_groups, "--metric", "test_loss")
    assert (default.axes[0].get_title(), default.axes[0].get_xlabel(), default.axes[0].get_ylabel()) == \
        ("", "round", "test loss")  # in words, not metrics.jsonl's key
    with pytest.raises(ConfigError, match="--figsize: '3.5x2' is not WIDTH,HEIGHT"):
        draw(two_groups, "--figsize", "3.5x2")


def test_default_labels_are_words_ticks_fall_on_evaluated_rounds_and_a_long_title_wraps(tmp_path):
    """Guards what a new user saw: raw keys as axis labels (test_accuracy, sim_time_s), ticks on
    rounds without a value (round 3 of a run evaluated every 5), a long title cut off."""
    assert [plot.words(k) for k in ("test_accuracy", "sim_time_s", "train_imbalance_s", "test_acc")] == \
        ["test accuracy", "simulated time (s)", "train imbalance (s)", "test acc"]
    for seed in (0, 1):  # evaluated every 5 rounds of 40
        fake_run(tmp_path / "every5" / f"s{seed}", [0.1 * seed + r / 100 if r % 5 == 0 else None for r in range(1, 41)],
                 algorithm__name="fedavg", run__seed=seed)
    title = "FedAvg on Synthetic(1, 1) with 100 clients, 10 per round, evaluated every 5 rounds, 2 seeds"
    fig, _ = draw(tmp_path / "every5", "--group-by", "auto", "--title", title, "--figsize", "3.5,2.6")
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == [5, 10, 15, 20, 25, 30, 35, 40]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("round", "test accuracy")
    assert "\n" in ax.get_title() and " ".join(ax.get_title().split()) == title
    fig.draw_without_rendering()
    assert ax.title.get_window_extent().width <= ax.get_window_extent().width
    fake_run(tmp_path / "long" / "a", [0.5] * 200, algorithm__name="fedavg")  # every round: every 20th
    fig, _ = draw(tmp_path / "long", "--title", "short")
    assert list(fig.axes[0].get_xticks()) == list(range(20, 201, 20)) and fig.axes[0].get_title() == "short"


def test_groups_in_numeric_order_and_a_baseline_named_by_its_rule(tmp_path):
    """eta 0.003 < 0.01 < 0.03 < 0.1 (as text: 0.01, 0.1, 0.003, 0.03); fedavg, which has no eta,
    is the series fedavg, not eta=None."""
    for eta in (0.1, 0.01, 0.003, 0.03):
        fake_run(tmp_path / f"eta{eta}", [0.5, 0.6], algorithm__name="fedadam", algorithm__params={"eta": eta})
    fake_run(tmp_path / "fedavg", [0.5, 0.6], algorithm__name="fedavg")
    fig, _ = draw(tmp_path, "--group-by", "algorithm.params.eta")
    assert [t.get_text() for t in legend_of(fig).get_texts()] == [
        "eta=0.003 (n=1)", "eta=0.01 (n=1)", "eta=0.03 (n=1)", "eta=0.1 (n=1)", "fedavg (n=1)"]
    fig, _ = draw(tmp_path, "--group-by", "auto", "--label", "name=fedavg:FedAvg")  # named: no eta=None
    assert [t.get_text() for t in legend_of(fig).get_texts()][:2] == ["FedAvg", "name=fedadam, eta=0.003 (n=1)"]


def test_label_maps_a_series_to_a_display_name_and_orders_the_legend(two_groups):
    """A series is named as the summary names its row (name=fedavg); its legend entry adds (n=runs)."""
    fig, _ = draw(two_groups, "--group-by", "algorithm.name")
    assert [t.get_text() for t in legend_of(fig).get_texts()] == ["name=fedavg (n=2)", "name=fedmom (n=2)"]
    fig, _ = draw(two_groups, "--group-by", "algorithm.name", "--label", "name=fedmom:FedMom (ours)",
                  "--label", "name=fedavg (n=2):FedAvg: baseline")  # the default entry works too; ':' in a name
    assert [t.get_text() for t in legend_of(fig).get_texts()] == ["FedMom (ours)", "FedAvg: baseline"]
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["FedMom (ours)", "FedAvg: baseline"]
    fig, _ = draw(two_groups, "--group-by", "algorithm.name", "--label", "name=fedmom:FedMom")
    assert [t.get_text() for t in legend_of(fig).get_texts()] == ["FedMom", "name=fedavg (n=2)"]
    runs, _ = draw(two_groups, "--label", "name=fedavg,seed=1:seed 1")  # a run is named by its folder
    assert "seed 1" in [t.get_text() for t in legend_of(runs).get_texts()]
    with pytest.raises(ConfigError, match="SERIES one of the plot's series: name=fedavg, name=fedmom; did you mean "
                                          "name=fedavg"):
        draw(two_groups, "--group-by", "algorithm.name", "--label", "name=fedavgg:FedAvg")
    with pytest.raises(ConfigError, match="already named 'A'"):
        draw(two_groups, "--group-by", "algorithm.name", "--label", "name=fedavg:A", "--label", "name=fedavg:B")


def test_series_differ_in_colour_line_style_marker_and_hatch(two_groups):
    fig, _ = draw(two_groups, "--group-by", "algorithm.name")
    ax = fig.axes[0]
    lines, bands = ax.get_lines(), ax.collections
    assert len(lines) == len(bands) == 2
    for attr in ("get_color", "get_linestyle", "get_marker"):
        assert len({getattr(line, attr)() for line in lines}) == 2, attr
    assert [b.get_hatch() for b in bands] == list(plot.HATCHES[:2])
    for line, band in zip(lines, bands):  # the band is the line's colour, filled lightly
        assert tuple(band.get_facecolor()[0][:3]) == pytest.approx(matplotlib.colors.to_rgb(line.get_color()))
        assert band.get_facecolor()[0][3] < 0.3
    filled, _ = draw(two_groups, "--group-by", "algorithm.name", "--bands", "fill")
    assert [b.get_hatch() for b in filled.axes[0].collections] == [None, None]
    bare, _ = draw(two_groups, "--group-by", "algorithm.name", "--bands", "none")
    assert len(bare.axes[0].collections) == 0


def test_style_sets_colours_and_looks_and_a_wrong_one_is_named(two_groups):
    fig, _ = draw(two_groups, "--group-by", "algorithm.name")
    assert [line.get_color() for line in fig.axes[0].get_lines()] == list(plot.OKABE_ITO[:2])
    fig, _ = draw(two_groups, "--group-by", "algorithm.name", "--style", "ggplot")
    ggplot = matplotlib.style.library["ggplot"]
    assert matplotlib.colors.same_color(fig.axes[0].get_facecolor(), ggplot["axes.facecolor"])
    assert [line.get_color() for line in fig.axes[0].get_lines()] == \
        ggplot["axes.prop_cycle"].by_key()["color"][:2]
    assert matplotlib.rcParams["axes.facecolor"] != ggplot["axes.facecolor"]  # the style does not leak
    with pytest.raises(ConfigError, match="'ggplt' is neither a matplotlib style nor a style file, did you mean "
                                          "ggplot"):
        draw(two_groups, "--style", "ggplt")


def test_legend_best_outside_below_or_none(two_groups):
    best, _ = draw(two_groups, "--group-by", "algorithm.name")
    assert best.axes[0].get_legend()._loc == 0  # matplotlib's "best": the place covering the least data
    for where in ("outside", "below"):
        fig, _ = draw(two_groups, "--group-by", "algorithm.name", "--legend", where, "--figsize", "4,3")
        assert fig.axes[0].get_legend() is None and len(fig.legends) == 1
        fig.draw_without_rendering()
        legend, axes = fig.legends[0].get_window_extent(), fig.axes[0].get_window_extent()
        assert not legend.overlaps(axes), where
        assert legend.x0 >= 0 and legend.y0 >= 0 and legend.x1 <= fig.bbox.x1 and legend.y1 <= fig.bbox.y1
        if where == "outside":
            assert legend.x0 >= axes.x1
        else:
            assert legend.y1 <= axes.y0
    none, _ = draw(two_groups, "--group-by", "algorithm.name", "--legend", "none")
    assert none.axes[0].get_legend() is None and not none.legends


def test_rounds_window(two_groups):
    fig, warned = draw(two_groups, "--group-by", "algorithm.name", "--rounds", "2-4")
    for line in fig.axes[0].get_lines():
        assert list(line.get_xdata()) == [2, 3, 4]
    fedavg = fig.axes[0].get_lines()[0]
    assert list(fedavg.get_ydata()) == pytest.approx([0.56, 0.61, 0.66])  # mean of the two seeds per round
    assert warned == []
    for bad in ("4-2", "0-3", "3"):
        with pytest.raises(ConfigError, match="--rounds"):
            draw(two_groups, "--rounds", bad)
    with pytest.raises(ConfigError, match="no run has values of 'test_accuracy' in rounds 7-9"):
        draw(two_groups, "--rounds", "7-9")


def test_pdf_svg_and_png_by_the_extension(two_groups, tmp_path, capsys):
    common = [str(two_groups), "--group-by", "algorithm.name", "--label", "name=fedavg:FedAvg", "--legend", "outside"]
    written = {}
    for ext in ("pdf", "svg", "png"):
        out = tmp_path / f"fig.{ext}"
        assert plot.main(common + ["--out", str(out)]) == 0
        written[ext] = out.read_bytes()
    assert written["pdf"].startswith(b"%PDF") and written["png"].startswith(b"\x89PNG\r\n\x1a\n")
    svg = written["svg"].decode()
    assert "<svg" in svg and ">FedAvg<" in svg  # text stays text
    again = tmp_path / "again.svg"
    assert plot.main(common + ["--out", str(again)]) == 0 and again.read_text() == svg  # no date in it
    capsys.readouterr()
    assert plot.main(common + ["--out", str(tmp_path / "fig.pnx")]) == 2
    assert "--out" in capsys.readouterr().err and not (tmp_path / "fig.pnx").exists()
