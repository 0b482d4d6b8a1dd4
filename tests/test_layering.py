"""The architecture holds: lower layers never import higher ones, no import cycles, a light ``import fp8kit``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fp8kit"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute name of the module a ``from ... import`` statement in ``module`` (file ``path``) reads."""
    if not node.level:
        return node.module or ""
    base = (module if path.name == "__init__.py" else module.rpartition(".")[0]).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path, top_level_only: bool = False, module: str | None = None) -> set[str]:
    """fp8kit modules ``path`` imports (relative imports resolved; ``module``: its name, by default from its
    place under ``SRC``): every import statement, those inside functions (deferred) included, or with
    ``top_level_only`` those at module level only."""
    name = module or module_name(path)
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fp8kit")}
        elif isinstance(node, ast.ImportFrom):
            mod = resolve(node, name, path)
            if mod.startswith("fp8kit"):
                found.add(mod)
                found |= {f"{mod}.{a.name}" for a in node.names}  # `from . import nn` imports a submodule
    modules = {module_name(p) for p in SRC.rglob("*.py")}
    return {m for m in found if m in modules}


FILES = {module_name(p): p for p in SRC.rglob("*.py")}


def under(module: str, *packages: str) -> bool:
    return any(module == f"fp8kit.{p}" or module.startswith(f"fp8kit.{p}.") for p in packages)


# The floors, bottom to top: numerics (formats, scaling, quantized tensors, and the kernels that implement
# them), the parts (one package per concern), the jobs (``fp8kit.jobs``), the command line.
NUMERICS = ("numerics", "kernels")
PARTS = (
    "data",
    "debug",
    "distributed",
    "engines",
    "export",
    "gemm",
    "integrations",
    "models",
    "nn",
    "optim",
    "planner",
    "ptq",
    "qat",
    "runtime",
    "train",
)
TOP_MODULES = {"fp8kit", "fp8kit.__main__", "fp8kit._moved", "fp8kit.version"}  # the public API and entry points


def test_every_module_lives_on_a_floor():
    """The top of the package holds the public API and the floors' packages; no loose module beside them."""
    loose = {m for m in FILES if not under(m, *NUMERICS, *PARTS, "jobs", "cli") and m not in TOP_MODULES}
    assert not loose, f"put these in numerics/, a part or jobs/: {sorted(loose)}"


def test_numerics_import_only_numerics():
    bad = {(m, i) for m, p in FILES.items() if under(m, *NUMERICS) for i in imports(p) if not under(i, *NUMERICS)}
    assert not bad, f"the numerics floor imports a part: {sorted(bad)}"


def test_parts_never_import_jobs_or_the_cli():
    bad = {
        (m, i) for m, p in FILES.items() if under(m, *NUMERICS, *PARTS) for i in imports(p) if under(i, "jobs", "cli")
    }
    assert not bad, f"a part imports a job: move the caller into fp8kit.jobs: {sorted(bad)}"


def test_jobs_never_import_the_cli():
    bad = {(m, i) for m, p in FILES.items() if under(m, "jobs") for i in imports(p) if under(i, "cli")}
    assert not bad, f"a job imports the command line: {sorted(bad)}"


def test_ptq_and_export_meet_only_at_the_quantized_modules():
    """``ptq`` quantizes modules and never writes formats; ``export`` reads PTQ's modules through
    ``fp8kit.ptq.quantized`` only."""
    ptq_to_export = {(m, i) for m, p in FILES.items() if under(m, "ptq") for i in imports(p) if under(i, "export")}
    assert not ptq_to_export, f"ptq imports export: {sorted(ptq_to_export)}"
    door = {"fp8kit.ptq", "fp8kit.ptq.quantized"}
    export_to_ptq = {
        (m, i) for m, p in FILES.items() if under(m, "export") for i in imports(p) if under(i, "ptq") and i not in door
    }
    assert not export_to_ptq, f"export reaches into ptq past fp8kit.ptq.quantized: {sorted(export_to_ptq)}"
    assert any("fp8kit.ptq.quantized" in imports(p) for m, p in FILES.items() if under(m, "export"))


def test_compare_and_eval_load_models_through_the_jobs_loader():
    """The compare and eval jobs read a train run folder through ``jobs.loading``, not from ``train``'s insides."""
    for job in ("fp8kit.jobs.compare", "fp8kit.jobs.evaluate"):
        reached = {i for i in imports(FILES[job]) if under(i, "train")}
        assert not reached, f"{job} imports {sorted(reached)}: load the model with fp8kit.jobs.loading"


