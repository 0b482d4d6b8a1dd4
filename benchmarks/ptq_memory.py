"""Peak memory of ``fp8kit quantize``: layer by layer (sequential PTQ) against the whole model loaded.

Writes a Llama-shaped checkpoint with random BF16 weights (default ~1B parameters: hidden 2048, 16 layers,
intermediate 5632, vocabulary 32000, untied head; sharded safetensors in a temporary folder, with a
word-level tokenizer and a calibration text), then runs in fresh subprocesses:

* ``baseline``: ``import fp8kit, transformers`` (the floor every row is measured above);
* ``full load``: the checkpoint loaded whole in float32, as whole-model PTQ loads it;
* ``sequential``: ``fp8kit quantize --model DIR`` (one decoder layer at a time);
* ``whole model``: the same quantization with the model loaded whole (``quantize_pretrained`` +
  ``save_pretrained``, what ``fp8kit quantize`` runs when an option needs the whole model).

Peak resident memory is each child's ``ru_maxrss`` (``getrusage(RUSAGE_CHILDREN)`` of a one-child
wrapper), reported above the baseline and as a multiple of the checkpoint's bytes; times are wall clock.

    python benchmarks/ptq_memory.py                          # ~1B, fp8-dynamic RTN, both paths
    python benchmarks/ptq_memory.py --layers 4 --scheme fp8 --gptq
    python benchmarks/ptq_memory.py --no-whole               # the sequential run only (less memory)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN = """
import resource, subprocess, sys, time, json
t0 = time.perf_counter()
rc = subprocess.run(sys.argv[1:]).returncode
print(json.dumps({"rc": rc, "s": time.perf_counter() - t0,
                  "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""
WHOLE = """
import sys
from fp8kit.jobs.compare import quantize_pretrained
from fp8kit.export import save_pretrained
model_dir, scheme, text, batches, gptq, out = sys.argv[1:]
m, tok, _ = quantize_pretrained(model_dir, scheme, text=text, calib_batches=int(batches), gptq=gptq == "1",
                                keep_bf16=0, norm_tweak=0)
save_pretrained(m, out, tok)
"""
FULL_LOAD = "import sys, torch, transformers; transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)"


def write_checkpoint(
    root: Path, hidden: int, layers: int, intermediate: int, vocab: int
) -> tuple[Path, Path, int, int]:
    """A random BF16 Llama checkpoint (shards of ~1 GB written one at a time), its tokenizer and a text."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    path = root / "model"
    path.mkdir()
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []
    size = params = 0

    def flush() -> None:
        name = f"part-{len(files)}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        files.append(name)
        shard.clear()

    for key, shape in shapes.items():
        if key.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[key] = t
        size += t.numel() * 2
        params += t.numel()
        if sum(v.numel() * 2 for v in shard.values()) > 1 << 30:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg.save_pretrained(path)
    words = [f"w{i}" for i in range(min(vocab - 1, 2000))]
    text = " ".join(words[(i * 7919) % len(words)] for i in range(200_000))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    (root / "text.txt").write_text(text)
    return path, root / "text.txt", size, params


def measure(cmd: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, *cmd], capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed:\n{done.stderr[-3000:]}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--scheme", default="fp8-dynamic")
    ap.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--calib-batches", type=int, default=8)
    ap.add_argument("--whole", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        model, text, nbytes, params = write_checkpoint(root, args.hidden, args.layers, args.intermediate, args.vocab)
        print(
            f"checkpoint: {params / 1e9:.3f}B parameters, {nbytes / 2**30:.2f} GiB BF16 ({time.perf_counter() - t0:.0f} s)"
        )
        py = [sys.executable]
        base = measure([*py, "-c", "import fp8kit, transformers"])["peak"]
        quantize = [
            *py, "-m", "fp8kit.cli", "quantize", "--model", str(model), "--scheme", args.scheme, "--text", str(text),
            "--calib-batches", str(args.calib_batches), "--gptq" if args.gptq else "--no-gptq",
            "--keep-bf16", "0", "--norm-tweak", "0",
        ]  # fmt: skip
        rows = {"full load (float32)": measure([*py, "-c", FULL_LOAD, str(model)])}
        rows["sequential"] = measure([*quantize, "--out", str(root / "seq")])
        if args.whole:
            whole = [str(model), args.scheme, str(text), str(args.calib_batches), str(int(args.gptq)), str(root / "w")]
            rows["whole model"] = measure([*py, "-c", WHOLE, *whole])
    gptq = "GPTQ" if args.gptq else "round to nearest"
    print(f"\n{args.scheme} ({gptq}), {args.calib_batches} calibration batches of 4 x 128 tokens; baseline "
          f"`import fp8kit, transformers` {base / 2**30:.2f} GiB")  # fmt: skip
    print("\n| run | peak RSS above baseline (GiB) | x checkpoint bytes | wall time (s) |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        above = r["peak"] - base
        print(f"| {name} | {above / 2**30:.2f} | {above / nbytes:.2f}x | {r['s']:.0f} |")


if __name__ == "__main__":
    main()
