"""fp8kit.optim.AdamW against torch.optim.AdamW, its state dict, bad input and memory per parameter."""

import math
import warnings

import pytest
import torch

from fp8kit.optim import AdamW, kahan_update_, stochastic_round_bf16
from fp8kit.optim.states import decode_expanded, decode_signed, encode_expanded, encode_signed

# Relative error of the total parameter change after 200 steps, against float64 torch.optim.AdamW fed
# the same gradient sequence. Measured: 0.057 (v in FP8) and 0.026 (v in BF16) with FP32 parameters,
# 0.096 (stochastic rounding) and 0.058 (Kahan) with BF16 parameters; torch AdamW on BF16 parameters,
# which rounds small updates away, is at 0.26 and FP32 torch AdamW near 1e-4.
VARIANTS = {
    "fp8-v/fp32-params": ({"exp_avg_sq": "fp8"}, torch.float32, 0.08),
    "bf16-v/fp32-params": ({"exp_avg_sq": "bf16"}, torch.float32, 0.05),
    "fp8-v/bf16-params/stochastic": ({"exp_avg_sq": "fp8", "bf16_update": "stochastic"}, torch.bfloat16, 0.15),
    "fp8-v/bf16-params/kahan": ({"exp_avg_sq": "fp8", "bf16_update": "kahan"}, torch.bfloat16, 0.12),
}


