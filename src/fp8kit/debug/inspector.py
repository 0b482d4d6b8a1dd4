"""The numerics inspector: per-layer, per-operand FP8 statistics over training, as JSONL and TensorBoard.

```python
with fp8kit.debug.inspect(model, log_dir="runs/inspect", every=10, what_if=["current", "block"]) as insp:
    for batch in data:
        loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()
        insp.step()          # one training step done
```

For every ``fp8kit.nn.Linear`` and each GEMM operand (``input``, ``weight``, ``grad``: the output
gradient), and for every expert of an MoE experts module (``nn.experts.FP8Experts``, as layers
``"{module}[{expert}].{weight}"``, e.g. ``model.layers.0.mlp.experts[3].gate_up_proj``: its weight, and
the rows routed to it as that projection's ``input`` and ``grad``, with ``tokens_routed``; eager mode),
on the steps where ``step % every == 0``, it records the figures of ``fp8kit.debug.stats.operand_stats`` under the layer's own recipe (``recipe: "actual"``), and under each
``what_if`` recipe on the same tensors (training is unchanged). Hooks exist only inside the ``with``
block: outside it the model runs exactly as without the inspector (no overhead).

FP8 attention (``fp8kit.convert(..., attention=...)``): for each attention block, as layer ``"{block}"``, the
four forward FP8 operands ``attn_q``, ``attn_k``, ``attn_v``, ``attn_p`` (the probabilities) and the two backward
ones ``attn_do`` and ``attn_ds`` (E5M2, E4M3 in MX blocks; recorded at ``step``), each call's worst
``sqnr_db``, ``underflow_pct`` (nonzero values flushed to zero: P's small probabilities), ``saturation_pct``,
``amax`` and ``amax_per_head`` (``nn.attention.observe_fp8_attention``'s figures; eager mode).

GEMM inputs carry the channel figures too (``channel_sqnr_db``, ``outlier_ratio``, ``kurtosis``). With
``trends=True`` (the default) it also records, as ``recipe: "trend"`` records (``value``), the signals
``fp8kit.debug.trends`` reads for early warning: ``gate_up_alignment`` of every SwiGLU MLP (before its
forward) and ``residual_rms`` of every decoder block's output.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..nn.attention import STATE_NAME, attention_states, attention_stats
from ..nn.experts import FP8Experts
from ..nn.linear import Linear as FP8Linear
from ..nn.routing import gather, permute
from ..numerics.recipes import DelayedScaling, Recipe, recipe_from_name
from ..numerics.tensor import tensor_amax
from .stats import ROLES, operand_stats
from .trends import gate_up_alignment

__all__ = ["Inspector", "expert_stats", "inspect", "routed_stats"]


class Inspector:
    """Collects operand statistics of a converted model's FP8 layers (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        log_dir: str | Path | None = None,
        every: int = 1,
        what_if: Iterable[Recipe | str] = (),
        tensorboard: bool = True,
        layers: Iterable[str] | None = None,
        trends: bool = True,
    ) -> None:
        self.model = model
        self.trends = trends
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self.what_if = [recipe_from_name(r) if isinstance(r, str) else r for r in what_if]
        wanted = None if layers is None else set(layers)
        self.layers = {
            n: m for n, m in model.named_modules() if isinstance(m, FP8Linear) and (wanted is None or n in wanted)
        }
        self.experts = {
            n: m for n, m in model.named_modules() if isinstance(m, FP8Experts) and (wanted is None or n in wanted)
        }
        self.attention = {
            block: st
            for n, st in attention_states(model).items()
            if (block := n.removesuffix(f".{STATE_NAME}")) and (wanted is None or block in wanted)
        }
        if not self.layers and not self.experts and not self.attention:
            raise ValueError(
                "the model has no FP8 layers to inspect: convert it first (fp8kit.convert(model, recipe))"
                + (" or fix the layer names given" if layers is not None else "")
            )
        self.current_step = 0
        self.records: list[dict[str, Any]] = []
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._jsonl = None
        self._tb = None
        self._want_tb = tensorboard
        self._hooks: list[Any] = []

    # ---- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Inspector:
        if self.log_dir is not None:
            try:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                self._jsonl = open(self.log_dir / "fp8_stats.jsonl", "a")  # noqa: SIM115
            except OSError as err:
                raise PermissionError(
                    f"cannot write the inspector log to {self.log_dir}: {err.strerror or err}"
                ) from err
            if self._want_tb:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(self.log_dir / "tensorboard"))
                except ImportError:  # tensorboard not installed: JSONL only
                    self._tb = None
        for name, m in self.layers.items():
            self._hooks.append(m.register_forward_pre_hook(self._on_forward(name)))
        for name, m in self.experts.items():
            self._hooks.append(m.register_forward_pre_hook(self._on_experts(name)))
            m.fp8_operand_tap = self._experts_tap(name, m)
        for block, st in self.attention.items():
            attn = self.model.get_submodule(block)
            self._hooks.append(attn.register_forward_pre_hook(self._on_attention(block, st)))
            self._hooks.append(attn.register_forward_hook(self._after_attention(block, st)))
        if self.trends:
            self._hook_trends()
        return self

    def _hook_trends(self) -> None:
        from ..nn.convert import decoder_blocks
        from ..nn.swiglu import swiglu_mlps

        for name, mlp in swiglu_mlps(self.model):

            def align(m: nn.Module, _args: Any, name: str = name) -> None:
                if self.active:
                    a = gate_up_alignment(m.gate_proj.weight, m.up_proj.weight)
                    self._record_trend(name, "gate_up_alignment", a.pop("value"), **a)

            self._hooks.append(mlp.register_forward_pre_hook(align))
        blocks = decoder_blocks(self.model)
        if blocks is None:
            return
        for i, block in enumerate(self.model.get_submodule(blocks[0])):

            def rms(_m: nn.Module, _args: Any, out: Any, name: str = f"{blocks[0]}.{i}") -> None:
                h = out[0] if isinstance(out, (tuple, list)) else out
                if self.active and isinstance(h, torch.Tensor) and h.is_floating_point():
                    self._record_trend(name, "residual_rms", float(h.detach().float().pow(2).mean().sqrt()))

            self._hooks.append(block.register_forward_hook(rms))

    def _on_attention(self, block: str, st: nn.Module):
        def hook(_m: nn.Module, _args: Any) -> None:
            self._attention_records(block, st)  # dO / dS of a backward not yet followed by ``step``
            st.observed, st.observing = [], self.active and not torch.compiler.is_compiling()

        return hook

    def _after_attention(self, block: str, st: nn.Module):
        """After an attention block's forward: its forward operands' figures as records (the backward's,
        dO and dS, are recorded at ``step``)."""

        def hook(_m: nn.Module, _args: Any, _out: Any) -> None:
            if st.observing:
                self._attention_records(block, st)
            st.observing = False

        return hook

    def _attention_records(self, block: str, st: nn.Module) -> None:
        """The FP8 attention figures ``st`` observed since the last call (``attention_stats``), as records."""
        rows = attention_stats({block: st})
        st.observed = []
        for row in rows:
            amax = [float(a) for a in row["amax"]]
            stats = {
                "amax": max(amax, default=0.0),
                "amax_per_head": amax,
                "sqnr_db": row["sqnr_db"],
                "underflow_pct": 100.0 * row["underflow"],
                "saturation_pct": 100.0 * row["saturated"],
            }
            operand = f"attn_{row['operand'].lower()}"
            kind = f"attention-{st.attention_recipe.scaling}-{st.attention_recipe.granularity}"
            rec = {"step": self.current_step, "layer": block, "operand": operand, "recipe": "actual"}
            rec.update(recipe_kind=kind, **stats)
            self.records.append(rec)
            if self._jsonl is not None:
                self._jsonl.write(json.dumps(rec) + "\n")
            if self._tb is not None:
                for key in ("amax", "underflow_pct", "saturation_pct", "sqnr_db"):
                    if stats[key] == stats[key] and abs(stats[key]) != float("inf"):
                        self._tb.add_scalar(f"{block}/{operand}/{key}", stats[key], self.current_step)

    def _record_trend(self, layer: str, signal: str, value: float, **extra: Any) -> None:
        rec = {"step": self.current_step, "layer": layer, "operand": signal, "recipe": "trend", "value": value}
        rec.update(extra)
        self.records.append(rec)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(rec) + "\n")
        if self._tb is not None and value == value and abs(value) != float("inf"):
            self._tb.add_scalar(f"{layer}/{signal}", value, self.current_step)

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for m in self.experts.values():
            m.fp8_operand_tap = None
        for block, st in self.attention.items():
            self._attention_records(block, st)
            st.observing = False
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def step(self) -> None:
        """Mark the end of a training step (statistics are taken on steps divisible by ``every``; FP8
        attention's backward operands of this step are recorded here)."""
        for block, st in self.attention.items():
            self._attention_records(block, st)
        self.current_step += 1
        if self._tb is not None:
            self._tb.flush()

    @property
    def active(self) -> bool:
        return self.current_step % self.every == 0

    # ---- collection --------------------------------------------------------------------------------
    def _delayed_scale(self, m: FP8Linear, role: str) -> torch.Tensor | None:
        i = ROLES.index(role)
        if isinstance(m.recipe, DelayedScaling) and m._calibrated[i]:
            return m.fp8_scale[i].detach().clone()
        return None

    def _record(self, name: str, m: FP8Linear, role: str, x: torch.Tensor, scale: torch.Tensor | None) -> None:
        step = self.current_step
        recipes = [("actual", m.active_recipe())] + [(r.kind, r) for r in self.what_if]
        for label, recipe in recipes:
            stats = operand_stats(x, role, recipe, scale if label == "actual" else None, channels=role == "input")
            rec = {"step": step, "layer": name, "operand": role, "recipe": label, "recipe_kind": recipe.kind, **stats}
            self.records.append(rec)
            if self._jsonl is not None:
                self._jsonl.write(json.dumps(rec) + "\n")
            if self._tb is not None:
                for key in ("amax", "scale", "underflow_pct", "saturation_pct", "sqnr_db", "staleness"):
                    if key in stats and stats[key] == stats[key] and abs(stats[key]) != float("inf"):
                        self._tb.add_scalar(f"{name}/{role}/{label}/{key}", stats[key], step)

    def _on_forward(self, name: str):
        def hook(m: FP8Linear, args: tuple[Any, ...]) -> None:
            if not self.active:
                return
            x = args[0]
            self._record(name, m, "input", x, self._delayed_scale(m, "input"))
            self._record(name, m, "weight", m.weight, self._delayed_scale(m, "weight"))
            if x.requires_grad or m.weight.requires_grad:
                scale = self._delayed_scale(m, "grad")  # what the backward of this step will use

                def on_out(mod, a, out):
                    if isinstance(out, torch.Tensor) and out.requires_grad:
                        out.register_hook(lambda g: self._record(name, mod, "grad", g, scale))
                    handle.remove()

                handle = m.register_forward_hook(on_out)

        return hook

    def _on_experts(self, name: str):
        """MoE experts, before each forward: per expert, its weights' figures and the tokens this forward
        routes to it (see ``expert_stats``; the routed rows come through ``_experts_tap``)."""

        def hook(m: FP8Experts, args: tuple[Any, ...]) -> None:
            if self.active:
                self._record_experts(name, m, expert_stats(m, top_k_index=args[1] if len(args) >= 2 else None))

        return hook

    def _experts_tap(self, name: str, m: FP8Experts):
        """``m.fp8_operand_tap``: per expert, the figures of the rows routed to it, for each projection's
        input (forward) and output gradient (backward), quantized as the layer does (``routed_stats``)."""

        def tap(p: int, role: str, x: torch.Tensor, row_experts: torch.Tensor, recipe: Recipe) -> None:
            if self.active:
                self._record_experts(name, m, routed_stats(m, p, role, x, row_experts, recipe))

        return tap

    def _record_experts(self, name: str, m: FP8Experts, rows: list[dict[str, Any]]) -> None:
        for stats in rows:
            layer = f"{name}[{stats.pop('expert')}].{stats.pop('param')}"
            operand = stats.pop("operand")
            rec = {"step": self.current_step, "layer": layer, "operand": operand, "recipe": "actual"}
            rec.update(recipe_kind=m.active_recipe().kind, **stats)
            self.records.append(rec)
            if self._jsonl is not None:
                self._jsonl.write(json.dumps(rec) + "\n")
            if self._tb is not None:
                for key in ("amax", "underflow_pct", "sqnr_db", "tokens_routed"):
                    if stats[key] == stats[key] and abs(stats[key]) != float("inf"):
                        self._tb.add_scalar(f"{layer}/{operand}/{key}", stats[key], self.current_step)

    def table(self, step: int | None = None, recipe: str = "actual") -> list[dict[str, Any]]:
        """The records of one step (default: the last one recorded) for ``recipe``."""
        if not self.records:
            return []
        step = self.records[-1]["step"] if step is None else step
        return [r for r in self.records if r["step"] == step and r["recipe"] == recipe]


