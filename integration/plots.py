"""PNG plots for docs/BENCHMARKS.md, drawn only from docs/results/*.json documents.

Uses matplotlib's object API on the Agg canvas (no pyplot global state, no display needed). Each
function takes one result document (the schema is in integration/bench.py), writes one PNG and
returns its path, or returns None when the document holds nothing to plot (then nothing is written).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter
from matplotlib.transforms import Bbox

_META = {"Software": None}  # keep the PNG bytes free of the matplotlib version


def _new(figsize=(6.0, 4.0)):
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata=_META)
    return path


def _med(s):
    """Median of a stats dict (reranker.eval.speed.stats) or a bare number."""
    if isinstance(s, dict):
        return s.get("median")
    return s


def _err(s):
    """(lower, upper) error-bar lengths from a stats dict's min/max, or (0, 0)."""
    if isinstance(s, dict) and s.get("median") is not None and s.get("min") is not None and s.get("max") is not None:
        return s["median"] - s["min"], s["max"] - s["median"]
    return 0.0, 0.0


def _log2_axis(ax, values):
    """A base-2 log x axis ticked at the measured values, labelled as plain numbers."""
    ax.set_xscale("log", base=2)
    ticks = sorted({v for v in values if v})
    ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _speedup(p):
    """The per-repeat (paired) speed-up stats if present, else the ratio of medians."""
    return p.get("speedup_paired") or p.get("speedup")


def plot_tau_frontier(doc: dict, path, title: str = "") -> Path | None:
    """Recall@1 vs decode tokens/s: one point per tau per batch size, AR as the reference star."""
    fig = _new()
    ax = fig.add_subplot()
    labels = []  # (x, y, text, colour): placed once the axes are final
    for row in doc.get("batches") or []:
        pts = [p for p in row.get("points") or [] if p.get("recall@1") is not None and _med(p.get("tokens_per_second"))]
        if not pts:
            continue
        b = row.get("batch_size")
        xs = [_med(p["tokens_per_second"]) for p in pts]
        line = ax.plot(xs, [p["recall@1"] for p in pts], "o-", label=f"diffusion, batch {b}")[0]
        labels += [(x, p["recall@1"], f"τ={p['tau']:g}", line.get_color()) for p, x in zip(pts, xs)]
        ar = row.get("ar") or {}
        if ar.get("recall@1") is not None and _med(ar.get("tokens_per_second")):
            ax.plot([_med(ar["tokens_per_second"])], [ar["recall@1"]], "*", ms=14, color=line.get_color(),
                    label=f"AR, batch {b}")
    if not labels:
        return None
    ax.set_xlabel("decode tokens/s (median)")
    ax.set_ylabel("Recall@1")
    ax.set_title(title or "τ frontier: accuracy vs decode speed")
    ax.grid(alpha=0.3)
    ax.margins(x=0.08, y=0.12)  # room for the labels of the outermost points
    ax.legend(fontsize=8)
    _label_points(ax, labels)
    return _save(fig, path)


# Where a point's label may go, nearest first: (dx, dy) in points from the point, the label's
# corner there facing the point; the further rings get a leader line.
_RING = [(1, 1), (1, -1), (-1, 1), (-1, -1), (0, 1), (0, -1), (1, 0), (-1, 0)]
_OFFSETS = [(r * dx, r * dy) for r in (5, 14, 24, 36) for dx, dy in _RING]


