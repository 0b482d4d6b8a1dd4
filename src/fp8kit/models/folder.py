"""What a local model folder must hold before any command loads it, checked from file headers in a few
milliseconds: a ``config.json`` object, safetensors files whose headers and sizes agree (an empty, corrupt or
truncated file is named), the shards an index lists, and tokenizer files beside the weights.

``check_model_folder`` raises ``ModelFolderError`` (a ``ValueError``) in one line that names the file and the fix.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

__all__ = [
    "TOKENIZER_FILES",
    "ModelFolderError",
    "check_model_folder",
    "has_tokenizer",
    "load_tokenizer",
    "safetensors_problem",
]

# The usual tokenizer files (any *.model or *.tiktoken file, vocab.txt, counts too).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


class ModelFolderError(ValueError):
    """A model folder that the loaders cannot read (exit code 2, before any work)."""


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file (empty, header unreadable, data shorter or longer than
    the header says), or ``None`` when its header and size agree. Reads the header only."""
    size = path.stat().st_size
    if size == 0:
        return "it is empty"
    if size < 8:
        return f"it is {size} bytes, shorter than a safetensors header"
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(_MAX_HEADER, size - 8):
            return "its header length is past the end of the file (corrupt or truncated)"
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, ValueError):
            return "its header is not valid JSON (corrupt)"
    if not isinstance(header, dict):
        return "its header is not a JSON object (corrupt)"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"its header entry {name!r} has no data offsets (corrupt)"
        end = max(end, offsets[1])
    have = size - 8 - length
    if have < end:
        return f"it holds {have:,} bytes of tensor data where its header lists {end:,} (truncated)"
    if have > end:
        return f"it holds {have:,} bytes of tensor data where its header lists {end:,} (corrupt)"
    return None


def check_model_folder(folder: str | Path) -> None:
    """Refuse a Hugging Face model folder that the loaders cannot read: ``config.json`` missing, not a JSON
    object or without a ``model_type``, a bad safetensors file (``safetensors_problem``), a shard its index lists but the folder lacks, or
    weights without tokenizer files."""
    folder = Path(folder)
    config = folder / "config.json"
    try:
        data = json.loads(config.read_text())
    except FileNotFoundError:
        raise ModelFolderError(f"{folder} has no config.json: give a Hugging Face model folder") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelFolderError(f"{config} is not readable JSON ({err}): restore it from the model's source") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"{config} is not a JSON object: restore it from the model's source")
    if "model_type" not in data and "model_type" not in data.get("text_config", {}):
        raise ModelFolderError(
            f"{config} names no model_type, so transformers cannot build the model: restore it from the model's source"
        )
    for path in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem is not None:
            raise ModelFolderError(f"{path} is not a readable safetensors file: {problem}; re-download or re-export it")
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ModelFolderError(f"{index} is not a safetensors index (no weight_map): re-download it") from None
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise ModelFolderError(f"{folder} lacks {', '.join(missing)}, listed in {index.name}: re-download it")
    weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
    if weights and not has_tokenizer(folder):
        raise _no_tokenizer(folder)


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds tokenizer files (``TOKENIZER_FILES``, vocab.txt, a *.model or *.tiktoken file)."""
    names = {p.name for p in folder.iterdir() if p.is_file()}
    return bool(names & {*TOKENIZER_FILES, "vocab.txt"}) or any(n.endswith((".model", ".tiktoken")) for n in names)


def _no_tokenizer(folder: Path) -> ModelFolderError:
    return ModelFolderError(
        f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the tokenizer files of the model it came "
        f"from into it, e.g. AutoTokenizer.from_pretrained(ORIGINAL).save_pretrained({str(folder)!r})"
    )


def load_tokenizer(folder: str | Path) -> Any:
    """``AutoTokenizer.from_pretrained(folder)``; a folder without a tokenizer it can read is refused in one line
    that names the files and how to add them."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not has_tokenizer(folder):
        raise _no_tokenizer(folder)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError, KeyError) as err:
        reason = " ".join(str(err).split())[:200]
        raise ModelFolderError(f"{folder}: its tokenizer does not load ({reason}): {_no_tokenizer(folder)}") from None
