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


def save_local_llama(root, text: str, **overrides):
    """A tiny Llama and a word-level tokenizer trained on ``text``, saved as the Hugging Face folder
    ``root / "model"``; ``text`` is written to ``root / "text.txt"``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=len(fast), **overrides)).save_pretrained(root / "model")
    fast.save_pretrained(root / "model")
    (root / "text.txt").write_text(text)
    return root


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "compiled: FP8 modules use the default compiled quantize kernels (torch.compile) in this test"
    )


@pytest.fixture(autouse=True, scope="session")
def _strict_compile():
    """A quantize kernel that fails to compile fails its test instead of silently falling back to eager."""
    from fp8kit.kernels import set_compile_strict

    set_compile_strict(True)
    yield
    set_compile_strict(False)


def tiny_train_config(out, **overrides):
    """A ``TrainConfig`` for the tiny demo Llama (8 steps of 4 x 32 tokens, no progress bar) in ``out``."""
    from fp8kit.train import TrainConfig

    base = {
        "model_size": "tiny",
        "steps": 8,
        "batch_size": 4,
        "seq_len": 32,
        "eval_interval": 4,
        "ckpt_interval": 2,
        "eval_batches": 2,
        "progress": False,
        "out": str(out),
        "recipes": ["delayed"],
    }
    return TrainConfig(**{**base, **overrides})


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _module_backend(request):
    """FP8 modules use the eager kernels (bit-identical to the compiled ones, see test_kernels.py) to keep
    the suite free of per-shape compilation time, except in tests marked ``compiled``, which run the
    library's default backend. Every recipe has at least one such test (test_numerics_layers.py)."""
    from fp8kit.nn import set_quantize_backend

    set_quantize_backend("compiled" if request.node.get_closest_marker("compiled") else "eager")
    yield
    set_quantize_backend("compiled")
