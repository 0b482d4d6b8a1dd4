"""``fp8kit compare``: the BF16 model and each PTQ scheme side by side on held-out text.

An application workflow (beside ``fp8kit.train``): it quantizes with ``fp8kit.jobs.quantize`` (the
``fp8kit quantize`` recipe) and scores with the shared evaluation (``fp8kit.data.evaluation``).

The comparison evaluates, for the BF16 model and each scheme: held-out perplexity, the KL divergence of each
scheme's next-token distribution from the BF16 row's and their top-1 agreement (``evaluation.Divergence``, on
the same held-out tokens; the BF16 row's model stays loaded as the reference), weight memory
(bytes as stored: 2 per BF16 weight, 1 per 8-bit code plus its scales), and prefill / decode time per
token on this machine. The BF16 row runs ``fp8kit.nn.BF16Linear`` (bf16 operands, FP32 accumulation,
emulated at FP32 speed); 8-bit rows run ``QuantLinear`` (exact codes, FP32 accumulation). On CPUs
without FP8/INT8 matrix units these times measure the emulation, not the hardware speed-up.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..data import windows
from ..data.evaluation import Divergence, window_losses, window_summary
from ..data.splits import EVAL_SPLITS, available_windows
from ..export.block_linear import BlockQuantLinear
from ..nn import to_bf16_gemms
from ..ptq.kv_cache import kv_cache_bytes
from ..ptq.linear import QuantLinear
from ..ptq.quantize import quantize
from ..ptq.schemes import CLI_SCHEMES, FP8_BLOCK, KV_SCHEMES, PTQ_SCHEMES
from .quantize import (  # re-exported: the names `fp8kit compare` users and the CLI import from here
    DEFAULT_KEEP_BF16,
    DEFAULT_NORM_TWEAK,
    calibration_for,
    calibration_loop,
    linear_weight_count,
    load_splits,
    ptq_settings,
    quantizable_layers,
    quantize_pretrained,
    settings_text,
)

__all__ = [
    "DEFAULT_KEEP_BF16",
    "DEFAULT_NORM_TWEAK",
    "calibration_for",
    "calibration_loop",
    "compare_markdown",
    "compare_schemes",
    "load_splits",
    "parse_schemes",
    "ptq_settings",
    "quantizable_layers",
    "quantize_pretrained",
    "settings_text",
    "weight_memory",
]


def parse_schemes(spec: str) -> list[str]:
    """``"all"`` or a comma list of ``ptq.schemes.CLI_SCHEMES`` names, the FP8 PTQ ones optionally suffixed ``+kv``
    (FP8 KV cache)."""
    names = (
        [*CLI_SCHEMES, "fp8+kv"] if spec.strip().lower() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    )
    for n in names:
        if n.removesuffix("+kv") not in CLI_SCHEMES:
            raise ValueError(f"unknown scheme {n!r}; accepted: {', '.join(CLI_SCHEMES)} (FP8 ones with +kv), or all")
        if n.endswith("+kv") and n.removesuffix("+kv") not in KV_SCHEMES:
            raise ValueError(f"{n!r}: the FP8 KV cache goes with the FP8 schemes ({', '.join(KV_SCHEMES)})")
    if not names:
        raise ValueError("no scheme given")
    return names


def weight_memory(model: nn.Module) -> dict[str, int]:
    """Bytes of the weights as stored: 8-bit (FP4: packed 4-bit) codes + scales for quantized layers, 2 bytes (BF16) for
    every other parameter (tied tensors counted once). ``linear_bytes`` counts the Linear weights."""
    seen: set[int] = set()
    linear = other = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            linear += m.weight_bytes()
            continue
        if isinstance(m, BlockQuantLinear):  # 1-byte codes and a float32 scale per tile
            linear += m.weight.numel() + 4 * m.weight_scale_inv.numel()
            continue
        for pname, p in m.named_parameters(recurse=False):
            ptr = p.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            if isinstance(m, nn.Linear) and pname == "weight":
                linear += p.numel() * 2
            else:
                other += p.numel() * 2
    return {"linear_bytes": linear, "total_bytes": linear + other}


@torch.no_grad()
def time_per_token(model: nn.Module, prompt: torch.Tensor, new_tokens: int, repeats: int = 2) -> tuple[float, float]:
    """(prefill seconds per prompt token, decode seconds per generated token), best of ``repeats``."""
    model.eval()
    best_p = best_d = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(input_ids=prompt, use_cache=False)
        best_p = min(best_p, (time.perf_counter() - t0) / prompt.numel())
        t0 = time.perf_counter()
        out = model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        total = time.perf_counter() - t0
        assert out.shape[1] == prompt.shape[1] + new_tokens
        best_d = min(best_d, total / new_tokens)
    return best_p, best_d


EVAL_WINDOWS, EVAL_SEQ_LEN = 64, 512  # 32,768 held-out tokens per text


def compare_schemes(
    model_name: str,
    schemes: list[str],
    out: str | Path,
    text: str | None = None,
    split: str = "test",
    n_windows: int = EVAL_WINDOWS,
    seq_len: int = EVAL_SEQ_LEN,
    calib_batches: int = 8,
    calibration: str | None = None,
    alpha: float | str | None = None,
    gptq: bool = True,
    awq: bool = True,
    keep_bf16: int | None = None,
    sensitivity: int = 0,
    smooth: bool | None = None,
    second_text: bool = True,
    timing: bool = True,
    progress: bool = True,
    norm_tweak: int | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Perplexity (mean and spread over ``n_windows`` windows of ``seq_len`` tokens of the ``split`` split,
    on the main text and the second text), weight memory and per-token times of BF16 and each scheme;
    writes ``compare.json``, ``compare.md`` and ``compare.png`` under ``out``. ``timing=False`` skips the
    prefill/decode timing (NaN in the table), for accuracy-only runs on a busy machine.

    The defaults evaluate 64 windows of 512 tokens (32,768 tokens) of the main text, one window per
    2,048-token block of the split, so they cover the whole text; the second text gives as many as its
    split holds (up to ``n_windows``).

    ``keep_bf16 = N``: the N most sensitive layers stay in BF16, ranked by ``quantize`` on calibration
    data (Fisher estimate of the loss increase, one pass with gradients); with ``sensitivity = W`` too,
    ranked instead by the dev-loss increase on W dev windows of the main text (one dev evaluation per
    layer). ``sensitivity`` alone writes that report for each scheme. Nothing ranks on the test split."""
    from ..runtime.device import work_dtype
    from ..runtime.progress import counting
    from .loading import load_model

    if split not in EVAL_SPLITS:
        raise ValueError(f"unknown split {split!r}; accepted: {', '.join(EVAL_SPLITS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base, tokenizer = load_model(model_name, work_dtype(torch.device(device)), device)  # BF16 on a GPU
    base.eval()
    texts = load_splits(text, tokenizer, second_text)
    evals = _eval_windows(texts, split, n_windows, seq_len)
    loop = calibration_loop(texts[0], calib_batches)
    sens_windows = windows(texts[0].dev, sensitivity, seq_len, texts[0].block) if sensitivity else None
    prompt = windows(texts[0].split(split), 1, min(seq_len, 64), texts[0].block)[:, :-1].to(device)
    settings = (calibration, alpha, smooth, gptq, awq, keep_bf16, norm_tweak)
    rows: dict[str, dict[str, Any]] = {}
    losses: dict[str, dict[str, torch.Tensor]] = {}
    sens_report: dict[str, list[dict[str, Any]]] = {}
    reference: nn.Module | None = None  # the bf16 row's model: KL and top-1 agreement are measured against it
    for name in ["bf16", *schemes]:
        t0 = time.perf_counter()
        model, extra = _quantized_row(base, name, loop, settings, sens_windows, sens_report, progress)
        qtime = time.perf_counter() - t0
        divs = {t: Divergence() for t in evals} if reference is not None else {}
        total = sum(int(w.shape[0]) for w in evals.values())
        with counting(model, total, f"  {name} held-out windows", "window", enabled=progress):
            losses[name] = {
                t: window_losses(model, w, reference=reference, divergence=divs.get(t)) for t, w in evals.items()
            }
        ref = losses["bf16"] if name != "bf16" else None
        rows[name] = _score(model, name, losses[name], ref, prompt, timing) | {"quantize_s": qtime, **extra}
        for t, d in divs.items():
            rows[name]["texts"][t].update(d.summary())
        if divs:
            rows[name].update(
                kl=rows[name]["texts"][texts[0].name]["kl"], top1=rows[name]["texts"][texts[0].name]["top1"]
            )
        if progress:
            _print_row(name, split, rows[name], qtime)
        if name == "bf16":
            reference = model
        del model
    del reference
    _relative_to_bf16(rows)
    result = {
        "model": model_name,
        "corpus": texts[0].name,
        "split": split,
        "texts": {t: {"windows": int(w.shape[0]), "tokens": int(w.shape[0] * seq_len)} for t, w in evals.items()},
        "seq_len": seq_len,
        "eval_tokens": int(evals[texts[0].name].shape[0] * seq_len),
        "calibration": {
            "method": calibration_methods(schemes, calibration),
            "batches": calib_batches,
            "tokens": calib_batches * 4 * 128,
        },
        "sensitivity": sens_report,
        "machine": f"{os.cpu_count()} CPU threads, torch {torch.__version__}",
        "rows": rows,
    }
    _write_compare(out, result)
    return result


def _eval_windows(texts: list, split: str, n_windows: int, seq_len: int) -> dict[str, torch.Tensor]:
    """The evaluation windows of each text's ``split`` (clear error when a split is too short)."""
    evals = {}
    for sp in texts:
        ids = sp.split(split)
        n = min(n_windows, available_windows(ids, seq_len, sp.block))
        if n < 1:
            raise ValueError(
                f"the {split} split of {sp.name} holds {ids.numel()} tokens, too few for windows of {seq_len + 1}: "
                f"give a --seq-len below {max(1, ids.numel() // 2)}, or a longer text"
            )
        evals[sp.name] = windows(ids, n, seq_len, sp.block)
    return evals


def _quantized_row(
    base: nn.Module,
    name: str,
    loop,
    settings: tuple,
    sens_windows: torch.Tensor | None,
    sens_report: dict[str, list[dict[str, Any]]],
    progress: bool,
) -> tuple[nn.Module, dict[str, Any]]:
    """A copy of ``base`` for the row ``name`` (``bf16``: BF16 GEMMs; else quantized with the scheme's
    settings, layers kept in BF16 ranked on dev windows when ``sens_windows``), and the row's settings."""
    from ..ptq.sensitivity import dev_loss, keep_filter, layer_sensitivity

    model = copy.deepcopy(base)
    extra: dict[str, Any] = {}
    if name == "bf16":
        to_bf16_gemms(model)
        return model, extra
    if name == FP8_BLOCK.name:  # no calibration: the largest tile every reader of the fp8-block format loads
        from ..export.serve import block_size_for, quantize_block

        extra["block"] = block_size_for(model, "fp8-block")
        quantize_block(model, block=extra["block"], format="fp8-block")
        return model, extra
    calibration, alpha, smooth, gptq, awq, keep_bf16, norm_tweak = settings
    kw = ptq_settings(name, calibration, alpha, smooth, gptq, awq, keep_bf16, quantizable_layers(base), norm_tweak)
    smoothed = PTQ_SCHEMES[name.removesuffix("+kv")].smooth if kw["smooth"] is None else kw["smooth"]
    extra["settings"] = {**{k: v for k, v in kw.items() if k != "kv_cache"}, "smooth": smoothed}
    n_keep = kw["keep_bf16"]
    if sens_windows is not None:
        kw["keep_bf16"] = 0
        plain = {k: v for k, v in kw.items() if k != "norm_tweak"}  # rank the layers, then tweak once
        ranking = layer_sensitivity(base, name.removesuffix("+kv"), loop, dev_loss(sens_windows), **plain)
        sens_report[name] = [{"layer": s.name, "dev_loss_delta": s.score} for s in ranking]
        if n_keep:
            kw["module_filter"] = keep_filter(ranking, n_keep)
            extra["kept_bf16"] = [s.name for s in ranking[:n_keep]]
    quantize(model, name.removesuffix("+kv"), loop, progress=progress, **kw)
    report = model.ptq_report
    if n_keep and "kept_bf16" not in extra:
        extra["kept_bf16"] = [s.name for s in report.sensitivity[:n_keep]]
    if report.smooth_alpha:
        extra["smooth_alpha"] = report.smooth_alpha
    if report.norm_tweak is not None:
        extra["norm_tweak"] = dataclasses.asdict(report.norm_tweak)
    if "kept_bf16" in extra:
        kept = sum(base.get_submodule(n).weight.numel() for n in extra["kept_bf16"])
        extra["kept_bf16_weight_fraction"] = kept / linear_weight_count(base)
    return model, extra


def _score(
    model: nn.Module,
    name: str,
    losses: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor] | None,
    prompt: torch.Tensor,
    timing: bool,
) -> dict[str, Any]:
    """Perplexity per text (paired against ``ref``, the bf16 row's losses), weight memory, KV-cache bytes
    and per-token times of one row."""
    prefill, decode = time_per_token(model, prompt, new_tokens=16) if timing else (float("nan"), float("nan"))
    mem = weight_memory(model)
    kv_bytes = kv_cache_bytes(model, 4096, 1 if name.endswith("+kv") else 2)
    per_text = {t: window_summary(v, ref[t] if ref is not None else None) for t, v in losses.items()}
    return {
        "ppl": next(iter(per_text.values()))["ppl"],
        "texts": per_text,
        **mem,
        "kv_cache_bytes_4k": kv_bytes,
        "prefill_s_per_token": prefill,
        "decode_s_per_token": decode,
    }


