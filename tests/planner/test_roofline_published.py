"""The H100 roofline's BF16 / FP8 (per-tensor) training-step time ratio against torchao's measured speed-ups.

Published: torchao ``Float8Linear`` forward + backward, tensorwise (dynamic) scaling, ``torch.compile``, on an
H100, speed-up over the BF16 ``nn.Linear`` at the forward's ``M, K, N``:

* torchao ``torchao/float8/README.md``, "Performance": 0.80 at 1024, 2048, 1024 (the casts cost more than
  the FP8 GEMMs save) and 1.39 at 4096, 8192, 16384;
* pytorch/ao PR 2185 (tensorwise, fast accumulation, compiled), Llama-70B single-GPU shapes at M = 16384:
  ``ffn.w13`` 1.73 at 16384, 8192, 7168; ``ffn.w2`` 1.71 at 16384, 3584, 8192; ``attn.w0`` 1.43 at 16384,
  1024, 8192; ``attn.wqkv`` 1.11 at 16384, 8192, 1280.

Tolerance 25%: the roofline takes datasheet peaks (BF16 and FP8 GEMMs at 100% of peak, casts at the full HBM
bandwidth), while cuBLAS reaches roughly 60-80% of peak on these shapes and the compiled cast kernels about 90%
of the bandwidth (torchao's own roofline, ``torchao/testing/training/roofline_utils.py``: 78% and 92%); the
ratio cancels the common part, and what is left differs by shape by up to about a fifth. Each ratio must also
be on the published side of 1.0: an FP8 peak equal to BF16's puts the large shapes below 1, dropping the casts
puts the small shape above 1, and either fails here.
"""

import dataclasses

from fp8kit.planner import roofline
from fp8kit.planner.roofline import GPU, GPUS, Gemm, layer_seconds

PUBLISHED = {  # (M, K, N): measured BF16 / FP8 step-time ratio (the FP8 speed-up)
    (1024, 2048, 1024): 0.80,
    (4096, 8192, 16384): 1.39,
    (16384, 8192, 7168): 1.73,
    (16384, 3584, 8192): 1.71,
    (16384, 1024, 8192): 1.43,
    (16384, 8192, 1280): 1.11,
}
TOLERANCE = 0.25


def disagreements(gpu: GPU) -> list[str]:
    """The published shapes where ``gpu``'s roofline ratio is off by more than ``TOLERANCE`` or on the other
    side of 1.0."""
    out = []
    for (m, k, n), published in PUBLISHED.items():
        g = [Gemm(m, k, n)]
        ratio = layer_seconds(g, "bf16", gpu) / layer_seconds(g, "current", gpu)
        if abs(ratio / published - 1) > TOLERANCE or (ratio > 1) != (published > 1):
            out.append(f"{m},{k},{n}: roofline {ratio:.2f}, published {published:.2f}")
    return out


def test_h100_roofline_matches_torchao_speedups():
    assert disagreements(GPUS["h100"]) == []


def test_the_check_catches_a_wrong_fp8_peak_or_dropped_casts(monkeypatch):
    h100 = GPUS["h100"]
    same_peak = disagreements(dataclasses.replace(h100, fp8_flops=h100.bf16_flops))
    assert any(s.startswith("16384,8192,7168") for s in same_peak)
    monkeypatch.setattr(roofline, "_cast_passes", lambda recipe, g: [0.0] * 6)
    dropped = disagreements(h100)
    assert any(s.startswith("1024,2048,1024") for s in dropped)
