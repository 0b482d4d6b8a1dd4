"""Bit-exactness check for refactors of the PTQ path: a tiny random Qwen3-MoE and a tiny Llama quantized
with every PTQ scheme (round to nearest; GPTQ and one norm-tweak pass on the MoE), and with block FP8
(``fp8kit.export.quantize_block``, dynamic and weight-only activations). ``save`` writes the logits
(float32 and bfloat16 inputs) and every quantized tensor; ``check`` compares bit for bit with a saved
file (run ``save`` on the base commit first).

    OMP_NUM_THREADS=1 PYTHONPATH=<base worktree>/src python benchmarks/ptq_bitexact.py save /tmp/ptq-ref.pt
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/ptq_bitexact.py check /tmp/ptq-ref.pt
"""

import sys
import warnings

import torch
import transformers as tf

from fp8kit.export import quantize_block
from fp8kit.export.block_linear import BlockQuantLinear
from fp8kit.ptq import quantize
from fp8kit.ptq.schemes import SCHEMES

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def qwen3_moe(top_k: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=top_k,
        mlp_only_layers=[],
    )
    return tf.Qwen3MoeForCausalLM(cfg).eval()


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=192,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return tf.LlamaForCausalLM(cfg).eval()


MODELS = {"qwen3_moe_k2": lambda: qwen3_moe(2), "qwen3_moe_k4": lambda: qwen3_moe(4), "llama": llama}
ids = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(1))


def loop(m):
    for i in range(0, 4, 2):
        m(ids[i : i + 2])


def record(res: dict, key: str, model: torch.nn.Module) -> None:
    with torch.no_grad():
        res[f"{key} logits"] = model(ids).logits.float()
        res[f"{key} logits bf16"] = model.to(torch.bfloat16)(ids).logits.float()
        model.float()
    for name, t in model.state_dict().items():
        if t.dtype in (torch.float8_e4m3fn, torch.int8) or "scale" in name:
            res[f"{key} {name}"] = t


def runs():
    for arch in MODELS:
        for scheme in SCHEMES:
            yield arch, scheme, {}
        yield arch, "fp8", {"gptq": True}
        yield arch, "fp8-dynamic", {"norm_tweak": 1}
        yield arch, "block", {}
        yield arch, "block-weight-only", {}


res: dict = {}
for arch, scheme, kw in runs():
    model = MODELS[arch]()
    key = f"{arch} {scheme} {kw}"
    if scheme.startswith("block"):
        quantize_block(model)
        for m in model.modules():
            if isinstance(m, BlockQuantLinear):
                m.dynamic_activations = scheme == "block"
    else:
        quantize(model, scheme, loop, progress=False, **kw)
    record(res, key, model)
    print(key, "done", flush=True)

mode, path = sys.argv[1], sys.argv[2]
if mode == "save":
    torch.save(res, path)
    print("saved", len(res))
else:
    ref = torch.load(path)
    bad = 0
    for k, a in ref.items():
        b = res.get(k)
        same = (
            b is not None
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        )
        if not same:
            bad += 1
            diff = "missing" if b is None else (a.float() - b.float()).abs().max().item()
            print("MISMATCH", k, diff)
    print(f"checked {len(ref)} tensors: {bad} mismatches")
