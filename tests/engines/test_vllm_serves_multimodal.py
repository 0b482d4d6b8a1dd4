"""vLLM (its CPU build) serves fp8kit's exports of a vision-language model and a speech model.

A tiny random Idefics3 quantized by fp8kit (``fp8-dynamic``, the vision tower and connector kept in high
precision), written as compressed-tensors with its processor (image processor, tokenizer, chat template): vLLM
loads the folder unmodified, keeps the tower's layers unquantized and runs the language model's in FP8, and
scores a text prompt and an image prompt through its own processor; fp8kit's reading of the same folder
(``export.load_pretrained``, the processor read back by ``transformers``) gives the same tokens, perplexities
within the engine tests' 1% and the same greedy tokens (after the image, the first: vLLM 0.32's decode steps
after an image prompt differ from transformers' for the float model too, while its text-only decode steps
agree). A tiny random Whisper (``fp8-dynamic``, the audio encoder kept) with its feature extractor and a
byte-level tokenizer is served on a second of audio: the decoder prompt's log-probabilities and greedy tokens
are fp8kit's. One vLLM process, about a minute and a half on two cores.

Run with ``FP8KIT_VLLM_PYTHON=.venv-vllm/bin/python pytest -m engine tests/engines``; without it the tests skip.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from fp8kit.engines.vllm import fp8kit_losses, held_out_windows, perplexity_of, run_vllm, vllm_unavailable
from tests.engines.exports import PPL_TOLERANCE, VLM_IMAGE_SIDE, WHISPER_SPECIAL, tiny_idefics3, tiny_whisper

pytestmark = pytest.mark.engine

IMAGE_PROMPT = "User:<image>What is in this picture?<end_of_utterance>\nAssistant:"
TRANSCRIBE_PROMPT = "".join(WHISPER_SPECIAL) + "hello"  # the decoder's: start, language, task, no timestamps
SAMPLING_RATE = 16000
NEW_TOKENS = 4


def _logprobs(model: torch.nn.Module, ids: list[int], **extra: torch.Tensor) -> torch.Tensor:
    """Each token's log-probability after the first, in fp8kit's model."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x, **extra).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, x[0, 1:, None])[:, 0]


