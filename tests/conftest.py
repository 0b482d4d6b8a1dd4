import pytest
import torch


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of ``approx`` against ``ref``."""
    ref, approx = ref.detach().double(), approx.detach()
    err = (ref - approx.double()).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / err.clamp_min(1e-300)))


def tiny_llama_config(**overrides):
    """A 2-layer ``LlamaConfig`` (hidden 64, 4 heads, 2 KV heads, vocabulary 256) with ``overrides``."""
    from transformers import LlamaConfig

    base = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return LlamaConfig(**{**base, **overrides})


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _eager_module_kernels(request):
    """Modules use the eager kernels in tests (bit-identical to the compiled ones, see test_kernels.py),
    which keeps the suite free of per-shape compilation time."""
    from fp8kit.nn import set_quantize_backend

    set_quantize_backend("eager")
    yield
    set_quantize_backend("compiled")
