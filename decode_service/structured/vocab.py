"""The model's vocabulary for xgrammar: the bytes of every token id of the tml-renderers tokenizer.

The logits are `unpadded_vocab_size` wide; ids the tokenizer does not know (there are none below the unpadded
size for Inkling, but the tiny test configs may differ) get empty bytes, which xgrammar never allows. Special
tokens (`<|...|>`) keep their spelling; xgrammar recognises them as special and allows them only where a
grammar names them as tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import lru_cache

import xgrammar as xgr

from decode_service.chat import tokenizer


def encoded_vocab(vocab_size: int) -> list[bytes]:
    tok = tokenizer()
    out = []
    for token_id in range(vocab_size):
        try:
            out.append(tok.decode_bytes([token_id]))
        except ValueError:  # not a token of the tokenizer (an embedding padding row)
            out.append(b"")
    return out


def tokenizer_info(vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """Built once per (vocab, stops) and process, whichever thread asks first: about a second for 200k tokens."""
    with _build_lock:
        return _tokenizer_info(vocab_size, stop_token_ids)


_build_lock = threading.Lock()


@lru_cache(maxsize=4)
def _tokenizer_info(vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(
        encoded_vocab(vocab_size), xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
    )


def stop_tokens(eos_token_ids: Sequence[int], stop_token_ids: Sequence[int]) -> list[int]:
    """The tokens a finished grammar allows: the model's EOS ids and the request's stop token ids."""
    return sorted(set(eos_token_ids) | set(stop_token_ids))
