"""``--device``: resolution, the GPU capability rules for native FP8 GEMMs, and every refusal ending the command
in one line with exit code 2 before any model is loaded (GPUs simulated by patching ``torch.cuda``)."""

from __future__ import annotations

import logging

import pytest
import torch

import fp8kit.debug
import fp8kit.jobs.compare
import fp8kit.jobs.cost
import fp8kit.jobs.evaluate
import fp8kit.jobs.quantize
import fp8kit.models.pretrained
import fp8kit.train
import fp8kit.train.loop
from fp8kit.cli import main
from fp8kit.runtime.device import DeviceError, device_report, native_on, resolve_device, work_dtype
from tests.helpers.models import save_local_llama

# what starts real work in each command: none of it may run before the checks have passed
LOADERS = {
    fp8kit.train: ("run_comparison",),
    fp8kit.train.loop: ("build_base",),
    fp8kit.jobs.evaluate: ("evaluate_checkpoint", "evaluate_pretrained"),
    fp8kit.models.pretrained: ("load_pretrained_lm",),
    fp8kit.jobs.compare: ("quantize_pretrained", "compare_schemes"),
    fp8kit.jobs.quantize: ("quantize_pretrained",),
    fp8kit.debug: ("doctor",),
}


class WorkStarted(Exception):
    pass


@pytest.fixture
def no_loading(monkeypatch, tmp_path):
    """Every loader raises ``WorkStarted``; the cost estimate sees a fast device with ample memory."""
    monkeypatch.chdir(tmp_path)
    save_local_llama(tmp_path, "the quick brown fox jumps over the lazy dog " * 20)

    def fail(*args, **kwargs):
        raise WorkStarted

    for module, names in LOADERS.items():
        for name in names:
            monkeypatch.setattr(module, name, fail)
    monkeypatch.setattr(fp8kit.jobs.cost, "device_flops", lambda device, dtype=None: 1e12)
    monkeypatch.setattr(fp8kit.jobs.cost, "available_bytes", lambda device: 1 << 40)
    return tmp_path


