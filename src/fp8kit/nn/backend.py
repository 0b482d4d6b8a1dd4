"""The kernel backend FP8 modules quantize their operands with: ``"compiled"`` (default) or ``"eager"``."""

from __future__ import annotations

__all__ = ["quantize_backend", "set_quantize_backend"]

_BACKEND = {"name": "compiled"}


def quantize_backend() -> str:
    """The backend FP8 layers quantize their operands with (``set_quantize_backend``)."""
    return _BACKEND["name"]


def set_quantize_backend(name: str) -> None:
    """Kernel backend the modules use: ``"compiled"`` (default) or ``"eager"``."""
    if name not in ("compiled", "eager"):
        raise ValueError(f"backend must be 'compiled' or 'eager', got {name!r}")
    _BACKEND["name"] = name
