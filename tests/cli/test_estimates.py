"""The time estimates (``fp8kit.jobs.estimate``) with fixed rates: which phases appear for which scheme and options,
and that the seconds grow with steps, tokens and a recipe's costs. No timing is measured."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from fp8kit.jobs import estimate
from fp8kit.jobs.cost import ModelShape, estimate_training
from fp8kit.jobs.estimate import Rates, forward_seconds, ptq_phases, training_seconds
from fp8kit.jobs.quantize import ptq_settings
from fp8kit.planner.roofline import GPU

HIDDEN, LAYERS, VOCAB = 64, 2, 100
GEMMS = ((HIDDEN, HIDDEN),) * 4 + ((HIDDEN, 128), (HIDDEN, 128), (128, HIDDEN))
SHAPE = ModelShape(100_000, 400_000, HIDDEN, LAYERS, VOCAB, GEMMS * LAYERS + ((HIDDEN, VOCAB),))


def rates(**call: float) -> Rates:
    gpu = GPU("cpu", 1e10, 1e10, 1e10, (0, 0), emulated_flops=5e9, cast_bytes_per_s=1e9,
              dequant_bytes_per_s=2e9, tile_dequant_bytes_per_s=1e8, matmul_call_s=1e-5, cast_call_s=2e-5)  # fmt: skip
    return Rates(gpu, 1e9, dict(call), tokenize_bytes_per_s=1e6, import_s=2.0)


def phases(scheme: str, calib_batches: int = 4, **options) -> dict[str, float]:
    return ptq_phases(SHAPE, scheme, ptq_settings(scheme, n_layers=14, **options), calib_batches, rates())


def test_fp8_prices_norm_tweak_and_gptq_but_no_awq():
    got = phases("fp8")
    assert {"calibrate", "gptq hessians", "quantize layers", "rank", "norm tweak", "export"} <= set(got)
    assert "awq" not in got
    assert all(s > 0 for s in got.values())


def test_each_scheme_lists_only_the_steps_it_runs():
    assert "awq" in phases("int8-weight-only")
    assert "awq" not in phases("int8-weight-only", awq=False)
    dynamic = phases("fp8-dynamic")
    assert not {"calibrate", "norm tweak", "rank", "awq"} & set(dynamic)
    assert "gptq hessians" not in phases("fp8-dynamic", gptq=False)
    assert "norm tweak" not in phases("fp8", norm_tweak=0)
    assert "smooth" in phases("int8-smoothquant")
    assert "kv cache" in phases("fp8+kv")


def test_ptq_seconds_grow_with_calibration_and_tweak_steps():
    assert sum(phases("fp8", 8).values()) > sum(phases("fp8", 4).values())
    assert phases("fp8", norm_tweak=200)["norm tweak"] > phases("fp8", norm_tweak=20)["norm tweak"]


def test_training_grows_with_steps_tokens_and_recipe_costs():
    r = rates()
    base = training_seconds(SHAPE, "bf16", 10, 2048, 2048, r)
    assert training_seconds(SHAPE, "bf16", 20, 2048, 2048, r) > base
    assert training_seconds(SHAPE, "bf16", 10, 4096, 2048, r) > base
    assert training_seconds(SHAPE, "bf16", 10, 2048, 2048, r, eval_tokens=4096) > base
    fp8 = training_seconds(SHAPE, "delayed", 10, 2048, 2048, r)
    assert fp8 > base  # casts and quantization passes cost more than BF16 on an emulating CPU
    slow = training_seconds(SHAPE, "delayed", 10, 2048, 2048, rates(delayed=1e-2))
    assert slow - fp8 == pytest.approx(10 * (len(GEMMS) * LAYERS) * (1e-2 - r.layer_call_s("delayed")))


def test_fixed_costs_count_beyond_flops():
    """Ten times fewer tokens take more than a tenth of the time: the per-call costs stay."""
    r = rates()
    assert forward_seconds(SHAPE, 512, r) > forward_seconds(SHAPE, 5120, r) / 10


def test_estimate_training_prices_each_run_by_its_recipe():
    cost = estimate_training(
        "train", SHAPE, torch.device("cpu"), ["bf16", "fp8-delayed"], 10, 2048, 2048,
        recipes={"fp8-delayed": "delayed"}, rates=rates(delayed=1e-2),
    )  # fmt: skip
    assert cost.phases["fp8-delayed"] > cost.phases["bf16"] > 0


def test_cli_quantize_fp8_cost_has_the_phases_that_run(monkeypatch):
    from fp8kit.jobs import quantize as _job

    monkeypatch.setattr(_job, "shape_of", lambda spec, *a: SHAPE)
    monkeypatch.setattr(estimate, "current_rates", lambda device, recipes=(), schemes=(): rates())
    args = argparse.Namespace(
        model="x", calibration=None, alpha=None, smooth=None, gptq=True, awq=True, keep_bf16=None,
        norm_tweak=None, calib_batches=8,
    )  # fmt: skip
    got = _job.ptq_cost_phases(args, torch.device("cpu"), "fp8")
    assert "awq" not in got and "norm tweak" in got and "load" in got and "export" in got
    assert "awq" in _job.ptq_cost_phases(args, torch.device("cpu"), "int8-weight-only")


def test_rates_measured_once_then_read_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path))
    monkeypatch.setattr(estimate, "_MEMO", {})
    monkeypatch.setattr(estimate, "_FIXED", [])
    calls = []
    measured = dataclasses.replace(rates(), step_memory_scale=1.0, tokenize_bytes_per_token=1.0)
    monkeypatch.setattr(estimate, "_measure", lambda device: calls.append(device) or measured)
    monkeypatch.setattr(estimate, "_probe", lambda *what: pytest.fail(f"probed {what}"))
    first = estimate.current_rates(torch.device("cpu"))
    monkeypatch.setattr(estimate, "_MEMO", {})
    second = estimate.current_rates(torch.device("cpu"))
    assert len(calls) == 1 and first == second
    (cache,) = (tmp_path / "rates").glob("*.json")
    cache.write_text(cache.read_text().replace('"import_s"', '"a_newer_field": 1, "import_s"'))
    monkeypatch.setattr(estimate, "_MEMO", {})
    assert estimate.current_rates(torch.device("cpu")) == first and len(calls) == 1  # read by an older fp8kit


def test_doctor_cost_grows_with_steps_and_names_its_report(monkeypatch):
    from fp8kit.jobs import doctor

    seen = []
    monkeypatch.setattr(doctor, "announce", lambda cost, device, force, floor=None: seen.append(cost))
    for steps in (4, 40):
        args = argparse.Namespace(
            model="demo", arch="dense", model_size="small", seq_len=64, batch_size=8, steps=steps, apply=False,
            noise_floor=True, recipe="delayed", force=False,
        )  # fmt: skip
        doctor.announce_cost(args, torch.device("cpu"))
    short, long = seen
    assert {"bf16 + fp8", "bf16 one ulp off", "report"} <= set(short.phases)
    assert long.phases["bf16 + fp8"] > short.phases["bf16 + fp8"] > 0


def test_a_job_on_an_export_prices_its_tokenizer_and_first_quantized_forward(tmp_path):
    """Beyond the weights and the forwards: transformers' import, the text encoded with the model's tokenizer
    (sampled: a byte-level one makes a token per byte) and, for a quantized export, the first forward through
    PTQ's layers (their kernels compile); the process's memory with them."""
    import dataclasses
    import json

    from fp8kit.data import ByteTokenizer
    from fp8kit.jobs.announce import process_cost

    r = dataclasses.replace(
        rates(), first_quantized_s=5.0, tokenize_bytes_per_token=100.0, process_bytes=1000, quantized_process_bytes=3000
    )
    export, plain = tmp_path / "q", tmp_path / "p"
    for folder, config in ((export, {"quantization_config": {"quant_method": "compressed-tensors"}}), (plain, {})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    text = tmp_path / "t.txt"
    text.write_text("x" * 2_000_000)
    phases, floor = process_cost(str(export), str(text), r)  # no tokenizer file: as the 1 MB/s byte-level one
    assert phases["compile"] == 5.0 and phases["tokenize"] == pytest.approx(2.0) and "import" in phases
    assert floor == 3000 + 100 * 2_000_000
    phases, floor = process_cost(str(plain), str(text), r)
    assert "compile" not in phases and floor == 1000 + 100 * 2_000_000
    assert process_cost(str(plain), str(text), r, quantized_forward=True)[0]["compile"] == 5.0
    assert process_cost(str(plain), str(text), r, encodes_text=False) == ({"import": phases["import"]}, 1000)
    assert process_cost("demo", None, r) == ({}, 1000)
    ByteTokenizer().save_pretrained(plain)  # a tokenizer to sample: its own rate, a token per byte
    phases, floor = process_cost(str(plain), str(text), r)
    assert phases["tokenize"] != pytest.approx(2.0) and floor == 1000 + 100 * 2_000_000


def test_the_cost_line_counts_the_process_itself_in_the_host_peak(monkeypatch, capsys):
    import dataclasses

    from fp8kit.jobs.announce import announce
    from fp8kit.jobs.cost import JobCost

    monkeypatch.setattr(
        estimate, "current_rates", lambda device, recipes=(): dataclasses.replace(rates(), process_bytes=2**30)
    )
    cpu = JobCost("eval", 10**6, "cpu", 2**29)
    announce(cpu, torch.device("cpu"), force=True)
    assert cpu.device_bytes == 3 * 2**29 and "peak ~1.50 GiB on cpu" in capsys.readouterr().err
    gpu = JobCost("eval", 10**6, "cuda:0", 2**29, host_bytes=2**29)
    announce(gpu, torch.device("cuda", 0), force=True)
    assert gpu.device_bytes == 2**29 and gpu.host_bytes == 3 * 2**29


def test_the_process_floor_is_the_probed_job_process_and_the_compiler_when_kernels_compile(monkeypatch):
    """A job's process is priced as a fresh process that did the job's imports (``process_bytes``); one that runs
    fp8kit's compiled kernels (an FP8 training recipe, a doctor run) as one that also compiled them."""
    from fp8kit.jobs import doctor, train
    from fp8kit.train import TrainConfig

    r = dataclasses.replace(rates(), process_bytes=1000, quantized_process_bytes=3000)
    assert estimate.process_floor(r, compiles=False) == 1000 and estimate.process_floor(r, compiles=True) == 3000
    monkeypatch.setattr(estimate, "current_rates", lambda device, recipes=(), schemes=(): r)
    monkeypatch.setattr(estimate, "doctor_rates", lambda device, recipe: (1.0, 0.0))
    floors = []
    for job in (train, doctor):
        monkeypatch.setattr(job, "announce", lambda cost, device, force, floor=None: floors.append(floor))
    train.announce_cost(TrainConfig(steps=2, recipes=["delayed"]), force=False)  # bf16, then fp8-delayed
    args = argparse.Namespace(
        model="demo", arch="dense", model_size="small", seq_len=64, batch_size=8, steps=2, apply=False,
        noise_floor=False, recipe="delayed", force=False,
    )  # fmt: skip
    doctor.announce_cost(args, torch.device("cpu"))
    assert floors == [3000, 3000]


