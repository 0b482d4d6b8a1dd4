"""Multimodal models (image-text-to-text, speech-to-text) through fp8kit, tiny and random, towers kept by default.

For each model type (default: the ten of ``tests/integrations/test_multimodal.py``; ``--all``: every type of
transformers' image-text-to-text and speech-seq2seq auto mappings, configs shrunk by rule,
``tests/helpers/multimodal.py``): ``fp8kit.convert(model, "current")`` + one training step (towers kept),
``ptq.quantize(model, "fp8-dynamic")`` + compressed-tensors and ModelOpt ``save_pretrained``, reload by transformers
(its logits against fp8kit's quantized model's, relative MSE, beside the quantization error itself; the towers'
weights exactly as they were) and by fp8kit (both formats). Prints one row per type and the types transformers
does not build tiny.

    OMP_NUM_THREADS=2 python benchmarks/multimodal.py [--all] [--only llava,whisper] [--skip vibevoice]
"""

from __future__ import annotations

import argparse
import copy
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.helpers.arch_sweep import quiet  # noqa: E402
from tests.helpers.multimodal import inputs, tiny_multimodal  # noqa: E402
from tests.integrations.test_multimodal import MODELS  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean().clamp_min(1e-30))


def all_types() -> list[str]:
    from transformers.models.auto import modeling_auto as auto

    return sorted(
        set(auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) | set(auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)
    )


def run_one(model_type: str, where: Path) -> dict[str, str]:
    """One row: each stage ``ok (figure)`` or the first line of its error."""
    import fp8kit
    from fp8kit import ptq
    from fp8kit.export import load_pretrained, save_pretrained
    from fp8kit.nn.towers import find_towers

    row: dict[str, str] = {"type": model_type}
    try:
        model = tiny_multimodal(model_type)
        kw = inputs(model)
        with torch.no_grad():
            ref = model(**kw).logits
    except Exception as err:
        return {**row, "built": f"{type(err).__name__}: {str(err).splitlines()[0][:80] if str(err) else ''}"}
    found = find_towers(model)
    row["towers"] = ", ".join(t.rpartition(".")[2] for t in found.kinds) if found else "none found"
    try:
        m = copy.deepcopy(model).train()
        fp8kit.convert(m, "current")
        loss = m(**kw).logits.float().pow(2).mean()
        loss.backward()
        report = m.fp8_conversion_report
        kept = sum("towers=True" in why for why in report.skipped.values())
        row["convert"] = f"ok ({len(report.converted)} FP8, {kept} kept)" if torch.isfinite(loss) else "non-finite"
    except Exception as err:
        row["convert"] = f"{type(err).__name__}: {str(err)[:80]}"
    try:
        q = ptq.quantize(copy.deepcopy(model), "fp8-dynamic")
        with torch.no_grad():
            ours = q(**kw).logits
        err_ptq = rel(ours, ref)
        row["ptq"] = f"ok ({len(q.ptq_report.quantized)})"
        row["err_ptq"] = f"{err_ptq:.1e}"
        ct = save_pretrained(q, where / model_type / "ct", overwrite=True)
        mo = save_pretrained(q, where / model_type / "mo", format="modelopt", overwrite=True)
        row["export"] = "ok"
    except Exception as err:
        row.setdefault("ptq", f"{type(err).__name__}: {str(err)[:80]}")
        row.setdefault("export", f"{type(err).__name__}: {str(err)[:80]}")
        return row
    try:
        with torch.no_grad():
            hf = type(model).from_pretrained(ct, dtype=torch.float32).eval()
            err_hf = rel(hf(**kw).logits, ours)
        towers_equal = found is None or all(
            torch.equal(hf.state_dict()[k], v)
            for k, v in model.state_dict().items()
            if found.tower_of(k.rpartition(".")[0]) and k in hf.state_dict()
        )
        ok = err_hf <= 2 * err_ptq + 1e-6 and towers_equal
        row["transformers"] = f"{'ok' if ok else 'WRONG'} ({err_hf:.1e}{'' if towers_equal else ', towers differ'})"
    except Exception as err:
        row["transformers"] = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
    try:
        with torch.no_grad():
            errs = [rel(load_pretrained(p)(**kw).logits, ours) for p in (ct, mo)]
        row["fp8kit"] = "ok" if max(errs) <= 1e-6 else f"WRONG ({max(errs):.1e})"
    except Exception as err:
        row["fp8kit"] = f"{type(err).__name__}: {str(err)[:80]}"
    return row


COLUMNS = ("type", "towers", "convert", "ptq", "err_ptq", "export", "transformers", "fp8kit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every image-text-to-text and speech-seq2seq type")
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--skip", default="", help="comma-separated model types left out")
    args = parser.parse_args()
    types = [t for t in args.only.split(",") if t] or (all_types() if args.all else list(MODELS))
    types = [t for t in types if t not in args.skip.split(",")]
    start, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp, quiet():
        for t in types:
            rows.append(run_one(t, Path(tmp)))
            print(rows[-1], file=sys.__stderr__, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"machine: {platform.processor() or platform.machine()}, commit {commit}, {time.perf_counter() - start:.0f} s"
    )
    built = [r for r in rows if "built" not in r]
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for r in built:
        print("| " + " | ".join(r.get(c, "-") for c in COLUMNS) + " |")
    passing = [
        r for r in built if all(r.get(c, "").startswith("ok") for c in ("convert", "ptq", "transformers", "fp8kit"))
    ]
    print(f"\n{len(passing)} of {len(built)} built types pass convert, PTQ, export and both reloads")
    unbuilt = [r["type"] for r in rows if "built" in r]
    print(f"not built tiny by transformers ({len(unbuilt)}): {', '.join(unbuilt)}")


if __name__ == "__main__":
    main()