def _grad_sequence_run(make, dtype, steps=200):
    """Two parameter groups (decay, no decay) fed a fixed gradient sequence whose per-column scales span
    4 decades and shrink 10x halfway (the second moment must follow); returns the parameter change."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(32, 300, generator=gen) * 0.1
    b0 = torch.randn(300, generator=gen) * 0.1
    w, b = torch.nn.Parameter(w0.to(dtype, copy=True)), torch.nn.Parameter(b0.to(dtype, copy=True))
    opt = make([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}])
    col = torch.logspace(-4, 0, 300)
    for s in range(steps):
        shrink = 0.1 if s >= steps // 2 else 1.0
        w.grad = ((torch.randn(32, 300, generator=gen) + 0.3) * col * shrink).to(dtype)
        b.grad = ((torch.randn(300, generator=gen) - 0.2) * col * shrink).to(dtype)
        opt.step()
    return torch.cat([(w.detach().double() - w0).reshape(-1), (b.detach().double() - b0)])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_torch_adamw_over_200_steps(variant):
    kwargs, dtype, tol = VARIANTS[variant]
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
    ref = _grad_sequence_run(lambda g: torch.optim.AdamW(g, **hyper), torch.float64)
    got = _grad_sequence_run(lambda g: AdamW(g, **hyper, **kwargs), dtype)
    err = float((got - ref).norm() / ref.norm())
    assert err < tol, f"{variant}: relative error {err:.4f} of the parameter change (tolerance {tol})"


def test_weight_decay_only_in_its_group_and_scheduler_sets_lr():
    a, b = torch.nn.Parameter(torch.ones(300)), torch.nn.Parameter(torch.ones(300))
    opt = AdamW([{"params": [a], "weight_decay": 0.5}, {"params": [b], "weight_decay": 0.0}], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):  # zero gradients: only decoupled weight decay moves a parameter
        a.grad, b.grad = torch.zeros(300), torch.zeros(300)
        opt.step()
        sched.step()
    expected = (1 - 0.1 * 0.5) * (1 - 0.05 * 0.5) * (1 - 0.025 * 0.5)
    torch.testing.assert_close(a.detach(), torch.full((300,), expected), rtol=1e-6, atol=0)
    assert torch.equal(b.detach(), torch.ones(300))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0125)


def _trained(kind="fp8", steps=3, dtype=torch.float32):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(130, 7).to(dtype)), torch.nn.Parameter(torch.randn(5).to(dtype))]
    opt = AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}], lr=1e-2, exp_avg_sq=kind)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_state_dict_plain_tensors_exact_round_trip_and_fresh_load(kind, tmp_path):
    ps, opt = _trained(kind)
    sd = opt.state_dict()
    allowed = {torch.uint8, torch.float32, torch.bfloat16}
    assert all(isinstance(v, torch.Tensor) and v.dtype in allowed for st in sd["state"].values() for v in st.values())
    torch.save(sd, tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    fresh = AdamW([{"params": ps2[:1]}, {"params": ps2[1:], "weight_decay": 0.0}], lr=1.0, exp_avg_sq=kind)
    fresh.load_state_dict(loaded)
    sd2 = fresh.state_dict()
    assert sd2["param_groups"] == sd["param_groups"]
    for pid, st in sd["state"].items():
        for key, val in st.items():
            assert sd2["state"][pid][key].dtype == val.dtype and torch.equal(sd2["state"][pid][key], val), key
    g = [torch.randn_like(p) for p in ps]  # the two optimizers continue identically
    for params, o in ((ps, opt), (ps2, fresh)):
        for p, gi in zip(params, g, strict=True):
            p.grad = gi.clone()
        o.step()
    for p, q in zip(ps, ps2, strict=True):
        assert torch.equal(p, q)


def test_torch_adamw_state_dict_converts():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 40))
    q = torch.nn.Parameter(p.detach().clone())
    ref = torch.optim.AdamW([p], lr=3e-3, betas=(0.8, 0.95), weight_decay=0.2)
    for _ in range(5):
        p.grad = torch.randn_like(p) * torch.logspace(-3, 0, 40)
        ref.step()
    q.data.copy_(p.data)
    opt = AdamW.from_torch_state_dict([q], ref.state_dict())
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-3, (0.8, 0.95), 0.2)
    st = opt.state[q]
    assert float(st["step"]) == 5.0
    m, v = opt.moments(q)
    m_ref, v_ref = ref.state[p]["exp_avg"], ref.state[p]["exp_avg_sq"]
    assert float((m - m_ref).norm() / m_ref.norm()) < 0.03
    assert float((v - v_ref).norm() / v_ref.norm()) < 0.06  # 6 decades per block: k < 1
    with pytest.raises(ValueError, match="load_torch_state_dict"):
        AdamW([q]).load_state_dict(ref.state_dict())


def test_nonfinite_gradient_skips_that_parameter_with_warning_naming_it():
    ps, opt = _trained()
    before = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    w_before, b_before = ps[0].detach().clone(), ps[1].detach().clone()
    ps[0].grad = torch.randn_like(ps[0])
    ps[0].grad[3, 2] = math.nan
    ps[1].grad = torch.randn_like(ps[1])
    with pytest.warns(RuntimeWarning, match=r"parameter 0 of group 0 .*NaN/inf.*skipped"):
        opt.step()
    assert torch.equal(ps[0], w_before)
    assert all(torch.equal(opt.state[ps[0]][k], v) for k, v in before.items())
    assert not torch.equal(ps[1], b_before)  # the other parameter still moved

    named = torch.nn.Linear(4, 3)
    if hasattr(torch.optim.Optimizer, "_patch_step_function") and _accepts_named_params():
        opt2 = AdamW(named.named_parameters())
        named.weight.grad = torch.full_like(named.weight, math.inf)
        named.bias.grad = torch.zeros_like(named.bias)
        with pytest.warns(RuntimeWarning, match="'weight'"):
            opt2.step()


def _accepts_named_params() -> bool:
    try:
        torch.optim.SGD(torch.nn.Linear(1, 1).named_parameters(), lr=0.1)
    except (TypeError, ValueError):
        return False
    return True


def test_bad_input_errors():
    with pytest.raises(TypeError, match="complex"):
        AdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))])
    with pytest.raises(TypeError, match="float16"):
        AdamW([torch.nn.Parameter(torch.randn(4).half())])
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW([torch.nn.Parameter(torch.randn(4))], amsgrad=True)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        AdamW([torch.nn.Parameter(torch.randn(4))], exp_avg_sq="fp16")
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize(
    ("kind", "dtype", "update", "limit"),
    [
        ("fp8", torch.float32, "stochastic", 2.1),
        ("bf16", torch.float32, "stochastic", 3.04),
        ("fp8", torch.bfloat16, "kahan", 4.1),
    ],
)
def test_state_bytes_per_parameter(kind, dtype, update, limit):
    p = torch.nn.Parameter(torch.randn(1000, 512).to(dtype))
    opt = AdamW([p], exp_avg_sq=kind, bf16_update=update)
    p.grad = torch.randn_like(p)
    opt.step()
    n, nb = p.numel(), p.numel() // 128
    counted = sum(t.numel() * t.element_size() for t in opt.state[p].values())
    expected = n + 4 * nb + 4  # m codes + float32 scales + float32 step
    expected += n + 4 * nb + 2 * nb if kind == "fp8" else 2 * n  # v codes + max + bf16 k, or bf16 v
    expected += 2 * n if update == "kahan" and dtype == torch.bfloat16 else 0
    assert counted == expected == opt.state_bytes()
    assert counted / n <= limit


def test_fp8_moment_codecs():
    torch.manual_seed(0)
    m = torch.randn(1000) * torch.logspace(-2, 1, 1000)
    codes, scale = encode_signed(m, 128)
    assert codes.dtype == torch.uint8 and codes.shape == (8, 128) and scale.shape == (8, 1)
    rel = (decode_signed(codes, scale, 1000) - m).abs() / m.abs().clamp_min(1e-30)
    big = m.abs() > m.abs().reshape(-1).amax() * 2**-6  # normal range of each block's E4M3
    assert float(rel[big].max()) <= 2**-4 + 1e-6
    # second moment: a narrow range spreads over more codes (k > 1), far beyond plain E4M3's precision
    v = torch.rand(256) * 0.5 + 1.0
    codes, vmax, k = encode_expanded(v, 128)
    assert k.dtype == torch.bfloat16 and float(k.min()) > 10
    err_exp = float(((decode_expanded(codes, vmax, k, 256) - v).abs() / v).max())
    plain = decode_signed(*encode_signed(v, 128), 256)
    assert err_exp < float(((plain - v).abs() / v).max()) / 4
    wide = torch.logspace(-12, 0, 300)  # 12 decades, wider than E4M3's: compressed (k < 1), still finite and > 0
    back = decode_expanded(*encode_expanded(wide, 128), 300)
    assert bool((back > 0).all()) and float(((back - wide).abs() / wide).max()) < 0.5
    z = torch.zeros(200)  # all-zero blocks stay zero
    assert torch.equal(decode_expanded(*encode_expanded(z, 128), 200), z)


def test_stochastic_rounding_unbiased_and_kahan_accumulates():
    gen = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way between two bf16 neighbours
    r = stochastic_round_bf16(x, gen).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(float(r.mean()) - (1.0 + 2**-10)) < 2e-5
    p = torch.ones(4, dtype=torch.bfloat16)
    comp = torch.zeros(4, dtype=torch.bfloat16)
    for _ in range(1000):  # each addition is far below bf16's spacing at 1.0 (2**-7)
        kahan_update_(p, p.float() + 1e-4, comp)
    torch.testing.assert_close(p.float(), torch.full((4,), 1.1), rtol=0, atol=2**-7)
    naive = torch.ones(4, dtype=torch.bfloat16)
    for _ in range(1000):
        naive = (naive.float() + 1e-4).to(torch.bfloat16)
    assert torch.equal(naive.float(), torch.ones(4))  # what the compensation prevents


def test_training_a_converted_tiny_model_reduces_loss():
    from transformers import LlamaForCausalLM

    from fp8kit import convert
    from tests.helpers.models import tiny_llama_config

    torch.manual_seed(0)
    model = convert(LlamaForCausalLM(tiny_llama_config()))
    model.to(torch.bfloat16)  # BF16 parameters: FP8 GEMMs, FP8 moments, stochastic rounding
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    def loss_fn():
        logits = model(input_ids=x).logits.float()
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), x[:, 1:].reshape(-1))

    with torch.no_grad():
        first = float(loss_fn())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no parameter may be skipped
        for _ in range(8):
            opt.zero_grad()
            loss_fn().backward()
            opt.step()
    with torch.no_grad():
        assert float(loss_fn()) < first - 0.1


def test_persistent_bytes_split_and_train_options():
    from fp8kit.nn.memory import persistent_bytes
    from fp8kit.train.loop import TrainConfig, run_comparison

    model = torch.nn.Linear(256, 128).to(torch.bfloat16)
    opt = AdamW(model.parameters(), bf16_update="kahan")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    mem = persistent_bytes(model, opt)
    n = 256 * 128 + 128
    assert mem["weights"] == mem["grads"] == 2 * n
    assert mem["master_weights"] == 2 * n  # the Kahan compensation stands in for FP32 master weights
    assert mem["optimizer_state"] == opt.state_bytes() - 2 * n
    torch_opt = torch.optim.AdamW(torch.nn.Linear(256, 128).parameters())
    assert persistent_bytes(torch.nn.Linear(256, 128), torch_opt)["optimizer_state"] == 0  # no state before a step
    with pytest.raises(ValueError, match="needs --optimizer fp8-adamw"):
        run_comparison(TrainConfig(master_weights="bf16"))
    with pytest.raises(ValueError, match="--optimizer must be one of"):
        run_comparison(TrainConfig(optimizer="sgd"))


def test_chunked_update_equals_whole_tensor_update(monkeypatch):
    import fp8kit.optim.adamw as adamw_mod

    def run(chunk):
        monkeypatch.setattr(adamw_mod, "_CHUNK", chunk)
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(50, 21).t())  # non-contiguous, 1050 elements: a ragged last block
        opt = AdamW([w], lr=1e-2)
        for i in range(3):
            w.grad = torch.randn(21, 50, generator=torch.Generator().manual_seed(i))
            opt.step()
        return w.detach().clone(), opt.state_dict()["state"][0]

    (w1, s1), (w2, s2) = run(1 << 20), run(256)
    assert torch.equal(w1, w2)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


@pytest.mark.parametrize("update", ["stochastic", "kahan"])
def test_bf16_parameters_resume_bit_exactly_from_the_state_dict(update):
    # Stochastic rounding draws from a generator reseeded per (seed, step, parameter, shard): a fresh optimizer
    # loaded from the state dict draws the same bits as the one that kept running (no generator state saved).
    def make(ps):
        return AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}], lr=1e-2, bf16_update=update)

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(130, 7).bfloat16()), torch.nn.Parameter(torch.randn(5).bfloat16())]
    opt = make(ps)
    grads = [[torch.randn_like(p) for p in ps] for _ in range(5)]

    def run(params, o, steps):
        for g in steps:
            for p, gi in zip(params, g, strict=True):
                p.grad = gi.clone()
            o.step()

    run(ps, opt, grads[:3])
    sd = opt.state_dict()
    sd = {
        "state": {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    fresh = make(ps2)
    fresh.load_state_dict(sd)
    run(ps, opt, grads[3:])
    run(ps2, fresh, grads[3:])
    for p, q in zip(ps, ps2, strict=True):
        assert torch.equal(p, q)