def test_a_training_step_holds_its_activations_times_the_measured_retention():
    """On the CPU the activations a micro-batch saves count ``step_memory_scale`` times (the allocator keeps what a
    step freed); the state and the GPU's activations do not scale."""
    from fp8kit.jobs.cost import activation_bytes

    def peak(device: str, scale: float) -> int:
        r = dataclasses.replace(rates(), step_memory_scale=scale)
        return estimate_training("train", SHAPE, torch.device(device), ["bf16"], 1, 2048, 2048, rates=r).device_bytes

    assert peak("cpu", 2.5) - peak("cpu", 1.0) == pytest.approx(1.5 * activation_bytes(SHAPE, 2048, 4), abs=2)
    assert peak("cpu", 0.0) == peak("cpu", 1.0)  # not measured: as modelled
    assert peak("cuda", 2.5) == peak("cuda", 1.0)


def test_process_rates_turn_the_probes_into_floors_and_a_retention(monkeypatch):
    from fp8kit.jobs.cost import activation_bytes

    shape = estimate._demo_shape()
    modelled = activation_bytes(shape, estimate._PROBE_BATCH * 128, 4)
    grown = 16 * shape.params + 2 * modelled
    probed = {"transformers": (1.5, 4e8), "tokenize": (2.0, 2**22, 1.0), "quantized": (3.0, 5e8), "train": (0, grown)}
    monkeypatch.setattr(estimate, "_probe", lambda what, *args: probed[what])
    got = estimate._process_rates()
    assert got["process_bytes"] == 4e8 and got["quantized_process_bytes"] == 5e8 and got["import_s"] == 1.5
    assert got["step_memory_scale"] == pytest.approx(2.0)
    probed["train"] = (0.0, 0.0)  # the probe could not run: as modelled
    assert estimate._process_rates()["step_memory_scale"] == 1.0


