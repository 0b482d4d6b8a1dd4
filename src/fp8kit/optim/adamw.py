"""``fp8kit.optim.AdamW``: AdamW with FP8 moments and optional BF16 master weights.

State per parameter (plain tensors, so ``state_dict`` saves as safetensors; DTensors under FSDP2):

* ``step``: float32 scalar tensor (as ``torch.optim.AdamW``).
* ``exp_avg_codes`` (uint8 E4M3 codes, ``(n_blocks, block)``) + ``exp_avg_scale`` (float32 per block).
* second moment, ``exp_avg_sq="fp8"``: ``exp_avg_sq_codes`` (uint8) + ``exp_avg_sq_max`` (float32 per
  block) + ``exp_avg_sq_k`` (bfloat16 per block), COAT's dynamic range expansion; ``"bf16"``:
  ``exp_avg_sq`` (bfloat16, flat).
* ``kahan_comp`` (bfloat16, flat): only for BF16 parameters with ``bf16_update="kahan"``.

FSDP2 (``fully_shard``) parameters are DTensors: each rank keeps the state of its own shard only,
as DTensors placed like the parameter (``sharding.py``: padded shards, blocks never straddle ranks),
so the state bytes per rank are ~1/N; the non-finite-gradient skip is agreed by all shards (one MIN
all-reduce of the flags per step), and ``torch.distributed.checkpoint`` saves and loads the state.

Bytes per parameter of the state (block 128): 1.03 (m) + 1.05 (v fp8) or 2 (v bf16), plus 2 with Kahan.
FP32 parameters are their own master weights; BF16 parameters are updated in FP32 and written back
with stochastic rounding (default) or Kahan compensation, so no FP32 copy is kept.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from .master import kahan_update_, stochastic_round_bf16
from .sharding import ShardInfo, dtensor_class, local_tensor, shard_info, wrap_like
from .states import decode_bf16, decode_expanded, decode_signed, encode_bf16, encode_expanded, encode_signed

__all__ = ["AdamW"]

_V_FORMATS = ("fp8", "bf16")
_BF16_UPDATES = ("stochastic", "kahan")
_PARAM_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_CHUNK = 1 << 20  # elements updated at a time: bounds the step's FP32 temporaries (~40 MiB)
_MASK64 = (1 << 64) - 1


def _mix_seed(*values: int) -> int:
    """A 63-bit generator seed from integers (splitmix64 over them): the same on every run and machine."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h >> 1


