"""Sequential PTQ: quantize a causal LM one decoder layer at a time, as llm-compressor's sequential pipeline
does, so a model larger than memory quantizes in about one layer's memory.

``quantize_checkpoint(path, scheme, out, forward_loop)`` builds the model's skeleton on the ``meta``
device and captures the first decoder layer's inputs on ``forward_loop``'s batches (only the embeddings are
read, in the checkpoint's dtype; no layer runs). Then, for each decoder layer: its weights are read from
the safetensors shards (``safe_open``, in float32 on ``device``), ``ptq.quantize`` calibrates / smooths /
GPTQs / AWQs it on the captured inputs, its tensors go to the sharded export, the layer runs on the
inputs to give the next layer its inputs, and it is freed. ``propagate="float"`` (the default) runs the
layer before it is quantized, so every layer calibrates on the high-precision model's activations and the
export equals whole-model PTQ's tensor for tensor; ``propagate="quantized"`` runs the quantized layer, so
each layer calibrates (and GPTQ compensates) on the outputs of the quantized layers before it, as
llm-compressor's sequential pipeline does. Tensors outside the decoder layers
(embeddings, final norm, output head) are copied in their checkpoint dtype. The export is written into a
hidden temporary folder renamed at the end (``export.common.export_folder``).

Keeping layers in BF16 by sensitivity (``keep_bf16``) and norm tweaking rank or tune the whole model: they
need a full load (``quantize`` on a loaded model).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..ptq.experts import QuantExperts, find_experts
from ..ptq.layer_error import swap_submodule
from ..ptq.linear import QuantLinear
from ..ptq.quantize import quantize as quantize_module
from ..ptq.report import PTQReport
from ..ptq.schemes import FP8_BLOCK, get_scheme

__all__ = ["Checkpoint", "is_on_meta", "needs_full_load", "quantize_checkpoint", "skeleton"]

FULL_LOAD_OPTIONS = ("keep_bf16", "norm_tweak")  # options that rank or tune the whole model at once
PROPAGATE = ("float", "quantized")  # what gives the next layer its calibration inputs


class Checkpoint:
    """The safetensors weights of a Hugging Face folder, read tensor by tensor (shards opened per read).

    An FP4 checkpoint (``export.fp4_checkpoints``: GPT-OSS MXFP4, compressed-tensors or ModelOpt NVFP4) is read as
    its plain model: ``files`` names the plain tensors, and ``read`` reads the stored tensors each is made from
    and dequantizes them (float32), so a layer's FP4 weights are dequantized when that layer is read."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        from ..export.fp4_checkpoints import fp4_layout

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            stored = {k: self.path / f for k, f in weight_map.items()}
        else:
            stored = {}
            for f in sorted(self.path.glob("*.safetensors")):
                with safe_open(str(f), "pt") as h:
                    stored.update(dict.fromkeys(h.keys(), f))
        if not stored:
            raise ValueError(f"{path} holds no .safetensors weights: sequential PTQ reads safetensors checkpoints")
        self.stored = stored
        self.layout = fp4_layout(self.path)
        self.sources = {k: (k,) for k in stored} if self.layout is None else self.layout.sources(stored)
        self.files = {k: stored[srcs[0]] for k, srcs in self.sources.items()}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """``keys``' tensors in their checkpoint dtype (FP4 weights: dequantized, float32), on the CPU."""
        from safetensors import safe_open

        raw: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for src in dict.fromkeys(s for k in keys for s in self.sources[k]):
            by_file.setdefault(self.stored[src], []).append(src)
        for f, ks in by_file.items():
            with safe_open(str(f), "pt") as h:  # closed after each read: no mapping stays resident
                raw.update({k: h.get_tensor(k) for k in ks})
        return raw if self.layout is None else self.layout.dequantize(raw, keys)

    def under(self, prefix: str) -> list[str]:
        return [k for k in self.files if k.startswith(prefix)]


def is_on_meta(model: nn.Module) -> bool:
    """Whether ``model``'s weights are on the ``meta`` device (a skeleton without data)."""
    p = next(model.parameters(), None)
    return p is not None and p.is_meta


