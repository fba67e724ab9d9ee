"""A request's prompt: its token ids with the media rows at their spans.

Chat messages are rendered with the real per-item row counts (`chat.render_chat`); a text prompt is encoded as it
is; a token prompt's one placeholder per item is expanded to the item's run(s) before `chat.attach_media` finds
the spans. Each span then takes its slice of the item's rows (bf16 as sent, or the audio codebook's sum of dMel
codes) as an engine `MultimodalItem`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from common.errors import InvalidInputError, UnavailableError
from common.wire import KIND_EMBEDDINGS, EncodedItem
from decode_service.api import GenerateInput
from decode_service.chat import (
    AUDIO_PLACEHOLDER,
    CONTENT_IMAGE,
    END_MESSAGE,
    IMAGE_PLACEHOLDER,
    MESSAGE_USER,
    RenderedPrompt,
    attach_media,
    encode_text,
    render_chat,
)
from decode_service.engine.request import MultimodalItem
from encoder_service.codebook import AudioCodebook

DEFAULT_REASONING_EFFORT = 0.9  # proto ChatPrompt.reasoning_effort unset


def build_prompt(inp: GenerateInput, encoded: Sequence[EncodedItem]) -> RenderedPrompt:
    """The prompt's token ids and media spans, from its chat messages, its text or its token ids."""
    counts: list[int | list[int]] = [
        [s.rows for s in item.spans] if item.modality == "video" else item.rows for item in encoded
    ]
    if inp.prompt_text is not None:
        return RenderedPrompt(token_ids=encode_text(inp.prompt_text), media_spans=[])
    if inp.prompt_token_ids is None:
        effort = DEFAULT_REASONING_EFFORT if inp.reasoning_effort is None else inp.reasoning_effort
        return render_chat(list(inp.messages), list(inp.tools), effort, counts)
    expanded = expand_placeholders(list(inp.prompt_token_ids), encoded)
    return attach_media(expanded, [item.modality for item in encoded], counts)


def media_items(
    prompt: RenderedPrompt,
    encoded: Sequence[EncodedItem],
    dtype: torch.dtype,
    audio_codebook: AudioCodebook | None,
) -> tuple[MultimodalItem, ...]:
    """One engine item per media span, its rows in `dtype`; a span past an item's first row gets its own key."""
    rows = {item.item_index: item_rows(item, audio_codebook).to(dtype) for item in encoded}
    items = []
    for span in prompt.media_spans:
        item = encoded[span.item_index]
        key = (
            item.mm_key
            if span.row_offset == 0
            else hashlib.sha256(item.mm_key + span.row_offset.to_bytes(8, "little")).digest()
        )
        items.append(
            MultimodalItem(key, span.start, rows[span.item_index][span.row_offset : span.row_offset + span.length])
        )
    return tuple(items)


def item_rows(item: EncodedItem, audio_codebook: AudioCodebook | None) -> torch.Tensor:
    """bf16 rows as sent, or the audio tower's codebook sum of an audio item's dMel codes."""
    if item.kind == KIND_EMBEDDINGS:
        return _bf16_rows(item)
    name = f"media[{item.item_index}] ({item.modality})"
    if audio_codebook is None:
        raise UnavailableError(f"{name}: the encoder sent dMel codes and this replica has no audio tower")
    return audio_codebook.rows(item, name)


def _bf16_rows(item: EncodedItem) -> torch.Tensor:
    """Raw little-endian bf16 bytes -> a `[rows, dim]` tensor."""
    return torch.frombuffer(bytearray(item.payload), dtype=torch.bfloat16).view(item.rows, item.dim)


def expand_placeholders(token_ids: list[int], items: Sequence[EncodedItem]) -> list[int]:
    """A token prompt's single placeholder per item -> the item's full placeholder run(s).

    Images and videos use the image placeholder, audio the audio placeholder; items of each kind are matched
    to placeholders in order. A video's frames are separate image messages, as in chat rendering.
    """
    visual = [item for item in items if item.modality != "audio"]
    audio = [item for item in items if item.modality == "audio"]
    found_visual = token_ids.count(IMAGE_PLACEHOLDER)
    found_audio = token_ids.count(AUDIO_PLACEHOLDER)
    if found_visual != len(visual) or found_audio != len(audio):
        raise InvalidInputError(
            f"prompt.token_ids: {found_visual} image and {found_audio} audio placeholders, but the media are "
            f"{len(visual)} image/video and {len(audio)} audio items (one placeholder token per item)"
        )
    queues = {IMAGE_PLACEHOLDER: iter(visual), AUDIO_PLACEHOLDER: iter(audio)}
    out: list[int] = []
    for token in token_ids:
        if token not in queues:
            out.append(token)
            continue
        item = next(queues[token])
        for n, span in enumerate(item.spans):
            if n:
                out += [END_MESSAGE, MESSAGE_USER, CONTENT_IMAGE]
            out += [token] * span.rows
    return out
