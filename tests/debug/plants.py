"""Faults planted in tiny models for the doctor's tests: an outlier channel in a SwiGLU output, and gate/up
rows pulled into alignment over the steps."""

from __future__ import annotations

import torch
import torch.nn as nn


class ChannelOutlier(nn.Module):
    """Wraps a SwiGLU MLP's ``act_fn``: from its ``start``-th call (0-based) on, and before its ``stop``-th,
    channel ``channel`` of the activation is multiplied by ``factor``, so the ``down_proj`` input carries
    the outlier in BF16 and FP8 copies alike (each deep copy counts its own calls)."""

    def __init__(self, act: nn.Module, channel: int = 3, factor: float = 2.0**14, start: int = 4, stop: int = 10**9):
        super().__init__()
        self.act, self.channel, self.factor, self.start, self.stop = act, channel, factor, start, stop
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(x)
        self.calls += 1
        if self.start < self.calls <= self.stop:
            scale = torch.ones(y.shape[-1], dtype=y.dtype, device=y.device)
            scale[self.channel] = self.factor
            y = y * scale
        return y


def plant_outlier(model: nn.Module, layer: int = 2, **kwargs) -> nn.Module:
    """``model`` with ``ChannelOutlier(**kwargs)`` around ``model.model.layers[layer].mlp.act_fn``."""
    mlp = model.model.layers[layer].mlp
    mlp.act_fn = ChannelOutlier(mlp.act_fn, **kwargs)
    return model


TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. "
) * 4


def llama(layers: int = 4) -> nn.Module:
    """A ``transformers`` Llama of ``layers`` layers, hidden 64, intermediate 128, byte vocabulary (seed 0)."""
    import transformers

    from tests.helpers.models import tiny_llama_config

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers, max_position_embeddings=64))


def batches(steps: int, batch: int = 4, seq: int = 32) -> list[dict[str, torch.Tensor]]:
    """``steps`` causal-LM batches of ``TEXT``'s bytes at random offsets (seed 1)."""
    ids = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq, (batch,), generator=g).tolist()
        x = torch.stack([ids[o : o + seq] for o in starts])
        out.append({"input_ids": x, "labels": x})
    return out


def plant_alignment(model: nn.Module, layer: int = 2, channel: int = 3, rate: float = 2.0**0.5, start: int = 2):
    """``model`` whose layer ``layer`` MLP, before each forward from its ``start``-th call (0-based) on, sets
    row ``channel`` of ``gate_proj`` along row ``channel`` of ``up_proj`` and scales both by ``rate`` per call:
    the gate/up alignment and weight growth that make a SwiGLU outlier grow (by ``rate**2`` per step)."""
    mlp = model.model.layers[layer].mlp
    mlp.plant_calls = 0

    def align(m: nn.Module, _args) -> None:
        k = m.plant_calls - start
        m.plant_calls += 1
        if k < 0:
            return
        with torch.no_grad():
            g, u = m.gate_proj.weight, m.up_proj.weight
            if k == 0:
                m.plant_norms = (float(g[channel].norm()), float(u[channel].norm()))
            unit = u[channel] / u[channel].norm()
            g[channel] = unit * m.plant_norms[0] * rate**k
            u[channel] = unit * m.plant_norms[1] * rate**k

    mlp.register_forward_pre_hook(align)
    return model
