"""The run folder's reports: ``summary.json``, ``summary.md`` and ``loss.png``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def summary_markdown(summary: dict[str, Any]) -> str:
    runs = summary["runs"]
    lines = [
        f"# fp8kit train: {summary['model']} {_arch_name(summary)} ({summary['params'] / 1e6:.2f}M parameters) "
        f"on {summary['corpus']}",
        "",
        f"Unigram entropy of the corpus: {summary['unigram_entropy']:.3f} nats/token (a model that learns nothing).",
        "",
        f"Optimizer of the FP8 runs: {_optimizer_line(summary.get('config', {}))}; the bf16 run uses torch AdamW "
        "with FP32 parameters.",
        "",
        "Memory (MiB): *persistent* = weights + gradients + optimizer state + master weights (+ FP8 weight "
        "copies held at the end), *activations* = what one micro-batch saves for backward.",
        "",
        "| run | train loss | val loss | val ppl (step 0 → end) | gap to bf16 | tokens/s | persistent | activations |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        gap = f"{100 * r['rel_gap']:+.2f}%" if "rel_gap" in r else "—"
        before = r.get("val_ppl_before", float("nan"))
        ppl = f"{before:.3f} → {r['val_ppl']:.3f}" if before == before else f"{r['val_ppl']:.3f}"
        lines.append(
            f"| {name} | {r['train_loss']:.4f} | {r['val_loss']:.4f} | {ppl} | {gap} | "
            f"{r['tokens_per_s']:,.0f} | {_memory_cells(r)} |"
        )
    return "\n".join(lines + _device_lines(summary) + _router_lines(runs)) + "\n"


def _device_lines(summary: dict[str, Any]) -> list[str]:
    """The device the runs ran on, what runs native there, the CUDA allocator's peak per run and the GEMMs
    that fell back to dequantized operands."""
    dev = summary.get("device")
    if not dev:
        return []
    cap = dev.get("capability")
    sm = f", SM{cap[0]}{cap[1]}" if cap else ""
    native = ", ".join(dev.get("native") or []) or "none (emulated)"
    lines = ["", f"Device: {dev['device']} ({dev['name']}{sm}); native FP8 GEMMs: {native}."]
    peaks = [
        f"{n} {r['memory']['cuda_peak'] / 2**30:.2f}"
        for n, r in summary["runs"].items()
        if "cuda_peak" in r.get("memory", {})
    ]
    if peaks:
        lines.append(f"torch.cuda.max_memory_allocated per run (GiB): {', '.join(peaks)}.")
    for kind, reason in (summary.get("gemm_fallbacks") or {}).items():
        lines.append(f"GEMM fallback: {kind} ran on dequantized BF16 operands ({reason}).")
    return lines


def _arch_name(summary: dict[str, Any]) -> str:
    return "Qwen3-MoE" if summary.get("arch") == "moe" else "Llama"


def _router_lines(runs: dict[str, Any]) -> list[str]:
    """The MoE runs' router load balance (``train/load_balance.py``), one row per run."""
    rows = [(name, r["router"], r.get("router_train") or {}) for name, r in runs.items() if r.get("router")]
    if not rows:
        return []
    layers = len(rows[0][1]["layers"])
    lines = [
        "",
        "Router load balance of the final model on the validation batches (the same tokens in every run); "
        "load = tokens routed to an expert, max/mean 1.00 = balanced. Train loss = cross-entropy + "
        "router_aux_loss_coef x aux loss; val loss is cross-entropy alone.",
        "",
        "| run | aux loss (val) | aux loss (train, last window) | max/mean load per layer | CV of loads per layer "
        "| idle experts |",
        "|---|---|---|---|---|---|",
    ]
    for name, val, train in rows:
        worst = " ".join(f"{layer['max_over_mean']:.2f}" for layer in val["layers"])
        cv = " ".join(f"{layer['cv']:.2f}" for layer in val["layers"])
        aux_train = f"{train['aux_loss']:.4f}" if train else "—"
        lines.append(f"| {name} | {val['aux_loss']:.4f} | {aux_train} | {worst} | {cv} | {val['idle_experts']} |")
    lines.append(f"\n({layers} MoE layers, {len(rows[0][1]['layers'][0]['fractions'])} experts each.)")
    return lines


def _optimizer_line(cfg: dict[str, Any]) -> str:
    opt = cfg.get("optimizer", "adamw")
    name = "fp8kit.optim.AdamW (FP8 moments)" if opt == "fp8-adamw" else "torch AdamW"
    return f"{name}, {cfg.get('master_weights', 'fp32').upper()} parameters"


def _memory_cells(r: dict[str, Any]) -> str:
    """``persistent | activations`` in MiB (older summaries hold only a total)."""
    mem = r.get("memory")
    if not mem:
        return f"{r['peak_mem_bytes'] / 2**20:.1f} (total) | —"
    persistent = sum(v for k, v in mem.items() if k not in ("activations", "total", "cuda_peak"))
    return f"{persistent / 2**20:.1f} | {mem['activations'] / 2**20:.1f}"


def plot_losses(path: Path, records: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if "loss" not in r:  # the step-0 held-out evaluation
            continue
        by_run.setdefault(r["run"], []).append(r)

    def smooth(vals: list[float], k: int = 10) -> list[float]:
        out, acc = [], []
        for v in vals:
            acc.append(v)
            acc = acc[-k:]
            out.append(sum(acc) / len(acc))
        return out

    fig, (ax, gap) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    base = by_run.get("bf16", [])
    base_s = dict(zip([r["step"] for r in base], smooth([r["loss"] for r in base]), strict=True))
    for run, recs in by_run.items():
        steps = [r["step"] for r in recs]
        s = smooth([r["loss"] for r in recs])
        ax.plot(steps, s, label=run, lw=2.2 if run == "bf16" else 1.3, color="black" if run == "bf16" else None)
        if run != "bf16" and base_s:
            pairs = [(st, 100 * (v - base_s[st]) / base_s[st]) for st, v in zip(steps, s, strict=True) if st in base_s]
            if pairs:
                gap.plot(*zip(*pairs, strict=True), label=run)
    ax.set_ylabel("training loss (nats/token, 10-step mean)")
    ax.set_title("FP8 recipes vs BF16: same weights, batches and seed")
    ax.legend()
    ax.grid(alpha=0.3)
    gap.axhline(0, color="black", lw=1)
    gap.set_ylabel("gap to bf16 (%)")
    gap.set_xlabel("step")
    gap.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_reports(out: Path, summary: dict[str, Any], records: list[dict[str, Any]]) -> None:
    _atomic_write(out / "summary.json", json.dumps(summary, indent=2))
    _atomic_write(out / "summary.md", summary_markdown(summary))
    plot_losses(out / "loss.png", records)
