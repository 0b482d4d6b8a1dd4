"""``--model``: the one place a folder path or a Hub ID becomes a local Hugging Face folder (``smollm2``, the
shipped GGUF, is converted by ``models.pretrained``).

Accepted: a local folder, or a Hugging Face Hub ID ``ORG/NAME[@REVISION]`` resolved as ``transformers`` resolves it
(``huggingface_hub.snapshot_download``): from the local cache when offline (``HF_HUB_OFFLINE=1``), downloaded
into it otherwise. An existing local path wins over a Hub ID of the same spelling.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["HUB_FILES", "ModelNotFound", "hub_id", "is_hub_id", "resolve_model"]

# What a causal LM needs from a Hub repository: configs, tokenizer files and safetensors weights.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


class ModelNotFound(FileNotFoundError):
    """A ``--model`` that names neither a local folder nor a resolvable Hub ID (exit code 2)."""


def is_hub_id(text: str) -> bool:
    """Whether ``text`` is spelled as a Hub ID (``ORG/NAME`` or ``ORG/NAME@REVISION``) and is not a local path."""
    return bool(_HUB_ID.match(text)) and not Path(text).exists()


def hub_id(text: str) -> tuple[str, str | None]:
    """``(repo_id, revision)`` of ``ORG/NAME[@REVISION]`` (revision ``None``: the default branch)."""
    repo, _, revision = text.partition("@")
    return repo, revision or None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model(spec: str) -> Path:
    """The local Hugging Face folder of ``spec``: a local folder with ``config.json``, or a Hub ID's snapshot
    (cache or download); ``models.pretrained.pretrained_dir`` serves ``smollm2``. Raises ``ModelNotFound`` in one line that
    names the fix (offline: that ``HF_HUB_OFFLINE`` / the cache is why)."""
    path = Path(spec)
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"--model {spec!r} is a folder without config.json: give a Hugging Face model folder")
        return path
    if not is_hub_id(spec):
        raise ModelNotFound(
            f"--model {spec!r} is neither demo, smollm2, a local folder, nor a Hub ID (ORG/NAME[@REVISION])"
        )
    return _snapshot(spec)


def _snapshot(spec: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, revision = hub_id(spec)
    offline = _offline()
    try:
        folder = snapshot_download(
            repo,
            revision=revision,
            cache_dir=os.environ.get("HF_HUB_CACHE") or None,
            local_files_only=offline,
            allow_patterns=HUB_FILES,
        )
    except LocalEntryNotFoundError:
        why = (
            "not in the Hugging Face cache while HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE to download it, or "
            "fill the cache (HF_HUB_CACHE) on a machine that can reach the Hub"
            if offline
            else "the Hub cannot be reached and the model is not in the cache (HF_HUB_CACHE): connect, or "
            "download it into the cache first"
        )
        raise ModelNotFound(f"--model {spec}: no local folder of that name, and {why}") from None
    except HfHubHTTPError as err:
        reason = str(err).splitlines()[0]
        raise ModelNotFound(
            f"--model {spec}: no local folder of that name, and the Hub refused it ({reason}): check the path, "
            "or the ID, revision and token"
        ) from None
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"--model {spec}: the snapshot {path} has no config.json: not a transformers model")
    return path
