"""Post-training quantization of Mixture-of-Experts experts: ``QuantExperts``, calibration of every expert.

A ``transformers`` (>= 5) experts module holds its experts as 3-D parameters (``gate_up_proj``
``(E, 2I, H)`` or ``up_proj``, ``down_proj`` ``(E, H, I)``; ``(E, in, out)`` where ``is_transposed``;
optional ``*_bias`` ``(E, out)``), and its forward is looked up by name in
``transformers.integrations.moe.ExpertsInterface``. ``quantize_experts_module`` turns such a module into a
``QuantExperts`` in place (a class swap, as ``fp8kit.convert`` does for training: the object, its hooks,
``act_fn`` / ``_apply_gate`` stay) and points the model's ``config._experts_implementation`` at
``"fp8kit_ptq"``, whose forward (``quant_experts_forward``) routes the tokens as the training experts do
(``fp8kit.nn.routing``) and runs each projection as one grouped GEMM of the GEMM floor
(``gemm.grouped.grouped_scaled_mm``: the exact 8-bit code values, FP32 accumulation on CPU, the scales
applied to the accumulator; block FP8: ``gemm.scaled.block_scaled_mm``). No Python loop over experts.

Stored per projection ``P`` (``gate_up_proj`` or ``up_proj``, and ``down_proj``), as buffers:

* ``P`` ``(E, out, in)`` codes (``float8_e4m3fn`` or ``int8``), always in the ``(out, in)`` layout of
  ``nn.Linear`` (``is_transposed`` becomes ``False``);
* ``P_weight_scale`` ``(E, 1, 1)`` (per tensor: one scale per expert) or ``(E, out, 1)`` (per channel):
  dequant multipliers ``amax / 448`` (E4M3) or ``amax / 127`` (INT8). **An expert never shares a weight
  scale with another expert** (a large expert would flush a small one's weights to zero). The fused
  ``gate_up`` of one expert has one per-tensor scale for gate and up together: vLLM's fused-MoE kernels
  need one ``w13`` scale per expert (its loader takes the max of the two and requantizes), so fp8kit
  chooses it that way from the start and the export writes it to both ``gate_proj`` and ``up_proj``;
* ``P_input_scale`` ``(1,)`` (static schemes): **one activation scale per projection for the whole
  layer, shared by all experts.** vLLM's fused-MoE loaders (``CompressedTensorsW8A8Fp8MoEMethod`` and the
  ``fp8`` / ModelOpt ones) reduce the per-expert ``input_scale`` tensors of a checkpoint to their max over
  experts (warning "Found input_scales that are not equal for fp8 MoE layer") because the fused kernel
  takes one activation scale; a per-expert scale in fp8kit would compute something no server runs. So the
  shared scale is exactly that max: the max over experts of each expert's calibrated amax, and the
  export writes it to every expert (vLLM then loads it without the warning and computes what fp8kit does).

Block FP8 (``schemes.FP8_BLOCK``, DeepSeek-V3 style; ``fp8kit.export.quantize_block``): ``P_weight_scale``
is ``(E, ceil(out / 128), ceil(in / 128))``, one dequant multiplier (``weight_scale_inv`` on disk) per
128x128 tile of **one** expert's ``(out, in)`` weight: tiles never cross experts (each expert is tiled on
its own, ragged edge tiles cut). The fused ``gate_up`` ``(2I, H)`` of an expert is tiled as one matrix,
which needs ``I`` to be a multiple of 128: then its first ``I / 128`` tile rows are exactly ``gate_proj``'s
tiles and the rest ``up_proj``'s, so the per-expert checkpoint tensors are whole tiles (an ``I`` that is
not a multiple of 128 is refused, as a tile would mix gate and up rows). Activations are quantized at run
time per 1x128 group along K of each routed token (``amax / 448``); the GEMM runs on the exact
dequantized values with FP32 accumulation, as ``export.BlockQuantLinear`` does.

FP4 (``nvfp4``, ``nvfp4-weight-only``, ``mxfp4-weight-only``): each expert's ``(out, in)`` weight is
quantized on its own by ``fp8kit.quantize(w_e, "e2m1", "nvfp4" | "mxfp4")``, as the dense ``QuantLinear``
quantizes its weight, and stored as that layer stores it: ``P`` ``(E, out, in / 2)`` uint8, two E2M1 codes
per byte (``state_dict.pack_fp4``); ``P_weight_scale`` ``(E, out, in / 16)`` float8_e4m3fn (NVFP4) or
``(E, out, in / 32)`` E8M0 uint8 codes (MXFP4); NVFP4's per-tensor ``P_weight_scale_2`` ``(E, 1)``
(``amax / 2688``, ModelOpt's name): one per expert, and for the fused ``gate_up`` one for gate and up
together (the fused matrix's amax), the per-expert ``w13`` scale vLLM's NVFP4 fused-MoE kernels take (they
keep gate's and warn when up's differs; llm-compressor and ModelOpt fuse gate/up global scales the same
way). A checkpoint whose gate and up scales differ loads as ``(E, 2)``: gate's rows under the first, up's
under the second. W4A4 (``nvfp4``) activations: 1x16 E4M3 block scales of each routed token at run time
under a static per-tensor ``P_input_scale`` ``(1,)`` (``amax / 2688``) shared by the experts of the layer,
the max over experts as for FP8: ModelOpt 0.47's fused-experts quantizer shares one input quantizer per
projection across the experts ("the shared input quantization scale used by downstream inference frameworks"), llm-compressor writes one per expert (with every token through every expert, so
``gate_up``'s is the same for all experts and only ``down_proj``'s differ), and vLLM's FlashInfer NVFP4 MoE
backends reduce per-expert scales to their max (its CUTLASS one keeps them per expert); the exports write
the shared one to every expert. The GEMM is the floor's ``block_scaled_mm`` with ``offs``, as the dense FP4
layer's: one grouped GEMM on the exact float32 dequantized weights (and NVFP4 inputs), FP32 accumulation.
GPTQ rounds FP4 experts with each expert's block scales fixed (``gptq.gptq_fp4_weight``).

Dynamic per-token activations (``fp8-dynamic``) are scaled per routed token, never across tokens; the
weight-only scheme leaves them in high precision.

Calibration (``ExpertsObserver``): llm-compressor's MoE calibration sends every calibration token through
every expert while the layer's output stays the routed one, so that an expert the router rarely picks
still gets a range from real inputs. fp8kit does the same with a forward hook that does not change the
output: the ``gate_up`` input is the layer's whole token tensor (every expert sees it), and each expert's
``down_proj`` input, ``act(gate_up(x))``, is computed for all tokens with one batched GEMM over the experts
and observed per expert. The tokens the router actually sent to each expert are counted and reported
(``PTQReport.expert_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from ..kernels.reference import expand_tiles
from ..nn.class_swap import swap_class
from ..nn.experts import routed_experts_forward
from ..nn.experts_interface import fallback_forward, restore_implementation, use_implementation
from ..nn.routing import RoutingPlan, routing_plan
from ..numerics.formats import E2M1
from ..numerics.grouped_tensor import GroupedWeight, quantize_experts
from ..numerics.scaling import dequant_scale, nvfp4_tensor_scale, parse_granularity
from ..numerics.state_dict import pack_fp4, unpack_fp4
from ..numerics.tensor import QuantizedTensor
from ..numerics.tensor import quantize as fp8_quantize
from .calibrate import InputObserver, choose_amax
from .schemes import Scheme, get_scheme

__all__ = [
    "IMPLEMENTATION",
    "ExpertsHessians",
    "ExpertsObserver",
    "collect_expert_hessians",
    "block_tiling_problem",
    "dispatch_quant_experts",
    "QuantExperts",
    "experts_projections",
    "find_experts",
    "fp4_experts_problem",
    "fp4_tensors",
    "gptq_codes",
    "observe_experts",
    "quant_experts_forward",
    "quantize_experts_module",
]

IMPLEMENTATION = "fp8kit_ptq"


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The ``transformers`` experts modules (3-D expert weights, ``ExpertsInterface`` dispatch) of ``model``."""
    from ..nn.experts import is_experts_module

    return {n: m for n, m in model.named_modules() if is_experts_module(m) and not isinstance(m, QuantExperts)}


