"""Every causal-LM architecture of transformers' auto mapping, built tiny from its config class, through fp8kit.

``tiny_config(model_type)`` shrinks the config class's defaults by rule, not by hand: every size-like field it
knows (hidden size, layers, heads, experts, vocabulary, positions, ...) is scaled down wherever the config has
it, in sub-configs too, and per-layer lists are cut to the new layer count. ``sweep_one`` runs one architecture
through ``fp8kit.convert`` + one training step and ``ptq.quantize`` + ``export.save_pretrained`` + reload by
fp8kit and by transformers, and returns a ``Row``; ``table`` prints the rows. Used by
``tests/integrations/test_arch_sweep.py`` (one scheme) and ``benchmarks/arch_sweep.py`` (all of them).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB, EXPERTS = 64, 4, 2, 16, 2, 256, 4
SEQ = 8

# field name -> the tiny value (applied wherever a config, or one of its sub-configs, has the field)
_SIZES: dict[str, int] = {
    **dict.fromkeys(
        ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "model_dim", "word_embed_proj_dim"), HIDDEN
    ),
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers"), LAYERS
    ),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads", "encoder_attention_heads"),
        HEADS,
    ),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("head_dim", "attention_head_size", "kv_channels", "v_head_dim", "qk_nope_head_dim"), HEAD_DIM),
    **dict.fromkeys(("qk_rope_head_dim", "rotary_dim"), HEAD_DIM // 2),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 32),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "n_inner",
            "d_ff",
            "ffn_hidden_size",
            "decoder_ffn_dim",
            "encoder_ffn_dim",
            "intermediate_size_mlp",
        ),
        2 * HIDDEN,
    ),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size"), HIDDEN),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_topk", "top_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    **dict.fromkeys(("vocab_size",), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"), 128),
    **dict.fromkeys(("sliding_window", "attention_window"), 16),
}
_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id")


def widen_heads(head_dim: int) -> None:
    """Build later tiny configs with ``head_dim`` (hidden ``HEADS * head_dim``, the MLPs in proportion): serving
    engines' attention kernels take only some head sizes (vLLM's CPU build: not 16)."""
    hidden = HEADS * head_dim
    lengths = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "sliding_window")
    for key, value in list(_SIZES.items()):
        if key in lengths or key == "attention_window":
            continue
        if value == HEAD_DIM:
            _SIZES[key] = head_dim
        elif value == HEAD_DIM // 2:
            _SIZES[key] = head_dim // 2
        elif value == HIDDEN:
            _SIZES[key] = hidden
        elif value == 2 * HIDDEN:
            _SIZES[key] = 2 * hidden


def causal_lm_types() -> list[str]:
    """Every model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink(values: dict, layers_before: int | None) -> dict:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            inner = value.get("num_hidden_layers")
            out[key] = _shrink(value, inner if isinstance(inner, int) else layers_before)
        elif key in _SIZES and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = min(value, _SIZES[key]) if key not in ("num_hidden_layers", "n_layer", "num_layers") else LAYERS
        elif key in _TOKENS and isinstance(value, int) and value >= VOCAB:
            out[key] = VOCAB - 1 - _TOKENS.index(key)
        elif key in _TOKENS and isinstance(value, list):
            out[key] = [t if t < VOCAB else VOCAB - 1 for t in value if isinstance(t, int)] or None
        elif isinstance(value, list) and layers_before and len(value) == layers_before and layers_before > LAYERS:
            out[key] = value[:LAYERS]
        else:
            out[key] = value
    return out


