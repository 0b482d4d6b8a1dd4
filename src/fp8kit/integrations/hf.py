"""Hugging Face ``transformers``: FP8 models that ``Trainer`` trains and ``save_pretrained`` round-trips.

A model converted by ``fp8kit.convert`` already trains unchanged under ``transformers.Trainer`` and
``accelerate.Accelerator`` (its layers are ``nn.Linear`` subclasses with the same parameters), and its
``save_pretrained`` writes the FP8 scaling state beside the weights (plain tensors in safetensors). What
``from_pretrained`` cannot know is that the layers were FP8: this module records it in the config.

    model = AutoModelForCausalLM.from_pretrained(path)
    fp8kit.integrations.hf.convert(model, "delayed")        # fp8kit.convert + a note in model.config
    Trainer(model=model, args=args, train_dataset=ds).train()
    model.save_pretrained("out")                             # weights + FP8 scaling state + the note
    model = fp8kit.integrations.hf.from_pretrained(AutoModelForCausalLM, "out")  # FP8 again, same state

The note is ``config.fp8kit = {"recipe": {...}, "layers": [...], "save_fp8_activations": bool}``; plain
``from_pretrained`` of the same folder still loads the high-precision model (the FP8 state is ignored).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.nn as nn

from ..nn.convert import convert as _convert
from ..nn.experts import FP8Experts
from ..nn.linear import Linear
from ..numerics.recipes import Recipe, recipe_from_name

__all__ = ["CONFIG_KEY", "convert", "fp8_state_keys", "from_pretrained"]

CONFIG_KEY = "fp8kit"
_FP8_MODULES = (Linear, FP8Experts)
_FP8_KEY_PATTERNS = (r"\.fp8_[A-Za-z0-9_]+$", r"\._extra_state$")


def convert(
    model: nn.Module, recipe: Recipe | str | None = None, *, save_fp8_activations: bool = True, **kwargs: Any
) -> nn.Module:
    """``fp8kit.convert`` a Hugging Face model and note the conversion in ``model.config`` (saved with it)."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError("fp8kit.integrations.hf.convert takes a Hugging Face model (with .config); use fp8kit.convert")
    _convert(model, recipe, save_fp8_activations=save_fp8_activations, **kwargs)
    layers = [n for n, m in model.named_modules() if isinstance(m, _FP8_MODULES)]
    recipes = {m.recipe for m in model.modules() if isinstance(m, _FP8_MODULES)}
    if len(recipes) > 1:
        raise ValueError("the model's FP8 layers use different recipes; the Hugging Face note holds one recipe")
    if layers:
        (used,) = recipes
        note = {
            "recipe": json.loads(used.to_json()),
            "layers": layers,
            "save_fp8_activations": save_fp8_activations,
        }
        setattr(config, CONFIG_KEY, note)
    return model


def fp8_state_keys(model: nn.Module) -> list[str]:
    """State-dict keys of ``model`` that hold FP8 scaling state (absent from the high-precision model)."""
    keys = []
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            keys += [f"{name}.{k}" for k in module.state_dict(keep_vars=True) if k not in ("weight", "bias")]
        elif isinstance(module, FP8Experts):
            keys += [
                f"{name}.{k}" for k in module.state_dict(keep_vars=True) if k.startswith("fp8_") or k == "_extra_state"
            ]
    return keys


@contextlib.contextmanager
def _fp8_keys_expected(cls: type) -> Iterator[None]:
    """While loading, the FP8 state is not reported as unexpected (it is loaded right after)."""
    attr = "_keys_to_ignore_on_load_unexpected"
    had = attr in cls.__dict__
    old = cls.__dict__.get(attr)
    setattr(cls, attr, [*(getattr(cls, attr, None) or []), *_FP8_KEY_PATTERNS])
    try:
        yield
    finally:
        if had:
            setattr(cls, attr, old)
        else:
            delattr(cls, attr)


def from_pretrained(
    model_cls: Any, path: str | Path, *, recipe: Recipe | str | None = None, **kwargs: Any
) -> nn.Module:
    """Load a model saved after ``convert`` (or by ``Trainer``), convert the same layers with the same recipe and
    restore its FP8 scaling state. ``model_cls`` is a model class or ``AutoModelFor...``; ``kwargs`` go to its
    ``from_pretrained``. A folder without the note loads as usual and is converted with ``recipe`` if given.
    """
    from safetensors import safe_open

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (config.json missing)")
    note = json.loads(config_file.read_text()).get(CONFIG_KEY)
    target = model_cls
    if hasattr(model_cls, "_model_mapping"):  # an AutoModelFor... class: the concrete class of this config
        from transformers import AutoConfig

        target = model_cls._model_mapping[type(AutoConfig.from_pretrained(path))]
    with _fp8_keys_expected(target):
        model = model_cls.from_pretrained(path, **kwargs)
    if note is None:
        if recipe is not None:
            convert(model, recipe)
        return model
    saved = Recipe.from_json(json.dumps(note["recipe"]))
    if recipe is not None:
        asked = recipe_from_name(recipe) if isinstance(recipe, str) else recipe
        if asked != saved:
            raise ValueError(
                f"{path} was saved with recipe {saved}, not {asked}: omit recipe= to use the saved one "
                "(a new recipe starts its FP8 state afresh: load without the note, then convert)"
            )
    layers = set(note["layers"])
    convert(
        model,
        saved,
        module_filter=lambda name, module: name in layers,
        save_fp8_activations=note.get("save_fp8_activations", True),
    )
    missing_layers = layers - set(model.fp8_conversion_report.converted)
    if missing_layers:
        raise ValueError(f"{path}: layers {sorted(missing_layers)[:3]} of the note are not in the loaded model")
    wanted = set(fp8_state_keys(model))
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys() if k in wanted})
    if wanted - set(state):
        raise ValueError(
            f"{path}: FP8 scaling state missing for {sorted(wanted - set(state))[:3]} (saved by another fp8kit version?)"
        )
    model.load_state_dict(state, strict=False)
    return model
