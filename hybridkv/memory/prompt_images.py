"""`PromptImages`: a prompt's images as the memory manager and the scheduler see them (no torch): where each image's
placeholder tokens sit, its content hash (hashed into the blocks it starts in), whether an image's tokens attend both
ways (a prefill chunk never splits one then), and the key of the model that encoded them. The embeddings are the
execution layer's (`hybridkv/execution/multimodal.py`: `MultiModalInputs` extends this with them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ImagePlacement:
    """One image of a prompt: its content hash and the prompt positions of its placeholder tokens (in order; an
    image's placeholders may have other tokens between them, e.g. Pixtral's row breaks)."""

    content_hash: bytes
    positions: tuple[int, ...]

    @property
    def span(self) -> tuple[int, int]:
        return self.positions[0], self.positions[-1] + 1


@dataclass
class PromptImages:
    """A request's images, in prompt order, whether their tokens attend both ways within an image, and the key of
    the model whose vision tower made their embeddings (hybridkv/execution/model_watch.py; the scheduler admits the
    request only under that model)."""

    images: Sequence[ImagePlacement]
    bidirectional: bool = False
    model_key: bytes = b""

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [image.span for image in self.images]

    def block_keys(self, block_size: int) -> dict[int, bytes]:
        """Extra hash keys per block: the content hash of every image whose first placeholder is in it."""
        keys: dict[int, bytes] = {}
        for image in self.images:
            block = image.positions[0] // block_size
            keys[block] = keys.get(block, b"") + image.content_hash
        return keys

    def limits(self, start: int, end: int) -> list[tuple[int, int]]:
        """(prompt position, last key position it sees) of every position in [start, end) inside an image
        span that attends both ways: the span's end, past the position itself."""
        found = []
        for span_start, span_end in self.spans:
            for position in range(max(start, span_start), min(end, span_end) - 1):
                found.append((position, span_end - 1))
        return found

    def fit(self, start: int, num_new: int) -> int:
        """The tokens of [start, start + num_new) a prefill chunk may compute without splitting a span that
        attends both ways: cut back to the span's start, or 0 when the span began before `start` (a
        prefix-cache hit inside it) and does not end in the chunk."""
        if not self.bidirectional:
            return num_new
        end = start + num_new
        for span_start, span_end in self.spans:
            if span_start < end < span_end:
                return max(0, span_start - start)
        return num_new