def skeleton(path: str | Path) -> nn.Module:
    """The causal LM of the Hugging Face folder ``path`` on the ``meta`` device (float32 parameters, no data);
    its rotary-embedding buffers are built on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, m in list(model.named_modules()):
        if any(b.is_meta for b in m.buffers(recurse=False)) and not any(True for _ in m.parameters()):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, type(m)(config=m.config))
    return model


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(name, ModuleList)`` of the decoder layers (the list of ``config.num_hidden_layers`` blocks)."""
    n = getattr(model.config, "num_hidden_layers", None)
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == n and name.rpartition(".")[2] in ("layers", "h", "blocks"):
            return name, m
    raise ValueError(f"{type(model).__name__}: no list of {n} decoder layers found for sequential PTQ")


def needs_full_load(options: dict[str, Any]) -> list[str]:
    """The options among ``options`` that need the whole model loaded (``FULL_LOAD_OPTIONS``, set above 0)."""
    return [k for k in FULL_LOAD_OPTIONS if options.get(k)]


# ---- capturing the first layer's inputs -------------------------------------------------------------


class _Stop(nn.Module):
    """Stands in for decoder layer ``index``: records the arguments the model gives that layer (its own
    attention mask where layer types differ, e.g. sliding-window layers) and, for layer 0, the hidden
    states; passes them on."""

    def __init__(self, index: int, record: list[list[tuple[torch.Tensor | None, tuple, dict]]]) -> None:
        super().__init__()
        self.index, self.record = index, record

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        drop = ("cache", "past_key_values", "past_key_value", "use_cache", "output_attentions")
        kw = {k: v for k, v in kwargs.items() if k not in drop}
        self.record[self.index].append((hidden_states if self.index == 0 else None, args, {**kw, "use_cache": False}))
        return hidden_states


class _ZeroLogits(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.new_zeros(*h.shape[:-1], self.vocab)


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


@torch.no_grad()
def capture_inputs(
    model: nn.Module, ckpt: Checkpoint, forward_loop: Callable[[nn.Module], object], device: torch.device
) -> list[list[tuple[torch.Tensor | None, tuple, dict]]]:
    """Per decoder layer, ``(hidden states, args, kwargs)`` for each batch ``forward_loop`` runs: the first
    layer's hidden states are the embeddings computed from the checkpoint's table (cast to float32), the
    others ``None`` (the layers before give them); no decoder layer, norm or head runs (the model's logits
    are zeros during the capture)."""
    layers_name, layers = decoder_layers(model)
    record: list[list[tuple[torch.Tensor | None, tuple, dict]]] = [[] for _ in layers]
    emb = model.get_input_embeddings()
    emb_name = _module_name(model, emb)
    meta_weight = emb.weight
    emb.weight = nn.Parameter(ckpt.read([f"{emb_name}.weight"])[f"{emb_name}.weight"].to(device), requires_grad=False)
    hook = emb.register_forward_hook(lambda m, args, out: out.float())
    swapped = {layers_name: nn.ModuleList([_Stop(i, record) for i in range(len(layers))])}
    norm_name = f"{layers_name.rpartition('.')[0]}.norm".lstrip(".")
    if isinstance(getattr(model.get_submodule(norm_name.rpartition(".")[0]), "norm", None), nn.Module):
        swapped[norm_name] = nn.Identity()
    head = model.get_output_embeddings()
    if head is not None:
        swapped[_module_name(model, head)] = _ZeroLogits(model.config.vocab_size)
    originals = {name: swap_submodule(model, name, m) for name, m in swapped.items()}
    try:
        forward_loop(model)
    finally:
        hook.remove()
        emb.weight = meta_weight
        for name, m in originals.items():
            swap_submodule(model, name, m)
    if not record[0]:
        raise ValueError("forward_loop ran no batch through the model: nothing to calibrate on")
    return record


# ---- one layer ---------------------------------------------------------------------------------------


def load_layer(
    model: nn.Module, layer: nn.Module, prefix: str, ckpt: Checkpoint, device: torch.device, block: str
) -> None:
    """Fill the meta ``layer`` (named ``prefix``) with its checkpoint weights, float32 on ``device``; ``block``
    is the MoE block's name on disk (``disk_block``)."""
    from ..export.experts import checkpoint_key, fuse_expert_tensors, model_key

    disk = checkpoint_key(f"{prefix}.", block)
    raw = ckpt.read(ckpt.under(disk))
    state = {model_key(f"{prefix}.{k[len(disk) :]}", block)[len(prefix) + 1 :]: v for k, v in raw.items()}
    del raw
    fuse_expert_tensors(layer, state, model)
    for m in layer.modules():
        if m._non_persistent_buffers_set:
            raise ValueError(f"{type(m).__name__} has buffers the checkpoint does not hold: load the model whole")
    layer.to_empty(device=device)
    missing, unexpected = layer.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{ckpt.path}: layer {prefix} does not fit its config: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )


