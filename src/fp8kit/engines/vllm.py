"""vLLM as the reader of fp8kit's exports: one subprocess in vLLM's own virtual environment loads each export
folder in turn with ``vllm.LLM`` (the engine in-process, so its start-up is paid once), generates a few greedy
tokens, scores held-out token windows with prompt log-probabilities, and reports, per folder, whether it
loaded and ran, the exception text where it did not, the quant method vLLM chose for each layer and whether
the checkpoint's tensors landed bit for bit in the layer's parameters (``_vllm_worker.py`` holds that side).

The vLLM interpreter is ``$FP8KIT_VLLM_PYTHON`` (``scripts/vllm_env.sh`` builds ``.venv-vllm/bin/python``).
``held_out_windows`` gives the token windows fp8kit's own evaluation and vLLM's share, and ``fp8kit_losses``
scores a folder with fp8kit's reader (``fp8kit.export.load_pretrained``) on them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ENV_VAR",
    "VllmError",
    "engine_environment",
    "fp8kit_losses",
    "held_out_windows",
    "perplexity_of",
    "score_beside_fp8kit",
    "run_vllm",
    "vllm_python",
    "vllm_unavailable",
]

ENV_VAR = "FP8KIT_VLLM_PYTHON"
WORKER = Path(__file__).with_name("_vllm_worker.py")
_BUILD_HINT = f"build it with `bash scripts/vllm_env.sh` and set {ENV_VAR}=.venv-vllm/bin/python"


class VllmError(RuntimeError):
    """vLLM's interpreter is missing or its subprocess failed before reporting."""


def vllm_python() -> str | None:
    """The interpreter of vLLM's virtual environment: ``$FP8KIT_VLLM_PYTHON`` as an absolute path (a relative
    one is read from the current directory; symlinks are kept, so the venv's own interpreter runs), or
    ``None`` when unset."""
    python = os.environ.get(ENV_VAR)
    return os.path.abspath(python) if python else None


