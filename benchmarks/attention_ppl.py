r"""FP8 attention on SmolLM2-135M: held-out perplexity of ``fp8-dynamic`` with and without FP8 attention.

Scores, on the same KJV windows (``--split test`` to report, ``--split dev`` to choose): the BF16 model,
``fp8-dynamic`` (round to nearest, no GPTQ), and ``fp8-dynamic`` + FP8 attention (``fp8kit.nn.attention``:
Q, K, V, P in E4M3), per tensor and per head, with static scales calibrated on the calibration split
(``calibrate_fp8_attention``, max over ``--calib-batches`` x 4 x ``--calib-seq-len`` tokens; P's static scale
``P_STATIC_DEQUANT``, with ``--p448`` also ``1 / 448`` and its one-ulp neighbour), with each call's own scales
(``--dynamic``), in MXFP8 blocks (``--mx``), and with torchao's ``apply_low_precision_attention`` where it
runs (else its error). Prints each perplexity and the paired change per window (mean ± standard error) vs
``fp8-dynamic`` alone and vs BF16. ``--ulp`` also scores ``fp8-dynamic`` with its embeddings moved by one
float32 ulp: the spread FP8 rounding alone gives two equal models. ``--ablate`` also scores the static per-head
model with only Q and K, only V, or only P in E4M3 (the other operands pass through unrounded: an instrument
of this benchmark, not a library setting) and with static Q, K, V scales of ``2 x`` the calibrated amax (one
binade of headroom: nothing clips up to twice the calibration's amax); ``--stats`` prints, per static model,
the fraction of Q, K, V values beyond their static range (clipped to 448) on the scored windows
(``observe_fp8_attention``). ``--hadamard`` also scores static per head with Q and K rotated along the head
dimension first (``AttentionRecipe(hadamard=True)``, not exported). ``--smooth-k`` also scores static per tensor and
per head with each block's keys minus their mean over the calibration tokens (per key/value head and channel,
after RoPE; SageAttention's smoothing: ``softmax(q (k - m)^T) = softmax(q k^T)``, so only the rounding changes; an
instrument of this benchmark). ``--kl`` also prints each model's ``KL(fp8-dynamic || model)`` per token and
top-1 agreement (``data.evaluation.Divergence``; reruns ``fp8-dynamic`` beside each): a figure with far less
spread over windows than the perplexity change, whose floor is what any perturbation of ``fp8-dynamic`` gives
(``--ulp``). ``--per-layer`` and ``--operands`` score the BF16 model instead (KL to BF16, whose floor is far
lower): static per-head FP8 attention one block at a time, or in every block with Q, K, both, or the first keys
(an attention sink's) left unrounded.

    python benchmarks/attention_ppl.py --windows 8 --split dev --p448 --ulp
    python benchmarks/attention_ppl.py --windows 8 --split dev --ablate --stats --kl --ulp --only "per head"
    python benchmarks/attention_ppl.py --windows 4 --split dev --per-layer
    python benchmarks/attention_ppl.py --windows 8 --split dev --operands
    python benchmarks/attention_ppl.py --windows 16
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fp8kit.data import windows
from fp8kit.data.evaluation import Divergence, window_losses, window_summary
from fp8kit.data.splits import available_windows
from fp8kit.jobs.quantize import calibration_loop, load_splits
from fp8kit.models.pretrained import load_pretrained_lm
from fp8kit.nn import attention as fp8_attention_module
from fp8kit.nn.attention import (
    AttentionRecipe,
    attention_states,
    attention_stats,
    calibrate_fp8_attention,
    enable_fp8_attention,
    observe_fp8_attention,
    set_static_scales,
    static_scales,
)
from fp8kit.ptq import quantize


def with_p_dequant(model: torch.nn.Module, dequant: float) -> torch.nn.Module:
    """``model`` (calibrated static FP8 attention) with P's static dequantization multiplier set to ``dequant``."""
    for st in attention_states(model).values():
        kept = static_scales(st)
        set_static_scales(st, {**kept, "p": torch.full_like(kept["p"], dequant)})
    return model