def disk_block(model: nn.Module, ckpt: Checkpoint | None = None) -> str:
    """The MoE block's name in the checkpoint (``mlp``; Mixtral's ``block_sparse_moe``), read before quantizing;
    ``mlp`` too when ``ckpt`` keeps its experts fused (GPT-OSS)."""
    from ..export.experts import experts_naming, has_expert_tensors

    if not find_experts(model) or (ckpt is not None and not has_expert_tensors(ckpt.files)):
        return "mlp"
    return experts_naming(model)[1]


def _layer_tensors(
    model: nn.Module, layer: nn.Module, prefix: str, fmt: str, scheme: str, kv_cache: bool, block: str
) -> tuple[dict[str, torch.Tensor], tuple]:
    """The export's tensors of the quantized ``layer`` (checkpoint names), and the ``format_tensors``
    arguments that give the export's ``quantization_config``."""
    from ..export.block_linear import BlockQuantLinear
    from ..export.checkpoint import format_tensors
    from ..export.common import kept_tensors
    from ..export.experts import checkpoint_key
    from ..ptq.kv_cache import attention_modules

    full = f"{prefix}."
    qlayers = {full + n: m for n, m in layer.named_modules() if isinstance(m, (QuantLinear, BlockQuantLinear))}
    experts = {full + n: m for n, m in layer.named_modules() if isinstance(m, QuantExperts)}
    kv = {full + n: m for n, m in attention_modules(layer).items() if hasattr(m, "k_scale")} if kv_cache else {}
    replaced = [n[len(full) :] for n in [*qlayers, *experts]]
    tensors = {full + k: v for k, v in kept_tensors(layer, replaced).items()}
    for name in kv:
        tensors.pop(f"{name}.k_scale", None)
        tensors.pop(f"{name}.v_scale", None)
    tensors = {checkpoint_key(k, block): v for k, v in tensors.items()}
    if qlayers or experts:
        tensors.update(format_tensors(fmt, model, qlayers, scheme, [], kv, experts)[0])
    return tensors, (qlayers, kv, experts)


def _merge(report: PTQReport, part: PTQReport, prefix: str) -> None:
    """Add one layer's report (names relative to the layer) to the model's."""
    full = f"{prefix}."
    report.quantized += [full + n for n in part.quantized]
    report.experts += [full + n for n in part.experts]
    report.skipped.update({full + n: why for n, why in part.skipped.items()})
    report.input_amax.update({full + n: a for n, a in part.input_amax.items()})
    report.smoothed += [full + n for n in part.smoothed]
    report.smooth_alpha.update({full + n: a for n, a in part.smooth_alpha.items()})
    report.awq.update({full + n: a for n, a in part.awq.items()})
    report.expert_tokens.update({full + n: t for n, t in part.expert_tokens.items()})
    report.gptq = report.gptq or part.gptq
    report.calibration = report.calibration or part.calibration


def _quantize_layer(
    layer: nn.Module,
    prefix: str,
    scheme_name: str,
    inputs: list[tuple[torch.Tensor, tuple, dict]],
    module_filter: Callable[[str, nn.Module], bool] | None,
    options: dict[str, Any],
) -> PTQReport:
    full = f"{prefix}."
    keep = (lambda n, m: module_filter(full + n, m)) if module_filter else None
    if scheme_name == FP8_BLOCK.name:
        from ..export.serve import quantize_block

        quantize_block(layer, keep, options["block"], format=None)  # the tile quantize_checkpoint checked
    else:

        def loop(m: nn.Module) -> None:
            for h, args, kw in inputs:
                m(h, *args, **kw)

        quantize_module(layer, scheme_name, loop, module_filter=keep, progress=False, **options)
    return layer.ptq_report


# ---- the whole run -----------------------------------------------------------------------------------


