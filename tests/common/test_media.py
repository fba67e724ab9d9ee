"""The one MediaItem <-> MediaInput conversion both servers use."""

from __future__ import annotations

import pytest

from common.errors import InvalidInputError
from common.media import ImageOptions, MediaInput, VideoOptions, media_from_proto, media_modality, media_to_proto
from proto.inkling_epd.v1 import media_pb2


def test_media_to_proto_round_trips_through_media_from_proto():
    items = [
        MediaInput("image", b"a", ImageOptions("long_edge", 1.5, 1024)),
        MediaInput("audio", b"b"),
        MediaInput(
            "video", b"c", video=VideoOptions(fps=2.0, max_frames=3, include_audio=False, frame=ImageOptions("none"))
        ),
    ]
    for i, item in enumerate(items):
        assert media_from_proto(i, media_to_proto(item)) == item


def test_bad_items_name_the_item():
    with pytest.raises(InvalidInputError, match=r"item 2: modality is not set"):
        media_from_proto(2, media_pb2.MediaItem(data=b"x"))
    with pytest.raises(InvalidInputError, match=r"item 0 \(image\): no media data"):
        media_from_proto(0, media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE))
    with pytest.raises(InvalidInputError, match=r"item 1 \(audio\): image parameters"):
        media_from_proto(1, media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=b"x", image={}))
    with pytest.raises(InvalidInputError, match=r"chat.messages\[0\]: modality"):
        media_modality(99, "chat.messages[0]")