def _print_row(name: str, split: str, row: dict[str, Any], qtime: float) -> None:
    cells = []
    for t, v in row["texts"].items():
        rel = "" if name == "bf16" else f" ({100 * v['ppl_rel']:+.2f}% +- {100 * v['ppl_rel_sem']:.2f})"
        kl = f", KL {v['kl']:.4f}, top-1 {100 * v['top1']:.1f}%" if "kl" in v else ""
        cells.append(f"{t[:24]}: {v['ppl']:.3f} +- {v['ppl_std']:.2f}{rel}{kl}")
    print(
        f"  {name:<18} {split} ppl " + "; ".join(cells) + f"; weights {row['total_bytes'] / 2**20:.1f} MiB; "
        f"decode {1e3 * row['decode_s_per_token']:.1f} ms/tok; quantize {qtime:.1f} s",
        flush=True,
    )


def _relative_to_bf16(rows: dict[str, dict[str, Any]]) -> None:
    ref = rows["bf16"]
    for r in rows.values():
        r["ppl_rel"] = r["ppl"] / ref["ppl"] - 1
        r["memory_ratio"] = r["total_bytes"] / ref["total_bytes"]
        r["linear_memory_ratio"] = r["linear_bytes"] / ref["linear_bytes"]
        r["prefill_ratio"] = r["prefill_s_per_token"] / ref["prefill_s_per_token"]
        r["decode_ratio"] = r["decode_s_per_token"] / ref["decode_s_per_token"]


