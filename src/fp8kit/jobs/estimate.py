"""Seconds per phase of a job, priced from the device's measured ``Rates`` (used by ``fp8kit.jobs.cost``).

A training step sums, per ``nn.Linear`` of the model, the planner's roofline of its three matmuls with the
run's recipe (``planner.roofline.layer_seconds``: FLOPs, bytes and the recipe's quantization passes) plus
the fixed seconds one step of a tiny layer with that recipe takes (dispatch, scale bookkeeping); per decoder
layer its attention matmuls and elementwise ops (each a fixed call cost plus its bytes); and the AdamW update
(its bytes, a fixed cost per parameter tensor). The output head stays in high precision. A PTQ run prices
each step of ``ptq.quantize.PIPELINE`` that runs for the scheme and options (the same rule the run uses):
its passes over the calibration data as forward passes, plus what the step does per layer (the MSE scale
search, GPTQ's Hessians and column sweep, AWQ's grid, the kernels the scheme's first quantization compiles),
and the export's write. Memory: a job's process holds, before its model, what a fresh process that did the
job's imports holds (``process_floor``), and a training step the activations it saves times a measured
retention (``held_activation_bytes``).

``current_rates`` measures the rates once per machine (``planner.roofline.cpu_roofline`` on the CPU, about a
minute on a loaded 2-core machine) and caches them under ``cache_dir()/rates``; ``set_rates`` fixes them
instead (the tests do).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from .model_shape import ModelShape

if TYPE_CHECKING:
    from ..planner.roofline import GPU

__all__ = [
    "Rates",
    "activation_bytes",
    "current_rates",
    "doctor_rates",
    "set_rates",
    "forward_seconds",
    "held_activation_bytes",
    "load_seconds",
    "process_floor",
    "ptq_phases",
    "training_seconds",
]

# counts of the ops a decoder layer runs besides its Linear layers (norms, rotary, residuals, softmax,
# activation), forward; a backward runs about twice as many
_ELEMENTWISE_OPS = 24
_ADAMW_OPS = 12  # per parameter tensor: the moments' updates, bias corrections, decay, the step
_ADAMW_BYTES = 4 * 4 * 3  # read and write parameter, moments; read gradient (FP32), about 3 passes
_GPTQ_COLUMN_OPS = 10  # ops per weight column in GPTQ's sweep (round, error, rank-1 update)
_MSE_CANDIDATE_OPS = 6  # ops per candidate scale of the MSE search (quantize, dequantize, error)


@dataclass(frozen=True)
class Rates:
    """What the device does per second and per call: the planner's roofline (``GPU``: FLOP/s, bytes/s,
    cast and call costs), the checkpoint read rate (bytes/s), per recipe the seconds of one training step of
    a tiny layer (the fixed cost a recipe adds per Linear and step), and how far the real module stack runs
    from the model: the demo decoder's measured forward and, per recipe, training step over their modelled
    seconds (``forward_scale``, ``step_scale``; 1 when not measured), one report figure's seconds, and per
    recipe the doctor's step (both copies, its statistics) over the modelled BF16 + FP8 steps, with its fixed
    seconds (diagnosis, the report's data). The process around the model is measured in fresh processes
    (``_probe``): its imports, a tokenizer's rate and memory, the first quantized forward, a training step's
    memory and each PTQ scheme's first quantization."""

    roofline: GPU
    load_bytes_per_s: float
    recipe_call_s: dict[str, float] = field(default_factory=dict)
    forward_scale: float = 1.0  # measured / modelled forward of the demo decoder
    step_scale: dict[str, float] = field(default_factory=dict)  # the same for a training step, per recipe
    figure_s: float = 0.0  # one report figure rendered and written (matplotlib)
    doctor: dict[str, tuple[float, float]] = field(default_factory=dict)  # recipe -> (step scale, fixed seconds)
    # the process around the model (``_process_rates``; 0: not measured)
    import_s: float = 0.0  # importing transformers' causal-LM classes in a fresh process
    process_bytes: int = 0  # peak resident memory of a process that did what a job does before its cost line
    tokenize_bytes_per_s: float = 0.0  # a byte-level Hugging Face fast tokenizer encoding text into a tensor
    tokenize_bytes_per_token: float = 0.0  # the peak memory that encoding takes per token (its lists, the tensor)
    tokenize_overhead: float = 1.0  # transformers' tokenizer call over the bare ``tokenizers`` encode it wraps
    first_quantized_s: float = 0.0  # a process's first forward through PTQ's layers (their kernels compile)
    quantized_process_bytes: int = 0  # resident memory of a process after that forward (the compiler loaded)
    # a BF16 training step's peak growth (the demo decoder) beyond its state, over its modelled activations
    # (0: not measured)
    step_memory_scale: float = 0.0
    # per PTQ scheme: a process's first quantization beyond a later one (the kernels it compiles)
    first_quantize_s: dict[str, float] = field(default_factory=dict)

    def layer_call_s(self, recipe: str) -> float:
        """Fixed seconds per Linear and training step with ``recipe``: measured, else the roofline's
        call costs (3 matmuls, 6 quantization passes for an FP8 recipe)."""
        if recipe in self.recipe_call_s:
            return self.recipe_call_s[recipe]
        r = self.roofline
        return 3 * r.matmul_call_s + (0 if recipe == "bf16" else 6 * r.cast_call_s)

    @property
    def op_call_s(self) -> float:
        """Fixed seconds per elementwise op (the roofline's per-matmul call cost)."""
        return self.roofline.matmul_call_s


# ---- measuring and caching -------------------------------------------------------------------------------
_MEMO: dict[str, Rates] = {}
_FIXED: list[Rates] = []  # set_rates: the rates every estimate uses instead of measured ones


def set_rates(rates: Rates | None) -> None:
    """Price every estimate with ``rates`` instead of this machine's measured ones (``None``: measure again)."""
    _FIXED[:] = [] if rates is None else [rates]


def _cache_file(device: torch.device) -> Path:
    from ..models.pretrained import cache_dir

    key = f"{device.type}-{platform.machine()}-{os.cpu_count()}cpu-{torch.get_num_threads()}t-torch{torch.__version__}"
    if device.type == "cuda":
        key += "-" + torch.cuda.get_device_name(device).replace(" ", "_")
    return cache_dir() / "rates" / f"{key}.json"


def current_rates(
    device: torch.device, recipes: list[str] | tuple[str, ...] = (), schemes: list[str] | tuple[str, ...] = ()
) -> Rates:
    """This machine's ``Rates`` for ``device``: from the cache file, else measured now and cached; each of
    ``recipes`` missing from it gets its per-call cost measured (CPU) and cached too, and each PTQ scheme of
    ``schemes`` its first quantization's extra seconds (``_probe("quantize", scheme)``, CPU)."""
    from ..planner.roofline import GPU

    if _FIXED:
        return _FIXED[0]
    path = _cache_file(device)
    rates = _MEMO.get(str(path))
    if rates is None and path.is_file():
        try:
            data = json.loads(path.read_text())
            data["roofline"] = GPU(**{**data["roofline"], "capability": tuple(data["roofline"]["capability"])})
            data["doctor"] = {k: tuple(v) for k, v in data.get("doctor", {}).items()}
            rates = Rates(**{k: v for k, v in data.items() if k in Rates.__dataclass_fields__})  # newer fields: kept
        except (ValueError, KeyError, TypeError):
            rates = None
    if rates is None:
        print(f"fp8kit: measuring this machine's rates for the estimates, once (cached in {path})", file=sys.stderr)
        rates = _measure(device)
    if not rates.step_memory_scale:  # a cache written before these were measured
        rates = replace(rates, **_process_rates())
        _MEMO.pop(str(path), None)
    missing = [r for r in recipes if r not in rates.step_scale and device.type == "cpu"]
    new_schemes = [q for q in schemes if q not in rates.first_quantize_s and device.type == "cpu"]
    if new_schemes:
        first = {q: _probe("quantize", q)[0] for q in new_schemes}
        rates = replace(rates, first_quantize_s=rates.first_quantize_s | first)
        _MEMO.pop(str(path), None)
    if missing or str(path) not in _MEMO:
        if missing:
            from ..planner.roofline import step_seconds

            calls = rates.recipe_call_s | {r: step_seconds(16, 16, r) for r in missing}
            rates = replace(rates, recipe_call_s=calls)
            rates = replace(rates, step_scale=rates.step_scale | {r: _step_scale(rates, r) for r in missing})
        _store(device, rates)
    return rates


def _measure(device: torch.device) -> Rates:
    from ..planner.roofline import GPU, cpu_roofline

    if device.type == "cpu":
        roofline = cpu_roofline()
    else:
        flops = device_flops(device)
        src = torch.randn(16 * 2**20, device=device)
        dst = torch.empty_like(src)
        roofline = GPU("cuda", flops, flops, 2 * src.numel() * 4 / _timed(lambda: dst.copy_(src), device), (0, 0),
                       matmul_call_s=_timed(lambda: dst[:16].add_(1), device))  # fmt: skip
    rates = Rates(roofline, _load_rate(), **_process_rates())
    if device.type != "cpu":
        return rates
    rates = replace(rates, forward_scale=_forward_scale(rates), figure_s=_figure_seconds())
    return replace(rates, step_scale={"bf16": _step_scale(rates, "bf16")})


def _demo(recipe: str | None = None) -> tuple[torch.nn.Module, ModelShape]:
    from ..models import build_demo
    from ..nn import convert, to_bf16_gemms
    from .model_shape import module_shape

    model = build_demo("dense", "small", max_seq_len=128)
    shape = module_shape(model)
    if recipe is not None and recipe != "bf16":
        convert(model, recipe)
    return to_bf16_gemms(model), shape


def _forward_scale(rates: Rates) -> float:
    """The demo decoder's forward over 4 x 128 tokens, measured over modelled."""
    model, shape = _demo()
    x = torch.randint(0, 256, (4, 128))
    with torch.no_grad():
        measured = _timed(lambda: model(x), torch.device("cpu"), reps=3)
    return measured / forward_seconds(shape, 4 * 128, replace(rates, forward_scale=1.0))


def _step_scale(rates: Rates, recipe: str) -> float:
    """One training step (forward, backward, AdamW) of the demo decoder with ``recipe`` on 4 x 128 tokens,
    measured over modelled."""
    model, shape = _demo(recipe)
    x = torch.randint(0, 256, (4, 128))
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
        logits.float().mean().backward()
        opt.step()
        opt.zero_grad()

    measured = _timed(step, torch.device("cpu"), reps=3)
    return measured / step_model(shape, recipe, 4 * 128, 4 * 128, replace(rates, step_scale={}))


def doctor_rates(device: torch.device, recipe: str) -> tuple[float, float]:
    """``Rates.doctor[recipe]``: measured once (``debug.doctor`` on the demo decoder for 1 and 2 steps of
    8 x 64 tokens, the ``fp8kit doctor`` defaults) and cached; ``(1, 0)`` off the CPU."""
    rates = current_rates(device, [recipe])
    if recipe in rates.doctor or device.type != "cpu" or _FIXED:
        return rates.doctor.get(recipe, (1.0, 0.0))
    from ..debug import doctor
    from ..models import build_demo
    from .model_shape import module_shape

    model = build_demo("dense", "small", max_seq_len=128)
    shape = module_shape(model)
    x = torch.randint(0, 256, (8, 64))
    times = []
    for steps in (1, 2):
        t0 = time.perf_counter()
        doctor(model, [{"input_ids": x, "labels": x}], recipe=recipe, steps=steps, progress=False)
        times.append(time.perf_counter() - t0)
    per_step = max(times[1] - times[0], times[1] / 4)
    modelled = sum(step_model(shape, r, 8 * 64, 8 * 64, rates) for r in ("bf16", recipe))
    measured = (per_step / modelled, max(times[0] - per_step, 0.0))
    rates = replace(rates, doctor=rates.doctor | {recipe: measured})
    _store(device, rates)
    return measured


def _store(device: torch.device, rates: Rates) -> None:
    path = _cache_file(device)
    _MEMO[str(path)] = rates
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(rates)))
    except OSError:
        pass  # a read-only cache: measured again next time


