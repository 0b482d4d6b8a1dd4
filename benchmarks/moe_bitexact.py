"""Bit-exactness check for speed work on the FP8 experts: a Qwen3-MoE experts layer, every
recipe, FP32 and BF16 modules, two sizes, normal routing and one with a zero-token expert, 3 steps each
(weights updated and the FP8 weight cache dropped between steps). ``save`` writes the outputs and both
gradients; ``check`` compares bit for bit with a saved file (run ``save`` on the base commit first).

    OMP_NUM_THREADS=1 PYTHONPATH=<base worktree>/src python benchmarks/moe_bitexact.py save /tmp/ref.pt
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/moe_bitexact.py check /tmp/ref.pt
"""

import sys
import warnings

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import fp8kit

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

mode, path = sys.argv[1], sys.argv[2]


def mk(dtype, d, inter, e):
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=d, moe_intermediate_size=inter, num_experts=e)
    cfg._experts_implementation = "grouped_mm"
    m = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.02)
        m.down_proj.normal_(0, 0.02)
    return m.to(dtype)


res = {}
# (192, 128): the down projection's K = 128 is one block tile (its scales factor out), its transpose's is not
for d, inter, e, t in [(256, 160, 8, 300), (192, 128, 8, 200), (1024, 512, 8, 2048)]:
    for zero in (False, True):
        gen = torch.Generator().manual_seed(1)
        scores = torch.rand(t, e, generator=gen)
        if zero:
            scores[:, 3] = -1.0  # expert 3 gets no token
        top_w, top_i = scores.topk(2, dim=-1)
        x0 = torch.randn(t, d, generator=gen)
        g0 = torch.randn(t, d, generator=gen)
        w0 = top_w / top_w.sum(-1, keepdim=True)
        for recipe in ("delayed", "current", "rowwise", "block", "block32", "mxfp8"):
            for dtype in (torch.float32, torch.bfloat16):
                r = fp8kit.BlockScaling(block_size=32) if recipe == "block32" else recipe
                m = fp8kit.convert(torch.nn.Sequential(mk(dtype, d, inter, e)), r)[0]
                for step in range(3):
                    m.release_fp8_weights()
                    x = (x0 * (1 + step)).to(dtype).requires_grad_()
                    out = m(x, top_i, w0.to(dtype))
                    out.backward(g0.to(dtype))
                    key = f"{d}x{inter} zero={zero} {recipe} {dtype} step{step}"
                    res[key] = [out.detach(), x.grad, m.gate_up_proj.grad, m.down_proj.grad]
                    with torch.no_grad():
                        m.gate_up_proj.sub_(m.gate_up_proj.grad * 0.01)
                        m.down_proj.sub_(m.down_proj.grad * 0.01)
                    m.zero_grad(set_to_none=True)
if mode == "save":
    torch.save(res, path)
    print("saved", len(res))
else:
    ref = torch.load(path)
    bad = 0
    for k, v in ref.items():
        for name, a, b in zip(("out", "dx", "dw_gate_up", "dw_down"), v, res[k], strict=True):
            same = (
                a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(
                    a.view(-1).view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                    b.view(-1).view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32),
                )
            )
            if not same:
                bad += 1
                print("MISMATCH", k, name, (a.float() - b.float()).abs().max().item())
    print(f"checked {len(ref)} runs x 4 tensors: {bad} mismatches")
