"""Runs inside vLLM's own virtual environment (it imports vLLM, not fp8kit): loads each export folder named in
a job file with ``vllm.LLM`` in this one process, and writes what it saw as JSON.

Usage: ``python _vllm_worker.py JOB.json OUT.json``. The job holds ``folders``, ``windows`` (token-id lists to
score with prompt log-probabilities; or a ``{folder: lists}`` map), ``new_tokens`` (greedy tokens to generate from the first window's start)
and ``dtype`` (``bfloat16`` where the quantization method takes no other; ``dtype`` in each result says which
ran); an export with an FP8 KV cache gets ``kv_cache_dtype="fp8"``. Optional, per folder: ``engine_args``
(``vllm.LLM`` keywords over the defaults, e.g. ``skip_tokenizer_init=False`` for a model whose processor needs
its tokenizer) and ``prompts`` (text prompts, each with an optional image or audio, run through vLLM's own
processor: ``prompts`` in the result); a folder with no windows is scored on its prompts alone. For each folder the result holds ``loaded`` (the engine started and ran), ``error`` (the
exception text and the stage it came from: ``load`` or ``run``), ``quant_config`` (the config class vLLM
parsed), ``layers`` (each layer's quant method and, where it has one, its scheme), ``weights`` (for one
quantized layer, each checkpoint tensor compared bit for bit with the parameter vLLM loaded it into, before
vLLM repacks it for its kernel), ``kv_scales`` (each attention layer's q/k/v scales as its backend is given
them, after loading), ``generated`` and ``window_losses`` (mean negative log-likelihood of each
window's tokens after the first). The per-layer record is taken when the weights are loaded, so it is there
even when the first forward then fails for want of a kernel.
"""

from __future__ import annotations

import gc
import json
import math
import sys
import traceback
from pathlib import Path
from typing import Any

_RECORD: dict[str, Any] = {}
_PROBE = "model.layers.0.mlp.down_proj"  # a layer vLLM keeps unfused: its tensors keep the checkpoint's names


def _layer_methods(model: Any) -> dict[str, str]:
    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "apply") and not hasattr(method, "process_weights_after_loading"):
            continue
        kind = type(method).__name__
        scheme = getattr(module, "scheme", None)
        if scheme is not None:
            kind += f"/{type(scheme).__name__}"
        out[name] = kind
    return out


def _checkpoint_tensors(folder: str, prefix: str) -> dict[str, Any]:
    from safetensors import safe_open

    found = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key.startswith(prefix + "."):
                    found[key[len(prefix) + 1 :]] = st.get_tensor(key)
    return found


def _weights_match(model: Any, folder: str) -> dict[str, bool]:
    import torch

    try:
        module = model.get_submodule(_PROBE)
    except AttributeError:
        return {}
    params = dict(module.named_parameters(recurse=False))
    out = {}
    for name, t in _checkpoint_tensors(folder, _PROBE).items():
        p = params.get(name)
        if p is None:
            out[name] = False
            continue
        p = p.detach().cpu()
        if p.numel() != t.numel() or p.element_size() != t.element_size():
            # a per-tensor scale may be kept per partition: compare each stored copy with the checkpoint's
            same = p.numel() % max(t.numel(), 1) == 0 and p.dtype == t.dtype
            out[name] = bool(same and torch.equal(p.reshape(-1, t.numel()), t.reshape(1, -1).expand(-1, t.numel())))
            continue
        a = p.contiguous().view(torch.uint8).reshape(-1) if p.dtype != t.dtype else p.reshape(-1)
        b = t.contiguous().view(torch.uint8).reshape(-1) if p.dtype != t.dtype else t.reshape(-1)
        if p.dtype != t.dtype:  # the same bytes under another dtype name (packed codes)
            out[name] = bool(torch.equal(a, b))
        else:
            out[name] = bool(torch.equal(p.reshape(t.shape) if p.numel() == t.numel() else p, t))
    return out


def _kv_scales(model: Any) -> dict[str, dict[str, float]]:
    """The q/k/v scales each attention layer serves with once its weights are processed (``_q_scale_float`` ...:
    what the attention backend is given; 1.0 where none was loaded)."""
    return {
        name: {op: float(getattr(module, f"_{op}_scale_float")) for op in "qkv"}
        for name, module in model.named_modules()
        if name.endswith("self_attn.attn") and hasattr(module, "_k_scale_float")
    }