def experts_projections(module: nn.Module) -> tuple[str, str]:
    """The parameter names of the two projections: ``("gate_up_proj" or "up_proj", "down_proj")``."""
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


def _weight_out_in(module: nn.Module, name: str) -> torch.Tensor:
    """Projection ``name``'s weight as ``(E, out, in)`` float32."""
    w = getattr(module, name).detach().float()
    return w.transpose(1, 2) if module.is_transposed else w


def _gate(module: nn.Module, proj: torch.Tensor) -> torch.Tensor:
    return module._apply_gate(proj) if module.has_gate else module.act_fn(proj)


# ---- calibration -----------------------------------------------------------------------------------


OBSERVE_ELEMENTS = 1 << 26  # the all-tokens-through-all-experts activations held at once (float32 values)


class ExpertsObserver:
    """What calibration saw in one experts module: the tokens routed to each expert, the first
    projection's input (all tokens, shared by all experts) and each expert's ``down_proj`` input over
    all tokens (computed, not routed: batched GEMMs over chunks of ``OBSERVE_ELEMENTS``)."""

    def __init__(self, name: str, num_experts: int) -> None:
        self.name = name
        self.tokens = torch.zeros(num_experts, dtype=torch.int64)
        self.first_input = InputObserver(f"{name} (experts input)")
        self.down_inputs = [InputObserver(f"{name}.down_proj of expert {e}") for e in range(num_experts)]

    @torch.no_grad()
    def observe(self, module: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor) -> None:
        e = module.num_experts
        routed = top_k_index.reshape(-1)
        routed = routed[(routed >= 0) & (routed < e)]
        self.tokens += torch.bincount(routed.cpu().long(), minlength=e)[:e]
        x = x.detach().reshape(-1, x.shape[-1]).float()
        self.first_input.observe(x)
        for start, h in down_inputs_of_all_tokens(module, x):
            for i in range(h.shape[0]):
                self.down_inputs[start + i].observe(h[i])

    def amax(self, fmt: Any, method: str, percentile: float) -> tuple[float, float]:
        """``(first projection's input amax, down_proj input amax)``: the latter is the max over experts of
        each expert's calibrated amax (the scale vLLM's fused-MoE loader keeps; see the module doc)."""
        a0 = choose_amax(self.first_input, fmt, method, percentile)
        per_expert = [choose_amax(o, fmt, method, percentile) for o in self.down_inputs if o.amax > 0]
        if not per_expert:
            raise ValueError(f"{self.name}: every expert's down_proj input was zero during calibration")
        return a0, max(per_expert)


