"""``--model ORG/NAME[@REVISION]`` resolved from a local Hugging Face cache offline, and the cost line every
long job prints before it loads (parameters from safetensors headers, peak memory, time per phase)."""

from __future__ import annotations

import shutil

import pytest
import torch

import fp8kit.jobs.compare
import fp8kit.jobs.cost
import fp8kit.jobs.quantize
import fp8kit.models.pretrained
import fp8kit.train
from fp8kit.cli import main
from fp8kit.jobs.cost import estimate_inference, estimate_training, model_shape
from fp8kit.models.resolve import ModelNotFound, is_hub_id, resolve_model
from tests.helpers.models import save_local_llama

MAIN_SHA, OLD_SHA = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    save_local_llama(root, "in the beginning was the word and the word was with the model " * 30)
    return root / "model"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_llama):
    """An offline Hugging Face cache holding ``org/tiny``: ``main`` at one commit, tag ``v1`` at an older one
    whose weights differ."""
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(tiny_llama, repo / "snapshots" / MAIN_SHA)
    shutil.copytree(tiny_llama, repo / "snapshots" / OLD_SHA)
    from safetensors.torch import load_file, save_file

    weights = repo / "snapshots" / OLD_SHA / "model.safetensors"
    state = load_file(weights)
    save_file({k: v * 0.5 for k, v in state.items()}, weights, metadata={"format": "pt"})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN_SHA)
    (repo / "refs" / "v1").write_text(OLD_SHA)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return repo


def test_hub_ids_resolve_from_the_offline_cache(hub_cache, tiny_llama):
    assert resolve_model("org/tiny") == hub_cache / "snapshots" / MAIN_SHA
    assert resolve_model(f"org/tiny@{OLD_SHA}") == hub_cache / "snapshots" / OLD_SHA
    assert resolve_model("org/tiny@v1") == hub_cache / "snapshots" / OLD_SHA
    main_model, _ = fp8kit.models.pretrained.load_pretrained_lm("org/tiny")
    old_model, _ = fp8kit.models.pretrained.load_pretrained_lm("org/tiny@v1")
    w_main = main_model.model.embed_tokens.weight
    assert torch.equal(old_model.model.embed_tokens.weight, w_main * 0.5)  # the revision's own weights
    assert resolve_model(str(tiny_llama)) == tiny_llama  # a local folder as before


def test_a_local_folder_wins_over_a_hub_id_of_the_same_spelling(hub_cache, tiny_llama):
    local = hub_cache.parent.parent / "org" / "tiny"
    shutil.copytree(tiny_llama, local)
    assert not is_hub_id("org/tiny") and resolve_model("org/tiny") == local.relative_to(local.parent.parent)


def test_an_id_missing_offline_says_why(hub_cache):
    for spec in ("org/absent", "org/tiny@v9"):
        with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE") as err:
            resolve_model(spec)
        assert "\n" not in str(err.value) and "cache" in str(err.value)
    with pytest.raises(ModelNotFound, match="Hub ID"):
        resolve_model("not a model")


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--model", "org/absent"],
        ["quantize", "--model", "org/absent", "--scheme", "fp8", "--out", "q"],
        ["train", "--model", "org/absent", "--out", "run"],
        ["doctor", "--model", "org/absent", "--out", "doc"],
        ["compare", "--model", "org/absent", "--schemes", "fp8", "--out", "cmp"],
    ],
    ids=lambda a: a[0],
)
def test_cli_offline_miss_is_one_line_exit_2_before_loading(hub_cache, monkeypatch, capsys, argv):
    def never(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for module, name in [
        (fp8kit.models.pretrained, "load_pretrained_lm"),
        (fp8kit.train, "run_comparison"),
        (fp8kit.jobs.quantize, "quantize_pretrained"),
        (fp8kit.jobs.compare, "compare_schemes"),
    ]:
        monkeypatch.setattr(module, name, never)
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith(f"fp8kit {argv[0]}: error: --model org/absent")
        and "HF_HUB_OFFLINE" in err[0]
    )


