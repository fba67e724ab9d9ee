"""`generate --local` on a make-tiny checkpoint: greedy tokens equal transformers' generate on the same files."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from common.errors import InvalidInputError
from decode_service.local import LocalGenerator
from tools.cli import main
from tools.make_tiny_checkpoint import make_tiny_checkpoint

PROMPT = [200000, 200004, 9906, 11, 1917, 200010]


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(out, nvfp4=False, seed=3)
    return out


@torch.no_grad()
def test_local_greedy_equals_transformers_generate(tiny_bf16):
    from transformers import InklingForConditionalGeneration

    hf = InklingForConditionalGeneration.from_pretrained(tiny_bf16, dtype=torch.float32).eval()
    hf.config.text_config._attn_implementation = "eager"
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, len(PROMPT) :
    ].tolist()
    ours = LocalGenerator.load(tiny_bf16, dtype="float32").generate(PROMPT, max_tokens=12)
    assert ours["token_ids"] == ref
    assert ours["finish_reason"] == "length"


def test_generation_stops_on_eos(tiny_bf16):
    generator = LocalGenerator.load(tiny_bf16, dtype="float32")
    first = generator.generate(PROMPT, max_tokens=3)["token_ids"]
    generator.config = dataclasses.replace(generator.config, eos_token_ids=(first[1],))
    stopped = generator.generate(PROMPT, max_tokens=3)
    assert stopped["token_ids"] == first[:2] and stopped["finish_reason"] == "stop"


def test_cli_generate_local_json(tiny_bf16, capsys):
    assert (
        main(
            [
                "generate",
                "--local",
                "--checkpoint",
                str(tiny_bf16),
                "--prompt-ids",
                "1,2,3",
                "--max-tokens",
                "4",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["prompt_token_ids"] == [1, 2, 3]
    assert len(result["token_ids"]) == 4 and isinstance(result["text"], str)
    assert result["finish_reason"] == "length"


def test_prompt_ids_out_of_vocab_are_rejected(tiny_bf16):
    with pytest.raises(InvalidInputError, match="out of range"):
        LocalGenerator.load(tiny_bf16).generate([1, 250000], max_tokens=1)