def expert_param_names(module: nn.Module) -> tuple[str, str]:
    """The names of an experts module's two 3-D weights: ``(gate_up_proj | up_proj, down_proj)``."""
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


@torch.no_grad()
def expert_stats(
    module: FP8Experts, hidden_states: torch.Tensor | None = None, top_k_index: torch.Tensor | None = None
) -> list[dict[str, Any]]:
    """Per expert of an FP8 experts module, the FP8 figures (``operand_stats``: amax, underflow, SQNR) under
    the module's recipe, each row tagged ``expert``, ``param`` (the weight's name) and ``operand``:

    * ``"weight"`` of both 3-D weights, with the expert's own scale (delayed: its current one);
    * given a forward's ``hidden_states`` ``(T, H)`` and ``top_k_index`` ``(T, k)``: ``"input"`` of the
      first projection, the tokens routed to each expert (``routed_stats``).

    ``tokens_routed``: tokens routed to the expert in that forward (else in the module's last forward).
    Under expert parallelism (``parallelize_experts``) the rows are this rank's experts, under their global
    ids; the routing given is ignored (the tokens an expert receives come from every rank)."""
    recipe = module.active_recipe()
    e_all, first = module.num_experts, _first_expert(module)
    if hasattr(module, "ep_num_experts"):
        hidden_states = top_k_index = None
    if top_k_index is not None:
        tokens = torch.bincount(top_k_index.reshape(-1), minlength=e_all).tolist()
    else:
        tokens = module.fp8_tokens_per_expert.tolist()
    delayed = isinstance(recipe, DelayedScaling) and recipe is module.recipe
    names = expert_param_names(module)
    out = []
    if hidden_states is not None and top_k_index is not None:
        x = hidden_states.detach().reshape(-1, hidden_states.shape[-1])
        perm = permute(top_k_index)
        out += routed_stats(module, 0, "input", gather(x, perm), perm.expert_ids, recipe)
    for p, param in enumerate(names):
        w = module.fp8_param(p).detach()
        w = w.to_local() if hasattr(w, "to_local") else w  # expert parallelism: a DTensor of this rank's experts
        w = w.transpose(1, 2) if module.is_transposed else w
        for e in range(e_all):
            scale, slot = None, 2 + first + e
            if delayed and bool(module.fp8_seen[p, slot] > 0):
                scale = module.fp8_scale[p, slot].clone()
            stats = operand_stats(w[e], "weight", recipe, scale)
            out.append({"expert": first + e, "param": param, "operand": "weight", "tokens_routed": tokens[e], **stats})
    return out


