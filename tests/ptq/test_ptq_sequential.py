"""Sequential PTQ (``fp8kit.jobs.layerwise``): a checkpoint quantized one decoder layer at a time gives the
whole-model export bit for bit with round-to-nearest settings (dense Llama, Qwen3-MoE, Mixtral; every
format), the same accuracy with calibrated settings, an export ``transformers`` reloads from several
shards, no complete-looking folder when a run dies half way, and a peak memory the whole-model path
exceeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fp8kit.export import load_pretrained, quantize_block, save_pretrained
from fp8kit.jobs import quantize_checkpoint
from fp8kit.ptq import quantize
from tests.helpers.models import tiny_llama_config
from tests.helpers.moe import qwen3_moe_config, tiny_moe_model

ROOT = Path(__file__).resolve().parents[1]


def _ids(vocab: int, n: int = 8, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def _loop(ids: torch.Tensor):
    return lambda m: [m(input_ids=x) for x in ids.split(4)]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (a high-precision tensor may be stored in another float dtype: BF16 vs float32)."""
    if a.is_floating_point() and b.is_floating_point():
        return (
            a.dtype.itemsize == 1 == b.dtype.itemsize
            and a.view(torch.uint8).equal(b.view(torch.uint8))
            or (a.dtype.itemsize > 1 and b.dtype.itemsize > 1 and torch.equal(a.float(), b.float()))
        )
    return a.dtype == b.dtype and torch.equal(a, b)


def _whole_and_sequential(
    src: Path, tmp: Path, scheme: str, fmt: str, ids: torch.Tensor, propagate: str = "float", **kw
):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model = quantize_block(model) if scheme == "fp8-block" else quantize(model, scheme, _loop(ids), **kw)
    whole = save_pretrained(model, tmp / f"whole-{scheme}-{fmt}", format=fmt)
    out = tmp / f"seq-{scheme}-{fmt}-{propagate}"
    seq, _ = quantize_checkpoint(str(src), scheme, out, _loop(ids), format=fmt, propagate=propagate, **kw)
    return whole, seq


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    import transformers

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama") / "model"
    transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("scheme", "fmt"),
    [
        ("fp8-dynamic", "compressed-tensors"),
        ("fp8-dynamic", "modelopt"),
        ("int8-weight-only", "compressed-tensors"),
        ("fp8-block", "fp8-block"),
    ],
)
def test_round_to_nearest_is_bit_identical_dense(llama_dir, tmp_path, scheme, fmt):
    ids = _ids(256)
    whole, seq = _whole_and_sequential(llama_dir, tmp_path, scheme, fmt, ids)
    a, b = _tensors(whole), _tensors(seq)
    assert set(a) == set(b)
    assert all(_same(a[k], b[k]) for k in a), [k for k in a if not _same(a[k], b[k])]
    qa, qb = (json.loads((p / "config.json").read_text())["quantization_config"] for p in (whole, seq))
    assert qa == qb
    assert sum(k.endswith((".weight_scale", ".weight_scale_inv")) for k in b) == 3 * 7  # every decoder Linear


@pytest.mark.parametrize(
    ("arch", "scheme"),
    [
        ("qwen3_moe", "fp8-dynamic"),
        ("qwen3_moe", "fp8-block"),
        ("mixtral", "int8-weight-only"),
        # fused experts on disk, per-expert in the export; calibrated on each layer's own (sliding) mask
        ("gpt_oss", "fp8"),
    ],
)
def test_round_to_nearest_is_bit_identical_moe(tmp_path, arch, scheme):
    src = tmp_path / "src"
    if scheme == "fp8-block":  # whole 128x128 tiles in every expert
        import transformers

        torch.manual_seed(0)
        cfg = qwen3_moe_config(hidden_size=128, moe_intermediate_size=128, num_experts=8, head_dim=32)
        transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(src)
    else:
        tiny_moe_model(arch).save_pretrained(src)
    fmt = "fp8-block" if scheme == "fp8-block" else "compressed-tensors"
    whole, seq = _whole_and_sequential(src, tmp_path, scheme, fmt, _ids(128))
    a, b = _tensors(whole), _tensors(seq)
    assert set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    assert any(".experts.7." in k for k in b)  # per expert, in the checkpoint's naming
    back = load_pretrained(seq)
    assert len(back.ptq_report.experts) == 2


