"""The device mesh of a run on several processes: its shape, its validation, and the model laid out on it.

One mesh per run, dims named ``("dp", "ep", "tp")`` (size-1 ``ep`` / ``tp`` dims are left out; ``dp`` is
always there): ``nproc = dp x ep x tp``, ranks ordered row-major (``tp`` innermost, so a TP group is
consecutive ranks, on one machine when ``tp`` divides the processes per machine).

* ``tp``: tensor parallelism (``tensor_parallel.py``) of the attention and MLP projections; the ``tp``
  ranks of a group read the same batch.
* ``ep``: expert parallelism of MoE experts (``expert_parallel.parallelize_experts`` on ``mesh["ep"]``:
  tokens are dispatched within a ``dp`` row's EP group); ``dp x ep`` ranks read distinct batch shards.
  Without FSDP2 (DDP-style; with ``tp`` only on one ``dp`` row): experts are sharded over ``ep`` and
  replicated over ``dp``; ``DistContext.reduce_expert_parallel_grads`` averages the expert gradients over
  the ``dp`` group (the ranks holding the same experts) and every other parameter's over all ``dp x ep``
  ranks (one flat all-reduce per step each; the first only with several ``dp`` rows). With FSDP2
  (``fsdp_meshes``): the experts are FSDP2-sharded over ``dp``, every other parameter over the flattened
  ``dp x ep`` ranks; FSDP2's reduce-scatters reduce both (the experts' divided by ``dp x ep``).
* ``dp``: data parallelism: FSDP2 (``fully_shard`` on ``mesh["dp"]``, or ``dp x ep`` as above, FP8 weight
  all-gather on that dim) with ``fsdp``, else DDP (refused together with ``tp``: shard with ``--fsdp``).

``check_mesh`` refuses a factorisation the run cannot take (one line naming the fix) before any process
or model exists; ``build_mesh`` makes the ``DeviceMesh`` in each worker; ``parallelize_model`` applies
TP, synchronized FP8 scaling and FSDP2 in that order.

**Identical scales on every rank.** Delayed scaling's one ``sync_scaling`` all-reduce per step and the
FP8 weight all-gather's amax all-reduce run over the whole world (every mesh dim), and the per-tensor
amaxes of TP-sharded operands (weights, column-parallel gradients, row-parallel inputs) are reduced over
the whole mesh too (``tp_amax_group``): a weight spans both ``dp`` (FSDP2 shards) and ``tp``, and the
other operands differ between ``dp`` ranks (different tokens), so a TP-group-only MAX would leave the
``dp`` ranks with different scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "MeshShape",
    "build_mesh",
    "check_mesh",
    "check_tp_model",
    "clip_grad_norm_",
    "fsdp_meshes",
    "llama_tp_plan",
    "mesh_layout",
    "mesh_of",
    "parallelize_model",
    "sequence_parallel_ends",
]

DIM_NAMES = ("dp", "ep", "tp")


@dataclass(frozen=True)
class MeshShape:
    """A run's factorisation ``nproc = dp x ep x tp`` (``check_mesh`` validates it)."""

    nproc: int
    tp: int = 1
    ep: int = 1
    fsdp: bool = False
    sp: bool = False  # sequence parallelism over ``tp`` (``llama_tp_plan``): no dim of its own

    @property
    def dp(self) -> int:
        return self.nproc // (self.tp * self.ep)

    @property
    def dim_names(self) -> tuple[str, ...]:
        """The mesh's dims: ``dp`` always, ``ep`` and ``tp`` when larger than 1."""
        return tuple(n for n in DIM_NAMES if n == "dp" or getattr(self, n) > 1)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in self.dim_names)

    @property
    def data_parallel(self) -> int:
        """Ranks that read distinct batch shards (``dp x ep``; the ranks of a TP group share theirs)."""
        return self.dp * self.ep

    def layout(self) -> dict[str, list]:
        """The parameters' mesh as checkpoints record it (``mesh_layout``)."""
        return _squeezed(self.shape, self.dim_names)

    def describe(self) -> dict[str, Any]:
        """The mesh as the run summary records it: ``{"shape": [...], "dim_names": [...], "fsdp": bool,
        "sequence_parallel": bool}``."""
        return {
            "shape": list(self.shape),
            "dim_names": list(self.dim_names),
            "fsdp": self.fsdp,
            "sequence_parallel": self.sp,
        }