def _figure_seconds() -> float:
    """One small line plot rendered and written as a PNG (the reports' figures)."""
    import tempfile

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0.0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(range(100), range(100))
        fig.savefig(os.path.join(tmp, "f.png"))
        plt.close(fig)
        return time.perf_counter() - t0


# What a job's process costs besides its model, each measured in a fresh process: ``python -c PROBE ARG``
# prints its seconds and its own peak resident bytes (``VmHWM``; ``ru_maxrss`` where there is no /proc, though it
# carries the parent's peak over a spawn). ``job_floor`` does what every job does before its
# cost line: imports fp8kit's CLI and builds a transformers causal LM (the demo decoder, on the meta device), whose
# model classes pull in torch's compiler stack (dynamo, inductor, sympy), torchao and scipy.
_PROBE = """
import os, resource, sys, time
def rss():  # the process's own peak: VmHWM (ru_maxrss keeps the parent's peak across fork and exec)
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def job_floor():
    import fp8kit.cli
    from fp8kit.models import build_demo
    with torch.device("meta"):
        build_demo("dense", "small", max_seq_len=128)
import torch
t0 = time.perf_counter()
if sys.argv[1] == "transformers":
    from transformers import AutoModelForCausalLM
    seconds = time.perf_counter() - t0
    job_floor()
    print(seconds, rss())
    sys.exit()
elif sys.argv[1] == "tokenize":  # prints seconds, the peak's growth, seconds of the bare tokenizers call
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    bare = Tokenizer(models.BPE(vocab={c: b for b, c in bytes_to_unicode().items()}, merges=[]))
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bare)
    text = ("In the beginning God created the heaven and the earth. " * 40000)[: 2**21]
    t0 = time.perf_counter()
    bare.encode(text, add_special_tokens=False)
    raw = time.perf_counter() - t0
    before = resident()
    t0 = time.perf_counter()
    encoded = tok(text, add_special_tokens=False)
    ids = torch.tensor(encoded["input_ids"])
    print(time.perf_counter() - t0, rss() - before, raw)
    sys.exit()
elif sys.argv[1] == "quantized":
    job_floor()
    t0 = time.perf_counter()
    from fp8kit import ptq
    model = ptq.quantize(torch.nn.Sequential(torch.nn.Linear(64, 64)), "fp8-dynamic")
    x = torch.randn(8, 64)
    with torch.no_grad():
        model(x)
        t1 = time.perf_counter()
        model(x)
        t0 += time.perf_counter() - t1  # the first forward beyond a later one
elif sys.argv[1] == "quantize":  # PTQ of a two-layer model with GPTQ: the first run beyond a second one
    job_floor()
    import copy
    from fp8kit import ptq
    torch.manual_seed(0)
    base, x = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)), torch.randn(8, 64)
    times = []
    for _ in range(2):
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        ptq.quantize(model, sys.argv[2], lambda m: m(x), gptq=True, progress=False)
        times.append(time.perf_counter() - t0)
    print(times[0] - times[1], rss())
    sys.exit()
elif sys.argv[1] == "train":  # prints the peak's growth over the floor of 3 BF16 steps (AdamW) of the demo decoder
    job_floor()
    from fp8kit.models import build_demo
    floor = resident()
    model = build_demo("dense", "small", max_seq_len=128)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (int(sys.argv[2]), 128))
    for _ in range(3):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    print(0.0, max(rss() - floor, 0))
    sys.exit()
print(time.perf_counter() - t0, rss())
"""