def _greedy(model: torch.nn.Module, ids: list[int], n: int, **extra: torch.Tensor) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out]), **extra).logits[0, -1].argmax()))
    return out[len(ids) :]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Both exports written and served by one vLLM process (the VLM: a text-window score, a greedy
    continuation, the image prompt; Whisper: a transcription prompt on audio), and read by fp8kit."""
    reason = vllm_unavailable()
    if reason:
        pytest.skip(f"vLLM engine tests: {reason}")
    from PIL import Image
    from transformers import AutoProcessor

    from fp8kit.export import load_pretrained, save_pretrained
    from fp8kit.models.folder import load_tokenizer
    from fp8kit.models.pretrained import HFTokenizer, smollm2_dir
    from fp8kit.ptq import quantize

    root = tmp_path_factory.mktemp("multimodal")
    model, processor = tiny_idefics3(load_tokenizer(smollm2_dir()))
    quantize(model, "fp8-dynamic", progress=False)
    folder = save_pretrained(model, root / "idefics3-fp8-dynamic", processor)
    speech, speech_processor = tiny_whisper(root / "whisper-tokenizer")
    quantize(speech, "fp8-dynamic", progress=False)
    speech_folder = save_pretrained(speech, root / "whisper-fp8-dynamic", speech_processor)
    windows = held_out_windows(HFTokenizer(load_tokenizer(smollm2_dir())), 2, 128)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (VLM_IMAGE_SIDE, VLM_IMAGE_SIDE, 3), dtype=np.uint8)
    audio = (0.1 * rng.standard_normal(SAMPLING_RATE)).astype(np.float32)  # one second
    got = run_vllm(
        [folder, speech_folder],
        {folder: windows, speech_folder: torch.empty(0, 0, dtype=torch.long)},
        new_tokens=NEW_TOKENS,
        dtype="float32",
        engine_args={
            folder: {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 1}},
            # the encoder takes 30 s of audio as 1500 positions at once
            speech_folder: {
                "skip_tokenizer_init": False,
                "limit_mm_per_prompt": {"audio": 1},
                "max_model_len": 448,
                "max_num_batched_tokens": 2048,
            },
        },
        prompts={
            folder: [{"prompt": IMAGE_PROMPT, "image": image}],
            speech_folder: [
                {"prompt": "", "audio": audio, "sampling_rate": SAMPLING_RATE, "decoder_prompt": TRANSCRIBE_PROMPT}
            ],
        },
    )
    ours = load_pretrained(folder, dtype=torch.float32)
    read_back = AutoProcessor.from_pretrained(folder)

    def pixels(img: np.ndarray) -> dict[str, Any]:
        enc = read_back(text=IMAGE_PROMPT, images=[Image.fromarray(img)], return_tensors="pt")
        return {k: v for k, v in enc.items() if k != "input_ids"} | {"ids": enc["input_ids"][0].tolist()}

    speech_read_back = AutoProcessor.from_pretrained(speech_folder)

    def features(samples: np.ndarray) -> torch.Tensor:
        return speech_read_back.feature_extractor(
            samples, sampling_rate=SAMPLING_RATE, return_tensors="pt"
        ).input_features

    return {
        "vllm": got["vllm"],
        "result": got["results"][0],
        "windows": windows,
        "ours": ours,
        "text_ppl": perplexity_of(fp8kit_losses(folder, windows)),
        "image": pixels(image),
        "other_image": pixels(255 - image),
        "speech_result": got["results"][1],
        "speech": load_pretrained(speech_folder, dtype=torch.float32),
        "features": features(audio),
        "other_features": features(np.zeros_like(audio)),
        "speech_prompt_ids": speech_read_back.tokenizer(TRANSCRIBE_PROMPT, add_special_tokens=False).input_ids,
    }


def test_vllm_serves_the_vlm_export_with_the_tower_unquantized(served):
    r = served["result"]
    assert r["loaded"], r["error"]
    assert r["quant_config"] == "CompressedTensorsConfig"
    linears = {n: m for n, m in r["layers"].items() if "Linear" in m and not n.endswith("lm_head")}
    tower = {n: m for n, m in linears.items() if "vision_model" in n or "connector" in n}
    language = {n: m for n, m in linears.items() if n not in tower}
    assert tower and language, sorted(linears)
    assert all("Unquantized" in m for m in tower.values()), tower
    assert all("CompressedTensorsW8A8Fp8" in m for m in language.values()), language


def test_a_text_prompt_agrees_with_fp8kit(served):
    r = served["result"]
    ours, theirs = served["text_ppl"], r["ppl"]
    print(f"Idefics3 fp8-dynamic, text: vLLM {served['vllm']} ppl={theirs:.4f}, fp8kit ppl={ours:.4f}")
    assert abs(theirs / ours - 1) < PPL_TOLERANCE, f"vLLM {theirs:.4f} vs fp8kit {ours:.4f}"
    start = served["windows"][0][:16].tolist()
    assert r["generated"] == _greedy(served["ours"], start, NEW_TOKENS)


def test_an_image_prompt_agrees_with_fp8kit(served):
    """vLLM's processor expands the image into the same tokens as ``transformers``' reading of the exported
    processor, and the vision tower's features reach the language model the same way: fp8kit's log-probabilities
    with this image match vLLM's, and another image would not."""
    prompt = served["result"]["prompts"][0]
    image, other = served["image"], served["other_image"]
    assert prompt["ids"] == image["ids"], "vLLM and transformers expand the image placeholder differently"
    pixels = {k: v for k, v in image.items() if k != "ids"}
    ours = _logprobs(served["ours"], image["ids"], **pixels)
    theirs = torch.tensor(prompt["logprobs"])
    ppl_ours, ppl_theirs = math.exp(-float(ours.mean())), math.exp(-float(theirs.mean()))
    gap = (ours - theirs).abs().max().item()
    print(
        f"Idefics3 fp8-dynamic, image: vLLM ppl={ppl_theirs:.4f}, fp8kit ppl={ppl_ours:.4f}, max |dlogprob|={gap:.2e}"
    )
    assert abs(ppl_theirs / ppl_ours - 1) < PPL_TOLERANCE, f"vLLM {ppl_theirs:.4f} vs fp8kit {ppl_ours:.4f}"
    # the first greedy token comes from the prompt's own forward; vLLM 0.32's later decode steps after an image
    # differ from transformers' even for the float model (its text-only decode steps agree), so they are shown only
    greedy = _greedy(served["ours"], image["ids"], NEW_TOKENS, **pixels)
    print(f"greedy after the image: vLLM {prompt['generated']}, fp8kit {greedy}")
    assert prompt["generated"][0] == greedy[0]
    without = _logprobs(served["ours"], other["ids"], **{k: v for k, v in other.items() if k != "ids"})
    assert (without - theirs).abs().max().item() > 10 * gap, "the image does not change the model's output"


def test_vllm_serves_the_whisper_export_on_audio(served):
    """vLLM runs fp8kit's Whisper export (the audio encoder unquantized, the decoder in FP8) on a second of
    audio through its own feature extractor: the decoder prompt's log-probabilities and the greedy tokens are
    fp8kit's on the same features, and silence would give others."""
    r = served["speech_result"]
    assert r["loaded"], r["error"]
    linears = {n: m for n, m in r["layers"].items() if "Linear" in m and not n.endswith("proj_out")}
    encoder = {n: m for n, m in linears.items() if ".encoder." in n}
    decoder = {n: m for n, m in linears.items() if ".decoder." in n}
    assert encoder and decoder, sorted(linears)
    assert all("Unquantized" in m for m in encoder.values()), encoder
    assert all("CompressedTensorsW8A8Fp8" in m for m in decoder.values()), decoder
    prompt = r["prompts"][0]
    assert prompt["ids"] == served["speech_prompt_ids"]
    model, ids = served["speech"], torch.tensor([prompt["ids"]])

    def logprobs(features: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_features=features, decoder_input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]

    ours, theirs = logprobs(served["features"]), torch.tensor(prompt["logprobs"])
    ppl_ours, ppl_theirs = math.exp(-float(ours.mean())), math.exp(-float(theirs.mean()))
    gap = (ours - theirs).abs().max().item()
    print(f"Whisper fp8-dynamic, audio: vLLM ppl={ppl_theirs:.4f}, fp8kit ppl={ppl_ours:.4f}, max |dlogprob|={gap:.2e}")
    assert abs(ppl_theirs / ppl_ours - 1) < PPL_TOLERANCE, f"vLLM {ppl_theirs:.4f} vs fp8kit {ppl_ours:.4f}"
    out = list(prompt["ids"])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            step = model(input_features=served["features"], decoder_input_ids=torch.tensor([out])).logits
            out.append(int(step[0, -1].argmax()))
    assert prompt["generated"] == out[len(prompt["ids"]) :]
    assert (logprobs(served["other_features"]) - theirs).abs().max().item() > 10 * gap, "the audio changes nothing"
