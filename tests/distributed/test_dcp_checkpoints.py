"""Distributed (DCP) checkpoints of FP8 training (CPU, gloo, 2 processes): resume on 2 ranks bit-exactly
under DDP and FSDP2, load on 1 process, the sharded FP8 optimizer's resume and its world-size check.

The assertions read the observations of ``two_rank_scenario.scenario_worker`` (fixture ``ddp_result``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.two_rank_scenario import STEPS, fp8_adamw, make

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch 2.13 renames DDP's broadcast_buffers


def test_dcp_resume_is_bit_exact_on_two_ranks(ddp_result):
    res, _ = ddp_result
    assert res["resume"]["step"] == STEPS
    assert res["resume"]["resumed"] == res["resume"]["continued"]


def test_dcp_resume_is_bit_exact_under_fsdp2_with_fp8_gather(ddp_result):
    res, _ = ddp_result
    assert res["fsdp_resume"]["resumed"] == res["fsdp_resume"]["continued"]


def test_dcp_checkpoint_loads_in_one_process(ddp_result):
    from safetensors.torch import load_file

    from fp8kit.train.checkpoint import load_distributed_checkpoint

    _, out = ddp_result
    model, opt = make("delayed")
    step, info = load_distributed_checkpoint(out / "ckpt" / f"step-{STEPS:06d}", model, opt)
    assert step == STEPS and info["world_size"] == 2 and info["run"] == "test"
    want = load_file(str(out / "rank0_step4.safetensors"))
    got = model.state_dict()
    for key in ("a.weight", "c.bias", "b.fp8_amax_history", "a.fp8_scale"):
        assert torch.equal(got[key], want[key]), key
    assert opt.state_dict()["state"], "optimizer state restored"
    # the single-file export holds the same full model
    export = load_file(str(out / "ckpt" / f"step-{STEPS:06d}" / "model.safetensors"))
    assert torch.equal(export["b.weight"], want["b.weight"])


def test_fsdp2_fp8_optimizer_resumes_bit_exactly_on_two_ranks(ddp_result):
    # BF16 parameters with stochastic rounding: the rounding bits are a function of (seed, step, parameter,
    # shard), so the resumed run draws the same bits without any saved generator state.
    res, _ = ddp_result
    got = res["fsdp_fp8_adamw_resume"]
    assert got["step"] == 3 and got["bf16"]
    assert got["resumed"] == got["continued"]
    assert got["params_equal"] == [True, True]


def test_sharded_fp8_optimizer_checkpoint_refuses_another_world_size(ddp_result):
    from fp8kit.train.checkpoint import CheckpointError, load_distributed_checkpoint

    _, out = ddp_result
    path = out / "ckpt_fsdp_fp8_adamw" / "step-000003"
    model, _ = make("delayed")
    model.to(torch.bfloat16)
    with pytest.raises(CheckpointError, match="sharded over 2 ranks .* resume it with --nproc 2 --fsdp"):
        load_distributed_checkpoint(path, model, fp8_adamw(model))
    step, info = load_distributed_checkpoint(path, model)  # the model alone reshards as before
    assert step == 3 and info["optimizer_shards"] == 2
