"""The doctor's self-contained report: Markdown with PNG plots, plus JSON and the raw statistics.

This module takes the doctor's result as data (``DoctorReport.to_dict()``: plain dicts and lists, as in
``report.json``) and never imports the doctor, so the two stay one-way: ``doctor`` -> ``report``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["report_markdown", "write_report"]


def _view(result: Mapping[str, Any]) -> SimpleNamespace:
    """Attribute access over the result dict (culprits and recommendations as namespaces too)."""
    rep = SimpleNamespace(**result)
    rep.culprits = [SimpleNamespace(**c) for c in result.get("culprits", [])]
    rep.recommendations = [SimpleNamespace(**r) for r in result.get("recommendations", [])]
    rep.notes = [SimpleNamespace(**c) for c in result.get("notes", [])]
    rep.trends = [SimpleNamespace(**t) for t in result.get("trends", [])]
    return rep


def report_markdown(result: Mapping[str, Any], stats: Sequence[Mapping[str, Any]] = ()) -> str:
    """Markdown of a doctor result (``DoctorReport.to_dict()``); with the per-layer ``stats``, the MoE
    experts' per-expert figures of the last step too."""
    rep = _view(result)
    status = (
        "healthy"
        if rep.healthy
        else "latent"
        if rep.kind == "latent"
        else f"problem: **{rep.kind}**"
        if rep.kind != "none"
        else "anomalies found"
    )
    lines = [
        f"# fp8kit doctor: {status}",
        "",
        f"FP8 recipe `{rep.recipe}` vs BF16, {rep.steps} steps from the same weights and batches.",
        "",
        f"**Diagnosis:** {rep.summary}.",
        "",
    ]
    if rep.first_nonfinite:
        f = rep.first_nonfinite
        lines += [f"**First non-finite value:** {f['operand']} of `{f['layer']}` at step {f['step']}.", ""]
    culprits = (
        "Latent findings (no loss effect yet: an operand past a threshold for most of the run, or a signal "
        "growing toward saturation)"
        if rep.kind == "latent"
        else "Culprits (most suspect first: dB past a threshold, summed over the steps past it)"
    )
    for title, rows in (
        (culprits, rep.culprits),
        ("Notes (departures without a loss effect, or at the edge of a threshold)", rep.notes),
    ):
        if rows:
            lines += [f"## {title}", "", _TABLE_HEAD, "|---|---|---|---|---|---|"]
            lines += [_row(c) for c in rows[:15]]
            lines.append("")
    if rep.recommendations:
        lines += ["## Recommendations (ranked)", ""]
        lines += [f"{i}. {r.action}. *Why:* {r.why}." for i, r in enumerate(rep.recommendations, 1)]
        lines.append("")
    lines += _trends_table(rep.trends)
    lines += _experts_table(stats)
    if rep.applied:
        a = rep.applied
        lines += [
            "## Top fix applied",
            "",
            f"{a['fix']}: final gap to BF16 {100 * a['gap_before']:+.2f}% -> {100 * a['gap_after']:+.2f}%; "
            f"after: {a['summary_after']} ({len(a['culprits_after'])} "
            f"{'latent findings' if a.get('kind_after') == 'latent' else 'culprits'}).",
            "",
        ]
    lines += [
        "## Plots",
        "",
        "![losses](loss.png)",
        "",
        "Per-layer numerics of the FP8 run (rows: layers in execution order; columns: steps):",
        "",
        "![heatmaps](heatmaps.png)",
        "",
    ]
    return "\n".join(lines)


_TABLE_HEAD = "| layer | operand | first step | steps past | score (dB x steps) | what happened |"


def _trends_table(trends: list[SimpleNamespace]) -> list[str]:
    """The growing early-warning signals (``debug.trends``), most urgent first."""
    if not trends:
        return []
    out = [
        "## Early warning (growing signals)",
        "",
        "| layer | signal | warns from step | x per step | projected saturation step | trend |",
        "|---|---|---|---|---|---|",
    ]
    for t in trends:
        at = "-" if t.projected_step is None else str(t.projected_step)
        out.append(f"| `{t.layer}` | {t.signal} | {t.step} | {t.growth_per_step:.2f} | {at} | {t.reason} |")
    return [*out, ""]


EXPERT_ROWS = 20  # experts' readings listed (lowest SQNR first)