def test_src_imports_no_moved_path():
    """Old paths (``fp8kit._moved.MOVED``) are for users; code in ``src/`` names the modules where they are."""
    from fp8kit._moved import MOVED

    bad = set()
    for mod, path in FILES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom):
                base = resolve(node, mod, path)
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad |= {(mod, n) for n in names if any(n == o or n.startswith(o + ".") for o in MOVED)}
    assert not bad, f"import these from their new place: {sorted(bad)}"


def test_the_old_import_paths_still_work():
    code = (
        "import json, importlib\n"
        "from fp8kit._moved import MOVED\n"
        "same = {old: importlib.import_module(old) is importlib.import_module(new) for old, new in MOVED.items()}\n"
        "from fp8kit.formats import E4M3\n"
        "from fp8kit.compare import compare_schemes\n"
        "import fp8kit.numerics.formats as f\n"
        "print(json.dumps({'same': same, 'name': f.__name__, 'cls': E4M3.name, 'fn': compare_schemes.__module__}))\n"
    )
    out = json.loads(run_python(code).stdout)
    assert all(out["same"].values()) and len(out["same"]) >= 15
    assert out["name"] == "fp8kit.numerics.formats" and out["fn"] == "fp8kit.jobs.compare"


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("ptq", ("train", "data", "models", "cli", "debug", "export")),
        ("nn", ("train", "data", "models", "cli", "debug", "ptq", "export", "planner")),
        ("planner", ("train", "data", "models", "cli", "debug", "export")),
        ("debug", ("train", "data", "models", "cli", "ptq", "export")),
        ("data", ("train", "models", "cli", "ptq", "debug", "nn", "export")),
        ("export", ("train", "data", "models", "cli", "debug")),
        ("distributed", ("train", "data", "models", "cli", "debug", "ptq", "export", "optim")),
        ("train", ("cli",)),
    ],
)
def test_a_lower_layer_never_imports_a_higher_one(layer, forbidden):
    shared = {"fp8kit.data.evaluation"}  # the held-out metrics every part that scores a model uses
    bad = {
        (mod, imp)
        for mod, path in FILES.items()
        if under(mod, layer)
        for imp in imports(path)
        if under(imp, *forbidden) and imp not in shared
    }
    assert not bad, f"{layer} imports from a higher layer: {sorted(bad)}"


def test_only_the_cli_imports_the_cli():
    """``fp8kit.__main__`` (``python -m fp8kit``) is the command's other entry point, as ``fp8kit.cli.__main__``."""
    importers = {
        mod
        for mod, path in FILES.items()
        if not under(mod, "cli") and mod != "fp8kit.__main__" and any(under(i, "cli") for i in imports(path))
    }
    assert not importers, f"the command line is the top floor; imported by {sorted(importers)}"


def test_doctor_and_report_do_not_import_each_other():
    assert "fp8kit.debug.doctor" not in imports(FILES["fp8kit.debug.report"])
    assert "fp8kit.debug.report" in imports(FILES["fp8kit.debug.doctor"])  # one way: the doctor writes the report


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_even_through_deferred_imports():
    top = {mod: imports(path, top_level_only=True) - {mod} for mod, path in FILES.items()}
    assert import_cycles(top) == []
    graph = {mod: imports(path) - {mod} for mod, path in FILES.items()}  # function-level imports too
    assert import_cycles(graph) == []
    graph["fp8kit.debug.report"].add("fp8kit.debug.doctor")  # the old cycle is found
    assert ["fp8kit.debug.doctor", "fp8kit.debug.report"] in import_cycles(graph)


def test_a_cycle_closed_by_a_function_level_import_is_found(tmp_path):
    # the launcher once imported the CLI back inside its worker function (`from ..cli import cmd_train`)
    (tmp_path / "cli.py").write_text("from .distributed.launch import launch\n")
    (tmp_path / "launch.py").write_text("def worker():\n    from ..cli import cmd_train\n")
    cli, launch = "fp8kit.cli", "fp8kit.distributed.launch"
    assert imports(tmp_path / "launch.py", top_level_only=True, module=launch) == set()
    graph = {cli: imports(tmp_path / "cli.py", module=cli), launch: imports(tmp_path / "launch.py", module=launch)}
    assert graph == {cli: {launch}, launch: {cli}}
    assert import_cycles(graph) == [[cli, launch]]


def package_of(module: str) -> str:
    """The room a module lives in: ``fp8kit.<package>`` (a top-level module is its own room)."""
    return ".".join(module.split(".")[:2])