def _install_hook() -> None:
    """Record the layers' quant methods and the probe layer's loaded tensors just before vLLM processes them."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading

    def recording(model: Any, model_config: Any, target_device: Any) -> Any:
        try:
            _RECORD["layers"] = _layer_methods(model)
            _RECORD["weights"] = _weights_match(model, _RECORD["folder"])
        except Exception as err:  # the record is diagnostic: never stop the load over it
            _RECORD["record_error"] = repr(err)
        done = original(model, model_config, target_device)
        try:
            _RECORD["kv_scales"] = _kv_scales(model)
        except Exception as err:
            _RECORD["record_error"] = repr(err)
        return done

    base_loader.process_weights_after_loading = recording


def _config_schemes(folder: str, config: Any) -> dict[str, str]:
    """The scheme a compressed-tensors config gives each quantized layer of the checkpoint, asked of the config
    itself (``get_scheme``): what the engine's layers would get, for exports whose load stops before them."""
    from safetensors import safe_open
    from torch import nn

    if not hasattr(config, "get_scheme"):
        return {}
    names = set()
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                for tail in (".weight_scale", ".weight_packed"):
                    if key.endswith(tail):
                        names.add(key[: -len(tail)])
    out = {}
    for name in sorted(names):
        try:
            scheme = config.get_scheme(nn.Linear(1, 1), name)
        except Exception as err:
            out[name] = f"error: {type(err).__name__}: {err}"
            continue
        out[name] = f"CompressedTensorsLinearMethod/{type(scheme).__name__}" if scheme is not None else "Unquantized"
    return out


def _quant_config(folder: str) -> Any:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    from vllm.model_executor.layers.quantization import get_quantization_config

    method = qc.get("quant_method")
    if method == "modelopt" and str(qc.get("quant_algo", "")).upper() in ("NVFP4", "W4A16_NVFP4"):
        method = "modelopt_fp4"
    if method == "modelopt" and str(qc.get("quant_algo", "")).upper() == "MIXED_PRECISION":
        method = "modelopt_mixed"
    return get_quantization_config(method).from_config(qc)


NO_FP4_KERNEL = ("NVFP4 linear layer", "MXFP4 linear layer")  # vLLM's message when no FP4 kernel fits


def _register_fp4_emulation() -> None:
    """Put vLLM's own FP4 emulation kernels (dequantize, then a high-precision GEMM: the fallback its CUDA and
    ROCm builds list last) on the CPU platform's kernel lists, which hold none in vLLM 0.32."""
    import vllm.model_executor.kernels.linear as kernels
    from vllm.platforms import PlatformEnum

    for table, kernel in (
        (kernels._POSSIBLE_NVFP4_KERNELS, kernels.EmulationNvFp4LinearKernel),
        (kernels._POSSIBLE_MXFP4_KERNELS, kernels.EmulationMxfp4LinearKernel),
    ):
        cpu = table.setdefault(PlatformEnum.CPU, [])
        if kernel not in cpu:
            cpu.append(kernel)


def _dtype_for(config: Any, wanted: str) -> str:
    """``wanted``, or ``bfloat16`` when the quantization config does not take it (vLLM 0.32's ``Fp8Config`` and
    ``ModelOptFp8Config`` list half precision only)."""
    import torch

    if config is None or getattr(torch, wanted) in config.get_supported_act_dtypes():
        return wanted
    return "bfloat16"


def _kv_cache_dtype(folder: str) -> str:
    """``fp8`` when the export declares an FP8 KV cache (compressed-tensors ``kv_cache_scheme``, ModelOpt
    ``kv_cache_quant_algo``), as ``vllm serve --kv-cache-dtype fp8`` would be given; else ``auto``."""
    qc = json.loads((Path(folder) / "config.json").read_text()).get("quantization_config") or {}
    return "fp8" if qc.get("kv_cache_scheme") or qc.get("kv_cache_quant_algo") else "auto"