def _experts_table(stats: Sequence[Mapping[str, Any]]) -> list[str]:
    """The last step's per-expert readings (records with ``tokens_routed``), lowest SQNR first."""
    rows = [r for r in stats if r.get("recipe") == "actual" and "tokens_routed" in r]
    if not rows:
        return []
    last = max(r["step"] for r in rows)
    rows = sorted((r for r in rows if r["step"] == last), key=lambda r: _sort_key(r["sqnr_db"]))
    out = [
        f"## MoE experts at step {last} ({min(len(rows), EXPERT_ROWS)} of {len(rows)} readings, lowest SQNR first)",
        "",
        "| expert | operand | tokens routed | amax | underflow % | saturation % | SQNR (dB) |",
        "|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| `{r['layer']}` | {r['operand']} | {int(r['tokens_routed'])} | {r['amax']:.3g} | {r['underflow_pct']:.2f} "
        f"| {r['saturation_pct']:.2f} | {r['sqnr_db']:.1f} |"
        for r in rows[:EXPERT_ROWS]
    ]
    return [*out, ""]


def _sort_key(sqnr: float) -> float:
    return sqnr if sqnr == sqnr else math.inf  # NaN (an expert no token reached) last


def _row(c: SimpleNamespace) -> str:
    return f"| `{c.layer}` | {c.operand} | {c.step} | {c.steps} | {c.score:.1f} | {c.reason} |"


def _matrix(
    rep: SimpleNamespace, stats: Sequence[Mapping[str, Any]], operand: str, key: str
) -> tuple[list[str], list[list[float]]]:
    layers = list(rep.layer_error)
    grid = {(r["layer"], r["step"]): r[key] for r in stats if r["recipe"] == "actual" and r["operand"] == operand}
    rows = [[grid.get((layer, s), math.nan) for s in range(rep.steps)] for layer in layers]
    return layers, rows


def write_report(result: Mapping[str, Any], stats: Sequence[Mapping[str, Any]], out: Path) -> Path:
    """Write ``report.md``, ``loss.png``, ``heatmaps.png``, ``report.json`` and ``fp8_stats.jsonl`` to ``out``.

    ``result`` is ``DoctorReport.to_dict()``; ``stats`` the per-layer records (``DoctorReport.stats``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PermissionError(f"cannot write the doctor report to {out}: {err.strerror or err}") from err
    rep = _view(result)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(rep.losses["bf16"], label="bf16", color="black", lw=2)
    ax.plot(rep.losses["fp8"], label=f"fp8 ({rep.recipe})")
    if "bf16_nudged" in rep.losses:
        ax.plot(rep.losses["bf16_nudged"], label="bf16, one layer one ulp off", color="grey", ls=":")
    if rep.applied:
        ax.plot(rep.applied["losses_after"]["fp8"], label="fp8 after the top fix", ls="--")
    for c in rep.culprits[:1]:
        ax.axvline(c.step, color="red", alpha=0.4, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)

    panels = [
        ("input", "sqnr_db", "input SQNR (dB)"),
        ("grad", "sqnr_db", "grad SQNR (dB)"),
        ("input", "saturation_pct", "input saturation (%)"),
        ("input", "underflow_pct", "input underflow (%)"),
    ]
    fig, axes = plt.subplots(1, 5, figsize=(22, max(3, 0.3 * len(rep.layer_error) + 1.5)))
    for ax, (operand, key, title) in zip(axes, panels, strict=False):
        layers, rows = _matrix(rep, stats, operand, key)
        im = ax.imshow(np.array(rows, dtype=float), aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_title(title)
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        ax.set_xlabel("step")
        fig.colorbar(im, ax=ax)
    err = np.array([[v if math.isfinite(v) else np.nan for v in rep.layer_error[n]] for n in rep.layer_error])
    im = axes[4].imshow(np.log10(np.maximum(err, 1e-8)), aspect="auto", interpolation="nearest", cmap="magma")
    axes[4].set_title("log10 output error FP8 vs BF16")
    axes[4].set_yticks(range(len(rep.layer_error)), list(rep.layer_error), fontsize=7)
    fig.colorbar(im, ax=axes[4])
    fig.tight_layout()
    fig.savefig(out / "heatmaps.png", dpi=90)
    plt.close(fig)

    _write_text(out / "report.md", report_markdown(result, stats))
    _write_text(out / "report.json", json.dumps(dict(result), indent=2, default=str))
    _write_text(out / "fp8_stats.jsonl", "".join(json.dumps(r) + "\n" for r in stats))
    return out / "report.md"


def _write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, then rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