def fake_gpu(monkeypatch, capability: tuple[int, int] | None, count: int = 1) -> None:
    """This process sees ``count`` GPUs of ``capability`` (``None``: no CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count if capability else 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def one_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln]
    assert len(err) == 1, err
    return err[0]


# ---- resolution ---------------------------------------------------------------------------------------------
def test_auto_is_the_cpu_without_cuda_and_the_gpu_with_it(monkeypatch):
    fake_gpu(monkeypatch, None)
    assert resolve_device() == torch.device("cpu")
    assert resolve_device("cpu", recipe="mxfp8") == torch.device("cpu")  # the CPU emulates every recipe
    fake_gpu(monkeypatch, (9, 0), count=2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a torchrun worker takes its own GPU
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert work_dtype(torch.device("cuda", 0)) == torch.bfloat16 and work_dtype(torch.device("cpu")) == torch.float32


def test_device_errors_name_the_fix(monkeypatch):
    fake_gpu(monkeypatch, None)
    with pytest.raises(DeviceError, match="no CUDA GPU.*--device cpu"):
        resolve_device("cuda")
    fake_gpu(monkeypatch, (9, 0), count=2)
    with pytest.raises(DeviceError, match="2 CUDA GPU"):
        resolve_device("cuda:2")
    with pytest.raises(DeviceError, match="auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")


# what runs native where (gemm/fp8.py: scaled_mm from SM89, 1x128/128x128 on SM90 only, MXFP8 from SM100)
NATIVE = {
    (8, 0): {"int8-smoothquant", "int8-weight-only", "fp8-block"},
    (8, 9): {"delayed", "current", "rowwise", "fp8", "fp8-dynamic"},
    (9, 0): {"delayed", "current", "rowwise", "block", "fp8", "fp8-dynamic"},
    (10, 0): {"delayed", "current", "rowwise", "mxfp8", "fp8", "fp8-dynamic"},
}
ALL = ("delayed", "current", "rowwise", "block", "mxfp8", "fp8", "fp8-dynamic", "int8-smoothquant")


@pytest.mark.parametrize("capability", list(NATIVE), ids=lambda c: f"SM{c[0]}{c[1]}")
@pytest.mark.parametrize("name", ALL)
def test_native_recipes_by_capability(monkeypatch, capability, name):
    native = name in NATIVE[capability] or name == "int8-smoothquant"  # INT8 GEMMs from SM80
    assert native_on(name, capability) is native
    fake_gpu(monkeypatch, capability)
    if native:
        assert resolve_device("cuda", recipe=name) == torch.device("cuda", 0)
        return
    with pytest.raises(DeviceError) as err:
        resolve_device("cuda", recipe=[name])
    text = str(err.value)
    assert "\n" not in text and "--emulate" in text and name in text and f"SM{capability[0]}{capability[1]}" in text


def test_emulate_runs_with_a_one_line_warning(monkeypatch, caplog):
    fake_gpu(monkeypatch, (9, 0))
    with caplog.at_level(logging.WARNING, logger="fp8kit"):
        assert resolve_device("cuda", recipe=["delayed", "mxfp8"], emulate=True) == torch.device("cuda", 0)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "mxfp8" in warned[0] and "SM100" in warned[0] and "\n" not in warned[0]


def test_device_report_names_the_native_recipes(monkeypatch):
    report = device_report("cpu")
    assert report.native == () and "mxfp8" in report.emulated and report.line().startswith("cpu (CPU")

    class Props:
        name, total_memory = "NVIDIA H100", 80 * 2**30

    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    line = device_report("cuda:0").line()
    assert "NVIDIA H100, SM90, 80 GiB" in line and "block" in line.split("emulated")[0] and "mxfp8" in line


def test_info_names_the_device(capsys):
    assert main(["info"]) == 0
    assert "device: cpu (CPU" in capsys.readouterr().out or torch.cuda.is_available()


# ---- the CLI: exit 2 and one line, before any model is loaded --------------------------------------------------
COMMANDS = [
    ["train", "--model-size", "tiny", "--out", "run"],
    ["doctor", "--model-size", "tiny", "--out", "doc"],
    ["eval", "--model", "model"],
    ["quantize", "--model", "model", "--scheme", "fp8", "--out", "q"],
    ["compare", "--model", "model", "--schemes", "fp8", "--out", "cmp"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_cuda_without_a_gpu_ends_before_loading(no_loading, monkeypatch, capsys, argv):
    fake_gpu(monkeypatch, None)
    assert main([*argv, "--device", "cuda"]) == 2
    line = one_line(capsys)
    assert line.startswith(f"fp8kit {argv[0]}: error:") and "no CUDA GPU" in line and "--device cpu" in line


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["train", "--model-size", "tiny", "--recipe", "delayed,mxfp8", "--out", "run"], "mxfp8"),
        (["doctor", "--model-size", "tiny", "--recipe", "block", "--out", "doc"], "block"),
        (["quantize", "--model", "model", "--scheme", "fp8", "--out", "q"], "fp8"),
        (["compare", "--model", "model", "--schemes", "fp8-dynamic", "--out", "cmp"], "fp8-dynamic"),
    ],
    ids=lambda a: a[0] if isinstance(a, list) else a,
)
def test_a_recipe_the_gpu_cannot_run_ends_before_loading_unless_emulated(no_loading, monkeypatch, capsys, argv, what):
    fake_gpu(monkeypatch, (8, 0))
    assert main([*argv, "--device", "cuda"]) == 2
    line = one_line(capsys)
    assert what in line and "SM80" in line and "--emulate" in line
    with pytest.raises(WorkStarted):  # --emulate: past every check, the work starts
        main([*argv, "--device", "cuda", "--emulate"])


def test_nproc_on_cuda_needs_a_gpu_per_process(no_loading, monkeypatch, capsys):
    fake_gpu(monkeypatch, (9, 0), count=2)
    assert main(["train", "--model-size", "tiny", "--out", "run", "--device", "cuda", "--nproc", "4"]) == 2
    assert "--nproc 4 on CUDA" in one_line(capsys)


def test_a_bad_device_spelling_ends_in_one_line(no_loading, capsys):
    assert main(["eval", "--model", "model", "--device", "gpu0"]) == 2
    assert "cuda:N" in one_line(capsys)