def vllm_unavailable(python: str | None = None) -> str | None:
    """Why vLLM cannot be run (one line), or ``None`` when ``python`` (default ``vllm_python()``) imports it."""
    python = python or vllm_python()
    if python is None:
        return f"{ENV_VAR} is not set: {_BUILD_HINT}"
    if not Path(python).is_file():
        return f"{ENV_VAR}={python} does not exist: {_BUILD_HINT}"
    probe = subprocess.run(
        [python, "-c", "import importlib.util as u; assert u.find_spec('vllm'), 'no vllm'"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"{python} cannot import vllm ({last}): {_BUILD_HINT}"
    return None


def engine_environment(threads: int | None = None) -> dict[str, str]:
    """The environment of vLLM's subprocess: the engine in-process, OpenMP bound to this machine's first
    ``threads`` cores (default all) with none reserved, a 2 GiB KV cache, and a model-step timeout raised so
    that a loaded CPU machine does not kill a slow first step."""
    n = threads or os.cpu_count() or 1
    env = dict(os.environ)
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1800",
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.pop("PYTHONPATH", None)  # vLLM's environment, not this one's source tree
    return env


def run_vllm(
    folders: list[str | Path],
    windows: torch.Tensor | dict[str, torch.Tensor],
    python: str | None = None,
    new_tokens: int = 4,
    dtype: str = "bfloat16",
    timeout: float | None = 3600,
    emulate_fp4: bool = False,
    engine_args: dict[str | Path, dict[str, Any]] | None = None,
    prompts: dict[str | Path, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Load each of ``folders`` in vLLM (one subprocess, one after the other) and score ``windows`` (``(n,
    seq_len + 1)`` token ids; or a ``{folder: windows}`` map) there. Returns ``{"vllm": version, "results": [per folder]}``; each result holds
    ``loaded``, ``error`` (``{"stage", "text"}`` or ``None``), ``quant_config``, ``layers``, ``weights``,
    ``generated``, ``window_losses`` and ``ppl`` (see ``_vllm_worker``). ``emulate_fp4``: an export refused
    for want of an FP4 kernel is loaded again with vLLM's own FP4 emulation kernels (``emulated``, and the
    refusal as ``no_kernel``). ``engine_args``: per folder, ``vllm.LLM`` keywords over the defaults (a
    multimodal model needs ``skip_tokenizer_init=False``: its processor reads the tokenizer). ``prompts``: per
    folder, ``{"prompt": text, "image": H x W x 3 uint8 array}`` or ``{"prompt", "audio": samples,
    "sampling_rate", "decoder_prompt"}`` (an encoder-decoder's: text and audio to the encoder) items that vLLM
    runs through its own processor; each folder's result then holds ``prompts``: per item the token ids vLLM
    built (image placeholders expanded; the decoder's), each token's log-probability after the first, and the
    greedy tokens. A folder whose windows are empty is scored on its prompts alone. Raises
    ``VllmError`` when vLLM is not available or the subprocess died before writing a result for every folder."""
    python = os.path.abspath(python) if python else vllm_python()  # the worker runs in a temporary folder
    reason = vllm_unavailable(python)
    if reason:
        raise VllmError(reason)
    paths = [str(Path(f).absolute()) for f in folders]
    if isinstance(windows, dict):
        by_path = {str(Path(f).absolute()): w.tolist() for f, w in windows.items()}
        missing = [p for p in paths if p not in by_path]
        if missing:
            raise ValueError(f"run_vllm: no windows for {', '.join(missing)}")
        job_windows: Any = {p: by_path[p] for p in paths}
    else:
        job_windows = windows.tolist()
    job = {
        "folders": paths,
        "windows": job_windows,
        "new_tokens": new_tokens,
        "dtype": dtype,
        "emulate_fp4": emulate_fp4,
        "engine_args": {str(Path(f).absolute()): dict(a) for f, a in (engine_args or {}).items()},
        "prompts": {
            str(Path(f).absolute()): [
                {**p, **{k: _as_list(p[k]) for k in ("image", "audio") if p.get(k) is not None}} for p in items
            ]
            for f, items in (prompts or {}).items()
        },
    }
    with tempfile.TemporaryDirectory(prefix="fp8kit-vllm-") as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job))
        worker = Path(tmp) / "fp8kit_vllm_worker.py"  # run from a copy: this folder's vllm.py would shadow vLLM
        worker.write_text(WORKER.read_text())
        proc = subprocess.run(
            [str(python), str(worker), str(job_file), str(out_file)],
            env=engine_environment(),
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        got = json.loads(out_file.read_text()) if out_file.is_file() else {"results": []}
    if len(got["results"]) < len(folders):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise VllmError(
            f"vLLM's subprocess exited with {proc.returncode} after {len(got['results'])} of {len(folders)} "
            f"folders:\n{tail}"
        )
    got["log_tail"] = "\n".join(proc.stderr.strip().splitlines()[-40:])
    return got


def _as_list(image: Any) -> list:
    """An image or audio array (numpy array, tensor or nested lists) as nested lists, for the job file."""
    return image.tolist() if hasattr(image, "tolist") else list(image)


def held_out_windows(tokenizer: Any, n: int = 2, seq_len: int = 256, text: str | Path | None = None) -> torch.Tensor:
    """``n`` windows of ``seq_len + 1`` token ids from the test split of the shipped corpus (or ``text``), as
    ``fp8kit compare`` cuts them: never used for calibration."""
    from ..data.corpus import load_ids
    from ..data.splits import ptq_splits, windows

    ids, name = load_ids(text, tokenizer)
    sp = ptq_splits(ids, name)
    return windows(sp.test, n, seq_len, sp.block)


def fp8kit_losses(folder: str | Path, windows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Each window's mean next-token loss with the export read by fp8kit (``export.load_pretrained``)."""
    from ..data.evaluation import window_losses
    from ..export import load_pretrained

    return window_losses(load_pretrained(folder, dtype=dtype), windows)


def perplexity_of(losses: list[float] | torch.Tensor) -> float:
    """``exp`` of the mean of per-window losses (windows of equal length)."""
    vals = [float(x) for x in losses]
    return math.exp(sum(vals) / len(vals))


def score_beside_fp8kit(
    folder: str | Path, n_windows: int = 4, seq_len: int = 256, text: str | Path | None = None
) -> dict[str, Any]:
    """Perplexity of the export ``folder`` read by fp8kit and by vLLM on the same held-out windows (the test
    split of the shipped corpus, or of ``text``, tokenized by the folder's tokenizer). Returns ``fp8kit_ppl``,
    ``vllm_ppl`` (``None`` when vLLM did not run it), ``vllm`` (its version), ``result`` (``run_vllm``'s
    record) and ``tokens`` (scored per reader)."""
    from transformers import AutoTokenizer

    from ..export.common import ExportError, read_config

    if "quantization_config" not in read_config(folder):
        raise ExportError(f"{folder} is not a quantized export (no quantization_config in config.json)")
    reason = vllm_unavailable()
    if reason:
        raise VllmError(f"--engine vllm: {reason}")
    windows = held_out_windows(AutoTokenizer.from_pretrained(folder), n_windows, seq_len, text)
    ours = perplexity_of(fp8kit_losses(folder, windows))
    got = run_vllm([folder], windows, dtype="float32")
    result = got["results"][0]
    return {
        "fp8kit_ppl": ours,
        "vllm_ppl": result.get("ppl"),
        "vllm": got["vllm"],
        "result": result,
        "tokens": windows.shape[0] * (windows.shape[1] - 1),
    }
