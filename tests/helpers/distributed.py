"""The multi-process harness of the distributed tests (``torch.multiprocessing`` spawn, gloo, a hard timeout)
and a spy on tensor-parallel quantization.

A spawned worker function must live in a module the child process can import by name: a test module or
a ``tests.helpers`` module (``tests`` is a package on ``sys.path``), never a closure."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch.nn as nn

SPAWN_TIMEOUT_S = 150.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_eager_worker(rank: int, world: int, port: int):
    """Join the gloo group of a spawned worker with eager kernels (bit-identical to the compiled ones,
    test_kernels.py: no compile time in the workers); returns ``gather(obj) -> [obj of every rank]``."""
    import torch.distributed as dist

    from fp8kit.kernels import set_compile_enabled
    from fp8kit.nn import set_quantize_backend

    set_quantize_backend("eager")
    set_compile_enabled(False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def gather(obj):
        objs = [None] * world
        dist.all_gather_object(objs, obj)
        return objs

    return gather


def run_spawned(fn, world: int, out: Path, timeout_s: float = SPAWN_TIMEOUT_S) -> None:
    """Run ``fn(rank, world, port, out)`` on ``world`` processes; a hang past ``timeout_s`` kills them and fails."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=(world, free_port(), str(out)), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"distributed workers did not finish within {timeout_s:.0f} s (hang)")


def record_tp_scales(model: nn.Module, log: list) -> None:
    """Every quantization of every TP layer appends (layer, role, scales) to ``log``."""
    from fp8kit.distributed.tensor_parallel import TensorParallelLinear

    for name, m in model.named_modules():
        if isinstance(m, TensorParallelLinear):
            real = m.quantize_operand

            def spy(x, role, recipe=None, values=None, _real=real, _name=name):
                q = _real(x, role, recipe, values)
                log.append((_name, role, q.scale_inv.flatten().tolist()))
                return q

            m.quantize_operand = spy