def with_qkv_headroom(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    """``model`` (calibrated static FP8 attention) with its Q, K, V dequantization multipliers times ``factor``."""
    for st in attention_states(model).values():
        kept = static_scales(st)
        set_static_scales(st, {op: d * factor if op != "p" else d for op, d in kept.items()})
    return model


@contextmanager
def unrounded(operands: str, first_keys: int = 0) -> Iterator[None]:
    """Within the block, FP8 attention's E4M3 casts of ``operands`` (letters of ``"qkvp"``) return the scaled
    values unrounded (float32), the others as usual: which operand's rounding costs what; ``first_keys``: also
    the keys of the first positions (an attention sink's). The kernel's inputs Q, K, V are told apart by
    identity; every other E4M3 cast of the forward is P's."""
    mod = fp8_attention_module
    cast, forward = mod._cast, mod._FP8Attention.forward
    names: dict[int, str] = {}

    def cast_or_not(x: torch.Tensor, scale: torch.Tensor, fmt):  # noqa: ANN001 - the kernel's private signature
        name = names.get(id(x), "p")
        if fmt is mod.QKVP_FORMAT and name in operands:
            return x.float() * scale
        out = cast(x, scale, fmt)
        if fmt is mod.QKVP_FORMAT and name == "k" and first_keys:
            out = out.float()
            out[:, :, :first_keys] = x[:, :, :first_keys].float() * scale
        return out

    def named_forward(ctx, q, k, v, *rest):  # noqa: ANN001
        names.clear()
        names.update({id(q): "q", id(k): "k", id(v): "v"})
        return forward(ctx, q, k, v, *rest)

    mod._cast, mod._FP8Attention.forward = cast_or_not, staticmethod(named_forward)
    try:
        yield
    finally:
        mod._cast, mod._FP8Attention.forward = cast, staticmethod(forward)


def smoothed_keys(dyn: torch.nn.Module, gran: str, loop) -> torch.nn.Module:  # noqa: ANN001
    """``dyn`` + static FP8 attention per ``gran`` whose keys lose their calibration mean before the kernel (the
    mean from one pass of ``loop``, the static scales from a second): ``--smooth-k``."""
    model = copy.deepcopy(dyn)
    enable_fp8_attention(model, AttentionRecipe("delayed", gran))
    states = list(attention_states(model).values())
    for st in states:
        st.key_sum, st.key_count = 0.0, 0
    with torch.no_grad():
        loop(model)
    for st in states:
        st.key_mean = st.key_sum / st.key_count
    calibrate_fp8_attention(model, loop)
    return model


def smoothing_kernel(kernel):  # noqa: ANN001, ANN201 - wraps ``nn.attention.fp8_attention``
    """``fp8_attention`` that sums the keys of states collecting them (``key_sum``) and subtracts the mean
    of states that have one (``key_mean``); other states are untouched."""

    def run(q, k, v, state, **kw):  # noqa: ANN001, ANN202
        if getattr(state, "key_mean", None) is not None:
            k = (k.float() - state.key_mean).to(k.dtype)
        elif getattr(state, "key_sum", None) is not None:
            state.key_sum = state.key_sum + k.detach().float().sum(dim=(0, 2), keepdim=True)
            state.key_count += k.shape[0] * k.shape[2]
        return kernel(q, k, v, state, **kw)

    return run


def static_per_head(base: torch.nn.Module, loop) -> torch.nn.Module:  # noqa: ANN001
    """A copy of ``base`` with static per-head FP8 attention in every block, its scales calibrated over ``loop``."""
    model = copy.deepcopy(base)
    enable_fp8_attention(model, AttentionRecipe("delayed", "head"))
    calibrate_fp8_attention(model, loop)
    return model


def per_layer(base: torch.nn.Module, test: torch.Tensor, loop) -> None:  # noqa: ANN001
    """Print ``KL(bf16 || model)`` of ``base`` with static per-head FP8 attention in all blocks, then in each
    block alone (the all-blocks calibration's scales): ``--per-layer``."""
    full = static_per_head(base, loop)
    scales = {name: static_scales(st) for name, st in attention_states(full).items()}
    runs = [("all blocks", full)] + [(name.rsplit(".", 1)[0], None) for name in scales]
    kls = []
    for name, model in runs:
        if model is None:
            model = copy.deepcopy(base)
            enable_fp8_attention(model, AttentionRecipe("delayed", "head"), lambda n, _m, keep=name: n == keep)
            for st_name, st in attention_states(model).items():
                set_static_scales(st, scales[st_name])
        div = Divergence()
        with torch.no_grad():
            window_losses(model, test, reference=base, divergence=div)
        kls.append(div.kl)
        print(f"  BF16 + FP8 attention (static, per head) in {name:28s} KL(bf16 || this) {div.kl:.5f}", flush=True)
    per_block = kls[1:]
    print(
        f"  one block at a time: sum {sum(per_block):.5f} (all blocks {kls[0]:.5f}), largest {max(per_block):.5f} "
        f"({100 * max(per_block) / sum(per_block):.1f}% of the sum)",
        flush=True,
    )


def operand_costs(base: torch.nn.Module, test: torch.Tensor, loop) -> None:  # noqa: ANN001
    """Print ``KL(bf16 || model)`` of ``base`` with static per-head FP8 attention in every block, with all four
    operands rounded and with Q, K, both, or the first key (an attention sink) left unrounded, after BF16's own
    loss: ``--operands``."""
    with torch.no_grad():
        print(f"  BF16 loss {float(window_losses(base, test).mean()):.4f}", flush=True)
    model = static_per_head(base, loop)
    for name, operands, first_keys in (
        ("Q, K, V, P in E4M3", "", 0),
        ("the first key unrounded", "", 1),
        ("the first 4 keys unrounded", "", 4),
        ("Q unrounded", "q", 0),
        ("K unrounded", "k", 0),
        ("Q, K unrounded", "qk", 0),
    ):
        div = Divergence()
        with torch.no_grad(), unrounded(operands, first_keys):
            losses = window_losses(model, test, reference=base, divergence=div)
        print(
            f"  BF16 + FP8 attention (static, per head), {name:28s} KL(bf16 || this) {div.kl:.5f}, "
            f"loss {float(losses.mean()):.4f}",
            flush=True,
        )


def torchao_model(dyn: torch.nn.Module) -> torch.nn.Module | str:
    """``dyn`` with torchao's ``apply_low_precision_attention``, or why it does not run here."""
    try:
        from torchao.prototype.attention import apply_low_precision_attention

        model = copy.deepcopy(dyn)
        model.config.use_cache = False
        return apply_low_precision_attention(model)
    except Exception as err:  # report, do not stop the fp8kit rows
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=16, help="KJV held-out windows")
    p.add_argument(
        "--split", choices=("dev", "test"), default="test", help="held-out windows: dev to choose, test to report"
    )
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-batches", type=int, default=8, help="calibration batches of 4 sequences")
    p.add_argument("--calib-seq-len", type=int, default=128, help="calibration sequence length")
    p.add_argument("--dynamic", action="store_true", help="also score per-call (dynamic) Q, K, V scales")
    p.add_argument("--p448", action="store_true", help="also score P's static scale 1 / 448 and one ulp above")
    p.add_argument("--mx", action="store_true", help="also score MXFP8 attention")
    p.add_argument("--ulp", action="store_true", help="also score fp8-dynamic with embeddings one ulp up")
    p.add_argument(
        "--ablate", action="store_true", help="also score per head with only Q+K, V or P rounded, and 2x Q/K/V headroom"
    )
    p.add_argument("--stats", action="store_true", help="print the static models' Q/K/V saturation on the windows")
    p.add_argument("--hadamard", action="store_true", help="also score static per head with Hadamard-rotated Q, K")
    p.add_argument("--smooth-k", action="store_true", help="also score static scales with mean-subtracted keys")
    p.add_argument("--per-layer", action="store_true", help="only: KL to BF16 of FP8 attention in one block at a time")
    p.add_argument("--operands", action="store_true", help="only: KL to BF16 with Q, K or the first key left unrounded")
    p.add_argument("--kl", action="store_true", help="also print KL(fp8-dynamic || model) and top-1 agreement")
    p.add_argument("--only", default=None, help="score only the FP8 attention settings whose name contains this")
    args = p.parse_args()
    torch.manual_seed(0)
    base, tok = load_pretrained_lm("smollm2")
    base.eval()
    (kjv,) = load_splits(None, tok, False)
    held = kjv.split(args.split)
    n = min(args.windows, available_windows(held, args.seq_len, kjv.block))
    test = windows(held, n, args.seq_len, kjv.block)
    print(f"KJV {args.split}: {test.shape[0]} windows x {args.seq_len} tokens; torch threads {torch.get_num_threads()}")
    if args.per_layer:
        per_layer(base, test, calibration_loop(kjv, args.calib_batches, seq_len=args.calib_seq_len))
        return
    if args.operands:
        operand_costs(base, test, calibration_loop(kjv, args.calib_batches, seq_len=args.calib_seq_len))
        return
    dyn = quantize(copy.deepcopy(base), "fp8-dynamic")
    settings: dict[str, torch.nn.Module] = {"bf16": base, "fp8-dynamic": dyn}
    ablations: dict[str, str] = {}  # setting -> operands left unrounded
    if args.ulp:
        nudged = copy.deepcopy(dyn)
        emb = nudged.get_input_embeddings().weight
        with torch.no_grad():
            emb.copy_(torch.nextafter(emb, torch.full_like(emb, float("inf"))))
        settings["fp8-dynamic, embeddings + 1 ulp"] = nudged
    for scales, scaling in (("dynamic", "current"), ("static", "delayed")):
        if scales == "dynamic" and not args.dynamic:
            continue
        for gran in ("tensor", "head"):
            model = copy.deepcopy(dyn)
            enable_fp8_attention(model, AttentionRecipe(scaling, gran))
            if scaling == "delayed":
                calibrate_fp8_attention(model, calibration_loop(kjv, args.calib_batches, seq_len=args.calib_seq_len))
                if args.p448:
                    d448 = torch.tensor(1 / 448, dtype=torch.float32)
                    settings[f"+ FP8 attention, static, per {gran}, P 1/448"] = with_p_dequant(
                        copy.deepcopy(model), float(d448)
                    )
                    if gran == "tensor":  # the multiplier one ulp above 448: 1 / d rounds to 448.00006
                        up = float(torch.nextafter(d448, torch.tensor(0.0)))
                        settings[f"+ FP8 attention, static, per {gran}, P 1/448 - 1 ulp"] = with_p_dequant(
                            copy.deepcopy(model), up
                        )
            settings[f"+ FP8 attention, {scales}, per {gran}"] = model
            if scaling == "delayed" and gran == "head" and args.hadamard:
                rotated = copy.deepcopy(dyn)
                enable_fp8_attention(rotated, AttentionRecipe(scaling, gran, hadamard=True))
                calibrate_fp8_attention(rotated, calibration_loop(kjv, args.calib_batches, seq_len=args.calib_seq_len))
                settings["+ FP8 attention, static, per head, Hadamard Q, K"] = rotated
            if scaling == "delayed" and gran == "head" and args.ablate:
                settings["+ FP8 attention, static, per head, 2x Q/K/V headroom"] = with_qkv_headroom(
                    copy.deepcopy(model), 2.0
                )
                for kept, unrounded_ops in (("Q, K", "vp"), ("V", "qkp"), ("P", "qkv")):
                    settings[f"+ FP8 attention, static, per head, only {kept} in E4M3"] = model
                    ablations[f"+ FP8 attention, static, per head, only {kept} in E4M3"] = unrounded_ops
    if args.smooth_k:
        fp8_attention_module.fp8_attention = smoothing_kernel(fp8_attention_module.fp8_attention)
        for gran in ("tensor", "head"):
            loop = calibration_loop(kjv, args.calib_batches, seq_len=args.calib_seq_len)
            settings[f"+ FP8 attention, static, per {gran}, keys minus their mean"] = smoothed_keys(dyn, gran, loop)
    if args.mx:
        mx = copy.deepcopy(dyn)
        enable_fp8_attention(mx, "mxfp8")
        settings["+ FP8 attention, MXFP8 blocks"] = mx
    ao = torchao_model(dyn)
    if isinstance(ao, str):
        print(f"torchao apply_low_precision_attention did not run on this CPU: {ao}")
    else:
        settings["+ torchao apply_low_precision_attention"] = ao
    if args.only:
        settings = {k: v for k, v in settings.items() if k in ("bf16", "fp8-dynamic") or args.only in k}
    losses = {}
    for name, model in settings.items():
        t = time.perf_counter()
        stats = args.stats and "static" in name and name not in ablations
        div = Divergence() if args.kl and name not in ("bf16", "fp8-dynamic") else None
        kw = {"reference": dyn, "divergence": div} if div is not None else {}
        with torch.no_grad(), unrounded(ablations.get(name, "")):
            if stats:
                with observe_fp8_attention(model) as states:
                    losses[name] = window_losses(model, test, **kw)
            else:
                losses[name] = window_losses(model, test, **kw)
        s = window_summary(losses[name], losses.get("fp8-dynamic"))
        vs_bf16 = window_summary(losses[name], losses["bf16"])["ppl_rel"]
        vs_dyn = f"{100 * s['ppl_rel']:+.2f}% ± {100 * s['ppl_rel_sem']:.2f}" if "ppl_rel" in s else "—"
        print(
            f"{name:44s} ppl {s['ppl']:.3f}  vs bf16 {100 * vs_bf16:+.2f}%  vs fp8-dynamic {vs_dyn}  "
            f"({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
        if div is not None:
            print(f"    KL(fp8-dynamic || this) {div.kl:.4f} nats/token, top-1 agreement {div.top1:.4f}", flush=True)
        if stats:
            rows = attention_stats(states)
            sat = {op: max(r["saturated"] for r in rows if r["operand"] == op) for op in ("Q", "K", "V")}
            clipped = {op: sum(r["saturated"] > 0 for r in rows if r["operand"] == op) for op in ("Q", "K", "V")}
            print(
                "    clipped at 448 (largest fraction of a call; blocks with any): "
                + ", ".join(f"{op} {sat[op]:.1e} ({clipped[op]}/{len(states)})" for op in sat),
                flush=True,
            )


if __name__ == "__main__":
    main()