def test_a_scheme_whose_quantization_compiles_prices_it_measured_once(monkeypatch, tmp_path):
    """The first PTQ run of a scheme compiles its kernels (NVFP4's scales): measured once per scheme in a fresh
    process, cached, and added to the ``quantize layers`` phase of that scheme only."""
    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path))
    monkeypatch.setattr(estimate, "_MEMO", {})
    monkeypatch.setattr(estimate, "_FIXED", [])
    probes = []
    monkeypatch.setattr(estimate, "_probe", lambda *what: probes.append(what) or (9.0, 0.0))
    cached = dataclasses.replace(rates(), step_memory_scale=1.0)
    monkeypatch.setattr(estimate, "_measure", lambda device: cached)
    cpu = torch.device("cpu")
    got = estimate.current_rates(cpu, schemes=["nvfp4"])
    monkeypatch.setattr(estimate, "_MEMO", {})
    assert estimate.current_rates(cpu, schemes=["nvfp4"]) == got  # read back from the cache file
    assert probes == [("quantize", "nvfp4")] and got.first_quantize_s == {"nvfp4": 9.0}

    def layers(scheme: str, r: Rates) -> float:
        return ptq_phases(SHAPE, scheme, ptq_settings(scheme, n_layers=14), 4, r)["quantize layers"]

    assert layers("nvfp4", got) - layers("nvfp4", rates()) == pytest.approx(9.0)
    assert layers("fp8-dynamic", got) == layers("fp8-dynamic", rates())
