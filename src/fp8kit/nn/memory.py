"""Memory accounting: the persistent bytes of a training setup and what autograd saves for backward."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..numerics.tensor import QuantizedTensor

__all__ = ["PERSISTENT_KEYS", "persistent_bytes", "saved_activation_bytes"]

# Categories of ``persistent_bytes`` (bytes that live for the whole run, activations excluded).
PERSISTENT_KEYS = ("weights", "grads", "optimizer_state", "master_weights", "fp8_weight_cache")
# Optimizer state entries that stand in for FP32 master weights (counted as master weights).
_MASTER_STATE_KEYS = ("master", "kahan_comp")


def _tensors_of(obj: object) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None:  # tensor subclasses (e.g. torchao's Float8 tensors): count inner data
            for name in flatten()[0]:
                yield from _tensors_of(getattr(obj, name))
        else:
            yield obj
    elif isinstance(obj, QuantizedTensor):
        yield obj.data
        yield obj.scales
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors_of(item)


def saved_activation_bytes(output: torch.Tensor, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of distinct tensor storages saved for backward in ``output``'s autograd graph.

    Walks the graph from ``output.grad_fn`` and adds up what each node saved: PyTorch's built-in nodes
    (their ``_saved_*`` tensors) and fp8kit's FP8 nodes (their FP8 data and scales). Storages listed
    in ``exclude`` (e.g. the model's parameters) are not counted; shared storages count once.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: set[int] = set()
    total = 0
    stack, visited = [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        found: list[object] = []
        n_act = getattr(node, "num_saved_activations", None)
        if n_act is not None:  # fp8kit node: count the saved input; the FP8 weights are a cache
            found.append(node.saved_tensors[:n_act])
        elif type(node).__name__.endswith("Backward") and hasattr(node, "saved_tensors"):
            try:
                found.append(node.saved_tensors)  # other custom autograd.Functions
            except RuntimeError:
                pass
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    found.append(getattr(node, name))
                except RuntimeError:  # already freed
                    continue
        for t in _tensors_of(found):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in skip or ptr in seen:
                continue
            seen.add(ptr)
            total += storage.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return total


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def persistent_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of a training setup's long-lived tensors, by category (shared storages count once).

    * ``weights``: parameter storages as they are (FP32 parameters are their own master weights).
    * ``grads``: one gradient per parameter in its dtype, whether or not one is allocated now (the
      steady state during a step).
    * ``optimizer_state``: tensors of ``optimizer.state`` (moments, FP8 codes and scales, steps).
    * ``master_weights``: state that stands in for higher-precision weights (separate ``master``
      copies, Kahan compensation buffers).
    * ``fp8_weight_cache``: FP8 copies of weights that layers hold right now (``_weight_cache``).
    """
    seen: set[int] = set()
    params = list(model.parameters())
    out = dict.fromkeys(PERSISTENT_KEYS, 0)
    out["weights"] = _storage_bytes(params, seen)
    out["grads"] = sum(p.numel() * p.element_size() for p in params)
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, val in state.items():
                if isinstance(val, torch.Tensor):
                    cat = "master_weights" if any(m in key for m in _MASTER_STATE_KEYS) else "optimizer_state"
                    out[cat] += _storage_bytes([val], seen)
    for module in model.modules():
        cache = getattr(module, "_weight_cache", None)
        # a Linear holds one (key, *FP8 copies) tuple; FP8 experts one per weight, in a dict
        for entry in cache.values() if isinstance(cache, dict) else [cache] if cache is not None else []:
            out["fp8_weight_cache"] += _storage_bytes(_tensors_of(list(entry[1:])), seen)
    return out
