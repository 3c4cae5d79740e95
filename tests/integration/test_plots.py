"""The plots read as pictures: τ-frontier labels do not cover each other, the curves legend fits the
figure, and a loss that starts orders of magnitude above where it settles gets a log-like axis."""
import pytest
from matplotlib.text import Text

from integration import plots


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions would save (nothing is written)."""
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    return figs


def speed(m):
    return {"median": m, "min": m, "max": m}


def test_tau_frontier_labels_stay_apart_and_inside(drawn):
    # Two batch sizes whose points nearly coincide, several taus with the same Recall@1: the labels
    # drawn at one fixed offset covered each other.
    rows = [{"batch_size": b, "ar": {"recall@1": 0.32, "tokens_per_second": speed(500 * b)},
             "points": [{"tau": t, "recall@1": r, "tokens_per_second": speed(x + 30 * b)}
                        for t, r, x in ((1.0, 0.325, 200), (0.9, 0.325, 2270), (0.8, 0.325, 2420), (0.6, 0.30, 2700),
                                        (0.4, 0.305, 2950))]}
            for b in (1, 8)]
    assert plots.plot_tau_frontier({"batches": rows}, "unused.png") == "unused.png"
    (fig,) = drawn
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    fig.draw_without_rendering()
    boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]
    assert len(boxes) == 10
    inside = ax.get_window_extent(renderer)
    for i, a in enumerate(boxes):
        assert inside.x0 <= a.x0 and a.x1 <= inside.x1 and inside.y0 <= a.y0 and a.y1 <= inside.y1
        assert not any(a.overlaps(b) for b in boxes[i + 1:])


def test_curves_legend_fits_the_figure(drawn):
    long = "cft, block-suffix, 1,000 steps more from the averaged model ({})"
    runs = {long.format(k): {"train": {"loss": [[1, 0.05], [2, 0.04]], "kl": [[1, 0.02], [2, 0.01]]},
                             "valid": {"loss": [[2, 0.03]]}} for k in ("a", "b")}
    plots.plot_training_curves({"runs": runs}, "unused.png")
    (fig,) = drawn
    fig.draw_without_rendering()
    (legend,) = fig.legends
    box = legend.get_window_extent(fig.canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and 0 <= box.y0


@pytest.mark.parametrize("values, scale", [
    ([7.0, 3.0, 0.5, 0.05, 0.01], "log"),  # all positive, orders of magnitude
    ([7.0, 3.0, 0.5, 0.05, 0.01, -0.02, 0.0, 0.001], "symlog"),  # with a policy-gradient loss beside it
    ([0.05, 0.03, 0.02, -0.001], "linear"),  # one order of magnitude: as it is
])
def test_a_loss_far_above_where_it_settles_gets_a_log_like_axis(drawn, values, scale):
    pts = [[i + 1, v] for i, v in enumerate(values)]
    plots.plot_training_curves({"runs": {"run": {"train": {"loss": pts}}}}, "unused.png")
    assert drawn[0].axes[0].get_yscale() == scale