def down_inputs_of_all_tokens(module: nn.Module, x: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """Every token of ``x`` ``(T, H)`` through every expert's first projection and activation:
    ``(first expert, act(gate_up(x)) (chunk, T, I) float32)`` for chunks of experts of at most
    ``OBSERVE_ELEMENTS`` values (one batched GEMM each), the ``down_proj`` inputs calibration observes."""
    first = experts_projections(module)[0]
    w = _weight_out_in(module, first)  # (E, out, in)
    bias = getattr(module, f"{first}_bias", None) if module.has_bias else None
    chunk = max(1, OBSERVE_ELEMENTS // max(1, x.shape[0] * w.shape[1]))
    for start in range(0, module.num_experts, chunk):
        h = torch.matmul(x.unsqueeze(0), w[start : start + chunk].transpose(1, 2))  # (chunk, T, out)
        if bias is not None:
            h = h + bias[start : start + chunk].detach().float().unsqueeze(1)
        yield start, _gate(module, h)


class ExpertsHessians:
    """GPTQ Hessians ``2 X^T X / N`` (float32) of one experts module's two projections over calibration,
    every token through every expert (as calibration and llm-compressor's MoE GPTQ do: an expert the
    router rarely picks still gets a full-rank Hessian): ``gate_up`` ``(H, H)``, one for all experts (they
    all see the layer's tokens); ``down_proj`` ``(E, I, I)``, each expert's own ``act(gate_up(x))``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.first: torch.Tensor | None = None
        self.down: torch.Tensor | None = None
        self.rows = 0

    @torch.no_grad()
    def observe(self, module: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        xtx = x.t() @ x
        self.first = xtx if self.first is None else self.first + xtx
        if self.down is None:
            inter = module.down_proj.shape[1 if module.is_transposed else 2]
            self.down = torch.zeros(module.num_experts, inter, inter, device=x.device)
        for start, h in down_inputs_of_all_tokens(module, x):
            self.down[start : start + h.shape[0]] += h.transpose(1, 2) @ h
        self.rows += x.shape[0]

    def hessians(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up (H, H), down_proj (E, I, I))``; clear error if calibration never reached the module."""
        if not self.rows:
            raise ValueError(f"GPTQ: experts {self.name!r} saw no calibration data (the forward_loop never reached it)")
        return 2 * self.first / self.rows, 2 * self.down / self.rows


@contextmanager
def observe_experts(model: nn.Module, names: list[str]) -> Iterator[dict[str, ExpertsObserver]]:
    """Observe the named experts modules while the block runs ``forward_loop`` (hooks removed on exit)."""
    observers = {n: ExpertsObserver(n, model.get_submodule(n).num_experts) for n in names}
    with _experts_inputs(model, observers):
        yield observers


@contextmanager
def collect_expert_hessians(model: nn.Module, names: list[str]) -> Iterator[dict[str, ExpertsHessians]]:
    """Accumulate the named experts modules' GPTQ Hessians while the block runs ``forward_loop``."""
    collectors = {n: ExpertsHessians(n) for n in names}
    with _experts_inputs(model, collectors):
        yield collectors


@contextmanager
def _experts_inputs(model: nn.Module, observers: dict[str, Any]) -> Iterator[None]:
    """Forward pre-hooks calling ``observers[name].observe(module, hidden_states, top_k_index)``."""
    hooks = []
    for n, obs in observers.items():

        def hook(module, args, kwargs, obs=obs):
            x = args[0] if args else kwargs["hidden_states"]
            idx = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
            obs.observe(module, x, idx)

        hooks.append(model.get_submodule(n).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


# ---- the quantized module ---------------------------------------------------------------------------


class QuantExperts:
    """Mixin ``quantize_experts_module`` puts in front of an experts module's class (see the module doc)."""

    scheme: Scheme
    projections: tuple[str, str]

    def weight_codes(self, p: int) -> torch.Tensor:
        """Projection ``p``'s ``(E, out, in)`` codes (0: gate_up / up, 1: down)."""
        return getattr(self, self.projections[p])

    def weight_scale(self, p: int) -> torch.Tensor:
        return getattr(self, f"{self.projections[p]}_weight_scale")

    def input_scale(self, p: int) -> torch.Tensor | None:
        return getattr(self, f"{self.projections[p]}_input_scale", None)

    def weight_scale_2(self, p: int) -> torch.Tensor | None:
        """NVFP4's per-tensor weight scales of projection ``p``, ``(E, 1)`` (or ``(E, 2)``: gate's, up's)."""
        return getattr(self, f"{self.projections[p]}_weight_scale_2", None)

    def expert_fp4_weight(self, p: int, e: int) -> QuantizedTensor:
        """Expert ``e``'s FP4 weight of projection ``p`` ``(out, in)``, as ``QuantLinear.fp4_weight`` holds
        a dense layer's (unpacked codes, block scales, NVFP4's per-tensor scale; one per expert)."""
        s2 = self.weight_scale_2(p)
        if s2 is not None and s2.shape[1] != 1:
            raise ValueError("gate and up hold their own per-tensor scales here: use grouped_fp4_weight")
        codes = unpack_fp4(self.weight_codes(p)[e])
        gran = parse_granularity(self.scheme.weight_granularity)
        block = gran.block_shape(*codes.shape)
        gs = None if s2 is None else s2[e, 0].reshape(())
        return QuantizedTensor(codes, self.weight_scale(p)[e], E2M1, gran, block, torch.float32, global_scale=gs)

    def grouped_fp4_weight(self, p: int) -> QuantizedTensor:
        """Projection ``p``'s FP4 weights ``(E, out, in)`` as one operand of the GEMM floor: the unpacked
        codes with each row's float32 block multipliers (NVFP4: ``block scale * weight_scale_2`` of its
        expert, the product ``QuantizedTensor.scale_inv`` forms for one expert; MXFP4: the E8M0 codes)."""
        codes = unpack_fp4(self.weight_codes(p))
        e, out, cols = codes.shape
        gran = parse_granularity(self.scheme.weight_granularity)
        block = gran.block_shape(out, cols)
        scales = self.weight_scale(p)
        s2 = self.weight_scale_2(p)
        if s2 is not None:
            rows = expand_tiles(s2.float().reshape(e, -1, 1), (out // s2.shape[1], 1), (out, 1))  # (E, out, 1)
            scales = scales.float() * rows
        return QuantizedTensor(codes, scales.reshape(e * out, -1), E2M1, gran, block, torch.float32)

    def quantize_fp4_input(self, p: int, x: torch.Tensor) -> QuantizedTensor:
        """The routed tokens ``x`` ``(S, in)`` in NVFP4 (``nvfp4``): 1x16 block scales from ``x`` under the
        static per-tensor ``input_scale``, as ``QuantLinear.quantize_fp4_input`` (non-finite input raises)."""
        return fp8_quantize(x, E2M1, "nvfp4", global_scale=self.input_scale(p), check_scale=False)

    def dequantized_weight(self, p: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``codes * scale``, ``(E, out, in)``: the weight the module computes with."""
        if self.scheme.is_fp4:
            return self.grouped_fp4_weight(p).dequantize(torch.float32).to(dtype)
        codes, scale = self.weight_codes(p), self.weight_scale(p)
        if self.scheme.weight_strategy == "block":
            scale = expand_tiles(scale, (self.scheme.block, self.scheme.block), tuple(codes.shape[1:]))
        return (codes.float() * scale).to(dtype)

    def dequantized_input(self, p: int, x: torch.Tensor) -> torch.Tensor:
        """The routed tokens ``x`` ``(S, in)`` as the module's GEMM sees them (float32): rounded to the
        activation format with ``quantize_input``'s scales, or per 1 x ``block`` group (block FP8)."""
        if self.scheme.act_strategy == "group":
            return self.quantize_groups(x).dequantize(torch.float32)
        if self.scheme.act_strategy == "nvfp4":
            return self.quantize_fp4_input(p, x).dequantize(torch.float32)
        xq, sx = self.quantize_input(p, x)
        return xq.float() * sx.reshape(-1, 1)

    def quantize_groups(self, x: torch.Tensor) -> QuantizedTensor:
        """The routed tokens ``x`` ``(S, in)`` quantized per 1 x ``block`` group (block FP8, run time)."""
        return fp8_quantize(x.float(), self.scheme.act_format, (1, self.scheme.block), nonfinite="propagate")

    def quantize_input(self, p: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes of the routed tokens ``x`` ``(S, in)`` and their dequant scale (``(1,)`` static, ``(S, 1)``
        per token), through ``fp8kit.quantize`` as ``QuantLinear`` does; NaN/inf propagate."""
        fmt = self.scheme.act_format
        if self.scheme.act_strategy == "tensor":
            s = self.input_scale(p)
            qt = fp8_quantize(x, fmt, "row", scale=1.0 / s, nonfinite="propagate", check_scale=False)
            return qt.data, s
        qt = fp8_quantize(x, fmt, "row", nonfinite="propagate")
        return qt.data, qt.scale_inv

    def grouped_weight(self, p: int) -> GroupedWeight:
        """Projection ``p``'s block-FP8 codes and tile scales as the GEMM floor's operand."""
        b = self.scheme.block
        codes = self.weight_codes(p)
        return GroupedWeight(codes, self.weight_scale(p), self.scheme.weight_format, (b, b), torch.float32)

    def project(self, p: int, x: torch.Tensor, offs: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """``out[j] = dequant(x[j]) @ dequant(W[e_j]).T`` (float32, no bias) for tokens sorted by expert: one
        grouped GEMM of the GEMM floor (``gemm.grouped.grouped_scaled_mm``, block FP8 and FP4
        ``gemm.scaled.block_scaled_mm``)."""
        from ..gemm.grouped import grouped_scaled_mm
        from ..gemm.scaled import block_scaled_mm

        if x.requires_grad and torch.is_grad_enabled():
            return self._project_straight_through(p, x, offs, group_ids)
        if self.scheme.weight_strategy == "block":
            return block_scaled_mm(self.quantize_groups(x), self.grouped_weight(p), offs=offs)
        if self.scheme.is_fp4:  # as the dense FP4 QuantLinear: the floor's block_scaled_mm, here grouped
            xin = x if self.scheme.act_format is None else self.quantize_fp4_input(p, x)
            return block_scaled_mm(xin, self.grouped_fp4_weight(p), offs=offs)
        codes, w_scale = self.weight_codes(p), self.weight_scale(p)
        if self.scheme.act_format is None:  # weight-only: high-precision activations
            return grouped_scaled_mm(x, codes, w_scale, offs, group_ids)
        xq, sx = self.quantize_input(p, x)
        return grouped_scaled_mm(xq, codes, w_scale, offs, group_ids, sx)

    def _project_straight_through(
        self, p: int, x: torch.Tensor, offs: torch.Tensor, group_ids: torch.Tensor
    ) -> torch.Tensor:
        """``project``'s value, differentiable in ``x`` (norm tweaking): the input quantizer passes the
        gradient straight through, the weights are frozen. Inference never takes this path."""
        if self.scheme.act_format is not None:
            with torch.no_grad():
                xd = self.dequantized_input(p, x.detach()).to(x.dtype)
            x = x + (xd - x).detach()
        return _GroupedMatmul.apply(x.float(), self.dequantized_weight(p), offs)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, scheme={self.scheme.name}"


class _GroupedMatmul(torch.autograd.Function):
    """``out[rows of e] = x[rows of e] @ w[e].T`` (``w`` ``(E, out, in)``, frozen), differentiable in ``x``."""

    @staticmethod
    def forward(ctx, x, w, offs):  # type: ignore[override]
        from ..gemm.grouped import grouped_mm

        ctx.save_for_backward(w, offs)
        return grouped_mm(x, w.transpose(1, 2).contiguous(), offs)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        from ..gemm.grouped import grouped_mm

        w, offs = ctx.saved_tensors
        return grouped_mm(grad.contiguous(), w.contiguous(), offs), None, None


def experts_base_class(module: nn.Module) -> type:
    """The ``transformers`` experts class under fp8kit's training mixins (``FP8Experts``, ``BF16Experts``)."""
    from ..nn.bf16 import BF16Experts
    from ..nn.experts import FP8Experts

    cls = type(module)
    while issubclass(cls, (FP8Experts, BF16Experts)) and cls not in (FP8Experts, BF16Experts):
        cls = cls.__bases__[-1]
    return cls


@torch.no_grad()
def quantize_experts_module(
    module: nn.Module,
    scheme: Scheme | str,
    input_amax: tuple[float, float] | None = None,
    name: str = "",
    *,
    copy: bool = False,
    hessians: tuple[torch.Tensor, torch.Tensor] | None = None,
    dispatch: bool = True,
) -> nn.Module:
    """Quantize an experts module in place (class swap, 3-D parameters replaced by code and scale buffers)
    with per-expert weight scales; ``input_amax`` ``(gate_up, down)`` sets the shared static activation
    scales (required by static schemes). ``copy``: leave ``module`` as it is and return a new quantized
    module object (tensors not copied; ``fp8kit.ptq.quantize`` keeps the original as norm tweaking's teacher).
    ``hessians`` (``ExpertsHessians.hessians()``): round each expert's weights with GPTQ instead of to
    nearest (same scales and codes format). ``dispatch=False`` leaves the model's config as it is (the
    module is then called through ``quant_experts_forward`` directly, or dispatched later with
    ``dispatch_quant_experts``)."""
    scheme = get_scheme(scheme)
    what = name or type(module).__name__
    if getattr(module, "_is_expert_parallel", False):
        raise ValueError(f"{what}: expert-parallel experts cannot be quantized by fp8kit.ptq yet")
    if scheme.static_activations and input_amax is None:
        raise ValueError(f"scheme {scheme.name!r} needs calibrated input amaxes for {what} (run a forward_loop)")
    projections = experts_projections(module)
    problem = block_tiling_problem(module, scheme.block) if scheme.weight_strategy == "block" else None
    problem = problem or fp4_experts_problem(module, scheme)
    if problem:
        raise ValueError(f"{what}: {problem}; keep these experts in high precision (module_filter)")
    new: dict[str, torch.Tensor] = {}
    for p, proj in enumerate(projections):
        w = _weight_out_in(module, proj)
        if not torch.isfinite(w).all():
            raise ValueError(f"{what}.{proj} holds NaN or inf; it cannot be quantized")
        if scheme.is_fp4:
            new.update(fp4_tensors(proj, w, scheme, None if hessians is None else hessians[p], f"{what}.{proj}"))
        elif hessians is None:
            new[proj], new[f"{proj}_weight_scale"] = quantize_codes(w, scheme)
        else:
            new[proj], new[f"{proj}_weight_scale"] = gptq_codes(w, hessians[p], scheme, f"{what}.{proj}")
        if scheme.act_strategy == "nvfp4":
            new[f"{proj}_input_scale"] = nvfp4_tensor_scale(float(input_amax[p])).reshape(1)
        elif scheme.static_activations:
            amax = torch.tensor([float(input_amax[p])])
            new[f"{proj}_input_scale"] = dequant_scale(amax, scheme.act_format)
        bias = getattr(module, f"{proj}_bias", None)
        if bias is not None:
            new[f"{proj}_bias"] = bias.detach().float().clone()
    if copy:
        module = shallow_copy(module)
    install_quant_experts(module, scheme, new, dispatch=dispatch)
    return module


def block_tiling_problem(module: nn.Module, block: int) -> str | None:
    """Why ``module``'s experts cannot be tiled in ``block`` x ``block`` tiles that the per-expert
    checkpoint tensors hold whole (a fused gate_up whose intermediate size is not a multiple), or ``None``."""
    if not module.has_gate:
        return None
    inter = _weight_out_in(module, experts_projections(module)[0]).shape[1] // 2
    if inter % block == 0:
        return None
    return (
        f"intermediate size {inter} is not a multiple of {block}, so a {block}x{block} tile of the fused "
        "gate_up_proj would mix gate and up rows"
    )


def fp4_experts_problem(module: nn.Module, scheme: Scheme) -> str | None:
    """Why an FP4 scheme cannot quantize ``module``'s experts (an input dim that is not whole blocks), or ``None``."""
    if not scheme.is_fp4:
        return None
    for proj in experts_projections(module):
        cols = _weight_out_in(module, proj).shape[2]
        block = parse_granularity(scheme.weight_granularity).block_shape(1, cols)[1]
        if cols % block:
            return f"{proj}'s input dim {cols} is not a multiple of {scheme.name}'s {block}-element blocks"
    return None


def fp4_tensors(
    proj: str, w: torch.Tensor, scheme: Scheme, hessian: torch.Tensor | None = None, what: str = ""
) -> dict[str, torch.Tensor]:
    """Projection ``proj``'s FP4 buffers (module doc) from the expert weights ``w`` ``(E, out, in)``: each
    expert quantized on its own by ``fp8kit.quantize(w[e], "e2m1", <the scheme's granularity>)`` (its own
    NVFP4 per-tensor scale), or GPTQ-rounded against ``hessian`` (``(in, in)`` shared or ``(E, in, in)``)
    with those scales fixed (``gptq.gptq_fp4_weight``)."""
    from .gptq import gptq_fp4_weight

    gran = scheme.weight_granularity
    qts = []
    for e in range(w.shape[0]):
        if hessian is None:
            qts.append(fp8_quantize(w[e], E2M1, gran))
        else:
            h = hessian if hessian.dim() == 2 else hessian[e]
            try:
                qts.append(gptq_fp4_weight(w[e], h, gran))
            except ValueError as err:
                raise ValueError(f"{what} expert {e}: {err}") from err
    out = {
        proj: pack_fp4(torch.stack([q.data for q in qts])).contiguous(),
        f"{proj}_weight_scale": torch.stack([q.scales for q in qts]).contiguous(),
    }
    if scheme.weight_strategy == "nvfp4":
        out[f"{proj}_weight_scale_2"] = torch.stack([q.global_scale.reshape(1) for q in qts]).float().contiguous()
    return out


def shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object with ``module``'s attributes, its own parameter/buffer/submodule dicts (tensors
    and submodules shared; hook dicts copied as their own type, so hooks can be registered on either), so
    that a class swap and new buffers leave ``module`` as it was."""
    new = object.__new__(type(module))
    new.__dict__ = {k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()}
    return new


def quantize_codes(w: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes (E, out, in), dequant scales (E, 1, 1) per tensor, (E, out, 1) per channel or
    (E, ceil(out / b), ceil(in / b)) per b x b tile)`` of the expert weights ``w`` ``(E, out, in)``, one
    scale per expert (per tensor), per expert and row, or per expert and tile (tiles never cross experts):
    ``grouped_tensor.quantize_experts``, the experts' one weight quantizer, with the dequant scales
    ``amax / fmt.max`` of the per-tensor and per-channel schemes."""
    e = w.shape[0]
    fmt, b = scheme.weight_format, scheme.block
    gran = {"block": (b, b), "channel": "row"}.get(scheme.weight_strategy, "tensor")
    q = quantize_experts(w.float(), fmt, gran)
    if scheme.weight_strategy == "block":
        return q.data.contiguous(), q.scales.float().contiguous()
    return q.data.contiguous(), dequant_scale(q.amax, fmt).reshape(e, -1, 1).contiguous()


def gptq_codes(w: torch.Tensor, hessian: torch.Tensor, scheme: Scheme, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_codes``' codes and scales with each expert's weight ``w[e]`` ``(out, in)`` GPTQ-rounded
    against ``hessian`` ``(in, in)`` (shared) or ``hessian[e]`` (``(E, in, in)``); the scales are fixed
    from the original weights before the sweep, as for ``gptq_linear``."""
    from .gptq import gptq_weight

    if scheme.weight_strategy not in ("tensor", "channel"):
        raise ValueError(f"GPTQ rounds per-tensor or per-channel weights, not {scheme.weight_strategy!r} ({what})")
    e = w.shape[0]
    codes, amaxes = [], []
    for i in range(e):
        h = hessian if hessian.dim() == 2 else hessian[i]
        c, amax, _ = gptq_weight(w[i], h, scheme.weight_format, scheme.weight_strategy == "channel")
        codes.append(c)
        amaxes.append(amax)
    scale = dequant_scale(torch.stack(amaxes), scheme.weight_format).reshape(e, -1, 1)
    return torch.stack(codes).contiguous(), scale.contiguous()


def install_quant_experts(
    module: nn.Module, scheme: Scheme, tensors: dict[str, torch.Tensor], *, dispatch: bool = True
) -> None:
    """Make ``module`` a ``QuantExperts`` holding ``tensors`` (codes, scales, biases by buffer name) in place
    of its 3-D parameters, and (``dispatch``) point its config at ``"fp8kit_ptq"``; without ``dispatch`` the
    module only carries tensors to an export (its config, shared with a training model, stays as it is)."""
    projections = experts_projections(module)
    device = module.down_proj.device
    for key in (*projections, *(f"{p}_bias" for p in projections)):
        module._parameters.pop(key, None)
    for key in ("fp8_amax_history", "fp8_scale", "fp8_seen", "fp8_amax_pending", "fp8_tokens_per_expert"):
        module._buffers.pop(key, None)
    swap_class(module, QuantExperts, "Quant", experts_base_class(module))
    for key, t in tensors.items():
        module.register_buffer(key, t.to(device))
    module.scheme = scheme
    module.projections = projections
    module._fp8kit_was_transposed = module.is_transposed
    module.is_transposed = False
    if dispatch:
        dispatch_quant_experts(module)


def dispatch_quant_experts(module: nn.Module) -> None:
    """Run ``module`` (a ``QuantExperts``) through ``"fp8kit_ptq"`` (``nn.experts_interface``); the
    implementation its config named before stays the fallback of the experts modules not quantized."""
    use_implementation([module], IMPLEMENTATION, quant_experts_forward)


@torch.no_grad()
def dequantize_experts_module(module: QuantExperts, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Undo ``install_quant_experts`` in place: the ``transformers`` experts module again, its 3-D
    parameters ``codes * scale`` in their original layout (exact in float32), biases restored, and the
    config's experts implementation back to the one it named before (when no other module is quantized)."""
    params = {}
    for p, proj in enumerate(module.projections):
        w = module.dequantized_weight(p, dtype)
        params[proj] = w.transpose(1, 2).contiguous() if module._fp8kit_was_transposed else w
        bias = module._buffers.get(f"{proj}_bias")
        if bias is not None:
            params[f"{proj}_bias"] = bias.to(dtype)
    for proj in module.projections:
        for key in (proj, f"{proj}_weight_scale", f"{proj}_weight_scale_2", f"{proj}_input_scale", f"{proj}_bias"):
            module._buffers.pop(key, None)
    module.__class__ = type(module).__bases__[1]
    module.is_transposed = module.__dict__.pop("_fp8kit_was_transposed")
    for key, t in params.items():
        module.register_parameter(key, nn.Parameter(t))
    for key in ("scheme", "projections"):
        module.__dict__.pop(key, None)
    restore_implementation(module, IMPLEMENTATION)
    return module


def quant_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``"fp8kit_ptq"`` experts implementation: ``grouped_mm_experts_forward`` on 8-bit or FP4 codes.

    ``hidden_states`` ``(T, H)``, ``top_k_index`` / ``top_k_weights`` ``(T, k)``; returns ``(T, H)``.
    Experts modules that are not ``QuantExperts`` (kept in high precision) run the implementation their
    config named before."""
    if not isinstance(self, QuantExperts):
        return fallback_forward(self, IMPLEMENTATION)(self, hidden_states, top_k_index, top_k_weights)
    plans: list[RoutingPlan] = []

    def project(x: torch.Tensor, p: int, expert_ids: torch.Tensor) -> torch.Tensor:
        if not plans:
            plans.append(routing_plan(expert_ids, self.num_experts, 1))
        return self.project(p, x, plans[0].offs, plans[0].group_ids)

    return routed_experts_forward(
        self, hidden_states, top_k_index, top_k_weights, project, norm_dtype=hidden_states.dtype
    )