def _probe(what: str, *args: str) -> tuple[float, ...]:
    """``(seconds, bytes)`` of ``_PROBE`` run for ``what``: ``transformers`` (the seconds of importing its
    causal-LM classes after torch; the peak of a process that did ``job_floor``), ``tokenize`` (2 MiB of text
    encoded by a Hugging Face fast tokenizer into a tensor; the peak's growth), ``quantized`` (after ``job_floor``,
    a process's first forward through a PTQ layer beyond a later one, whose kernels compile or come from the
    compiler's cache; the process's peak), ``train BATCH`` (the peak's growth over ``job_floor`` of 3 BF16 training
    steps of the demo decoder on ``BATCH`` x 128 tokens); ``(0, 0)`` when it cannot run."""
    import subprocess

    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE, what, *args], capture_output=True, text=True, timeout=600, check=True
        )
        return tuple(max(float(v), 0.0) for v in out.stdout.splitlines()[-1].split())
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return (0.0, 0.0, 0.0) if what == "tokenize" else (0.0, 0.0)


_PROBE_BATCH = 16  # sequences of 128 tokens per step of the ``train`` probe (``fp8kit train``'s default)


def _process_rates() -> dict[str, float]:
    """The ``Rates`` fields a job's process adds to its model: imports, tokenizing, the first quantized forward,
    and how much memory a training step holds beyond the modelled state and activations."""
    imports, process = _probe("transformers")
    tokenize, tokenize_bytes, bare = _probe("tokenize")
    first_quantized, quantized_process = _probe("quantized")
    _, grown = _probe("train", str(_PROBE_BATCH))
    shape = _demo_shape()
    state = 16 * shape.params  # FP32 weights, gradients, AdamW's two moments
    modelled = activation_bytes(shape, _PROBE_BATCH * 128, 4)
    return {
        "import_s": imports,
        "process_bytes": int(process),
        "tokenize_bytes_per_s": 2**21 / tokenize if tokenize else 0.0,
        "tokenize_bytes_per_token": tokenize_bytes / 2**21,  # one token per byte
        "tokenize_overhead": tokenize / bare if bare else 1.0,
        "first_quantized_s": first_quantized,
        "quantized_process_bytes": int(quantized_process),
        "step_memory_scale": max((grown - state) / modelled, 1.0) if grown else 1.0,
    }