def quantize_checkpoint(
    path: str | Path | nn.Module,
    scheme: str,
    out: str | Path,
    forward_loop: Callable[[nn.Module], object] | None = None,
    *,
    format: str = "compressed-tensors",  # noqa: A002 - the name users know from the CLI (--format)
    max_shard_size: int | str | None = None,
    device: str | torch.device = "cpu",
    tokenizer: Any = None,
    overwrite: bool = False,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
    progress: bool | None = None,
    model: nn.Module | None = None,
    propagate: str = "float",
    **options: Any,
) -> tuple[Path, PTQReport]:
    """Quantize the causal LM in the Hugging Face folder ``path`` (safetensors; or a model built on the ``meta``
    device from that folder's config, its ``config._name_or_path``) layer by layer with
    ``scheme`` (a ``ptq.schemes`` name, or ``"fp8-block"``) and write the export in ``format`` to ``out``
    (shards of at most ``max_shard_size``, default 5GB). ``forward_loop(model)`` runs the calibration
    batches through the model (its outputs are not meaningful during the capture). ``options`` are
    ``ptq.quantize``'s (``calibration``, ``gptq``, ``awq``, ``smooth``, ``alpha``, ``kv_cache``, ...);
    ``keep_bf16`` and ``norm_tweak`` need a full load and are refused; ``"fp8-block"`` takes ``block``, the tile
    edge (default: the largest every reader of ``format`` loads, ``export.serve.block_size_for``). ``propagate``: ``"float"`` or
    ``"quantized"`` layers give the next layer its inputs (module docstring). Returns the export's path and
    report."""
    from ..export.checkpoint import format_tensors
    from ..export.common import check_export_dir, export_folder, hf_config_dict, write_metadata
    from ..export.experts import checkpoint_key
    from ..export.shards import DEFAULT_MAX_SHARD_SIZE, ShardWriter
    from ..export.support import check_scheme_format
    from ..ptq.kv_cache import enable_fp8_kv

    if isinstance(path, nn.Module):
        model, path = path, getattr(path.config, "_name_or_path", "")
        if not path or not Path(path, "config.json").is_file():
            raise ValueError(
                f"a meta-device model is quantized from its folder's weights, and {path!r} is not one: "
                "build it with from_config on the folder's config, or pass the folder"
            )
    if str(scheme).strip().lower() == "auto":
        raise ValueError(
            "scheme 'auto' scores every layer in one pass over the whole model: load it and pass the model to "
            "fp8kit.ptq.quantize"
        )
    if propagate not in PROPAGATE:
        raise ValueError(f"propagate must be one of {', '.join(PROPAGATE)}, got {propagate!r}")
    full_load = needs_full_load(options)
    if full_load:
        raise ValueError(
            f"{' and '.join(full_load)} rank or tune the whole model: quantize the loaded model instead "
            "(fp8kit.ptq.quantize(model, ...)), or set them to 0 to quantize layer by layer"
        )
    name = FP8_BLOCK.name if str(scheme).lower() == FP8_BLOCK.name else get_scheme(scheme).name
    kv_cache = bool(options.get("kv_cache"))
    check_scheme_format(name + ("+kv" if kv_cache else ""), format)
    if name != FP8_BLOCK.name and forward_loop is None and _needs_data(name, options):
        raise ValueError(
            f"scheme {name!r} with these options calibrates: pass "
            "forward_loop=lambda m: [m(input_ids=x) for x in calibration_batches]"
        )
    device = torch.device(device)
    out_path = check_export_dir(out, overwrite)
    fixed_mmap_threshold()
    ckpt = Checkpoint(path)
    model = model if model is not None else skeleton(path)
    if name == FP8_BLOCK.name:  # the tile every reader of the format loads, checked before any layer is read
        from ..export.serve import block_size_for

        options = {**options, "block": block_size_for(model, format, options.get("block"), module_filter)}
    _read_generation_config(model, Path(path))
    layers_name, layers = decoder_layers(model)
    report = PTQReport(name, kv_cache=kv_cache)
    report.skipped.update(_outside_layers(model, layers_name))
    block = disk_block(model, ckpt)
    captured = capture_inputs(model, ckpt, forward_loop, device) if forward_loop is not None else None
    inputs = captured[0] if captured is not None else []
    config_args: tuple | None = None
    from ..runtime.progress import bar

    layer_bar = bar(len(layers), "  layers", "layer", enabled=sys.stderr.isatty() if progress is None else progress)
    with export_folder(out_path) as tmp:
        writer = ShardWriter(tmp, max_shard_size or DEFAULT_MAX_SHARD_SIZE)
        try:
            for i, layer in enumerate(layers):
                prefix = f"{layers_name}.{i}"
                load_layer(model, layer, prefix, ckpt, device, block)
                if kv_cache:  # the shared config routes attention through fp8kit's: high precision until calibrated
                    enable_fp8_kv(layer, "off")
                opts = dict(options)
                if captured is not None:
                    inputs = _own_arguments(inputs, captured[i])
                following = _propagate(layer, inputs) if propagate == "float" else None
                _merge(report, _quantize_layer(layer, prefix, name, inputs, module_filter, opts), prefix)
                tensors, args = _layer_tensors(model, layer, prefix, format, name, kv_cache, block)
                writer.add_all(tensors)
                del tensors
                if args[0] or args[2]:
                    config_args = args  # shapes and types only: the layer is freed below
                inputs = following if following is not None else _propagate(layer, inputs)
                del following
                layer.to("meta")
                release_memory()
                if layer_bar is not None:
                    layer_bar.update(1)
            for key in _outside_keys(model, ckpt, checkpoint_key(f"{layers_name}.", block)):
                writer.add(key, ckpt.read([key])[key])  # one at a time, in the checkpoint's dtype
            if config_args is None:
                raise ValueError("no nn.Linear layer to quantize in the decoder layers")
            ignore = [checkpoint_key(n, block) for n in report.skipped]
            _, qc, extra = format_tensors(format, model, config_args[0], name, ignore, config_args[1], config_args[2])
            writer.close()
        finally:
            writer.abort()
            if layer_bar is not None:
                layer_bar.close()
        cfg = hf_config_dict(model)
        cfg["quantization_config"] = qc
        write_metadata(tmp, model, cfg, tokenizer, extra)
    object.__setattr__(model, "ptq_report", report)
    return out_path, report