class AdamW(torch.optim.Optimizer):
    """Drop-in for ``torch.optim.AdamW`` (decoupled weight decay) that stores its moments in 8 bits.

    Args:
        params, lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW``.
        amsgrad: only ``False`` (AMSGrad's extra buffer defeats the memory saving).
        foreach: accepted and ignored (the update is vectorized per tensor).
        exp_avg_sq: second moment storage, ``"fp8"`` (E4M3 with COAT range expansion, default) or ``"bf16"``.
        bf16_update: how BF16 parameters take the FP32 update, ``"stochastic"`` rounding (default, no
            extra memory) or ``"kahan"`` (a BF16 compensation buffer, 2 bytes per parameter).
        block: contiguous elements per FP8 scale (default 128).
        seed: seed of stochastic rounding. The random bits of a parameter's step are drawn from a generator
            seeded with ``(seed, step, parameter index, shard index)``: runs are reproducible, a resumed
            run continues bit-exactly without saving generator state, DDP replicas round alike and
            FSDP2 shards draw independent bits.
        quantize_backend: ``"eager"`` or ``"compiled"`` kernels of ``fp8kit.quantize``.

    Parameters may be float32, float64 or bfloat16 (a mix is fine), plain tensors or FSDP2's sharded
    DTensors (state kept per shard). A parameter whose gradient holds NaN/inf (on any shard) is not
    updated that step (its state is untouched) and a ``RuntimeWarning`` names it.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        exp_avg_sq: str = "fp8",
        bf16_update: str = "stochastic",
        block: int = 128,
        seed: int = 0,
        quantize_backend: str = "eager",
    ) -> None:
        lr = float(lr)
        if not lr >= 0:
            raise ValueError(f"invalid learning rate {lr}; give lr >= 0")
        if not eps >= 0:
            raise ValueError(f"invalid eps {eps}; give eps >= 0")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"invalid betas {betas}; give two values in [0, 1)")
        if not weight_decay >= 0:
            raise ValueError(f"invalid weight_decay {weight_decay}; give weight_decay >= 0")
        if amsgrad:
            raise ValueError("fp8kit.optim.AdamW does not support amsgrad=True; use torch.optim.AdamW for AMSGrad")
        for name, val in (("capturable", capturable), ("differentiable", differentiable), ("fused", fused)):
            if val:
                raise ValueError(f"fp8kit.optim.AdamW does not support {name}=True; leave it unset")
        if exp_avg_sq not in _V_FORMATS:
            raise ValueError(f"exp_avg_sq must be one of {_V_FORMATS}, got {exp_avg_sq!r}")
        if bf16_update not in _BF16_UPDATES:
            raise ValueError(f"bf16_update must be one of {_BF16_UPDATES}, got {bf16_update!r}")
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        if quantize_backend not in ("eager", "compiled"):
            raise ValueError(f"quantize_backend must be 'eager' or 'compiled', got {quantize_backend!r}")
        del foreach  # the update is vectorized per tensor; there is no per-element Python loop to avoid
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": False,
            "maximize": maximize,
            "exp_avg_sq": exp_avg_sq,
            "bf16_update": bf16_update,
            "block": block,
        }
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._quantize_backend = quantize_backend
        super().__init__(params, defaults)

    # ---- parameter groups ------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            if p.is_complex():
                raise TypeError(
                    f"fp8kit.optim.AdamW: parameter {self._name(group, i)} is complex; "
                    "use torch.optim.AdamW or pass torch.view_as_real(param)"
                )
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(
                    f"fp8kit.optim.AdamW: parameter {self._name(group, i)} has dtype {p.dtype}; "
                    "give float32, float64 or bfloat16 parameters"
                )
            shard_info(p, f"parameter {self._name(group, i)}")  # TypeError for layouts other than FSDP2's
        if group["exp_avg_sq"] not in _V_FORMATS or group["bf16_update"] not in _BF16_UPDATES:
            raise ValueError(f"invalid exp_avg_sq / bf16_update in a parameter group: {group['exp_avg_sq']!r}")
        if group.get("amsgrad"):
            raise ValueError("fp8kit.optim.AdamW does not support amsgrad=True; use torch.optim.AdamW for AMSGrad")

    def _name(self, group: dict[str, Any], i: int) -> str:
        names = group.get("param_names")
        gi = next((j for j, g in enumerate(self.param_groups) if g is group), len(self.param_groups))
        return f"'{names[i]}'" if names else f"{i} of group {gi}"

    def _generator(self, device: torch.device, hyper: dict[str, Any], r0: int) -> torch.Generator:
        """The stochastic-rounding generator of one parameter's step; reseeded at its first chunk (``r0 == 0``)
        from ``hyper["seed"]`` = hash of (seed, step, parameter index, shard index)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            self._generators[device] = gen
        if r0 == 0:
            gen.manual_seed(hyper["seed"])
        return gen

    # ---- the update ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step over every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        live = []  # (group, index in group, index in optimizer, param, layout)
        index = 0
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise TypeError(
                            f"fp8kit.optim.AdamW: parameter {self._name(group, i)} has a sparse gradient; "
                            "use torch.optim.SparseAdam or a dense embedding"
                        )
                    live.append((group, i, index, p, shard_info(p)))
                index += 1
        if not live:
            return loss
        for (group, i, index, p, info), ok in zip(live, self._finite_flags(live), strict=True):
            if not ok:
                warnings.warn(
                    f"fp8kit.optim.AdamW: gradient of parameter {self._name(group, i)} holds NaN/inf"
                    f"{' (on some shard)' if info.sharded else ''}; its update was skipped this step (state unchanged)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            self._update(p, group, index, info)
        return loss

    @staticmethod
    def _finite_flags(live: list) -> list[bool]:
        """Whether each live parameter's gradient is finite: one host sync; sharded parameters are decided
        by all their shards (one MIN all-reduce per process group), so every rank skips the same ones."""
        flags = torch.stack([torch.isfinite(local_tensor(p.grad)).all() for *_, p, _ in live]).to(torch.int32)
        by_group: dict[Any, list[int]] = {}
        for j, (*_, info) in enumerate(live):
            if info.sharded:
                by_group.setdefault(info.group, []).append(j)
        for pgs, idx in by_group.items():
            sub = flags[idx]
            for pg in pgs if isinstance(pgs, tuple) else (pgs,):  # several mesh dims: MIN over each in turn
                torch.distributed.all_reduce(sub, op=torch.distributed.ReduceOp.MIN, group=pg)
            flags[idx] = sub
        return [bool(f) for f in flags.tolist()]

    def _init_state(self, p: torch.Tensor, group: dict[str, Any], info: ShardInfo | None = None) -> dict[str, Any]:
        info = info or shard_info(p)
        device = local_tensor(p).device
        zeros = torch.zeros(info.padded, device=device)
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        self._store(state, zeros, zeros, group, info)
        if p.dtype == torch.bfloat16 and group["bf16_update"] == "kahan":
            n = self._flat_len(info, group)
            state["kahan_comp"] = wrap_like(torch.zeros(n, dtype=torch.bfloat16, device=device), info)
        return state

    @staticmethod
    def _flat_len(info: ShardInfo, group: dict[str, Any]) -> int:
        """Length of the flat (BF16) state: the parameter's elements, or whole blocks of the padded shard."""
        return -(-info.padded // group["block"]) * group["block"] if info.sharded else info.padded

    def _store(
        self, state: dict[str, Any], m: torch.Tensor, v: torch.Tensor, group: dict[str, Any], info: ShardInfo
    ) -> None:
        """Encode flat moments ``m``, ``v`` (``info.padded`` elements) into ``state``."""
        block, backend = group["block"], self._quantize_backend
        codes, scale = encode_signed(m, block, backend)
        state["exp_avg_codes"], state["exp_avg_scale"] = wrap_like(codes, info), wrap_like(scale, info)
        if group["exp_avg_sq"] == "fp8":
            codes, vmax, k = encode_expanded(v, block, backend)
            state["exp_avg_sq_codes"], state["exp_avg_sq_max"] = wrap_like(codes, info), wrap_like(vmax, info)
            state["exp_avg_sq_k"] = wrap_like(k, info)
        else:
            flat = torch.zeros(self._flat_len(info, group), dtype=torch.bfloat16, device=v.device)
            flat[: v.numel()] = encode_bf16(v)
            state["exp_avg_sq"] = wrap_like(flat, info)

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded ``(exp_avg, exp_avg_sq)`` of parameter ``p`` as float32 tensors of its shape (of this
        rank's shard, for an FSDP2 ``DTensor`` parameter)."""
        st = {k: local_tensor(v) for k, v in self.state[p].items()}
        shape = local_tensor(p).shape
        n = math.prod(shape)
        m = decode_signed(st["exp_avg_codes"], st["exp_avg_scale"], n)
        if "exp_avg_sq_codes" in st:
            v = decode_expanded(st["exp_avg_sq_codes"], st["exp_avg_sq_max"], st["exp_avg_sq_k"], n)
        else:
            v = decode_bf16(st["exp_avg_sq"], n)
        return m.reshape(shape), v.reshape(shape)

    def _update(self, p: torch.Tensor, group: dict[str, Any], index: int, info: ShardInfo) -> None:
        """AdamW step of one parameter (this rank's shard of it), in chunks of whole blocks (FP32
        temporaries stay ~``_CHUNK``); ``index``: the parameter's position in the optimizer."""
        state = self.state[p] if self.state[p] else self._init_state(p, group, info)
        state["step"] += 1  # on every shard, also an empty one: the (replicated) step stays equal on all ranks
        step = float(state["step"])
        if info.numel == 0:
            return
        beta1, beta2 = group["betas"]
        hyper = {
            "lr": float(group["lr"]),
            "bias1": 1 - beta1**step,
            "bias2_sqrt": math.sqrt(1 - beta2**step),
            "seed": _mix_seed(self._seed, int(step), index, info.coord),
        }
        block, n = group["block"], info.numel
        local = local_tensor(p).detach()
        contiguous = local.is_contiguous()
        flat = local.view(-1) if contiguous else local.reshape(-1).clone()
        grad = local_tensor(p.grad).reshape(-1)
        st = {k: local_tensor(v) for k, v in state.items() if k != "step"}
        rows = -(-n // block)  # blocks holding this shard's elements (a padded shard's tail stays zero)
        step_rows = max(1, _CHUNK // block)
        for r0 in range(0, rows, step_rows):
            r1 = min(rows, r0 + step_rows)
            self._update_rows(st, group, hyper, flat, grad, r0, r1, min(r1 * block, n) - r0 * block)
        if not contiguous:
            local.copy_(flat.reshape(local.shape))

    def _update_rows(self, state, group, hyper, flat, grad, r0: int, r1: int, count: int) -> None:
        """Update blocks ``r0:r1`` (elements ``r0 * block`` onwards, ``count`` of them) in place."""
        block, backend = group["block"], self._quantize_backend
        e0, e1 = r0 * block, r0 * block + count
        beta1, beta2 = group["betas"]
        lr, wd, eps = hyper["lr"], group["weight_decay"], group["eps"]
        g = grad[e0:e1].float()
        if group["maximize"]:
            g = -g
        m = decode_signed(state["exp_avg_codes"][r0:r1], state["exp_avg_scale"][r0:r1], count)
        if "exp_avg_sq_codes" in state:
            v = decode_expanded(
                state["exp_avg_sq_codes"][r0:r1], state["exp_avg_sq_max"][r0:r1], state["exp_avg_sq_k"][r0:r1], count
            )
        else:
            v = decode_bf16(state["exp_avg_sq"][e0:e1], count)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / hyper["bias2_sqrt"]).add_(eps)
        target = flat[e0:e1]
        new = target.to(torch.float32 if target.dtype != torch.float64 else target.dtype)
        new = new.mul(1 - lr * wd).addcdiv_(m, denom, value=-lr / hyper["bias1"])
        del denom
        if target.dtype == torch.bfloat16:
            if group["bf16_update"] == "kahan":
                kahan_update_(target, new, state["kahan_comp"][e0:e1])
            else:
                target.copy_(stochastic_round_bf16(new, self._generator(target.device, hyper, r0)))
        else:
            target.copy_(new)
        codes, scale = encode_signed(m, block, backend)
        state["exp_avg_codes"][r0:r1], state["exp_avg_scale"][r0:r1] = codes, scale
        if "exp_avg_sq_codes" in state:
            codes, vmax, k = encode_expanded(v, block, backend)
            state["exp_avg_sq_codes"][r0:r1], state["exp_avg_sq_max"][r0:r1], state["exp_avg_sq_k"][r0:r1] = (
                codes,
                vmax,
                k,
            )
        else:
            state["exp_avg_sq"][e0:e1] = encode_bf16(v)

    # ---- state dicts -----------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class; tensors keep their stored dtypes (exact round trip)."""
        groups = state_dict.get("param_groups", [])
        for gi, group in enumerate(groups):
            if group.get("exp_avg_sq") not in _V_FORMATS:
                raise ValueError(
                    f"param group {gi} of the state dict is not fp8kit.optim.AdamW's; for a torch.optim.AdamW "
                    "state dict use AdamW.load_torch_state_dict"
                )
        saved = state_dict["state"]
        ids = [pid for g in groups for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        if len(ids) == len(params):
            for pid, p in zip(ids, params, strict=True):
                if pid in saved:
                    self._check_layout(p, saved[pid])
        super().load_state_dict(state_dict)
        for pid, p in zip(ids, params, strict=True):
            if pid in saved:  # torch casts floating state to the parameter's dtype: undo that
                self.state[p] = {
                    k: (v.to(local_tensor(p).device, copy=True) if k != "step" else v.clone())
                    for k, v in saved[pid].items()
                }

    @staticmethod
    def _check_layout(p: torch.Tensor, st: dict[str, Any]) -> None:
        """``ValueError`` unless the saved state of ``p`` is laid out as this optimizer keeps it (sharded state
        as DTensors of the same number of blocks per shard; whole-tensor state as plain tensors)."""
        info = shard_info(p)
        codes = st.get("exp_avg_codes")
        if codes is None:
            return
        block = codes.shape[-1]
        want = (info.shards * -(-info.padded // block), block)
        if info.sharded != _is_dtensor(codes) or (info.sharded and tuple(codes.shape) != want):
            saved = f"sharded {tuple(codes.shape)}" if _is_dtensor(codes) else "unsharded"
            raise ValueError(
                f"saved fp8kit.optim.AdamW state ({saved}) does not fit a parameter "
                f"{'sharded over ' + str(info.shards) + ' ranks' if info.sharded else 'that is not sharded'}: "
                "sharded FP8 optimizer state loads only on the world size that saved it"
            )

    def load_torch_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim.AdamW`` state dict: hyper-parameters and moments (re-encoded)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups, this optimizer {len(self.param_groups)}")
        for gi, (mine, theirs) in enumerate(zip(self.param_groups, groups, strict=True)):
            if len(mine["params"]) != len(theirs["params"]):
                raise ValueError(
                    f"param group {gi}: {len(theirs['params'])} params in the state dict, {len(mine['params'])} here"
                )
            if theirs.get("amsgrad"):
                raise ValueError("the torch.optim.AdamW state dict uses amsgrad=True, which fp8kit.optim.AdamW lacks")
            for key in ("lr", "betas", "eps", "weight_decay", "maximize"):
                if key in theirs:
                    mine[key] = tuple(theirs[key]) if key == "betas" else theirs[key]
            for pid, p in zip(theirs["params"], mine["params"], strict=True):
                st = state_dict["state"].get(pid)
                if not st:
                    continue
                if "exp_avg" not in st or "exp_avg_sq" not in st:
                    raise ValueError(f"state of parameter {pid} lacks exp_avg/exp_avg_sq: not a torch AdamW state dict")
                info = shard_info(p)
                if info.sharded != _is_dtensor(st["exp_avg"]):
                    raise ValueError(
                        f"state of parameter {pid}: sharded and unsharded layouts differ between the state dict "
                        "and this optimizer; convert with the same FSDP2 sharding (or none)"
                    )
                state = self._init_state(p, mine, info)
                state["step"] = torch.as_tensor(st["step"], dtype=torch.float32).clone().reshape(())
                device = local_tensor(p).device
                m, v = (
                    F.pad(local_tensor(st[k]).to(device).float().reshape(-1), (0, info.padded - info.numel))
                    for k in ("exp_avg", "exp_avg_sq")
                )
                self._store(state, m, v, mine, info)

    @classmethod
    def from_torch_state_dict(cls, params: Iterable[Any], state_dict: dict[str, Any], **kwargs: Any) -> AdamW:
        """A new optimizer over ``params`` (same group layout) holding a ``torch.optim.AdamW`` state dict."""
        opt = cls(params, **kwargs)
        opt.load_torch_state_dict(state_dict)
        return opt

    def state_bytes(self) -> int:
        """Bytes of all optimizer state tensors held by this process (codes, scales, steps, compensation
        buffers; for FSDP2 parameters this rank's shard only)."""
        return sum(
            local_tensor(t).numel() * local_tensor(t).element_size() for st in self.state.values() for t in st.values()
        )

    def state_shards(self) -> int:
        """Number of ranks the state is sharded over (1: not sharded). Sharded state is saved per rank in
        blocks of the padded shard, so it loads only on the same number of ranks."""
        return max((shard_info(p).shards for g in self.param_groups for p in g["params"]), default=1)


def _is_dtensor(t: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)