def _demo_shape() -> ModelShape:
    """The demo decoder's shape (built on the meta device), as the probes build it."""
    from ..models import build_demo
    from .model_shape import module_shape

    with torch.device("meta"):
        return module_shape(build_demo("dense", "small", max_seq_len=128))


def activation_bytes(shape: ModelShape, tokens: int, bytes_per_value: int) -> int:
    """Bytes one micro-batch of ``tokens`` tokens saves for backward: per layer ~17 values per token and
    hidden unit (Korthikanti et al.: 34 bytes at 16 bits, attention scores aside), plus the FP32 logits
    and their gradient."""
    layers = shape.layers * tokens * shape.hidden * 17 * bytes_per_value
    return layers + 2 * tokens * shape.vocab * 4


def held_activation_bytes(shape: ModelShape, tokens: int, bytes_per_value: int, rates: Rates) -> int:
    """What one training micro-batch of ``tokens`` tokens holds in a CPU process: its saved activations
    (``activation_bytes``) times ``rates.step_memory_scale`` (the allocator keeps the blocks a step freed
    and the backward's temporaries beside them)."""
    return int(activation_bytes(shape, tokens, bytes_per_value) * (rates.step_memory_scale or 1.0))


def process_floor(rates: Rates, compiles: bool) -> int:
    """Resident bytes of a job's process before its model: one that did what every job does before its cost
    line (``job_floor``), and, when the job runs fp8kit's compiled kernels (``compiles``: an FP8 training recipe,
    a pass through PTQ's layers), one that also ran them once (the compiler loaded)."""
    return max(rates.process_bytes, rates.quantized_process_bytes if compiles else 0)


