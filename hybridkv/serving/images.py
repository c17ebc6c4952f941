"""Images sent to the server: OpenAI's `image_url` parts, decoded here (data URLs only), with limits.

A `data:image/...;base64,...` URL is decoded with Pillow. A remote URL (http, https) is refused with a 400
unless the server was started with `--fetch-images` (`serve(fetch_images=True)`): then it is fetched with
httpx (no redirects followed, `FETCH_TIMEOUT_SECONDS`, at most `MAX_IMAGE_BYTES` read). An image over
`MAX_IMAGE_BYTES` encoded or `MAX_IMAGE_PIXELS` decoded, or one Pillow cannot read, is a 400 too, before
anything is queued.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 50_000_000
FETCH_TIMEOUT_SECONDS = 10.0


def decode_image(url: str, fetch: bool = False) -> Any:
    """The RGB image of a data URL (or, with `fetch`, of an http(s) URL); a ValueError that names the fault."""
    if url.startswith(("http://", "https://")):
        if not fetch:
            raise ValueError(
                "remote image URLs are not fetched by this server: send the image as a data URL (base64), or "
                "start the server with --fetch-images"
            )
        return _image(_fetched(url))
    if not url.startswith("data:"):
        raise ValueError("an image_url must be a data URL: data:image/png;base64,...")
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ValueError("an image data URL must be base64: data:image/png;base64,...")
    if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
        raise ValueError(f"an image is larger than {MAX_IMAGE_BYTES >> 20} MiB encoded")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("an image data URL's base64 does not decode") from None
    return _image(data)


def _fetched(url: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_SECONDS, follow_redirects=False) as response:
            if response.status_code != 200:
                raise ValueError(f"fetching the image at {url} gave HTTP {response.status_code}")
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise ValueError(f"the image at {url} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise ValueError(f"fetching the image at {url} failed: {type(exc).__name__}: {exc}") from None
    return b"".join(chunks)


def _image(data: bytes) -> Any:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ValueError(f"an image of {width} x {height} pixels is over the {MAX_IMAGE_PIXELS:,}-pixel limit")
            probe.verify()
        image = Image.open(io.BytesIO(data))
        return image.convert("RGB")
    except ValueError:
        raise
    except Exception as exc:  # Pillow's many ways of saying "not an image"
        raise ValueError(f"an image could not be decoded: {type(exc).__name__}: {exc}") from None
