"""``fp8kit train --nproc N``: validate in the calling process, then run the same command on N local
processes through ``torch.distributed.run`` (torchrun, ``--standalone`` rendezvous). The parsed options
travel to the workers as JSON in ``FP8KIT_TRAIN_ARGS``; each worker runs ``fp8kit train`` as one rank.

Several machines: run ``torchrun --nnodes ... -m fp8kit.cli train ...`` on each (``docs/distributed.md``);
a worker started by torchrun joins the process group by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .runtime import check_parallel_settings, in_torchrun

__all__ = ["launch_train", "should_launch", "torchrun_command"]

ARGS_ENV = "FP8KIT_TRAIN_ARGS"


def should_launch(cfg: Any) -> bool:
    """Whether ``fp8kit train`` must re-launch itself on ``cfg.nproc`` processes (not yet under torchrun)."""
    return cfg.nproc > 1 and not in_torchrun()


def torchrun_command(nproc: int) -> list[str]:
    """The torchrun command line that starts ``nproc`` local workers of ``fp8kit train``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "fp8kit.distributed.launch",
    ]


def launch_train(args: argparse.Namespace, cfg: Any) -> int:
    """Check what can be checked before any process starts (one-line ``ValueError``: exit code 2, nothing
    written), then run the workers and return torchrun's exit code."""
    from ..train.loop import _check_resumable, parse_recipes

    check_parallel_settings(cfg.batch_size, cfg.nproc, cfg.fsdp, cfg.optimizer)
    if cfg.resume:
        names = ["bf16"] + [f"fp8-{r}" for r in parse_recipes(",".join(cfg.recipes))]
        _check_resumable(Path(cfg.out), names, cfg)
    payload = {k: v for k, v in vars(args).items() if k != "func"}
    env = dict(os.environ, **{ARGS_ENV: json.dumps(payload, default=str)})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    return subprocess.call(torchrun_command(cfg.nproc), env=env)


def _worker_main() -> int:
    """One rank of ``fp8kit train --nproc N``: only rank 0 prints; errors end every rank with exit code 2."""
    import torch.distributed as dist

    from ..cli import cmd_train

    args = argparse.Namespace(**json.loads(os.environ[ARGS_ENV]))
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    try:
        return int(cmd_train(args) or 0)
    except (ValueError, FileNotFoundError, PermissionError, ImportError, FloatingPointError, OSError) as err:
        if rank == 0:
            print(f"fp8kit train: error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(_worker_main())