def tiny_config(model_type: str):
    """The config class of ``model_type`` with its defaults shrunk (module doc)."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    values = base.to_dict()
    layers = next(
        (values[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(values.get(k), int)), None
    )
    values = _shrink(values, layers)
    values.pop("model_type", None)
    values.pop("transformers_version", None)
    config = type(base)(**values)
    for name in ("use_cache",):
        if hasattr(config, name):
            setattr(config, name, False)
    return config


@contextlib.contextmanager
def quiet():
    """Silence transformers' and fp8kit's chatter (warnings, progress bars, load reports) inside a sweep."""
    loggers = [logging.getLogger(n) for n in ("transformers", "fp8kit", "fp8kit.ptq", "accelerate")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


def build(model_type: str):
    """``(model, input_ids)`` of a tiny float32 model of ``model_type`` that runs a forward, or ``(None, reason)``."""
    from transformers import AutoModelForCausalLM

    try:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        vocab = model.get_input_embeddings().weight.shape[0]
        ids = torch.randint(3, min(vocab, VOCAB) - 8, (1, SEQ), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        if not torch.isfinite(logits).all():
            return None, "non-finite logits from the float model"
        return model, ids
    except Exception as err:  # transformers cannot build or run it tiny on CPU
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean().clamp_min(1e-30))


@dataclass
class Row:
    """One architecture's results: ``ok`` / a reason per stage, and the figures."""

    model_type: str
    scheme: str = "fp8-dynamic"
    built: bool = True
    convert: str = ""
    ptq: str = ""
    export: str = ""
    fp8kit_reload: str = ""
    transformers_reload: str = ""
    converted: int = 0
    quantized: int = 0
    err_ptq: float = float("nan")  # fp8kit's quantized logits vs the float model's (relative MSE)
    err_hf: float = float("nan")  # transformers' reload vs fp8kit's quantized logits
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def failures(self) -> dict[str, str]:
        stages = ("convert", "ptq", "export", "fp8kit_reload", "transformers_reload")
        return {s: getattr(self, s) for s in stages if not getattr(self, s).startswith(("ok", "refused"))}


def _linear_like_unaccounted(model: nn.Module) -> list[str]:
    """Linear-like layers (``nn.Linear``, ``Conv1D``, experts) neither converted nor reported with a reason."""
    from fp8kit.nn.experts import is_experts_module
    from fp8kit.nn.linear import Linear
    from fp8kit.nn.linear_like import is_linear_like

    report = model.fp8_conversion_report
    done = set(report.converted) | set(report.skipped)
    out = []
    for name, m in model.named_modules():
        if isinstance(m, Linear) or name in done or type(m).__module__.startswith("fp8kit."):
            continue
        if is_linear_like(m) or is_experts_module(m):
            if not any(name.startswith(f"{d}.") for d in done):
                out.append(name)
    return out


def _convert_step(model: nn.Module, ids: torch.Tensor, row: Row) -> None:
    import fp8kit

    model = copy.deepcopy(model).train()
    fp8kit.convert(model, "current")
    row.converted = len(model.fp8_conversion_report.converted)
    missing = _linear_like_unaccounted(model)
    if missing:
        row.convert = f"unreported layers: {', '.join(missing[:3])}"
        return
    logits = model(input_ids=ids).logits  # next-token loss computed here: some models' own `labels` need more inputs
    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    if not torch.isfinite(loss) or not grads or not all(torch.isfinite(g).all() for g in grads):
        row.convert = f"loss {float(loss):.3g} or gradients not finite"
        return
    row.convert = "ok"


def _reload_tolerance(err_ptq: float) -> float:
    """transformers' reload vs fp8kit's quantized logits: within the quantization error itself (twice, plus
    float noise): a reader that dequantizes (no activation quantization) differs by at most about that much,
    while one that loads codes as values or leaves weights at random is orders of magnitude away."""
    return 2 * err_ptq + 1e-6