def test_cli_evaluates_a_cached_hub_model(hub_cache, monkeypatch, capsys):
    monkeypatch.setattr(fp8kit.jobs.cost, "device_flops", lambda device, dtype=None: 1e3)  # a long job: the line shows
    assert main(["eval", "--model", "org/tiny@v1", "--device", "cpu", "--eval-batches", "1"]) == 0
    captured = capsys.readouterr()
    assert "org/tiny@v1 (step 0)" in captured.out and "perplexity" in captured.out
    assert "fp8kit eval:" in captured.err and "parameters" in captured.err  # the cost line came first


# ---- cost up front ---------------------------------------------------------------------------------------------
def test_parameters_come_from_the_safetensors_headers(tiny_llama):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    n = sum(p.numel() for p in model.parameters())
    shape = model_shape(tiny_llama)
    assert shape.params == n and shape.checkpoint_bytes == 4 * n  # float32 tensors
    assert (shape.hidden, shape.layers, shape.vocab) == (64, 2, model.config.vocab_size)


def test_cost_line_and_estimates(tiny_llama):
    shape = model_shape(tiny_llama)
    cpu = torch.device("cpu")
    train = estimate_training("train", shape, cpu, ["bf16", "fp8-delayed"], 10, 512, 512, flops=1e9)
    # FP32 base + the run's master weights, gradients, moments and FP8 copy, + activations
    assert train.device_bytes > shape.params * (4 + 16 + 1)
    assert train.phases["bf16"] == pytest.approx(10 * 6 * shape.params * 512 / 1e9)
    line = train.line()
    assert line.startswith(f"fp8kit train: {shape.params / 1e6:,.1f}M parameters; expected peak ~")
    assert "on cpu" in line and "bf16" in line and "fp8-delayed" in line and "\n" not in line
    cuda = estimate_training("train", shape, torch.device("cuda", 0), ["bf16"], 10, 512, 512, flops=1e12)
    assert cuda.host_bytes == 4 * shape.params and "host RAM" in cuda.line()
    quant = estimate_inference("quantize", shape, cpu, {"calibrate": 1, "gptq": 3}, 4096, 512, flops=1e9)
    assert quant.phases["gptq"] == pytest.approx(3 * quant.phases["calibrate"])
    bf16 = estimate_inference("quantize", shape, torch.device("cuda", 0), {}, 0, 512, flops=1e12)
    assert bf16.device_bytes < quant.device_bytes  # BF16 weights on a GPU, FP32 on the CPU


def test_a_job_that_will_not_fit_ends_before_loading(tiny_llama, monkeypatch, capsys, tmp_path):
    class Started(Exception):
        pass

    def started(*args, **kwargs):
        raise Started

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fp8kit.jobs.quantize, "quantize_pretrained", started)
    monkeypatch.setattr(fp8kit.train, "run_comparison", started)
    monkeypatch.setattr(fp8kit.jobs.cost, "available_bytes", lambda device: 1000)
    monkeypatch.setattr(fp8kit.jobs.cost, "device_flops", lambda device, dtype=None: 1e3)
    argv = ["quantize", "--model", str(tiny_llama), "--scheme", "fp8", "--out", "q", "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("fp8kit quantize:") and "parameters" in err[0]
    assert "GiB is free" in err[1] and "--force" in err[1]
    with pytest.raises(Started):
        main([*argv, "--force"])
    assert main(["train", "--model-size", "tiny", "--out", "run", "--device", "cpu"]) == 2
    assert "fp8kit train: error: train needs" in capsys.readouterr().err
    monkeypatch.setattr(fp8kit.jobs.cost, "available_bytes", lambda device: 1 << 40)
    monkeypatch.setattr(fp8kit.jobs.cost, "device_flops", lambda device, dtype=None: 1e12)
    with pytest.raises(Started):  # a short job that fits starts after its cost line, in a log file too
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp8kit quantize:") and "parameters" in err[0]