def calibration_methods(schemes: list[str], calibration: str | None) -> str:
    """How each scheme's static scales are calibrated: ``calibration`` or the scheme's default, and ``none``
    for a scheme with no static scale to calibrate (weight-only, dynamic activations, no ``+kv``); one
    method when every scheme uses the same."""
    methods = {}
    for name in schemes:
        scheme = PTQ_SCHEMES.get(name.removesuffix("+kv"))
        static = name.endswith("+kv") or scheme is not None and scheme.act_strategy in ("tensor", "nvfp4")
        methods[name] = calibration_for(name, calibration) if static else "none"
    if set(methods.values()) == {"none"}:
        return "none (no static scale to calibrate)"
    if len(set(methods.values())) == 1:
        return next(iter(methods.values()))
    return ", ".join(f"{m} ({n})" for n, m in methods.items())


def compare_markdown(result: dict[str, Any]) -> str:
    cal = result["calibration"]
    split = result["split"]
    texts = list(result["texts"])
    opts = ", ".join(k for k in ("gptq", "awq") if cal.get(k)) or "round to nearest"
    lines = [
        f"# fp8kit compare: {result['model']}, {split} split",
        "",
        f"Perplexity over the **{split}** split: "
        + "; ".join(
            f"{t}: {v['windows']} windows of {result['seq_len']} tokens ({v['tokens']:,} tokens)"
            for t, v in result["texts"].items()
        )
        + ". Spread: std over windows; the change vs bf16 is paired per window (mean +- standard error). KL to bf16:"
        " the mean KL(P_bf16 || P_scheme) of the next-token distributions; top-1 agreement: the share of positions"
        " whose most likely next token is the bf16 row's, on the same tokens.",
        "",
        f"Calibration: {cal['method']} over {cal['tokens']:,} tokens of the calibration split "
        + (
            f"(SmoothQuant alpha {cal['smoothquant_alpha']}; weights: {opts}"
            + (f"; {cal['keep_bf16']} most sensitive layers kept in BF16" if cal.get("keep_bf16") else "")
            + ")"
            if "smoothquant_alpha" in cal
            else "(each scheme's settings below)"
        )
        + f". Machine: {result['machine']}. Times are CPU emulation of the 8-bit GEMMs, not hardware FP8/INT8.",
        "",
    ]
    for name, r in result["rows"].items():
        if r.get("settings"):
            lines.append(f"- {name}: {settings_text(r['settings'])}")
        if r.get("block"):
            lines.append(
                f"- {name}: {r['block']}x{r['block']} weight tiles (the largest every reader of the fp8-block format "
                f"loads), activations per 1x{r['block']} group at run time; no calibration"
            )
    if any(r.get("settings") or r.get("block") for r in result["rows"].values()):
        lines.append("")
    head = "| scheme | " + " | ".join(
        f"{t} ({split}) ppl +- std | vs bf16 (+- s.e.) | KL to bf16 (nats/token) | top-1 agreement" for t in texts
    )
    lines += [
        head + " | weights (MiB) | vs bf16 | Linear weights vs bf16 | KV cache @4k tokens (MiB) "
        "| prefill ms/token | decode ms/token | decode vs bf16 |",
        "|---|" + "---|---|---|---|" * len(texts) + "---|---|---|---|---|---|---|",
    ]
    for name, r in result["rows"].items():
        cells = []
        for t in texts:
            v = r["texts"][t]
            rel = "" if name == "bf16" else f"{100 * v['ppl_rel']:+.2f}% (+- {100 * v['ppl_rel_sem']:.2f})"
            div = [f"{v['kl']:.4f}", f"{100 * v['top1']:.2f}%"] if "kl" in v else ["", ""]
            cells += [f"{v['ppl']:.3f} +- {v['ppl_std']:.2f}", rel, *div]
        timed = r["decode_s_per_token"] is not None and math.isfinite(r["decode_s_per_token"])
        times = (
            f"{1e3 * r['prefill_s_per_token']:.2f} | {1e3 * r['decode_s_per_token']:.1f} | {r['decode_ratio']:.2f}x"
            if timed
            else "not timed | not timed | -"
        )
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {r['total_bytes'] / 2**20:.1f} | {r['memory_ratio']:.2f}x | {r['linear_memory_ratio']:.2f}x | "
            f"{r['kv_cache_bytes_4k'] / 2**20:.1f} | {times} |"
        )
    for name, r in result["rows"].items():
        if r.get("kept_bf16"):
            lines += [
                "",
                f"{name}: {len(r['kept_bf16'])} layer{'s' * (len(r['kept_bf16']) != 1)} kept in BF16 "
                f"({100 * r['kept_bf16_weight_fraction']:.1f}% of the quantizable Linear weights): "
                + ", ".join(r["kept_bf16"]),
            ]
    for name, ranking in result.get("sensitivity", {}).items():
        lines += ["", f"Per-layer sensitivity of {name} (dev split, loss increase with only that layer quantized):", ""]
        lines += [f"- {e['layer']}: {e['dev_loss_delta']:+.5f} nats/token" for e in ranking[:8]]
    return "\n".join(lines) + "\n"


