"""The doctor's self-contained report: Markdown with PNG plots, plus JSON and the raw statistics."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .doctor import DoctorReport

__all__ = ["report_markdown", "write_report"]


def report_markdown(rep: DoctorReport) -> str:
    status = "healthy" if rep.healthy else f"problem: **{rep.kind}**" if rep.kind != "none" else "anomalies found"
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
    if rep.culprits:
        lines += [
            "## Culprits (most suspect first)",
            "",
            "| layer | operand | first step | what happened |",
            "|---|---|---|---|",
        ]
        lines += [f"| `{c.layer}` | {c.operand} | {c.step} | {c.reason} |" for c in rep.culprits[:15]]
        lines.append("")
    if rep.recommendations:
        lines += ["## Recommendations (ranked)", ""]
        lines += [f"{i}. {r.action}. *Why:* {r.why}." for i, r in enumerate(rep.recommendations, 1)]
        lines.append("")
    if rep.applied:
        a = rep.applied
        lines += [
            "## Top fix applied",
            "",
            f"{a['fix']}: final gap to BF16 {100 * a['gap_before']:+.2f}% -> {100 * a['gap_after']:+.2f}%; "
            f"after: {a['summary_after']} ({len(a['culprits_after'])} culprits).",
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


def _matrix(rep: DoctorReport, operand: str, key: str) -> tuple[list[str], list[list[float]]]:
    layers = list(rep.layer_error)
    grid = {(r["layer"], r["step"]): r[key] for r in rep.stats if r["recipe"] == "actual" and r["operand"] == operand}
    rows = [[grid.get((layer, s), math.nan) for s in range(rep.steps)] for layer in layers]
    return layers, rows


def write_report(rep: DoctorReport, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PermissionError(f"cannot write the doctor report to {out}: {err.strerror or err}") from err
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(rep.losses["bf16"], label="bf16", color="black", lw=2)
    ax.plot(rep.losses["fp8"], label=f"fp8 ({rep.recipe})")
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
        layers, rows = _matrix(rep, operand, key)
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

    tmp = out / ".report.md.tmp"
    tmp.write_text(report_markdown(rep))
    os.replace(tmp, out / "report.md")
    (out / "report.json").write_text(json.dumps(rep.to_dict(), indent=2, default=str))
    with open(out / "fp8_stats.jsonl", "w") as f:
        for r in rep.stats:
            f.write(json.dumps(r) + "\n")
    return out / "report.md"
