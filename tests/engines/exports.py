"""Every export fp8kit writes, made once from SmolLM2-135M (and one tiny Qwen3-MoE, one tiny Idefics3, one tiny
Whisper) for the engine tests:
one-shot PTQ (round to nearest, one calibration batch of the corpus' calibration split), so that building
all of them stays within a few minutes on two cores."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Export:
    """One export of the engine tests: ``scheme`` (``auto``: a scheme per layer) written in ``fmt``, with an FP8
    KV cache (``kv``) or static FP8 attention (``attention``: ``ptq.quantize``'s spelling)."""

    name: str
    scheme: str
    fmt: str = "compressed-tensors"
    kv: bool = False
    moe: bool = False
    attention: str | None = None


EXPORTS = [
    Export("fp8-dynamic", "fp8-dynamic"),
    Export("fp8-dynamic+kv", "fp8-dynamic", kv=True),
    Export("fp8-dynamic+attention", "fp8-dynamic", attention="fp8-head"),
    Export("fp8", "fp8"),
    Export("int8-smoothquant", "int8-smoothquant"),
    Export("int8-weight-only", "int8-weight-only"),
    Export("nvfp4", "nvfp4"),
    Export("nvfp4-weight-only", "nvfp4-weight-only"),
    Export("mxfp4-weight-only", "mxfp4-weight-only"),
    Export("auto", "auto"),
    Export("fp8-dynamic/modelopt", "fp8-dynamic", "modelopt"),
    Export("fp8-block/fp8-block", "fp8-block", "fp8-block"),
    Export("moe fp8-dynamic", "fp8-dynamic", moe=True),
]

PPL_TOLERANCE = 0.01  # vLLM's perplexity within 1% of fp8kit's on the same tokens
AUTO_CANDIDATES = ("fp8-dynamic", "nvfp4-weight-only")
AUTO_BUDGET = 6.0  # mean effective bits per weight: between NVFP4's 4.5 and FP8's 8, so both are chosen


def calibration_batch(tokenizer, seq_len: int = 128) -> torch.Tensor:
    """Two windows of the corpus' calibration split."""
    from fp8kit.data.corpus import load_ids
    from fp8kit.data.splits import ptq_splits

    ids, name = load_ids(None, tokenizer)
    calib = ptq_splits(ids, name).calib
    return torch.stack([calib[:seq_len], calib[seq_len : 2 * seq_len]])


def tiny_qwen3_moe(seed: int = 0) -> nn.Module:
    """A 2-layer Qwen3-MoE (8 experts, top 2, hidden 128) with random weights scaled so that its next-token
    distribution is far from uniform (a perplexity gap between two readers then shows)."""
    from transformers import Qwen3MoeForCausalLM

    from tests.helpers.moe import qwen3_moe_config

    torch.manual_seed(seed)
    cfg = qwen3_moe_config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        head_dim=32,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
    )
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


VLM_IMAGE_SIDE = 56  # the vision tower's image size: 4 x 4 patches of 14, pixel-shuffled into 4 image tokens


def tiny_idefics3(tokenizer, seed: int = 0) -> tuple[nn.Module, object]:
    """A 2-layer Idefics3 (Llama text model with head size 64, which vLLM's CPU attention takes; a 2-block
    SigLIP-like vision tower) with random weights, its output head scaled as ``tiny_qwen3_moe``'s, and its
    processor: ``tokenizer`` (a ``transformers`` tokenizer, changed in place) with Idefics3's image tokens
    added, and the PIL image processor with image splitting off, so one image is one ``VLM_IMAGE_SIDE`` square.
    vLLM's Idefics3 and its processor import no torchvision (its CPU build has no working one)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
    from transformers.models.idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    special = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    patch, scale = 14, 2
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=VLM_IMAGE_SIDE,
        patch_size=patch,
    )
    cfg = Idefics3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=scale,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    side = {"longest_edge": VLM_IMAGE_SIDE}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side)
    tokens_per_image = (VLM_IMAGE_SIDE // patch) ** 2 // scale**2
    processor = Idefics3Processor(
        images, tokenizer, image_seq_len=tokens_per_image, chat_template=tokenizer.chat_template
    )
    return model, processor


def _byte_level_alphabet() -> list[str]:
    """The 256 characters byte-level BPE (GPT-2, Whisper) writes the bytes 0-255 as, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


WHISPER_SPECIAL = ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")


def tiny_whisper(folder: Path, seed: int = 0) -> tuple[nn.Module, object]:
    """A 2-layer Whisper (head size 64, 80 mel bins, 30 s of audio as every Whisper) with random weights, its
    output head scaled as ``tiny_qwen3_moe``'s, and its processor: the feature extractor and a byte-level
    tokenizer (the 256 bytes, no merges, Whisper's task tokens), whose files are written under ``folder``."""
    import json

    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(_byte_level_alphabet())}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    end = "<|endoftext|>"
    tokenizer = WhisperTokenizer(
        str(folder / "vocab.json"), str(folder / "merges.txt"), unk_token=end, bos_token=end, eos_token=end
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(WHISPER_SPECIAL)})
    end_id = tokenizer.convert_tokens_to_ids(end)
    cfg = WhisperConfig(
        vocab_size=len(tokenizer),
        d_model=128,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        num_mel_bins=80,
        decoder_start_token_id=tokenizer.convert_tokens_to_ids(WHISPER_SPECIAL[0]),
        bos_token_id=end_id,
        eos_token_id=end_id,
        pad_token_id=end_id,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.proj_out.weight.mul_(20)  # tied to the decoder's embeddings
    return model, WhisperProcessor(WhisperFeatureExtractor(feature_size=80), tokenizer)


def write_export(e: Export, base: nn.Module, tokenizer, batch: torch.Tensor, out: Path) -> Path:
    """Quantize a copy of ``base`` as ``e`` says and write it to ``out``."""
    from fp8kit.export import quantize_block, save_pretrained
    from fp8kit.ptq.auto import quantize_auto
    from fp8kit.ptq.quantize import quantize

    model = copy.deepcopy(base)

    def loop(m: nn.Module) -> None:
        m(input_ids=batch)

    if e.scheme == "fp8-block":
        quantize_block(model)
    elif e.scheme == "auto":
        quantize_auto(model, loop, budget=AUTO_BUDGET, candidates=list(AUTO_CANDIDATES), progress=False)
    else:
        quantize(model, e.scheme, loop, kv_cache=e.kv, attention=e.attention, progress=False)
    return save_pretrained(model, out, tokenizer, format=e.fmt)