def _timed(fn: Any, device: torch.device, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _load_rate() -> float:
    """Bytes/s of writing and reading back a 64 MiB safetensors file (a checkpoint's load or save)."""
    import tempfile

    from safetensors.torch import load_file, save_file

    t = {"w": torch.randn(16 * 2**20)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.safetensors")
        t0 = time.perf_counter()
        save_file(t, path)
        load_file(path)["w"].add_(0)
        seconds = time.perf_counter() - t0
    return 2 * t["w"].numel() * 4 / max(seconds, 1e-9)


# ---- pricing ------------------------------------------------------------------------------------------------
def _gemms(shape: ModelShape) -> tuple[tuple[int, int], ...]:
    """The model's Linear dims; without them, its parameters as square ``hidden`` layers plus the head."""
    if shape.gemms:
        return shape.gemms
    h = max(shape.hidden, 1)
    body = max(shape.params - 2 * shape.vocab * h, 0)
    return ((h, h),) * (body // (h * h)) + (((h, shape.vocab),) if shape.vocab else ())


def _is_head(shape: ModelShape, dims: tuple[int, int]) -> bool:
    return shape.vocab > 0 and dims[1] == shape.vocab


def tokenizer_sample(folder: Path | None, text: str) -> tuple[float, float] | None:
    """``(seconds, tokens per byte)`` of the Hugging Face tokenizer in ``folder`` (its ``tokenizer.json``, read by
    the bare ``tokenizers`` library, without transformers' wrapper) encoding all of ``text``: timed on its first
    128 and 512 KiB and extrapolated by the power law of those two (a tokenizer whose pre-tokenizer does not split
    the text into words takes more than linear time); ``None`` when there is no tokenizer to read."""
    if folder is None or not (Path(folder) / "tokenizer.json").is_file() or not text:
        return None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        timed = []
        for size in (1 << 17, 1 << 19):
            part = text[:size]
            t0 = time.perf_counter()
            tokens = len(tok.encode(part, add_special_tokens=False).ids)
            timed.append((len(part.encode()), max(time.perf_counter() - t0, 1e-9), tokens))
    except Exception:  # noqa: BLE001 - any tokenizer this library cannot read: priced as the byte-level one
        return None
    (n1, t1, _), (n2, t2, tokens) = timed
    power = min(max(math.log(t2 / t1) / math.log(n2 / n1), 1.0), 2.0) if n2 > n1 else 1.0
    return t2 * (len(text.encode()) / n2) ** power, tokens / n2


def tokenize_cost(text_bytes: int, rates: Rates, sample: tuple[float, float] | None = None) -> tuple[float, int]:
    """``(seconds, bytes)`` of encoding ``text_bytes`` of text into a tensor of token ids through transformers:
    ``sample``'s seconds (``tokenizer_sample``, of these texts) times the wrapper's measured overhead, else at the
    measured byte-level tokenizer's rate (a token per byte); the memory, the measured peak bytes per token."""
    if sample is not None:
        seconds, per_byte = sample[0] * rates.tokenize_overhead, sample[1]
    else:
        rate, per_byte = rates.tokenize_bytes_per_s, 1.0
        seconds = text_bytes / rate if rate > 0 else 0.0
    return seconds, int(text_bytes * per_byte * rates.tokenize_bytes_per_token)


def load_seconds(shape: ModelShape, rates: Rates) -> float:
    """Reading the checkpoint and building the model: its bytes at the load rate, its weights written once."""
    return shape.checkpoint_bytes / rates.load_bytes_per_s + 4 * shape.params / rates.roofline.hbm_bytes_per_s


def _layer_ops_seconds(shape: ModelShape, tokens: int, seq_len: int, rates: Rates, passes: int) -> float:
    """Attention matmuls and elementwise ops of every decoder layer, ``passes`` = 1 forward, 3 with backward."""
    r = rates.roofline
    attention = 4 * tokens * min(seq_len, tokens) * shape.hidden / r.bf16_flops
    elementwise = _ELEMENTWISE_OPS * (rates.op_call_s + 8 * tokens * shape.hidden / r.hbm_bytes_per_s)
    return passes * shape.layers * (attention + elementwise)


def forward_seconds(shape: ModelShape, tokens: int, rates: Rates, seq_len: int = 128) -> float:
    """One forward pass over ``tokens`` tokens in batches of ``seq_len``: every Linear's matmul and call,
    the layers' attention and elementwise ops."""
    r = rates.roofline
    batches = max(tokens // max(seq_len * 4, 1), 1)  # the calibration / eval batches (4 sequences)
    gemm = sum(2 * tokens * i * o / r.bf16_flops + batches * r.matmul_call_s for i, o in _gemms(shape))
    return rates.forward_scale * (gemm + batches * _layer_ops_seconds(shape, tokens // batches, seq_len, rates, 1))


def training_seconds(
    shape: ModelShape,
    recipe: str,
    steps: int,
    tokens_per_step: int,
    micro_tokens: int,
    rates: Rates,
    eval_tokens: int = 0,
    seq_len: int = 128,
) -> float:
    """``steps`` optimizer steps of ``recipe`` (``bf16`` or an FP8 recipe name), each of
    ``tokens_per_step // micro_tokens`` micro-batches, plus forward passes over ``eval_tokens`` and the
    checkpoint's write; scaled by the measured ``step_scale`` / ``forward_scale``."""

    recipe = recipe if _is_recipe(recipe) else "bf16"  # a per-layer plan (auto): priced at its BF16 floor
    step = step_model(shape, recipe, tokens_per_step, micro_tokens, rates, seq_len)
    step *= rates.step_scale.get(recipe, rates.step_scale.get("bf16", 1.0))
    evaluate = forward_seconds(shape, eval_tokens, rates, seq_len) if eval_tokens else 0.0
    if recipe != "bf16" and "bf16" in rates.step_scale and recipe in rates.step_scale:
        evaluate *= rates.step_scale[recipe] / rates.step_scale["bf16"]  # an emulated FP8 forward costs more
    save = 16 * shape.params / rates.load_bytes_per_s  # the run's checkpoint: weights and optimizer state
    return steps * step + evaluate + save


def step_model(
    shape: ModelShape, recipe: str, tokens_per_step: int, micro_tokens: int, rates: Rates, seq_len: int = 128
) -> float:
    """Modelled seconds of one optimizer step (before ``step_scale``)."""
    from ..planner.roofline import Gemm, layer_seconds

    free = replace(rates.roofline, matmul_call_s=0.0, cast_call_s=0.0)  # the fixed costs: layer_call_s
    micro = max(micro_tokens, 1)
    micro_step = 0.0
    for dims in _gemms(shape):
        candidate = "bf16" if recipe == "bf16" or _is_head(shape, dims) else recipe
        micro_step += layer_seconds([Gemm(micro, *dims)], candidate, free) + rates.layer_call_s(candidate)
    micro_step += _layer_ops_seconds(shape, micro, seq_len, rates, 3)
    tensors = 2 * shape.layers + len(_gemms(shape)) + 2  # norms, Linears, embedding and final norm
    optimizer = shape.params * _ADAMW_BYTES / rates.roofline.hbm_bytes_per_s + tensors * _ADAMW_OPS * rates.op_call_s
    accum = max(tokens_per_step // micro, 1)
    return accum * micro_step + optimizer


def _is_recipe(name: str) -> bool:
    from ..numerics.recipes import recipe_from_name

    if name == "bf16":
        return True
    try:
        recipe_from_name(name)
    except (ValueError, KeyError):
        return False
    return True


def ptq_phases(
    shape: ModelShape,
    scheme: str,
    settings: dict[str, Any],
    calib_batches: int,
    rates: Rates,
    tokens_per_batch: int = 4 * 128,
    export: bool = True,
) -> dict[str, float]:
    """Seconds of each step ``ptq.quantize`` will run for ``scheme`` with ``settings`` (``jobs.quantize.
    ptq_settings``' keywords), decided by the pipeline's own rule (``PIPELINE``'s ``runs``), and of the export."""
    from ..ptq.awq import AWQ_GRID
    from ..ptq.calibrate import MSE_GRID
    from ..ptq.quantize import PIPELINE, PTQOptions
    from ..ptq.schemes import get_scheme

    scheme_obj = get_scheme(scheme.removesuffix("+kv"))
    keys = ("calibration", "alpha", "smooth", "kv_cache", "gptq", "awq", "keep_bf16", "norm_tweak")
    opts = PTQOptions(**{k: settings[k] for k in keys if k in settings})
    run = SimpleNamespace(
        scheme=scheme_obj,
        opts=opts,
        calibrating=opts.needs_data(scheme_obj),
        progress=SimpleNamespace(batches=calib_batches),
        targets=[None] * len(_gemms(shape)),
    )
    r = rates.roofline
    tokens = calib_batches * tokens_per_batch
    one_pass = forward_seconds(shape, tokens, rates)
    body = [d for d in _gemms(shape) if not _is_head(shape, d)]
    # a pass over the quantized model also quantizes each layer's input (and decodes its weight codes)
    quantized_pass = one_pass + calib_batches * sum(
        (3 * tokens_per_batch * i + 3 * i * o) / r.cast_bytes_per_s + 2 * r.cast_call_s for i, o in _gemms(shape)
        if not _is_head(shape, (i, o))
    )  # fmt: skip
    phases: dict[str, float] = {}
    for step in PIPELINE:
        if not step.runs(run):
            continue
        seconds = step.passes(run) * (quantized_pass if step.name in ("rank", "norm tweak") else one_pass)
        if step.name == "awq":  # per layer: the grid's weight casts and sample matmuls
            seconds += sum(AWQ_GRID * (3 * i * o / r.cast_bytes_per_s + 4 * r.cast_call_s) for i, o in body)
        elif step.name == "activation scales" and opts.calibration == "mse":
            seconds += len(body) * MSE_GRID * _MSE_CANDIDATE_OPS * rates.op_call_s
        elif step.name == "gptq hessians":
            seconds += sum(2 * tokens * i * i / r.bf16_flops + calib_batches * r.matmul_call_s for i, _ in body)
        elif step.name == "quantize layers":
            if opts.gptq:  # Cholesky inverse, the blocks' updates, a Python step per column
                seconds += sum((i**3 + 2 * o * i * i) / r.bf16_flops + i * _GPTQ_COLUMN_OPS * rates.op_call_s
                               for i, o in body)  # fmt: skip
            else:
                seconds += sum(3 * i * o / r.cast_bytes_per_s + r.cast_call_s for i, o in body)
            seconds += rates.first_quantize_s.get(scheme.removesuffix("+kv"), 0.0)  # its kernels compile
        if seconds > 0:
            phases[step.name] = seconds
    if export:
        phases["export"] = shape.params * 2 / rates.load_bytes_per_s + len(body) * rates.op_call_s
    return phases


def device_flops(device: torch.device, dtype: torch.dtype | None = None) -> float:
    """FLOP/s a 1024 x 1024 x 1024 GEMM reaches on ``device`` now (in ``dtype``: BF16 on CUDA, FP32 on
    the CPU), best of three after a warm-up."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    a = torch.randn(1024, 1024, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(4):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024**3 / max(best, 1e-9)