def _ptq_export_reload(model: nn.Module, ids: torch.Tensor, row: Row, scheme: str, where: Path) -> None:
    from fp8kit import ptq
    from fp8kit.export import load_pretrained, save_pretrained
    from fp8kit.export.compressed_tensors import TRANSFORMERS_REFUSAL

    with torch.no_grad():
        ref = model(input_ids=ids).logits
    try:
        q = ptq.quantize(copy.deepcopy(model), scheme, lambda m: m(input_ids=ids))
        with torch.no_grad():
            ours = q(input_ids=ids).logits
    except Exception as err:
        row.ptq = f"{type(err).__name__}: {str(err)[:120]}"
        return
    row.quantized = len(q.ptq_report.quantized) + len(q.ptq_report.experts)
    row.err_ptq = _rel(ours, ref)
    row.ptq = "ok" if torch.isfinite(ours).all() else "non-finite logits"
    try:
        out = save_pretrained(q, where, overwrite=True)
    except Exception as err:
        row.export = f"{type(err).__name__}: {str(err)[:120]}"
        return
    row.export = "ok"
    try:
        with torch.no_grad():
            mine = load_pretrained(out)(input_ids=ids).logits
        err = _rel(mine, ours)
        row.fp8kit_reload = "ok" if err <= 1e-6 else f"logits {err:.2e} from fp8kit's quantized model"
    except Exception as exc:
        row.fp8kit_reload = f"{type(exc).__name__}: {str(exc)[:120]}"
    try:
        # the class transformers built; compressed-tensors decompresses FP4 on CPU to bfloat16 only
        dtype = torch.bfloat16 if "fp4" in scheme else torch.float32
        hf = type(model).from_pretrained(out, dtype=dtype).eval()
        with torch.no_grad():
            theirs = hf(input_ids=ids).logits
        row.err_hf = _rel(theirs, ours)
        tol = _reload_tolerance(row.err_ptq)
        row.transformers_reload = "ok" if row.err_hf <= tol else f"loads wrong: logits {row.err_hf:.2e} > {tol:.1e}"
    except Exception as exc:
        if TRANSFORMERS_REFUSAL in str(exc):
            row.transformers_reload = "refused (layout it would load wrong)"
        else:
            row.transformers_reload = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def sweep_one(model_type: str, where: Path, scheme: str = "fp8-dynamic") -> Row:
    """Run ``model_type`` through convert + one training step and PTQ + export + both reloads (module doc)."""
    return sweep(model_type, where, (scheme,))[0]


def sweep(model_type: str, where: Path, schemes: tuple[str, ...]) -> list[Row]:
    """``sweep_one`` for several PTQ schemes: one build and one convert step, one ``Row`` per scheme."""
    start = time.perf_counter()
    rows = [Row(model_type, scheme=s) for s in schemes]
    with quiet():
        model, ids = build(model_type)
        if model is None:
            for row in rows:
                row.built, row.notes = False, [ids]
            return rows
        try:
            _convert_step(model, ids, rows[0])
        except Exception as err:
            rows[0].convert = f"{type(err).__name__}: {str(err)[:120]}"
        for row in rows:
            row.convert, row.converted = rows[0].convert, rows[0].converted
            _ptq_export_reload(model, ids, row, row.scheme, where / f"{model_type}-{row.scheme}")
    for row in rows:
        row.seconds = (time.perf_counter() - start) / len(rows)
    return rows


def table(rows: list[Row]) -> str:
    """A Markdown table of the built architectures, and one line listing those transformers could not build."""

    def cell(s: str) -> str:
        return "ok" if s == "ok" else ("refused" if s.startswith("refused") else "FAIL")

    lines = [
        "| architecture | convert + step | PTQ | export | reload fp8kit | reload transformers | err PTQ | err HF |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.built:
            lines.append(
                f"| {r.model_type} | {cell(r.convert)} ({r.converted}) | {cell(r.ptq)} ({r.quantized}) | "
                f"{cell(r.export)} | {cell(r.fp8kit_reload)} | {cell(r.transformers_reload)} | "
                f"{r.err_ptq:.1e} | {r.err_hf:.1e} |"
            )
    unbuilt = [r.model_type for r in rows if not r.built]
    lines.append(f"\nnot built tiny on CPU by transformers ({len(unbuilt)}): {', '.join(unbuilt)}")
    return "\n".join(lines)