@pytest.mark.parametrize(
    ("arch", "scheme", "fmt"),
    [
        ("qwen3_moe", "nvfp4", "compressed-tensors"),
        ("mixtral", "nvfp4-weight-only", "modelopt"),
        ("qwen3_moe", "mxfp4-weight-only", "compressed-tensors"),
    ],
)
def test_fp4_experts_layer_by_layer_are_bit_identical(tmp_path, arch, scheme, fmt):
    """FP4 experts (W4A4 with its calibrated input scales too) quantized one layer at a time give the
    whole-model export's tensors, per expert."""
    src = tmp_path / "src"
    tiny_moe_model(arch).save_pretrained(src)
    whole, seq = _whole_and_sequential(src, tmp_path, scheme, fmt, _ids(128))
    a, b = _tensors(whole), _tensors(seq)
    assert set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    assert any(".experts.7." in k and k.endswith("weight_scale") for k in b)
    assert len(load_pretrained(seq).ptq_report.experts) == 2


def _loss(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize(
    ("scheme", "kw"),
    [
        ("fp8", {"gptq": True, "calibration": "mse"}),
        ("int8-smoothquant", {"gptq": True, "alpha": 0.8}),
        ("int8-weight-only", {"gptq": True, "awq": True}),
        ("fp8", {"kv_cache": True}),
    ],
)
def test_calibrated_settings_give_the_same_accuracy(llama_dir, tmp_path, scheme, kw):
    """``propagate="quantized"``: layer 0 sees the same inputs either way (bit-identical but with AWQ, whose
    row sample draws from one generator across layers); later layers calibrate on the quantized layers'
    outputs, and the held-out loss stays within 0.1% perplexity of the whole-model export."""
    ids, held_out = _ids(256, 16, 32), _ids(256, 8, 64, seed=2)
    whole, seq = _whole_and_sequential(llama_dir, tmp_path, scheme, "compressed-tensors", ids, "quantized", **kw)
    a, b = _tensors(whole), _tensors(seq)
    layer0 = [k for k in a if k.startswith("model.layers.0.")]
    assert layer0 and (kw.get("awq") or all(_same(a[k], b[k]) for k in layer0))
    la, lb = _loss(load_pretrained(whole), held_out), _loss(load_pretrained(seq), held_out)
    assert abs(lb - la) < 1e-3, (la, lb)  # perplexity ratio exp(lb - la) within 0.1%


@pytest.mark.parametrize(
    ("scheme", "kw"),
    [("fp8", {"gptq": True, "calibration": "mse"}), ("int8-smoothquant", {"gptq": True, "alpha": 0.8})],
)
def test_float_propagation_gives_the_whole_model_tensors(llama_dir, tmp_path, scheme, kw):
    """``propagate="float"`` (the default): every layer calibrates on the high-precision model's activations,
    so the codes and scales equal whole-model PTQ's: bit for bit, but for SmoothQuant, whose whole-model
    run takes later layers' activation scales from the smoothed model (equal up to float32 rounding)."""
    ids = _ids(256, 16, 32)
    whole, seq = _whole_and_sequential(llama_dir, tmp_path, scheme, "compressed-tensors", ids, **kw)
    a, b = _tensors(whole), _tensors(seq)
    assert a.keys() == b.keys()
    differ = [k for k in a if not _same(a[k], b[k])]
    if scheme != "int8-smoothquant":
        assert differ == []
    assert all(k.endswith("input_scale") for k in differ), differ
    assert all(torch.allclose(a[k], b[k], rtol=2**-21, atol=0) for k in differ)  # one float32 ulp


def test_transformers_reloads_the_sharded_export(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ids = _ids(256)
    out, _ = quantize_checkpoint(str(llama_dir), "fp8", tmp_path / "ckpt", _loop(ids), max_shard_size="40KB")
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    for s in shards:  # a shard closes before it passes the size, unless one tensor alone is larger
        held = load_file(str(s))
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held.values()) <= 40_000
    ours = load_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    from fp8kit.export import dequantized_model

    want = dequantized_model(out)(ids).logits
    torch.testing.assert_close(hf.eval()(ids).logits, want, rtol=1e-5, atol=1e-5)
    assert ours.ptq_report.scheme == "fp8" and len(ours.ptq_report.quantized) == 3 * 7


def test_a_run_that_fails_half_way_leaves_nothing(llama_dir, tmp_path, monkeypatch):
    from fp8kit.jobs import layerwise as sequential

    calls = []
    real = sequential._layer_tensors

    def fail_on_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk full")
        return real(*a, **k)

    monkeypatch.setattr(sequential, "_layer_tensors", fail_on_second)
    with pytest.raises(RuntimeError, match="disk full"):
        quantize_checkpoint(str(llama_dir), "fp8-dynamic", tmp_path / "ckpt", max_shard_size="40KB")
    assert os.listdir(tmp_path) == []


KILLED = """
import os, signal, sys
from fp8kit.export import shards
from fp8kit.jobs import quantize_checkpoint
finish = shards.ShardWriter._finish_shard
def finish_then_die(self):
    finish(self)
    if len(self.shards) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
shards.ShardWriter._finish_shard = finish_then_die
quantize_checkpoint(sys.argv[1], "fp8-dynamic", sys.argv[2], max_shard_size="40KB")
"""


def test_a_killed_run_leaves_no_folder_that_looks_complete(llama_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", KILLED, str(llama_dir), str(tmp_path / "ckpt")], env=env)
    assert done.returncode == -signal.SIGKILL
    left = os.listdir(tmp_path)
    assert not (tmp_path / "ckpt").exists() and len(left) == 1 and left[0].startswith(".ckpt.tmp-")
    leftover = tmp_path / left[0]
    assert not (leftover / "config.json").exists() and not list(leftover.glob("model*.safetensors"))


PEAK = """
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from fp8kit.export import save_pretrained
from fp8kit.jobs import quantize_checkpoint
from fp8kit.ptq import quantize

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

mode, src, warm, out = sys.argv[1:]
ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
loop = lambda m: [m(input_ids=x) for x in ids.split(4)]

def run(path, dest):
    if mode == "sequential":
        quantize_checkpoint(path, "int8-weight-only", dest, loop)
    else:
        model = quantize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "int8-weight-only", loop)
        save_pretrained(model, dest)

run(warm, out + "-warm")  # imports and kernels loaded once, outside the measurement
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS")
run(src, out)
print(status("VmHWM") - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_peak_memory_stays_under_the_checkpoint_bytes(tmp_path):
    """A BF16 checkpoint of ~57 MB (16 layers): the sequential run's peak above its start stays under 0.75x
    its bytes (one layer in float32 with its quantization temporaries is an eighth of them here; the ~1B
    benchmark, ``benchmarks/ptq_memory.py``, holds 0.5x); the whole-model run (float32 model, codes, export
    dict) needs about 3x."""
    import transformers

    def save(path: Path, **over) -> Path:
        torch.manual_seed(0)
        cfg = tiny_llama_config(**{"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 16, **over})
        transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
        return path

    src, warm = save(tmp_path / "src"), save(tmp_path / "warm", num_hidden_layers=1)
    nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["OMP_NUM_THREADS"] = "1"

    def peak(mode: str) -> int:
        cmd = [sys.executable, "-c", PEAK, mode, str(src), str(warm), str(tmp_path / mode)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        return int(done.stdout.strip().splitlines()[-1])

    sequential, whole = peak("sequential"), peak("whole")
    print(f"peak above start: sequential {sequential / nbytes:.2f}x, whole model {whole / nbytes:.2f}x the checkpoint")
    assert sequential < 0.75 * nbytes < whole / 3, (sequential / nbytes, whole / nbytes)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layers_onloaded_to_the_gpu_give_the_cpu_export(llama_dir, tmp_path):
    """Round to nearest on CUDA (each layer onloaded in turn) writes the CPU run's codes and scales."""
    cpu, _ = quantize_checkpoint(str(llama_dir), "fp8-dynamic", tmp_path / "cpu")
    torch.cuda.reset_peak_memory_stats()
    gpu, _ = quantize_checkpoint(str(llama_dir), "fp8-dynamic", tmp_path / "gpu", device="cuda")
    assert torch.cuda.max_memory_allocated() > 0
    a, b = _tensors(cpu), _tensors(gpu)
    assert set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