def check_mesh(nproc: int, tp: int = 1, ep: int = 1, fsdp: bool = False, batch_size: int | None = None) -> MeshShape:
    """The ``MeshShape`` of ``nproc`` processes with ``tp``-way tensor and ``ep``-way expert parallelism, or a
    one-line ``ValueError`` naming the fix. Needs no process group (``fp8kit train`` calls it before launching)."""
    for flag, val in (("--nproc", nproc), ("--tp", tp), ("--ep", ep)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{flag} must be a positive integer, got {val!r}")
    inner = tp * ep
    if nproc % inner:
        fit = max(inner, nproc // inner * inner)
        raise ValueError(
            f"--nproc {nproc} does not factor as data-parallel x --ep {ep} x --tp {tp}: give --nproc a multiple of "
            f"{inner} (e.g. --nproc {fit}) or a --tp/--ep whose product divides {nproc}"
        )
    shape = MeshShape(nproc, tp, ep, fsdp)
    if fsdp and shape.data_parallel < 2:
        raise ValueError(
            "--fsdp shards over the data-parallel ranks, and "
            + (f"--nproc {nproc} / --tp {tp} leaves one" if tp > 1 else "--nproc 1 has one")
            + f": drop --fsdp or use --nproc {2 * inner}"
        )
    if tp > 1 and shape.dp > 1 and not fsdp:
        raise ValueError(
            f"--tp {tp} on --nproc {nproc} leaves {shape.dp} data-parallel replicas, which fp8kit shards with FSDP2 "
            f"only (no DDP x TP): add --fsdp, or use --nproc equal to --tp{f' x --ep ({inner})' if ep > 1 else ''}"
        )
    if batch_size is not None and batch_size % shape.data_parallel:
        raise ValueError(
            f"--batch-size {batch_size} (the global batch) does not split evenly over the {shape.data_parallel} "
            f"data-parallel ranks (--nproc {nproc} / --tp {tp}): give a multiple of {shape.data_parallel}"
        )
    return shape


def check_tp_model(tp: int, heads: int, kv_heads: int, hidden: int, intermediate: int, recipes: list[str]) -> None:
    """Refuse (one-line ``ValueError``) a ``tp`` the Llama plan (``llama_tp_plan``) cannot split: heads, KV
    heads and the MLP width must divide evenly, and every recipe's scaling tiles must stay within a shard
    (``tensor_parallel.check_tensor_parallel_layout``'s rule, checked here without building the model)."""
    if tp == 1:
        return
    from ..numerics.recipes import recipe_from_name

    for what, size in (("attention heads", heads), ("key/value heads", kv_heads), ("intermediate size", intermediate)):
        if size % tp:
            raise ValueError(f"--tp {tp} does not divide the model's {size} {what}: choose a --tp that divides {size}")
    for name in recipes:
        recipe = recipe_from_name(name)
        if recipe.scales_whole_rows:
            raise ValueError(
                f"--tp {tp}: the rowwise recipe's scales span the features tensor parallelism splits; use the "
                "delayed, current, block or mxfp8 recipe"
            )
        tile = recipe.tile_width
        for size in (hidden, intermediate):
            if tile and (size // tp) % tile:
                raise ValueError(
                    f"--tp {tp}: each rank would hold {size // tp} of {size} features, which splits the {name} "
                    f"recipe's {tile}-wide scaling tiles; choose a --tp that leaves a multiple of {tile} per rank"
                )


def build_mesh(shape: MeshShape, device_type: str = "cpu") -> Any:
    """The ``DeviceMesh`` of ``shape`` (collective: every rank calls it, after the process group is up)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape.shape, mesh_dim_names=shape.dim_names)


def llama_tp_plan(block: nn.Module, sequence_parallel: bool = False) -> dict[str, Any]:
    """The TP plan of one Llama-style decoder layer (``transformers`` names): q/k/v and gate/up column-wise
    (each rank its heads / MLP columns), o and down row-wise (all-reduce of the output, in high precision).
    ``fp8kit.nn.Linear`` layers get the FP8 styles, other linears (a BF16 baseline's) torch's own. Only the
    projections ``block`` has are planned (an MoE layer's experts are left to EP). Per-head norms inside the
    attention (Qwen3's q/k norms) see this rank's heads only: their gradients are summed over the group.

    ``sequence_parallel`` (Megatron's, torchtitan's): the residual stream stays sharded along the sequence
    (dim 1) between the projections; the two norms run on the shard (gradients summed over the group), the
    attention's and the MLP's input is all-gathered once, in FP8 for FP8 layers with a scale agreed over
    the group (``PrepareFloat8ModuleInput``), and o / down reduce-scatter their outputs along the sequence
    (high precision). The model's ends are ``sequence_parallel_ends``'."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    from ..nn.linear import Linear
    from .tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
        ReplicatedPartialInput,
    )

    colwise = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    rowwise = ("self_attn.o_proj", "mlp.down_proj")
    modules = dict(block.named_modules())
    out = Shard(1) if sequence_parallel else None
    plan: dict[str, Any] = {}
    for name in colwise + rowwise:
        if name in modules:
            fp8 = type(modules[name]) is Linear
            if name in colwise:
                plan[name] = Float8ColwiseParallel() if fp8 else ColwiseParallel()
            elif fp8:
                plan[name] = Float8RowwiseParallel(output_layouts=out)
            else:
                plan[name] = RowwiseParallel(output_layouts=out or Replicate())
    for name in ("self_attn.q_norm", "self_attn.k_norm"):
        if name in modules and plan:
            plan[name] = ReplicatedPartialInput()
    if not sequence_parallel:
        return plan
    for name in ("input_layernorm", "post_attention_layernorm"):
        if name in modules:
            plan[name] = ReplicatedPartialInput()
    for parent, kwarg in (("self_attn", "hidden_states"), ("mlp", None)):
        consumers = [n for n in colwise if n.startswith(parent + ".") and n in plan]
        if not consumers:
            continue
        kinds = {type(modules[n]) is Linear for n in consumers}
        if len(kinds) > 1:
            raise ValueError(
                f"sequence parallelism: {parent}'s column-parallel inputs mix FP8 and high-precision layers "
                f"({', '.join(consumers)}); convert all of them or none"
            )
        if kinds == {True}:
            plan[parent] = PrepareFloat8ModuleInput(input_layouts=Shard(1), input_kwarg=kwarg)
        elif kwarg is not None:
            plan[parent] = PrepareModuleInput(
                input_kwarg_layouts={kwarg: Shard(1)}, desired_input_kwarg_layouts={kwarg: Replicate()}
            )
        else:
            plan[parent] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def sequence_parallel_ends(model: nn.Module, tp_mesh: Any) -> None:
    """The ends of a sequence-parallel transformers decoder (with ``llama_tp_plan(sequence_parallel=True)``
    on its layers), in place: the first decoder layer cuts its input (the embedding output, whole on every
    rank) to this rank's sequence shard, so the model computes positions, rotary embeddings and the causal
    mask from the whole sequence and passes them on whole (the attention runs on the gathered sequence);
    the final norm runs on the shard and its output is all-gathered (high precision) for the LM head and
    the loss, which every TP rank computes alike on the whole sequence. The embedding's and head's
    gradients are then whole on every rank; the final norm's are summed over the group."""
    from torch.distributed.tensor.parallel import parallelize_module

    from .tensor_parallel import GatherSequenceOutput, ReplicatedPartialInput, ShardSequenceInput

    layers = _decoder_layers(model)
    norm = None
    for name in ("model.norm", "norm", "transformer.ln_f"):
        try:
            norm = model.get_submodule(name)
            break
        except AttributeError:
            continue
    if norm is None:
        raise ValueError(
            f"sequence parallelism: no final norm found in {type(model).__name__} (looked for model.norm); "
            "apply fp8kit.distributed.tensor_parallel.GatherSequenceOutput where the sequence shards end"
        )
    parallelize_module(layers[0], tp_mesh, ShardSequenceInput(sequence_dim=1))
    parallelize_module(norm, tp_mesh, ReplicatedPartialInput())
    parallelize_module(norm, tp_mesh, GatherSequenceOutput(sequence_dim=1))


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    for name in ("model.layers", "layers", "transformer.h"):
        try:
            layers = model.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(
        f"tensor parallelism: no decoder layers found in {type(model).__name__} (looked for model.layers); "
        "apply fp8kit.distributed.tensor_parallel styles with parallelize_module yourself"
    )


def _mesh_group(mesh: Any) -> Any:
    """The process group of all ranks of ``mesh`` (None, the default group, when it spans the world)."""
    import torch.distributed as dist

    ranks = mesh.mesh.flatten().tolist()
    return None if len(ranks) == dist.get_world_size() else dist.new_group(ranks)


def parallelize_model(
    model: nn.Module, mesh: Any, fsdp: bool = False, fp8_all_gather: bool = True, sequence_parallel: bool = False
) -> nn.Module:
    """Lay an FP8-converted Llama-style model out on ``mesh`` (``build_mesh``), in place; returns it.

    1. ``tp`` dim: ``llama_tp_plan`` on every decoder layer (``parallelize_module`` on ``mesh["tp"]``); the TP
       layers' per-tensor amaxes are reduced over the whole mesh (identical scales on every rank).
       ``sequence_parallel``: the plan's sequence-parallel form, and ``sequence_parallel_ends``.
    2. ``ep`` dim: ``expert_parallel.parallelize_experts(model, mesh["ep"])``.
    3. synchronized FP8 scaling over the whole mesh (``enable_fp8_distributed``).
    4. ``fsdp``: FSDP2 on ``mesh["dp"]`` (each decoder layer, then the root), with the FP8 weight
       all-gather of per-tensor layers (``fsdp.py``): TP-sharded weights are all-gathered in FP8 over ``dp``.
       With ``ep`` (``fsdp_meshes``): the non-expert parameters over the flattened ``dp x ep`` ranks, each
       experts module (its own unit) over ``dp``, its gradients divided by ``dp x ep`` (``shard_model``).
    """
    from .fsdp import shard_model
    from .scaling import enable_fp8_distributed

    names = mesh.mesh_dim_names or ()
    if sequence_parallel and "tp" not in names:
        raise ValueError("sequence parallelism splits the sequence over the mesh's 'tp' dim, which it lacks")
    whole = _mesh_group(mesh)
    if "tp" in names:
        from torch.distributed.tensor.parallel import parallelize_module

        from .tensor_parallel import TensorParallelLinear

        for layer in _decoder_layers(model):
            parallelize_module(layer, mesh["tp"], llama_tp_plan(layer, sequence_parallel))
        if sequence_parallel:
            sequence_parallel_ends(model, mesh["tp"])
        for m in model.modules():
            if isinstance(m, TensorParallelLinear):
                m.tp_amax_group = whole
    if "ep" in names:
        try:
            from .expert_parallel import parallelize_experts
        except ImportError:
            raise ValueError(
                "--ep: expert parallelism (fp8kit.distributed.expert_parallel) is not in this build of fp8kit; "
                "run without --ep"
            ) from None
        parallelize_experts(model, mesh["ep"])
    enable_fp8_distributed(model, whole)
    if fsdp:
        dense, experts = fsdp_meshes(mesh)
        shard_model(model, fp8_all_gather=fp8_all_gather, mesh=dense, scale_group=whole, experts_mesh=experts)
    return model


def fsdp_meshes(mesh: Any) -> tuple[Any, Any]:
    """``(dense, experts)``: the 1-D meshes FSDP2 shards over. Without ``ep``: ``mesh["dp"]`` and None (the
    experts modules too). With ``ep`` (torchtitan's ``dp_shard`` / ``dp_shard_mod_ep``): every non-expert
    parameter is replicated over ``dp`` and ``ep`` alike, so it shards over the flattened ``dp x ep`` ranks
    (``"dp_ep"``); the experts, already split over ``ep``, shard over ``mesh["dp"]``."""
    names = mesh.mesh_dim_names or ()
    if "ep" not in names:
        return mesh["dp"], None
    return mesh["dp", "ep"]._flatten("dp_ep"), mesh["dp"]


def _squeezed(shape: Any, names: Any) -> dict[str, list]:
    kept = [(int(n), str(d)) for n, d in zip(shape, names, strict=True) if n > 1]
    return {"shape": [n for n, _ in kept], "dim_names": [d for _, d in kept]}


def mesh_layout(mesh: Any) -> dict[str, list]:
    """``{"shape": [...], "dim_names": [...]}`` of a ``DeviceMesh`` without its size-1 dims (an unnamed 1-D
    mesh, FSDP2's default, is ``dp``): equal for two runs exactly when their parameters are split alike."""
    names = mesh.mesh_dim_names or (("dp",) if mesh.ndim == 1 else tuple(f"dim{i}" for i in range(mesh.ndim)))
    return _squeezed(mesh.shape, names)


def mesh_of(model: nn.Module) -> Any:
    """The largest ``DeviceMesh`` a parameter of ``model`` is laid out on (None: no DTensor parameter)."""
    from torch.distributed.tensor import DTensor

    best = None
    for p in model.parameters():
        if isinstance(p, DTensor) and (best is None or p.device_mesh.ndim > best.ndim):
            best = p.device_mesh
    return best


@torch.no_grad()
def clip_grad_norm_(parameters: Any, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (L2) for parameters on several meshes (FSDP2 x TP: plain
    parameters on ``mesh["dp"]``, TP ones on the 2-D mesh), which torch's cannot stack: one norm per mesh
    (``full_tensor``: one all-reduce each), combined in float32. Returns the total norm (float32 scalar)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
