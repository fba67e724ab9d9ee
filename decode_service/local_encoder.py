"""In-process encoding on the decode replica: the encoder engine's own code, without its server.

Used by `inkling-epd decode --local-encode` (when no encoder replica is reachable) and by
`inkling-epd generate --local` with media: it loads the towers. A decode replica that only needs `mm_key`s
uses `encoder_service.planner.MediaPlanner` and `common.fingerprint.encoder_fingerprint_of` instead.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

from common.errors import InvalidInputError
from common.media import MediaInput
from common.settings import EncoderSettings
from common.wire import EncodedItem
from decode_service.encoder_client import item_error
from encoder_service.service import EncoderEngine, ItemError, load_engine

log = logging.getLogger(__name__)


class LocalEncoder:
    """An `EncoderEngine` (towers + preprocessing, no cache) living in the decode process."""

    def __init__(self, engine: EncoderEngine) -> None:
        self.engine = engine

    @classmethod
    def load(cls, checkpoint: str | Path, device: str = "cpu", dtype: str = "bfloat16") -> LocalEncoder:
        settings = EncoderSettings(
            checkpoint=str(checkpoint), device=device, dtype=dtype, l1_cache_bytes=0, preprocess_workers=2
        )
        return cls(load_engine(settings))

    @property
    def fingerprint(self) -> bytes:
        return self.engine.fingerprint

    @property
    def dim(self) -> int:
        return self.engine.dim

    def preprocess_fingerprint(self, media: MediaInput, item: str) -> dict:
        return self.engine.preprocess_fingerprint(media, item)

    @property
    def pool_fingerprint(self) -> bytes:
        return self.engine.fingerprint

    @property
    def inflight_items(self) -> int:
        return self.engine.inflight_items

    async def encode(
        self, items: Sequence[MediaInput], request_id: str = "", timeout_s: float | None = None
    ) -> list[EncodedItem]:
        """Encode every item; the first bad one raises `InvalidInputError` naming it as `media[i]`."""
        out: list[EncodedItem] = []
        async with contextlib.aclosing(self.engine.encode(items, request_id)) as results:
            async for result in results:
                if isinstance(result, ItemError):
                    index = result.item_index
                    if isinstance(result.error, InvalidInputError):
                        raise InvalidInputError(item_error(index, items[index].modality, str(result.error)))
                    raise result.error
                out.append(result)
        return out

    async def close(self) -> None:
        await self.engine.close()
