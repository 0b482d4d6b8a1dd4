import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "compiled: FP8 modules use the default compiled quantize kernels (torch.compile) in this test"
    )


@pytest.fixture(autouse=True, scope="session")
def _strict_compile():
    """A quantize kernel that fails to compile fails its test instead of silently falling back to eager."""
    from fp8kit.kernels import set_compile_strict

    set_compile_strict(True)
    yield
    set_compile_strict(False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _module_backend(request):
    """FP8 modules use the eager kernels (bit-identical to the compiled ones, see kernels/test_kernels.py) to keep
    the suite free of per-shape compilation time, except in tests marked ``compiled``, which run the
    library's default backend. Every recipe has at least one such test (numerics/test_numerics_exact.py)."""
    from fp8kit.nn import set_quantize_backend

    set_quantize_backend("compiled" if request.node.get_closest_marker("compiled") else "eager")
    yield
    set_quantize_backend("compiled")


@pytest.fixture(autouse=True, scope="session")
def _fixed_rates():
    """Every cost line is priced with fixed rates: no test measures this machine (``fp8kit.jobs.estimate``)."""
    from fp8kit.jobs.estimate import Rates, set_rates
    from fp8kit.planner.roofline import GPU

    gpu = GPU("cpu", 3e10, 3e10, 2e10, (0, 0), emulated_flops=3e10, cast_bytes_per_s=4e9,
              dequant_bytes_per_s=1e10, tile_dequant_bytes_per_s=1.5e8, matmul_call_s=2e-5, cast_call_s=6e-5)  # fmt: skip
    set_rates(Rates(gpu, 4e8))
    yield
    set_rates(None)
