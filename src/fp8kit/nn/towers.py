"""The towers of a multimodal model: the modules outside its language model, found from the model's structure.

A ``transformers`` image-text-to-text or speech model holds one language model (what ``get_decoder()`` returns:
``model.language_model`` of Llava, Gemma 3, Qwen2-VL, ``model.text_model`` of Idefics3, ``model.decoder`` of
Whisper) beside the modules that turn images or audio into its inputs: vision and audio encoders
(``model.vision_tower``, ``model.visual``, ``model.audio_tower``, Whisper's ``model.encoder``) and projectors
(``model.multi_modal_projector``, Idefics3's ``model.connector``). A model is multimodal when it generates text
(it has output embeddings) and its config holds a text sub-config (``get_text_config()`` is not the config
itself), or it is an encoder-decoder whose first input is not text (``main_input_name``: Whisper's
``input_features``); an image or audio classifier and CLIP's dual encoders are not. Its towers are the children,
holding parameters, of the modules on the path from the model to its language model that are off that path, the
output head aside. Each tower's kind comes from the config: a module whose ``config`` is the model's
``vision_config`` is a vision tower, ``audio_config`` (or the whole config of a model whose input is audio) an
audio tower, and any other a projector.

``convert`` and ``ptq.quantize`` keep the towers in high precision unless asked (``towers=True``), as
llm-compressor's and ModelOpt's multimodal recipes do, and the exports list them in ``ignore`` /
``exclude_modules`` by pattern (``ignore_patterns``) so serving stacks load them unquantized whatever they name
the modules above them.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

import torch.nn as nn

__all__ = ["TOWERS_KEPT", "Towers", "find_towers", "ignore_patterns"]

TOWERS_KEPT = (
    "{kind} {tower}, outside the language model {language} (kept in high precision, as llm-compressor's and "
    "ModelOpt's multimodal recipes do; pass towers=True to quantize it)"
)
_TEXT_INPUTS = ("input_ids", "inputs_embeds")


@dataclass(frozen=True)
class Towers:
    """A multimodal model's language model and towers, by qualified name; ``kinds`` maps each tower to
    ``"vision tower"``, ``"audio tower"`` or ``"projector"``."""

    language_model: str
    kinds: dict[str, str]

    def tower_of(self, name: str) -> str | None:
        """The tower holding the module ``name`` (or being it), else ``None``."""
        return next((t for t in self.kinds if name == t or name.startswith(f"{t}.")), None)

    def why_kept(self, name: str) -> str | None:
        """The report's reason for keeping ``name`` in high precision as part of a tower, else ``None``."""
        tower = self.tower_of(name)
        if tower is None:
            return None
        return TOWERS_KEPT.format(kind=self.kinds[tower], tower=tower, language=self.language_model)


def _call(model: nn.Module, method: str) -> object:
    fn = getattr(model, method, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None


def _is_multimodal(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    text = _call(config, "get_text_config") if config is not None else None
    if text is not None and text is not config:
        return True
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    return encoder_decoder and getattr(model, "main_input_name", "input_ids") not in _TEXT_INPUTS


def _kind(model: nn.Module, module: nn.Module) -> str:
    config = getattr(model, "config", None)
    own = getattr(module, "config", None)
    if own is not None and config is not None:
        for key, sub in vars(config).items():
            if key.endswith("_config") and sub is not None and type(sub) is type(own):
                if "vision" in key or "visual" in key:
                    return "vision tower"
                if "audio" in key or "speech" in key:
                    return "audio tower"
        if own is config and getattr(model, "main_input_name", "") in ("input_features", "input_values"):
            return "audio tower"
        if own is config and getattr(model, "main_input_name", "") == "pixel_values":
            return "vision tower"
    return "projector"


def find_towers(model: nn.Module) -> Towers | None:
    """The language model and towers of a multimodal ``model`` (module doc), or ``None`` for a text-only model, a
    model with no text output, or one whose language model is not a proper submodule."""
    head = _call(model, "get_output_embeddings")
    if not isinstance(head, nn.Module) or not _is_multimodal(model):
        return None  # no text output (CLIP's dual encoders, classifiers), or a text-only model
    decoder = _call(model, "get_decoder")
    if not isinstance(decoder, nn.Module) or decoder is model:
        return None
    language = next((n for n, m in model.named_modules() if m is decoder and n), None)
    if language is None:
        return None
    kinds: dict[str, str] = {}
    parts = language.split(".")
    for depth in range(len(parts)):
        parent_name = ".".join(parts[:depth])
        parent = model.get_submodule(parent_name) if parent_name else model
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if child_name == parts[depth] or child is head or next(child.parameters(), None) is None:
                continue
            kinds[name] = _kind(model, child)
    return Towers(language, kinds) if kinds else None


def ignore_patterns(model: nn.Module, quantized: list[str], fmt: str) -> list[str]:
    """The ``ignore`` (compressed-tensors, ``re:`` patterns) or ``exclude_modules`` (ModelOpt, wildcards) entries
    of the towers of ``model`` none of whose layers is among ``quantized``: each tower by its own attribute name
    under any prefix (``model.vision_tower`` -> ``re:(.*\\.)?vision_tower($|\\..*)``, ``*vision_tower``,
    ``*vision_tower.*``), as llm-compressor's ``re:.*vision_tower.*`` does, so a serving stack that names the
    modules above the tower its own way (vLLM's ``vision_tower.`` for transformers' ``model.vision_tower.``) still
    matches; the tower's full name where its attribute name would also match a quantized layer. Other formats:
    the towers' qualified names."""
    towers = find_towers(model)
    if towers is None:
        return []
    kept = [t for t in towers.kinds if not any(q == t or q.startswith(f"{t}.") for q in quantized)]
    out: list[str] = []
    for tower in kept:
        attr = tower.rpartition(".")[2]
        if fmt == "compressed-tensors":
            loose, exact = rf"re:(.*\.)?{re.escape(attr)}($|\..*)", rf"re:{re.escape(tower)}($|\..*)"
            pick = exact if any(re.match(loose[3:], q) for q in quantized) else loose
            out.append(pick)
        elif fmt == "modelopt":
            loose_wild = [f"*{attr}", f"*{attr}.*"]
            clash = any(fnmatch.fnmatchcase(q, p) for p in loose_wild for q in quantized)
            out += [tower, f"{tower}.*"] if clash else loose_wild
        else:
            out.append(tower)
    return out