def _outside_keys(model: nn.Module, ckpt: Checkpoint, layers_prefix: str) -> list[str]:
    """The checkpoint's tensors outside the decoder layers, without a head tied to the embeddings."""
    head = model.get_output_embeddings()
    tied = (
        f"{_module_name(model, head)}.weight"
        if head is not None and getattr(model.config, "tie_word_embeddings", False)
        else None
    )
    return [k for k in ckpt.files if not k.startswith(layers_prefix) and k != tied]


def _needs_data(scheme: str, options: dict[str, Any]) -> bool:
    from ..ptq.quantize import PTQOptions

    known = {k: v for k, v in options.items() if k in PTQOptions.__dataclass_fields__}
    return PTQOptions(**known).needs_data(get_scheme(scheme))


def _outside_layers(model: nn.Module, layers_name: str) -> dict[str, str]:
    """The Linear layers outside the decoder layers, kept in their checkpoint dtype, with the reason."""
    from ..nn.convert import is_output_head

    head = is_output_head(model)
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and not n.startswith(f"{layers_name}."):
            out[n] = (
                "output head (kept in high precision, as ModelOpt and llm-compressor do)"
                if head(n, m)
                else "outside the decoder layers (sequential PTQ keeps it in its checkpoint dtype)"
            )
    return out


@torch.no_grad()
def _propagate(layer: nn.Module, inputs: list[tuple[torch.Tensor, tuple, dict]]) -> list:
    """The next layer's hidden states: ``layer`` run on each batch (``_own_arguments`` sets that layer's
    other arguments)."""
    out = []
    for h, args, kw in inputs:
        y = layer(h, *args, **kw)
        out.append((y[0] if isinstance(y, tuple) else y, args, kw))
    return out


def _own_arguments(inputs: list[tuple[torch.Tensor, tuple, dict]], captured: list[tuple]) -> list:
    """Each batch's hidden states with the arguments the model gives this layer (``capture_inputs``)."""
    return [(h, args, kw) for (h, _, _), (_, args, kw) in zip(inputs, captured, strict=True)]


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None


def fixed_mmap_threshold() -> None:
    """Serve tensor-sized allocations with their own mappings, returned to the OS when freed: glibc's
    threshold otherwise grows with each freed block, and a layer's weights, freed, stay resident as heap.
    A no-op without glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB (fixed, so no longer adjusted)


def release_memory() -> None:
    """Hand freed heap memory back to the OS (``malloc_trim``); a no-op without glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _read_generation_config(model: nn.Module, path: Path) -> None:
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
