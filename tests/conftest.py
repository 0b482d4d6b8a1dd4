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