def _nan_to_none(x: Any) -> Any:
    """Strict JSON: the times of an untimed run (NaN) are written as null."""
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _write_compare(out: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / "compare.json").write_text(json.dumps(_nan_to_none(result), indent=2))
    (out / "compare.md").write_text(compare_markdown(result))
    names = list(result["rows"])
    rows = [result["rows"][n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [100 * r["ppl_rel"] for r in rows], color="tab:blue")
    axes[0].set_ylabel(f"perplexity change vs bf16 (%), {result['split']} split")
    axes[1].bar(names, [r["total_bytes"] / 2**20 for r in rows], color="tab:green")
    axes[1].set_ylabel("weight memory (MiB)")
    axes[2].bar(names, [1e3 * r["decode_s_per_token"] for r in rows], color="tab:orange")
    axes[2].set_ylabel("decode ms/token (CPU emulation)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"FP8 vs INT8 post-training quantization: {result['model']}")
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=110)
    plt.close(fig)


def announce_cost(args: Any, device: torch.device, schemes: list[str]) -> None:
    """The cost line of a comparison of ``schemes`` (``args``: the command's options): the BF16 model and one quantized copy at a time; per scheme its PTQ passes over the calibration data,
    then every model's held-out windows on two texts (in units of calibration passes)."""
    from .announce import announce_inference, ptq_passes

    calib_tokens = args.calib_batches * 4 * 128
    per_scheme = sum(ptq_passes(args.calib_batches, args.gptq, args.awq, args.norm_tweak).values())
    passes = {f"{s} ptq": per_scheme for s in schemes}
    passes["eval"] = max(1, (len(schemes) + 1) * 2 * args.windows * args.seq_len // calib_tokens)
    announce_inference(
        args, "compare", device, passes, calib_tokens, 8 * args.seq_len, copies=2, second_text=not args.no_second_text,
        quantized_forward=True,
    )  # fmt: skip