@torch.no_grad()
def routed_stats(
    module: FP8Experts, p: int, role: str, x: torch.Tensor, row_experts: torch.Tensor, recipe: Recipe
) -> list[dict[str, Any]]:
    """Per expert, the FP8 figures of the rows of ``x`` ``(S, K)`` routed to it (``row_experts`` ``(S,)``)
    as projection ``p``'s ``role`` operand ("input" or "grad"), quantized as the layer does: per-tensor
    recipes with the one layer-wide scale of all routed rows (delayed: the layer's current scale, the
    fresh one before its first step), the per-token recipes per row or tile. An expert with no row reads
    amax 0 and SQNR NaN; ``tokens_routed`` counts its rows. ``row_experts`` are the module's own expert
    indices; the rows name global ids (expert parallelism)."""
    param, first = expert_param_names(module)[p], _first_expert(module)
    x = x.detach().reshape(-1, x.shape[-1])
    scale = None
    if recipe.per_tensor and x.numel():  # the scale the layer quantizes these rows with
        scale = module.activation_scale(tensor_amax(x).float(), p, role, recipe).clone()
    tokens = torch.bincount(row_experts, minlength=module.num_experts).tolist()
    out = []
    for e in range(module.num_experts):
        rows = x[row_experts == e]
        stats = operand_stats(rows, role, recipe, scale) if rows.shape[0] else _empty_stats()
        out.append({"expert": first + e, "param": param, "operand": role, "tokens_routed": tokens[e], **stats})
    return out


def _first_expert(module: nn.Module) -> int:
    """The global id of the module's expert 0 (not 0 only under expert parallelism)."""
    return int(getattr(module, "ep_first_expert", 0))


def _empty_stats() -> dict[str, float]:
    """The figures of an operand with no values (an expert no token reached): nothing lost, nothing to say."""
    keys = ("amax", "scale", "scale_inv", "underflow_pct", "saturation_pct", "dynamic_range_binades", "nonfinite")
    return {**dict.fromkeys(keys, 0.0), "sqnr_db": float("nan")}


def inspect(model: nn.Module, **kwargs: Any) -> Inspector:
    """``Inspector(model, **kwargs)``; use it as a context manager."""
    return Inspector(model, **kwargs)


def read_stats(path: str | Path) -> list[dict[str, Any]]:
    """Records of an inspector's ``fp8_stats.jsonl`` (clear error if missing or empty)."""
    path = Path(path)
    if path.is_dir():
        path = path / "fp8_stats.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no inspector log at {path}")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i} is not a JSON line ({err.msg})") from err
    if not rows:
        raise ValueError(f"{path} is empty: the inspector recorded no step (is `every` larger than the run?)")
    return rows