def private_names_reached(path: Path, module: str | None = None) -> set[tuple[str, str]]:
    """``(module, name)`` for each ``_private`` name of another package that ``path`` uses: imported by name
    (``from ..nn.linear import _knobs``) or read from an imported module (``linear._knobs``)."""
    name = module or module_name(path)
    home = package_of(name)
    modules = set(FILES)
    bound: dict[str, str] = {}  # local name -> fp8kit module it is bound to
    found: set[tuple[str, str]] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = resolve(node, name, path)
            for a in node.names:
                if f"{mod}.{a.name}" in modules:  # `from ..train import loop`: a module, used below
                    bound[a.asname or a.name] = f"{mod}.{a.name}"
                elif is_private(a.name) and mod.startswith("fp8kit") and package_of(mod) != home:
                    found.add((mod, a.name))
        elif isinstance(node, ast.Import):
            bound |= {a.asname: a.name for a in node.names if a.asname and a.name in modules}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and is_private(node.attr):
            mod = bound.get(node.value.id)
            if mod is not None and package_of(mod) != home:
                found.add((mod, node.attr))
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# Private names reached across packages that are known, with the reason they are not public yet.
KNOWN_PRIVATE_REACHES: dict[str, set[tuple[str, str]]] = {}  # none left: add one only with its reason


def test_no_module_reaches_a_private_name_of_another_package():
    reached = {mod: private_names_reached(path) for mod, path in FILES.items()}
    bad = {mod: found - KNOWN_PRIVATE_REACHES.get(mod, set()) for mod, found in reached.items()}
    bad = {m: f for m, f in bad.items() if f}
    assert not bad, f"make these public where they are used across packages: {bad}"
    assert all(reached[mod] >= known for mod, known in KNOWN_PRIVATE_REACHES.items())  # drop a fixed entry


def test_the_private_name_check_sees_both_forms(tmp_path):
    # what the launcher once did, and the same reach through a module
    code = "def check():\n    from ..train.loop import _check_resumable\n    from ..train import loop\n    loop._prepare_out\n"
    (tmp_path / "launch.py").write_text(code)
    assert private_names_reached(tmp_path / "launch.py", module="fp8kit.distributed.launch") == {
        ("fp8kit.train.loop", "_check_resumable"),
        ("fp8kit.train.loop", "_prepare_out"),
    }
    assert private_names_reached(tmp_path / "launch.py", module="fp8kit.train.checkpoint") == set()  # same room


def run_python(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *flags, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=SRC.parents[1],
    )


HEAVY = ("transformers", "matplotlib", "tensorboard", "accelerate", "peft", "safetensors", "gguf")


def test_import_fp8kit_is_light_and_submodules_are_reachable():
    code = (
        "import sys, json, fp8kit\n"
        "before = sorted(sys.modules)\n"
        "names = {n: getattr(fp8kit, n).__name__ for n in fp8kit._LAZY_SUBMODULES}\n"
        "calls = [fp8kit.ptq.quantize.__name__, fp8kit.debug.doctor.__name__, fp8kit.export.save_pretrained.__name__]\n"
        "print(json.dumps({'before': before, 'names': names, 'calls': calls, 'dir': 'ptq' in dir(fp8kit)}))\n"
    )
    out = json.loads(run_python(code).stdout)
    loaded = set(out["before"])
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]
    lazy = list(out["names"])
    assert {"ptq", "debug", "export", "optim", "train", "data", "models", "integrations"} <= set(lazy)
    assert not [m for m in loaded if under(m, *lazy, "cli")]  # none imported by `import fp8kit`
    assert out["names"] == {n: f"fp8kit.{n}" for n in lazy}  # each reachable as an attribute afterwards
    assert out["calls"] == ["quantize", "doctor", "save_pretrained"] and out["dir"]


def test_importtime_of_fp8kit_lists_no_heavy_module():
    err = run_python("import fp8kit", "-X", "importtime").stderr
    rows = [line.split("|") for line in err.splitlines() if line.startswith("import time:") and "|" in line]
    names = [r[2].strip() for r in rows[1:]]
    assert "fp8kit" in names and "torch" in names
    assert not [n for n in names if n.split(".")[0] in HEAVY]
    assert not [n for n in names if under(n, "ptq", "debug", "train", "data", "models", "export", "jobs", "optim")]


def test_missing_attribute_is_still_an_attribute_error():
    import fp8kit

    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        fp8kit.bogus  # noqa: B018
