"""FP4 checkpoints as other producers write them, made from tiny models: GPT-OSS's MXFP4 experts
(``*_blocks`` / ``*_scales``), compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` and ModelOpt
NVFP4, each with its producer's config (compressed-tensors' own ``QuantizationConfig``); MoE experts one by one."""

import json

import torch

import fp8kit
from fp8kit.numerics.state_dict import pack_fp4

# openai/gpt-oss-20b's quantization_config
GPT_OSS_QC = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def fp4_quantize(w: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(packed codes (..., in / 2), block scales, per-tensor dequant multiplier or None)`` of ``w`` ``(..., in)``."""
    qt = fp8kit.quantize(w.float().reshape(-1, w.shape[-1]), "e2m1", granularity)
    packed = pack_fp4(qt.data).reshape(*w.shape[:-1], -1)
    scales = qt.scales.reshape(*w.shape[:-1], -1)
    return packed, scales, qt.global_scale


def _save(path, tensors: dict, config: dict, extra: dict | None = None):
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    for name, obj in (extra or {}).items():
        (path / name).write_text(json.dumps(obj))
    return path


def write_gpt_oss_mxfp4(model, path):
    """``model`` (a ``GptOssForCausalLM``) as openai/gpt-oss ships it: experts ``P_blocks`` ``(E, out, in/32, 16)``
    and ``P_scales`` ``(E, out, in/32)`` (E8M0), the rest in bfloat16."""
    tensors = {}
    for key, val in model.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = val.detach().transpose(1, 2)  # (E, in, out) -> (E, out, in)
            packed, scales, _ = fp4_quantize(w, "mxfp4")
            tensors[f"{key}_blocks"] = packed.reshape(*w.shape[:2], -1, 16)
            tensors[f"{key}_scales"] = scales
        else:
            tensors[key] = val.detach().to(torch.bfloat16)
    return _save(path, tensors, {**model.config.to_dict(), "quantization_config": GPT_OSS_QC})


def per_expert_state(model) -> dict:
    """``model``'s state dict with its fused experts split one by one as checkpoints name them
    (``experts.E.gate_proj.weight``, ``up_proj``, ``down_proj``; gate rows first in ``gate_up_proj``)."""
    out = {}
    for key, val in model.state_dict().items():
        if key.endswith("experts.gate_up_proj"):
            base, inter = key.removesuffix("gate_up_proj"), val.shape[1] // 2
            for e in range(val.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = val[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = val[e, inter:]
        elif key.endswith("experts.down_proj"):
            base = key.removesuffix("down_proj")
            for e in range(val.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = val[e]
        else:
            out[key] = val
    return {k: v.detach() for k, v in out.items()}


def _ct_config(fmt: str) -> dict:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    preset = "NVFP4" if fmt.startswith("nvfp4") else "MXFP4A16"
    qc = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
        format=fmt,
        quantization_status="compressed",
        ignore=["lm_head", "re:.*mlp.gate$"],
    )
    return {**qc.model_dump(mode="json"), "quant_method": "compressed-tensors"}


def write_fp4(model, path, producer: str, fmt: str = "nvfp4-pack-quantized"):
    """``model`` as ``producer`` (``"compressed-tensors"``, format ``fmt``; or ``"modelopt"``, NVFP4) writes it:
    every ``*_proj`` linear (experts one by one) in FP4 with static input scales, the rest in bfloat16."""
    nvfp4 = fmt.startswith("nvfp4") or producer == "modelopt"
    tensors = {}
    for key, val in per_expert_state(model).items():
        if not key.endswith("_proj.weight"):
            tensors[key] = val.to(torch.bfloat16)
            continue
        name = key.removesuffix(".weight")
        packed, scales, g = fp4_quantize(val, "nvfp4" if nvfp4 else "mxfp4")
        if producer == "modelopt":
            tensors.update(
                {
                    f"{name}.weight": packed,
                    f"{name}.weight_scale": scales,
                    f"{name}.weight_scale_2": g.float().reshape(()),
                    f"{name}.input_scale": torch.tensor(0.01),
                }
            )
            continue
        tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"] = packed, scales
        if nvfp4:  # compressed-tensors' global scales: the float32 reciprocals of the dequant multipliers
            tensors[f"{name}.weight_global_scale"] = (1.0 / g.float()).reshape(1)
            tensors[f"{name}.input_global_scale"] = torch.tensor([100.0])
    cfg = model.config.to_dict()
    if producer == "modelopt":
        from fp8kit.export.modelopt import hf_quant_config, quantization_config

        hq = hf_quant_config("nvfp4", ["lm_head", "model.layers.*.mlp.gate"], False)
        hq["producer"] = {"name": "modelopt", "version": "0.47.0"}
        cfg["quantization_config"] = quantization_config(hq)
        return _save(path, tensors, cfg, {"hf_quant_config.json": hq})
    cfg["quantization_config"] = _ct_config(fmt)
    return _save(path, tensors, cfg)
