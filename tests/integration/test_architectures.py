"""Architectures beyond Llama (tiny random Qwen2, Qwen3, Mistral, Gemma, Phi built from their configs)
pass the rollout worker's tokenizer path (the tokenizer AutoTokenizer gives, through the torch-free
path where transformers loads the directory's tokenizer as it is) and generate through the inference
server's model backend: batched rows with different prompt lengths get the log-probs a plain full
forward pass gives, with no deprecated transformers call on the way."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from services.inference.model_backend import TransformersBackend
from services.inference.requests import Joining, SamplingParams
from services.rollout.tokenizer import GENERIC_MODEL_TYPES, generic_tokenizer_dir, load_pretrained_tokenizer
from services.rollout.workflows.common import encode_chat
from tests.support.archs import ARCHS, build_arch_model
from tests.support.inference import reference_logprobs

TEXT = "What is 12 + 7? Give the final answer as a number."


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_arch_model(request.param, tmp_path_factory.mktemp(request.param))


def test_the_rollout_tokenizer_is_autotokenizers_and_round_trips_with_its_chat_template(arch_model: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    model_type = AutoConfig.from_pretrained(arch_model).model_type
    ours, auto = load_pretrained_tokenizer(str(arch_model)), AutoTokenizer.from_pretrained(arch_model)
    assert type(ours) is type(auto)
    # the torch-free path wherever transformers loads the directory's own tokenizer as it is (not qwen2:
    # transformers puts its Qwen2Tokenizer in place of the declared class)
    assert generic_tokenizer_dir(str(arch_model)) == (model_type in GENERIC_MODEL_TYPES) == (model_type != "qwen2")
    ids = encode_chat(ours, TEXT)
    assert ids == encode_chat(auto, TEXT)
    assert ours.decode(ids) == f"<|im_start|>user\n{TEXT}<|im_end|>\n<|im_start|>assistant\n"
    assert ours.decode(ours(TEXT, add_special_tokens=False).input_ids) == TEXT  # spaces and digits kept


def test_the_server_backend_generates_what_a_full_forward_pass_gives(arch_model: Path) -> None:
    tok = load_pretrained_tokenizer(str(arch_model))
    prompts = {0: encode_chat(tok, TEXT), 1: encode_chat(tok, "1 + 1?")}  # two lengths: left padding in the batch
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # e.g. the KV cache passed by a deprecated name
        backend = TransformersBackend(str(arch_model))
        joining = [Joining(sid, p, SamplingParams(max_new_tokens=6, seed=sid, ignore_eos=True)) for sid, p in prompts.items()]
        got: dict[int, list[tuple[int, float]]] = {}
        out, _ = backend.step(set(), joining)
        for _ in range(5):
            for sid, token, logprob, _top in out:
                got.setdefault(sid, []).append((token, logprob))
            out, _ = backend.step(set(), [])
    for sid, prompt in prompts.items():
        tokens = [t for t, _ in got[sid]]
        ref = reference_logprobs(arch_model, prompt, tokens, 1.0)
        assert [lp for _, lp in got[sid]] == pytest.approx(ref, abs=1e-4), sid
    assert backend.decode_text(tokens) is not None
