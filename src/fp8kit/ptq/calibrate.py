"""Calibration: observe each layer's input over a ``forward_loop`` and choose static clipping ranges.

Methods for the clipping value ``c`` (the static scale is ``c / fmt.max``):

* ``"max"``: the largest magnitude seen (no clipping);
* ``"percentile"``: the ``percentile``-th percentile of magnitudes (default 99.99);
* ``"mse"``: the ratio ``r`` of ``c = r * amax`` among ``MSE_GRID`` candidates in ``[0.3, 1]`` that
  minimises the squared quantize-dequantize error.

Both work on a weighted sample per batch: the ``TOP_PER_BATCH`` largest magnitudes exactly, plus
``SAMPLE_PER_BATCH`` uniform draws from the rest, each weighted by the count it stands for.

Observers also keep each input channel's max magnitude (for SmoothQuant) and refuse non-finite or
all-zero inputs with an error naming the layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from ..numerics.formats import Format
from ..numerics.scaling import compute_scale
from ..numerics.tensor import quantize

__all__ = ["CALIBRATION_METHODS", "InputObserver", "choose_amax", "observe_inputs"]

CALIBRATION_METHODS = ("max", "percentile", "mse")
SAMPLE_PER_BATCH = 16384
TOP_PER_BATCH = 256
MSE_GRID = 36


class InputObserver:
    """Running statistics of one layer's input: amax, per-channel amax, a magnitude sample and, with
    ``keep_rows > 0``, up to ``keep_rows`` whole input rows (tokens) drawn uniformly per batch."""

    def __init__(self, name: str, seed: int = 0, keep_rows: int = 0) -> None:
        self.name = name
        self.keep_rows = keep_rows
        self.row_sample: list[torch.Tensor] = []
        self.amax = 0.0
        self.channel_amax: torch.Tensor | None = None
        self.samples: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        self.batches = 0
        self.gen = torch.Generator().manual_seed(seed)

    def observe(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if not torch.isfinite(x).all():
            raise ValueError(
                f"calibration input of layer {self.name!r} holds NaN or inf: clean the calibration data "
                "(or fix the model) before quantizing"
            )
        if self.keep_rows:
            idx = torch.randperm(x.shape[0], generator=self.gen)[: self.keep_rows]
            self.row_sample.append(x[idx].clone())
        mag = x.abs()
        ch = mag.amax(dim=0)
        self.channel_amax = ch if self.channel_amax is None else torch.maximum(self.channel_amax, ch)
        self.amax = max(self.amax, float(ch.max()))
        flat = mag.reshape(-1)
        if flat.numel() > SAMPLE_PER_BATCH:
            # the largest values exactly (weight 1), a uniform sample standing for the rest
            top, idx = flat.topk(TOP_PER_BATCH)
            rest = torch.ones_like(flat, dtype=torch.bool)
            rest[idx] = False
            rest_vals = flat[rest]
            pick = rest_vals[torch.randint(0, rest_vals.numel(), (SAMPLE_PER_BATCH,), generator=self.gen)]
            self.samples.append(torch.cat([top, pick]))
            self.weights.append(
                torch.cat(
                    [torch.ones(TOP_PER_BATCH), torch.full((SAMPLE_PER_BATCH,), rest_vals.numel() / SAMPLE_PER_BATCH)]
                )
            )
        else:
            self.samples.append(flat.clone())
            self.weights.append(torch.ones(flat.numel()))
        self.batches += 1

    def rows(self) -> torch.Tensor:
        """The kept input rows, ``(rows, in_features)`` float32 (empty without ``keep_rows``)."""
        return torch.cat(self.row_sample) if self.row_sample else torch.zeros(0)

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Magnitudes and the number of observed values each stands for."""
        if not self.samples:
            return torch.zeros(0), torch.zeros(0)
        return torch.cat(self.samples), torch.cat(self.weights)


def choose_amax(obs: InputObserver, fmt: Format, method: str = "max", percentile: float = 99.99) -> float:
    """The clipping value (the amax the static scale is set for) by ``method``."""
    if method not in CALIBRATION_METHODS:
        raise ValueError(f"unknown calibration method {method!r}; accepted: {', '.join(CALIBRATION_METHODS)}")
    if obs.batches == 0:
        raise ValueError(f"layer {obs.name!r} saw no calibration data: the forward_loop never reached it")
    if obs.amax == 0.0:
        raise ValueError(
            f"layer {obs.name!r} saw only zeros during calibration, so no activation scale can be chosen: "
            "calibrate on representative data, or keep the layer in high precision with module_filter"
        )
    if method == "max":
        return obs.amax
    sample, weight = obs.sample()
    if method == "percentile":
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        order = sample.argsort()
        cum = weight[order].cumsum(0)
        k = int(torch.searchsorted(cum, cum[-1] * percentile / 100).clamp(max=sample.numel() - 1))
        return max(float(sample[order[k]]), obs.amax * 1e-6)
    best, best_err = obs.amax, float("inf")
    for r in torch.linspace(0.3, 1.0, MSE_GRID).tolist():  # magnitudes: the error is symmetric in sign
        c = obs.amax * r
        deq = quantize(sample, fmt, "tensor", scale=compute_scale(c, fmt)).dequantize(torch.float32)
        err = float((weight * (deq - sample) ** 2).sum())
        if err < best_err:
            best, best_err = c, err
    return best


def run_with_input_hooks(
    model: nn.Module,
    names: Iterable[str],
    on_input: Callable[[str, torch.Tensor], None],
    forward_loop: Callable[[nn.Module], object],
) -> None:
    """Run ``forward_loop(model)`` without gradients, calling ``on_input(name, x)`` with the input of each
    named layer as it runs; the hooks are removed afterwards, also on error."""
    hooks = [
        model.get_submodule(n).register_forward_pre_hook(lambda _m, args, n=n: on_input(n, args[0])) for n in names
    ]
    try:
        with torch.no_grad():
            forward_loop(model)
    finally:
        for h in hooks:
            h.remove()


def observe_inputs(
    model: nn.Module,
    names: Iterable[str],
    forward_loop: Callable[[nn.Module], object],
    seed: int = 0,
    keep_rows: int = 0,
) -> dict[str, InputObserver]:
    """Run ``forward_loop(model)`` with observers on the inputs of the named ``nn.Linear`` layers
    (``keep_rows``: input rows each observer keeps per batch, for searches that need whole tokens)."""
    observers = {name: InputObserver(name, seed, keep_rows) for name in names}
    run_with_input_hooks(model, observers, lambda name, x: observers[name].observe(x), forward_loop)
    if observers and all(o.batches == 0 for o in observers.values()):
        raise ValueError(
            "the forward_loop never ran the model: it must call model(...) on calibration batches "
            "(e.g. `def forward_loop(m): [m(x) for x in batches]`)"
        )
    return observers