def _free(llm: Any) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def _score(llm: Any, windows: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    gen = llm.generate(
        [TokensPrompt(prompt_token_ids=windows[0][:16])],
        SamplingParams(max_tokens=new_tokens, temperature=0.0),
        use_tqdm=False,
    )
    scored = llm.generate(
        [TokensPrompt(prompt_token_ids=w) for w in windows],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    losses = []
    for w, out in zip(windows, scored, strict=True):
        nll = [-lp[tok].logprob for tok, lp in zip(w[1:], out.prompt_logprobs[1:], strict=True)]
        losses.append(sum(nll) / len(nll))
    return {"generated": list(gen[0].outputs[0].token_ids), "window_losses": losses}


def _score_prompts(llm: Any, prompts: list[dict[str, Any]], new_tokens: int) -> list[dict[str, Any]]:
    """Each text prompt through vLLM's own processor, with its ``image`` (an ``H x W x 3`` list of 0-255 values)
    or its ``audio`` (samples at ``sampling_rate``) where it has one; a prompt with a ``decoder_prompt`` is an
    encoder-decoder's (the text and media go to the encoder). Returns, per prompt, its token ids as vLLM built
    them (the decoder's for an encoder-decoder), each token's log-probability after the first, and
    ``new_tokens`` greedy tokens."""
    import numpy as np
    from PIL import Image
    from vllm import SamplingParams

    inputs: list[Any] = []
    for p in prompts:
        item: dict[str, Any] = {"prompt": p["prompt"]}
        if p.get("image") is not None:
            item["multi_modal_data"] = {"image": Image.fromarray(np.asarray(p["image"], dtype=np.uint8))}
        if p.get("audio") is not None:
            item["multi_modal_data"] = {"audio": (np.asarray(p["audio"], dtype=np.float32), p["sampling_rate"])}
        if p.get("decoder_prompt") is not None:
            item = {"encoder_prompt": item, "decoder_prompt": p["decoder_prompt"]}
        inputs.append(item)
    outs = llm.generate(
        inputs, SamplingParams(max_tokens=new_tokens, temperature=0.0, prompt_logprobs=0), use_tqdm=False
    )
    return [
        {
            "ids": list(o.prompt_token_ids),
            "logprobs": [lp[t].logprob for t, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)],
            "generated": list(o.outputs[0].token_ids),
        }
        for o in outs
    ]


def run_one(folder: str, job: dict[str, Any]) -> dict[str, Any]:
    """``_run_one``; with ``job["emulate_fp4"]``, an export refused for want of an FP4 kernel is loaded again
    with vLLM's FP4 emulation kernels (``_register_fp4_emulation``), the first refusal kept as ``no_kernel``."""
    result = _run_one(folder, job)
    err = (result.get("error") or {}).get("text", "")
    if job.get("emulate_fp4") and not result["loaded"] and any(k in err for k in NO_FP4_KERNEL):
        _register_fp4_emulation()
        again = _run_one(folder, job)
        again["no_kernel"] = result["error"]["text"].splitlines()[0]
        again["emulated"] = True
        return again
    return result


def _run_one(folder: str, job: dict[str, Any]) -> dict[str, Any]:
    _RECORD.clear()
    _RECORD["folder"] = folder
    result: dict[str, Any] = {"folder": folder, "loaded": False, "error": None}
    try:
        config = _quant_config(folder)
        result["quant_config"] = type(config).__name__ if config is not None else None
    except Exception as err:
        result["quant_config"] = None
        result["error"] = {"stage": "config", "text": f"{type(err).__name__}: {err}"}
        return result
    from vllm import LLM

    windows = job["windows"][folder] if isinstance(job["windows"], dict) else job["windows"]
    dtype = _dtype_for(config, job.get("dtype", "bfloat16"))
    result["dtype"] = dtype
    llm = None
    args = {
        "max_model_len": max((len(w) for w in windows), default=248) + 8,
        "max_num_seqs": max(len(windows), 1),
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "kv_cache_dtype": _kv_cache_dtype(folder),
        "seed": 0,
    }
    args.update(job.get("engine_args", {}).get(folder, {}))
    prompts = job.get("prompts", {}).get(folder, [])
    try:
        llm = LLM(model=folder, dtype=dtype, **args)
    except Exception as err:
        result["error"] = {
            "stage": "load",
            "text": f"{type(err).__name__}: {err}",
            "trace": traceback.format_exc()[-3000:],
        }
    else:
        try:
            if windows:  # none for a model whose prompts need more than text (a speech encoder-decoder)
                result.update(_score(llm, windows, job.get("new_tokens", 4)))
            if prompts:
                result["prompts"] = _score_prompts(llm, prompts, job.get("new_tokens", 4))
            result["loaded"] = True
        except Exception as err:
            result["error"] = {
                "stage": "run",
                "text": f"{type(err).__name__}: {err}",
                "trace": traceback.format_exc()[-3000:],
            }
    for key in ("layers", "weights", "kv_scales", "record_error"):
        if key in _RECORD:
            result[key] = _RECORD[key]
    if "layers" not in result and config is not None:  # the load stopped before the model was built
        result["layers"] = _config_schemes(folder, config)
        result["layers_from"] = "config"
    if llm is not None:
        _free(llm)
    else:
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception:
            pass
    if result.get("window_losses"):
        ls = result["window_losses"]
        result["ppl"] = math.exp(sum(ls) / len(ls))
    return result


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    import vllm

    _install_hook()
    results = []
    out = Path(sys.argv[2])
    for folder in job["folders"]:
        results.append(run_one(folder, job))
        out.write_text(json.dumps({"vllm": vllm.__version__, "results": results}, indent=1))
        print(f"fp8kit-vllm: {folder}: loaded={results[-1]['loaded']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
