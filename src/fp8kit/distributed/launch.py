"""``fp8kit train --nproc N``: run the same command on N local processes through ``torch.distributed.run``
(torchrun, ``--standalone`` rendezvous). The command validates its options first, then calls ``launch``
with its own command line; each worker, started under torchrun, runs the command as one rank (it sees
torchrun's ``RANK`` and ``WORLD_SIZE``, so it does not launch again).

Several machines: run ``torchrun --nnodes ... -m fp8kit.cli train ...`` on each (``docs/distributed.md``);
a worker started by torchrun joins the process group by itself.

This module knows nothing of the command it launches: it imports neither the CLI nor the training loop.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

from .runtime import in_torchrun

GLOO_DRAIN_S = 0.05  # seconds without the GIL after leaving the process group (leave_process_group)

__all__ = ["launch", "leave_process_group", "should_launch", "torchrun_command", "torchrun_worker"]


def should_launch(nproc: int) -> bool:
    """Whether a command asked for ``nproc`` processes must launch them (not yet under torchrun)."""
    return nproc > 1 and not in_torchrun()


def torchrun_command(nproc: int, module: str, args: Sequence[str]) -> list[str]:
    """The torchrun command line that runs ``python -m module *args`` as ``nproc`` local workers. ``--``
    ends torchrun's own options, so that none of ``args`` is read as one (``--nproc`` would be taken for an
    abbreviation of torchrun's ``--nproc-per-node``)."""
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*runner, "-m", module, "--", *args]


def launch(nproc: int, module: str, args: Sequence[str]) -> int:
    """Run ``python -m module *args`` on ``nproc`` local processes under torchrun and return its exit code
    (non-zero when a worker failed). Each worker gets ``cpu_count / nproc`` threads unless
    ``OMP_NUM_THREADS`` is set."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(torchrun_command(nproc, module, args), env=env)


@contextlib.contextmanager
def torchrun_worker() -> Iterator[int]:
    """The body of one process of a job; yields its rank (0 outside torchrun). On ranks > 0 the body's
    standard output is dropped (rank 0 speaks for the job); at the end the process group that the body
    joined, if any, is destroyed."""
    import torch.distributed as dist

    def joined() -> bool:
        return dist.is_available() and dist.is_initialized()

    rank = int(os.environ["RANK"]) if in_torchrun() else 0
    had_group = joined()
    with contextlib.ExitStack() as stack:
        if rank:
            stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
        try:
            yield rank
        finally:
            if joined() and not had_group:
                leave_process_group()


def leave_process_group() -> None:
    """Destroy the default process group, then give up the GIL for a moment. gloo's worker threads free the
    last collectives' tensors after the collective has returned, and that takes the GIL; when they only get it
    during interpreter exit, the process aborts ("terminate called without an active exception", SIGABRT)
    although its work succeeded. The pause lets them finish first."""
    import torch.distributed as dist

    dist.destroy_process_group()
    time.sleep(GLOO_DRAIN_S)
