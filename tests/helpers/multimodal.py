"""Tiny, random multimodal models (image-text-to-text, speech-to-text) built from their config classes, with inputs
that run their towers.

``tiny_multimodal(model_type)`` takes ``arch_sweep.tiny_config``'s shrunk config and shrinks what only multimodal
configs hold, by rule: images to two patches a side (``image_size``), vision depths to two blocks (``depth``,
per-block index lists cut), projector outputs to the text hidden size (``out_hidden_size``), multimodal RoPE
sections to the text head size (``mrope_section``), special token ids into the tiny vocabulary. ``inputs(model,
ids)`` gives the model's forward keywords: Whisper-like models (first input not text) get random features and
``decoder_input_ids``; Llava-like models (an ``image_token_id`` and a vision config with ``image_size``) an image
and its placeholder tokens where the count is the patch grid; others the text alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.helpers.arch_sweep import LAYERS, SEQ, VOCAB, quiet, tiny_config

_TOKEN_IDS = ("image_token_id", "image_token_index", "audio_token_id", "audio_token_index", "video_token_id")


def _shrink_multimodal(config, text_hidden: int, head_dim: int) -> None:
    for key, sub in list(vars(config).items()):
        if key.endswith("_config") and hasattr(sub, "to_dict"):
            _shrink_multimodal(sub, text_hidden, head_dim)
    patch = getattr(config, "patch_size", None)
    if isinstance(getattr(config, "image_size", None), int) and isinstance(patch, int):
        config.image_size = 2 * patch
    if isinstance(getattr(config, "depth", None), int):
        config.depth = LAYERS
        for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            if isinstance(getattr(config, key, None), list):
                setattr(config, key, [i for i in getattr(config, key) if i < LAYERS] or [LAYERS - 1])
    if isinstance(getattr(config, "out_hidden_size", None), int):
        config.out_hidden_size = text_hidden
    rope = getattr(config, "rope_parameters", None)
    mrope = "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ())
    if isinstance(rope, dict) and ("mrope_section" in rope or mrope):
        half = head_dim // 2
        sections = [half // 4, (half - half // 4) // 2]
        rope["mrope_section"] = [*sections, half - sum(sections)]
    for i, key in enumerate(_TOKEN_IDS):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= VOCAB:
            setattr(config, key, VOCAB - 10 - i)


def tiny_multimodal(model_type: str) -> nn.Module:
    """A float32, eval-mode model of ``model_type`` (an image-text-to-text or speech-to-text type) with random
    weights and the shrunk config (module doc)."""
    from transformers.models.auto import modeling_auto as auto

    config = tiny_config(model_type)
    text = config.get_text_config()
    hidden = text.hidden_size if hasattr(text, "hidden_size") else text.d_model
    head_dim = getattr(text, "head_dim", None) or hidden // text.num_attention_heads
    _shrink_multimodal(config, hidden, head_dim)
    names = {
        **auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
        **auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
        **auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    }
    import transformers

    cls = getattr(transformers, names[model_type])
    torch.manual_seed(0)
    with quiet():
        return cls._from_config(config, dtype=torch.float32).eval()


def inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    """The forward keywords of ``model`` that run its towers where the rule knows how (module doc)."""
    config = model.config
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB - 16, (1, SEQ), generator=gen)
    if model.main_input_name == "input_features":
        frames = 2 * config.max_source_positions  # the encoder's two stride-2 convolutions
        return {"input_features": torch.randn(1, config.num_mel_bins, frames, generator=gen), "decoder_input_ids": ids}
    vision = getattr(config, "vision_config", None)
    token = getattr(config, "image_token_id", None)
    if token is not None and hasattr(vision, "image_size") and type(model).__name__.startswith("Llava"):
        grid = vision.image_size // vision.patch_size
        image = torch.full((1, grid * grid), token)
        pixels = torch.randn(1, vision.num_channels, vision.image_size, vision.image_size, generator=gen)
        return {"input_ids": torch.cat([ids[:, :2], image, ids[:, 2:]], 1), "pixel_values": pixels}
    return {"input_ids": ids}
