"""Tiny models and configurations shared by the tests: Llama (transformers) and the demo training config."""

import torch
import torch.nn as nn


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


def tiny_llama(seed: int = 0, tie: bool = True) -> nn.Module:
    """The tiny Llama of ``tiny_llama_config`` (tied embeddings unless ``tie=False``) in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=tie)).eval()


def calib(model_batches: list[torch.Tensor]):
    """A calibration loop that runs the model on each of ``model_batches``."""

    def loop(m: nn.Module) -> None:
        for x in model_batches:
            m(x)

    return loop


def token_batches(vocab: int, count: int, shape: tuple[int, int], seed: int = 1) -> list[torch.Tensor]:
    """``count`` batches of random token ids below ``vocab`` (calibration and evaluation inputs)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, shape, generator=g) for _ in range(count)]


def whole_tile_llama(seed: int = 0):
    """A random 2-layer Llama in eval mode, hidden 256, intermediate 384: every weight holds whole 128x128 tiles."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    return LlamaForCausalLM(cfg).eval()


def word_tokenizer(text: str):
    """A word-level ``transformers`` tokenizer trained on ``text``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def save_local_llama(root, text: str, **overrides):
    """A tiny Llama and a word-level tokenizer trained on ``text``, saved as the Hugging Face folder
    ``root / "model"``; ``text`` is written to ``root / "text.txt"``."""
    import transformers

    fast = word_tokenizer(text)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=len(fast), **overrides)).save_pretrained(root / "model")
    fast.save_pretrained(root / "model")
    (root / "text.txt").write_text(text)
    return root


def save_sample_llama(root, hidden_size: int = 32, intermediate_size: int = 64):
    """``save_local_llama`` on ``SAMPLE_TEXT``: a tied Llama with 2 heads, 1 KV head, of the given widths."""
    return save_local_llama(
        root,
        SAMPLE_TEXT,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )


SAMPLE_TEXT = (  # a short English text repeated: a word-level tokenizer learns it whole
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. "
) * 40


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
