"""Bit-exactness check for refactors of the dense FP8 layer: a small Llama-style MLP (gate, up, down as
``fp8kit.nn.Linear``), every recipe (delayed with its defaults and with a short most-recent window and a
margin, current, row-wise, block, block 32, MXFP8), FP32 and BF16 modules, 4 training steps (SGD updates, so
the FP8 weight cache is rebuilt and delayed scaling's history and first-step rule matter), then one
evaluation forward, then the state dict (scaling state included) loaded into a fresh model for one more
step. ``save`` writes the outputs, input and weight gradients and the scaling buffers; ``check`` compares
bit for bit with a saved file (run ``save`` on the base commit first).

    OMP_NUM_THREADS=1 PYTHONPATH=<base worktree>/src python benchmarks/linear_bitexact.py save /tmp/ref.pt
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/linear_bitexact.py check /tmp/ref.pt
"""

import io
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8kit

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

HIDDEN, INTER, TOKENS, STEPS = 256, 320, 96, 4  # INTER = 320: the down projection's K splits a 128 tile
RECIPES = {
    "delayed": lambda: fp8kit.DelayedScaling(),
    "delayed-window2": lambda: fp8kit.DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent", margin=1),
    "delayed-hp-saved": lambda: fp8kit.DelayedScaling(),
    "current": lambda: fp8kit.CurrentScaling(),
    "current-pow2": lambda: fp8kit.CurrentScaling(power_of_two=True, margin=1),
    "rowwise": lambda: fp8kit.RowwiseScaling(),
    "block": lambda: fp8kit.BlockScaling(),
    "block32": lambda: fp8kit.BlockScaling(block_size=32),
    "mxfp8": lambda: fp8kit.MXFP8Scaling(),
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def build(name: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = MLP().to(dtype)
    return fp8kit.convert(model, RECIPES[name](), save_fp8_activations=name != "delayed-hp-saved")


def step(model: nn.Module, x0: torch.Tensor, g0: torch.Tensor, scale: float, dtype: torch.dtype) -> list:
    x = (x0 * scale).to(dtype).requires_grad_()
    out = model(x)
    out.backward(g0.to(dtype))
    found = [out.detach(), x.grad]
    found += [p.grad for p in model.parameters()]
    found += [b.detach().clone() for _, b in sorted(model.named_buffers())]
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(p.grad * 0.01)
    model.zero_grad(set_to_none=True)
    return found


def run() -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(TOKENS, HIDDEN, generator=gen)
    g0 = torch.randn(TOKENS, HIDDEN, generator=gen)
    res = {}
    for name in RECIPES:
        for dtype in (torch.float32, torch.bfloat16):
            model = build(name, dtype)
            for s in range(STEPS):
                res[f"{name} {dtype} step{s}"] = step(model, x0, g0, 1.0 + s, dtype)
            model.eval()
            with torch.no_grad():
                res[f"{name} {dtype} eval"] = [model(x0.to(dtype))]
            model.train()
            buf = io.BytesIO()
            torch.save(model.state_dict(), buf)
            buf.seek(0)
            fresh = build(name, dtype)
            fresh.load_state_dict(torch.load(buf, weights_only=True))
            res[f"{name} {dtype} state_dict"] = [v.clone() for _, v in sorted(fresh.state_dict().items())]
            res[f"{name} {dtype} resumed"] = step(fresh, x0, g0, 2.5, dtype)
    return res


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().view(-1)
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    res = run()
    if mode == "save":
        torch.save(res, path)
        print("saved", len(res), "runs")
        return
    ref = torch.load(path, weights_only=True)
    bad = total = 0
    for key, want in ref.items():
        got = res.get(key)
        if got is None or len(got) != len(want):
            bad += 1
            print("MISSING or different tensor count", key)
            continue
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            total += 1
            same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
            if not same:
                bad += 1
                diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
                print("MISMATCH", key, i, diff)
    print(f"checked {len(ref)} runs, {total} tensors: {bad} mismatches")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