def _label_points(ax, labels) -> None:
    """Annotate each (x, y, text, colour) at the nearest offset where the label stays inside the
    axes and covers no marker, no legend and no label placed before it, preferring offsets that
    cross no plotted line either (the nearest offset when none is free). Fixes the figure's layout
    first: the check is in display coordinates."""
    fig = ax.figure
    fig.draw_without_rendering()
    fig.set_layout_engine("none")  # keep the axes where the check saw them
    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer).padded(-2)
    taken, on_lines = [], []  # boxes a label must not cover; points along the lines it should not cross
    for line in ax.get_lines():
        xy = ax.transData.transform(line.get_xydata())
        r = line.get_markersize() * fig.dpi / 72 / 2
        taken += [Bbox.from_extents(px - r, py - r, px + r, py + r) for px, py in xy]
        if line.get_linestyle() not in ("None", " ", ""):
            for a, b in zip(xy[:-1], xy[1:]):
                n = max(2, int(np.hypot(*(b - a)) / 2))
                on_lines.append(a + np.linspace(0, 1, n)[:, None] * (b - a))
    if ax.get_legend() is not None:
        taken.append(ax.get_legend().get_window_extent(renderer))
    on_lines = np.concatenate(on_lines) if on_lines else np.empty((0, 2))

    def crosses_line(bb) -> bool:
        x, y = on_lines[:, 0], on_lines[:, 1]
        return bool(((x > bb.x0) & (x < bb.x1) & (y > bb.y0) & (y < bb.y1)).any())

    for x, y, text, colour in labels:
        free = []  # the offsets, nearest first, where the label is inside and covers nothing taken
        for offset in _OFFSETS:
            bb = _text_box(_annotate(ax, text, (x, y), offset, colour), renderer, remove=True)
            inner = inside.x0 <= bb.x0 and bb.x1 <= inside.x1 and inside.y0 <= bb.y0 and bb.y1 <= inside.y1
            if inner and not any(bb.overlaps(t) for t in taken):
                if not crosses_line(bb):
                    free.insert(0, offset)  # the first clear of the lines too: take it
                    break
                free.append(offset)
        taken.append(_text_box(_annotate(ax, text, (x, y), (free or _OFFSETS)[0], colour), renderer))


def _text_box(ann, renderer, remove: bool = False) -> Bbox:
    """An annotation's text in display coordinates, without its leader line (which would cover the
    point it labels); `remove` takes the annotation off the axes (a trial placement)."""
    ann.update_positions(renderer)  # the text's place follows from the point and the offset
    bb = Text.get_window_extent(ann, renderer)
    if remove:
        ann.remove()
    return bb


def _annotate(ax, text, xy, offset, colour):
    """`text` at `offset` points from `xy`, its corner facing the point; a leader line when it is far."""
    dx, dy = offset
    far = abs(dx) + abs(dy) > 12
    return ax.annotate(text, xy, textcoords="offset points", xytext=offset, fontsize=8, color=colour,
                       ha="left" if dx > 0 else "right" if dx < 0 else "center",
                       va="bottom" if dy > 0 else "top" if dy < 0 else "center",
                       arrowprops=dict(arrowstyle="-", color=colour, lw=0.6, shrinkA=0, shrinkB=0) if far else None)


def plot_speedup_vs_length(doc: dict, path, title: str = "") -> Path | None:
    """Diffusion / AR speed-up vs generated length (EOS disabled), one line per (tau, batch);
    error bars span the min..max of the per-repeat ratios."""
    series = {}
    for row in doc.get("length_curve") or []:
        for p in row.get("points") or []:
            s = _speedup(p)
            if _med(s) is None:
                continue
            series.setdefault((p.get("tau"), row.get("batch_size")), []).append((row.get("length"), s))
    lines = [(f"τ={tau:g}, batch {b}", pts)
             for (tau, b), pts in sorted(series.items(), key=lambda kv: (str(kv[0][1]), str(kv[0][0])))]
    return _speedup_plot(lines, path, "generated tokens per row (EOS disabled)", title or "Speed-up vs output length")


def plot_speedup_vs_batch(doc: dict, path, title: str = "") -> Path | None:
    """Diffusion / AR speed-up vs batch size at the model's natural output length, one line per tau."""
    series = {}
    for row in doc.get("batches") or []:
        for p in row.get("points") or []:
            s = _speedup(p)
            if _med(s) is not None:
                series.setdefault(p.get("tau"), []).append((row.get("batch_size"), s))
    lines = [(f"τ={tau:g}", pts) for tau, pts in sorted(series.items(), key=lambda kv: -(kv[0] or 0))]
    return _speedup_plot(lines, path, "batch size", title or "Speed-up vs batch size")


