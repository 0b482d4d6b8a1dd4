"""Measure the memory that autograd holds for the backward pass."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..tensor import QuantizedTensor

__all__ = ["saved_activation_bytes"]


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
