"""Images in prompts: the vision tower outside the paged step, its embeddings placed at the placeholders.

A prompt with images is a dict, vLLM's shape: `{"prompt": text or token ids, "multi_modal_data": {"image":
image or list}}`, processed by the model's own processor (given to `patch` as `processor=`, or as its
`tokenizer=`), or `{"prompt_token_ids": ids with the placeholders expanded, "multi_modal_data":
{"pixel_values": ..., ...}}` with the processor's outputs made by the caller. When the request is added
(in the caller's thread, outside any step) each image goes through the model's own `get_image_features`
once, unless its content hash is in the encoder cache (`ImageEncoder`: least recently used out, bounded in
bytes); the request holds its images' embeddings (`MultiModalInputs`) until it ends, as a preempted request
computes its prompt again.

In a step, the rows of image placeholders get their embeddings through a forward hook on the model's input
embedding module (the model embeds the step's ids as always, then the hook puts the image rows in place:
what the model's own merge does with `masked_scatter`), so every other use of the ids by the model is
unchanged. Blocks are hashed with the hash of each image that starts in them (the chain carries it on):
the same image and text hit the prefix cache, another image never does.

Models that let an image's tokens see each other both ways (Gemma 3 on every layer, Gemma 4 on its sliding
layers: found by `image_attention_layers`, from the masks the model itself builds) get the same rule in the
paged kernels, and the scheduler never splits such an image across prefill chunks.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.memory.prompt_images import ImagePlacement, PromptImages

# Processor outputs that are not per-image data.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})
DEFAULT_ENCODER_CACHE_BYTES = 256 << 20
_HASH_BYTES = 32  # an image's content hash (SHA-256), the end of its encoder-cache key after the model key


@dataclass(frozen=True)
class ImageInput(ImagePlacement):
    """One image of a prompt (its content hash and placeholder positions: `ImagePlacement`) with its embeddings
    `[tokens, hidden]`."""

    features: torch.Tensor


@dataclass
class MultiModalInputs(PromptImages):
    """A request's images (`PromptImages`: placements, both-ways attention, the encoding model's key) with their
    embeddings, which the step's placeholder rows take."""

    images: list[ImageInput]
    _positions: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for index, image in enumerate(self.images):
            for row, position in enumerate(image.positions):
                self._positions[position] = (index, row)

    def rows(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """(prompt position, embedding) of every placeholder in positions [start, end)."""
        found = []
        for position in range(start, end):
            place = self._positions.get(position)
            if place is not None:
                found.append((position, self.images[place[0]].features[place[1]]))
        return found


class ImageEncoder:
    """The engine's images: the model's processor and vision tower, the placeholder id, and the encoder
    cache (embeddings by model key and content hash, least recently used out past `cache_bytes`; `keep_only` drops
    another model's). Counters: `num_encoded` images through the tower, `num_cache_hits` taken from the cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Any,
        bidirectional: bool,
        cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES,
    ) -> None:
        self.model = model
        self.processor = processor
        self.bidirectional = bidirectional
        self.image_token_id = image_token_id(model.config)
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.cached_bytes = 0
        self.num_encoded = 0
        self.num_cache_hits = 0
        self._lock = threading.Lock()
        # The merge check's verdict (None: not run yet; "" passed; else why images are refused).
        self.refusal: str | None = None

    @property
    def serves_images(self) -> bool:
        return self.image_token_id is not None and callable(getattr(self.model, "get_image_features", None))

    def keep_only(self, model_key: bytes) -> None:
        """Drop the embeddings every other model made (the model changed: hybridkv/execution/model_watch.py)."""
        with self._lock:
            for cache_key in [k for k in self._cache if k[:-_HASH_BYTES] != model_key]:
                dropped = self._cache.pop(cache_key)
                self.cached_bytes -= dropped.numel() * dropped.element_size()

    def clear(self) -> None:
        """Drop every embedding (`LLMEngine.sleep`)."""
        with self._lock:
            self._cache.clear()
            self.cached_bytes = 0

    def inputs(
        self, prompt: dict[str, Any], model_key: bytes = b""
    ) -> tuple[str | None, list[int], MultiModalInputs | None]:
        """A dict prompt's text, its token ids (placeholders expanded) and its images' embeddings, made by the model
        `model_key` names (the engine's key as the call began)."""
        unknown = prompt.keys() - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise ValueError(
                f"a dict prompt takes 'prompt' or 'prompt_token_ids', and 'multi_modal_data'; got {sorted(unknown)}"
            )
        data = prompt.get("multi_modal_data") or {}
        if not isinstance(data, dict):
            raise TypeError("multi_modal_data must be a dict, e.g. {'image': image} or {'pixel_values': tensor}")
        other_media = {"video", "audio"} & data.keys()
        if other_media:
            raise ValueError(f"multi_modal_data holds {sorted(other_media)}: hybridkv serves images only")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a dict prompt needs exactly one of 'prompt' (text) and 'prompt_token_ids'")
        if data and not self.serves_images:
            raise ValueError(
                f"{type(self.model).__name__} takes no images (no image placeholder in its config, or no "
                "get_image_features): load the model's ...ForConditionalGeneration class"
            )
        if "image" in data:
            text, ids, kwargs = self._processed(prompt, data["image"])
        else:
            ids = prompt.get("prompt_token_ids", prompt.get("prompt"))
            if isinstance(ids, str):
                raise ValueError("with processed inputs (pixel_values), give 'prompt_token_ids' with the placeholders")
            text, ids, kwargs = None, _token_list(ids), {k: v for k, v in data.items() if k not in _TEXT_KEYS}
        if not kwargs:
            return text, ids, None
        if self.refusal:  # an earlier check refused this model's images: no tower run for nothing
            raise ValueError(self.refusal)
        multimodal = self._images(ids, kwargs, model_key)
        self._check_merge(ids, kwargs, multimodal)
        return text, ids, multimodal

    def _check_merge(self, ids: list[int], kwargs: dict[str, Any], multimodal: MultiModalInputs) -> None:
        """The first prompt with images is checked once: the model's own forward with its image inputs must give
        the logits of its forward with hybridkv's merge (the embeddings placed at the placeholders, positions
        0..n-1, no pixel values), both with the model's own attention. A model that places images otherwise
        (3-D positions for image tokens, as Qwen2-VL's M-RoPE; a merge that is more than the placement) is
        refused for images from then on: its tokens would be silently wrong."""
        with self._lock:
            refusal = self.refusal
        if refusal == "":
            return
        if refusal is None:
            refusal = self._merge_differs(ids, kwargs, multimodal)
            with self._lock:
                self.refusal = refusal
        if refusal:
            raise ValueError(refusal)

    def _merge_differs(self, ids: list[int], kwargs: dict[str, Any], multimodal: MultiModalInputs) -> str:
        model = self.model
        device = next(model.parameters()).device
        input_ids = torch.tensor([ids], device=device)
        parameters = inspect.signature(model.forward).parameters
        types = {
            name: (input_ids == self.image_token_id).long()
            for name in ("token_type_ids", "mm_token_type_ids")
            if name in parameters
        }
        moved = self._on_model(kwargs)
        rows = [position for image in multimodal.images for position in image.positions]
        features = torch.cat([image.features for image in multimodal.images])
        try:
            with torch.inference_mode():
                own = model(input_ids=input_ids, **moved, **types, use_cache=False).logits[0].float()
                with image_embeddings_placed(model, rows, features):
                    positions = torch.arange(len(ids), device=device)[None]
                    placed = model(input_ids=input_ids, position_ids=positions, **types, use_cache=False)
                placed = placed.logits[0].float()
        except Exception as exc:
            return (
                f"{type(model).__name__} failed hybridkv's check of its image merge ({type(exc).__name__}: {exc}): "
                "it is served for text only"
            )
        difference = (own - placed).abs().max().item()
        if not difference <= 1e-4 * max(1.0, own.abs().max().item()):
            return (
                f"{type(model).__name__} does not place images the way hybridkv does (its own forward with the "
                f"images and hybridkv's placement of their embeddings differ by {difference:.3g} in the logits; "
                "e.g. 3-D positions for image tokens): it is served for text only"
            )
        return ""

    def _processed(self, prompt: dict[str, Any], images: Any) -> tuple[str, list[int], dict]:
        if self.processor is None or getattr(self.processor, "image_processor", None) is None:
            raise ValueError(
                "images need the model's processor: hybridkv.patch(model, processor=AutoProcessor.from_pretrained"
                "(...)), or give the processor's outputs as {'prompt_token_ids': ..., 'multi_modal_data': "
                "{'pixel_values': ...}}"
            )
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError("with raw images give 'prompt' as text holding the model's image placeholder(s)")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if not images:
            raise ValueError("multi_modal_data['image'] is an empty list")
        try:
            out = self.processor(text=text, images=images, return_tensors="pt")
        except Exception as exc:
            raise ValueError(f"the processor refused the prompt and images: {type(exc).__name__}: {exc}") from exc
        ids = out["input_ids"][0].tolist()
        return text, ids, {k: v for k, v in out.items() if k not in _TEXT_KEYS}

    def _images(self, ids: list[int], kwargs: dict[str, Any], model_key: bytes) -> MultiModalInputs:
        per_image = _split_per_image(kwargs)
        positions = [i for i, token in enumerate(ids) if token == self.image_token_id]
        images, used = [], 0
        for image_kwargs in per_image:
            content_hash = _content_hash(image_kwargs)
            features = self._features(model_key + content_hash, image_kwargs)
            count = features.shape[0]
            if used + count > len(positions):
                raise ValueError(
                    f"the prompt holds {len(positions)} image placeholder tokens (id {self.image_token_id}) but its "
                    f"images make {used + count} or more embeddings: expand each image's placeholder as the "
                    "processor does"
                )
            images.append(ImageInput(content_hash, tuple(positions[used : used + count]), features))
            used += count
        if used != len(positions):
            raise ValueError(
                f"the prompt holds {len(positions)} image placeholder tokens but its {len(per_image)} image(s) "
                f"make {used} embeddings: one placeholder per embedding, as the processor expands them"
            )
        return MultiModalInputs(images, self.bidirectional, model_key)

    def _features(self, cache_key: bytes, image_kwargs: dict[str, Any]) -> torch.Tensor:
        with self._lock:
            features = self._cache.get(cache_key)
            if features is not None:
                self._cache.move_to_end(cache_key)
                self.num_cache_hits += 1
                return features
        features = self._encode(image_kwargs)
        with self._lock:
            self.num_encoded += 1
            size = features.numel() * features.element_size()
            if cache_key not in self._cache and size <= self.cache_bytes:
                self._cache[cache_key] = features
                self.cached_bytes += size
                while self.cached_bytes > self.cache_bytes:
                    _, dropped = self._cache.popitem(last=False)
                    self.cached_bytes -= dropped.numel() * dropped.element_size()
        return features

    def _on_model(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Processor outputs on the model's device, floating tensors in its dtype."""
        device = next(self.model.parameters()).device
        dtype = self.model.get_input_embeddings().weight.dtype
        return {
            k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) if torch.is_tensor(v) else v
            for k, v in kwargs.items()
        }

    def _encode(self, image_kwargs: dict[str, Any]) -> torch.Tensor:
        """The model's own vision tower and projector for one image: `[tokens, hidden]`."""
        moved = self._on_model(image_kwargs)
        accepted = inspect.signature(self.model.get_image_features).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        moved = {k: v for k, v in moved.items() if takes_any or k in accepted}
        try:
            with torch.inference_mode():
                output = self.model.get_image_features(**moved)
        except Exception as exc:
            shapes = {k: tuple(v.shape) for k, v in moved.items() if torch.is_tensor(v)}
            raise ValueError(
                f"the model's vision tower failed on an image given as {shapes} ({type(exc).__name__}: {exc}); "
                "give the processor's outputs batched per image, as the processor makes them"
            ) from exc
        features = getattr(output, "pooler_output", output)
        if isinstance(features, (list, tuple)):
            features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        return features.reshape(-1, features.shape[-1]).to(self.model.get_input_embeddings().weight.dtype)


def image_token_id(config: Any) -> int | None:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _token_list(ids: Any) -> list[int]:
    from hybridkv.execution.inputs import token_ids

    return token_ids(ids)


def _split_per_image(kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """The processor's batched image tensors, one dict per image (tensors whose first dimension counts them)."""
    pixel_values = kwargs.get("pixel_values")
    if not torch.is_tensor(pixel_values) and pixel_values is not None:
        pixel_values = torch.as_tensor(pixel_values)
        kwargs = {**kwargs, "pixel_values": pixel_values}
    if pixel_values is None:
        raise ValueError("processed image inputs need 'pixel_values'")
    count = pixel_values.shape[0]  # batched as the processor makes them: one entry per image
    per_image = []
    for index in range(count):
        one = {}
        for key, value in kwargs.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == count:
                one[key] = value[index : index + 1]
            else:
                one[key] = value
        per_image.append(one)
    return per_image


def _content_hash(image_kwargs: dict[str, Any]) -> bytes:
    digest = hashlib.sha256(b"hybridkv-image-v1")
    for key in sorted(image_kwargs):
        value = image_kwargs[key]
        digest.update(key.encode())
        if torch.is_tensor(value):
            value = value.detach().cpu().contiguous()
            digest.update(str((value.dtype, tuple(value.shape))).encode())
            digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        else:
            digest.update(repr(value).encode())
    return digest.digest()


@contextlib.contextmanager
def image_embeddings_placed(model: torch.nn.Module, rows: Sequence[int], features: torch.Tensor) -> Iterator[None]:
    """During the step's forward, the input embedding's output has `features` at flattened rows `rows`."""
    if not rows:
        yield
        return
    embedding = model.get_input_embeddings()
    index = torch.tensor(list(rows), device=features.device)

    def place(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        flat = output.reshape(-1, output.shape[-1])
        flat = flat.index_copy(0, index.to(flat.device), features.to(flat.device, flat.dtype))
        return flat.view(output.shape)

    handle = embedding.register_forward_hook(place)
    try:
        yield
    finally:
        handle.remove()