def _speedup_plot(lines: list[tuple[str, list]], path, xlabel: str, title: str) -> Path | None:
    """Speed-up (median, min..max error bars) vs a base-2 x, one line per (label, [(x, stats)]), in
    that order, with the break-even line at 1; None when there are no lines."""
    if not lines:
        return None
    fig = _new()
    ax = fig.add_subplot()
    for label, pts in lines:
        pts.sort(key=lambda t: t[0])
        errs = list(zip(*[_err(s) for _, s in pts]))
        ax.errorbar([x for x, _ in pts], [_med(s) for _, s in pts], yerr=errs, marker="o", capsize=3, label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    _log2_axis(ax, [x for _, pts in lines for x, _ in pts])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speed-up (diffusion tok/s ÷ AR tok/s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_service_load(doc: dict, path, title: str = "") -> Path | None:
    """QPS and p50 / p99 latency vs concurrency, one line per decoder."""
    by_dec = {}
    for r in doc.get("runs") or []:
        dec = (r.get("options") or {}).get("decoder") or r.get("decoder") or "?"
        if r.get("concurrency") is not None and r.get("qps") is not None:
            by_dec.setdefault(dec, []).append(r)
    if not by_dec:
        return None
    fig = _new((9.0, 3.8))
    ax_q, ax_l = fig.subplots(1, 2)
    for dec, rs in sorted(by_dec.items()):
        rs.sort(key=lambda r: r["concurrency"])
        c = [r["concurrency"] for r in rs]
        line = ax_q.plot(c, [r["qps"] for r in rs], "o-", label=dec)[0]
        lat = [r.get("latency_ms") or {} for r in rs]
        for key, style in (("p50", "o-"), ("p99", "s--")):
            ys = [x.get(key) for x in lat]
            if any(y is not None for y in ys):
                ax_l.plot(c, [float("nan") if y is None else y for y in ys], style, color=line.get_color(),
                          label=f"{dec} {key}")
    for ax in (ax_q, ax_l):
        _log2_axis(ax, [r["concurrency"] for rs in by_dec.values() for r in rs])
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_q.set_ylabel("requests/s")
    ax_l.set_ylabel("latency (ms)")
    fig.suptitle(title or "Service load")
    return _save(fig, path)


CURVE_METRICS = ("loss", "answer_nll", "kl", "reward_mean", "valid_rate", "r1")


def plot_training_curves(doc: dict, path, title: str = "") -> Path | None:
    """One panel per learning-curve metric (loss, KL, reward, valid rate, R@1): training rows as
    lines, validation rows as markers, one colour per stage run."""
    runs = doc.get("runs") or {}
    metrics = [m for m in CURVE_METRICS if any(m in c.get(kind, {}) for c in runs.values() for kind in c)]
    if not metrics:
        return None
    # One legend for the figure, below the panels: per-panel legends hide the curves once a few
    # runs are compared.
    fig = _new((3.4 * len(metrics), 3.2 + 0.15 * len(runs)))
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    colours = {label: f"C{i % 10}" for i, label in enumerate(runs)}
    for ax, m in zip(axes, metrics):
        values = []
        for label, c in runs.items():
            for kind, style in (("train", "-"), ("valid", "o--")):
                pts = c.get(kind, {}).get(m)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colours[label],
                            label=f"{label} ({kind})", markersize=3, linewidth=1)
                    values += [p[1] for p in pts]
        _spread_y(ax, values)
        ax.set_title(m)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    # As many columns as fit the figure's width (a legend wider than the figure is cut off), and
    # the figure as tall as the panels plus the legend's rows.
    renderer = fig.canvas.get_renderer()
    for ncol in range(len(labels), 0, -1):
        legend = fig.legend(handles, labels, loc="outside lower center", fontsize=7, ncol=ncol, frameon=False)
        if ncol == 1 or legend.get_window_extent(renderer).width <= 0.96 * fig.bbox.width:
            break
        legend.remove()
    fig.set_figheight(3.2 + 0.15 * -(-len(labels) // ncol))
    fig.suptitle(title or "Training curves")
    return _save(fig, path)


def _spread_y(ax, values) -> None:
    """A log y axis for a metric whose positive values span orders of magnitude (a loss that starts
    far above where it settles would squash the rest of the curve against zero); a symmetric log
    axis, linear around zero, where some values are zero or negative (a policy-gradient loss beside
    a cross-entropy)."""
    positive = [v for v in values if v > 0]
    if not positive or max(positive) <= 30 * min(positive):
        return
    if len(positive) == len(values):
        ax.set_yscale("log")
        return
    # Linear below the decade of the smaller of: the zero-or-negative values' size, the low end
    # of the positive ones (so a curve that settles low keeps its shape).
    low = sorted(positive)[len(positive) // 20]
    small = min(max(abs(v) for v in values if v <= 0) or low, low)
    k0 = math.floor(math.log10(small))
    ax.set_yscale("symlog", linthresh=10.0 ** k0, linscale=0.5)
    # Ticks at 0 and at decades clear of the linear band (its edges' labels would run into 0's),
    # every other decade when there are many.
    top, bottom = math.log10(max(positive)), math.log10(-min(values)) if min(values) < 0 else k0
    step = 2 if (top - k0) + (bottom - k0) > 5 else 1
    ticks = [0.0] + [10.0 ** k for k in range(k0 + step, math.ceil(top) + 1, step)]
    ticks += [-(10.0 ** k) for k in range(k0 + step, math.ceil(bottom) + 1, step)]
    ax.yaxis.set_major_locator(FixedLocator(sorted(ticks)))


def plot_stage_summary(summary: dict, path, title: str = "") -> Path | None:
    """The pipeline's stage table in three panels: Recall@1 of every row beside the baselines (the
    language-model rows with their 95% CI against the retriever order), the valid-ranking rate of
    the language-model rows (an invalid answer falls back to the retriever order, so a row with a
    low rate shows the retriever's Recall@1), and each row's decode speed relative to AR, with the
    side-by-side batch-1 ratio of the final student when the summary has one."""
    rows = [r for r in summary.get("rows") or [] if r.get("recall@1") is not None]
    if not rows:
        return None
    base = [{"name": n, **b["metrics"]} for n, b in (summary.get("baselines") or {}).items() if n != "retriever"]
    fig = _new((13.0, 0.42 * (len(rows) + len(base)) + 1.8))
    ax_r, ax_v, ax_s = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.4, 1.0, 1.0]})
    table = rows[:1] + base + rows[1:]
    names = [r["name"] for r in table]
    colors = ["C7"] + ["C2"] * len(base) + ["C0"] * (len(rows) - 1)
    err = [[0.0, 0.0]] * (1 + len(base))
    for r in rows[1:]:
        ci = (r.get("vs_retriever") or {}).get("recall@1") or {}
        d = ci.get("diff")
        err.append([d - ci["ci_low"], ci["ci_high"] - d] if d is not None else [0.0, 0.0])
    ax_r.barh(names, [r["recall@1"] for r in table], color=colors, xerr=list(zip(*err)), capsize=2)
    ax_r.axvline(rows[0]["recall@1"], color="C7", ls="--", lw=0.8)
    ax_r.set_xlabel("Recall@1 (green: baselines; bars: 95% CI vs retriever)")
    ax_r.invert_yaxis()
    lm = rows[1:]
    lm_names = [r["name"] for r in lm]
    ax_v.barh(lm_names, [r.get("valid_rate") or 0.0 for r in lm], color="C1")
    ax_v.set_xlim(0, 1.05)
    ax_v.set_xlabel("valid rankings (share of test users)")
    ax_v.invert_yaxis()
    ax_s.barh(lm_names, [r.get("speedup_vs_ar") or 0.0 for r in lm], color="C4")
    ax_s.axvline(1.0, color="k", lw=0.8)
    sp = summary.get("speed")
    ax_s.set_xlabel("tok/s ÷ AR's (evaluation batches)")
    if sp:
        ax_s.axvline(sp["batch1_speedup"], color="C3", ls="--", lw=1.2)
        ax_s.set_title(f"red: final student at batch 1,\nside by side: {sp['batch1_speedup']:.2f}x AR", fontsize=9)
    ax_s.invert_yaxis()
    for ax in (ax_r, ax_v, ax_s):
        ax.grid(alpha=0.3, axis="x")
    for ax in (ax_v, ax_s):
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(title or "Stage table")
    return _save(fig, path)
