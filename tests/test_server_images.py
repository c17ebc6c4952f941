"""Images through the server: OpenAI's `image_url` parts (data URLs) in /v1/chat/completions, with the real
`openai` client, give the offline engine's tokens for the same conversation; bad images are 400s and
nothing runs."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
from PIL import Image

import hybridkv
from hybridkv import SamplingParams
from hybridkv.tiny import tiny_vision_model

from lazy_modules import lazy_import

openai = lazy_import("openai")  # loaded by the first test that uses it (tests/lazy_modules.py)

MODEL = "tiny-gemma3-vision"
DEADLINE_SECONDS = 30


def picture(seed: int) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((40, 60, 3)) * 255).astype(np.uint8))


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def served():
    model, processor = tiny_vision_model()
    offline_model, offline_processor = tiny_vision_model()
    offline = hybridkv.patch(offline_model, processor=offline_processor, max_model_len=128, block_size=4)
    llm = hybridkv.patch(model, processor=processor, max_model_len=128, block_size=4)
    handle = hybridkv.serve(llm, port=0, model_name=MODEL)
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="-", max_retries=0, timeout=DEADLINE_SECONDS)
    yield handle, client, offline
    handle.stop()
    hybridkv.unpatch(model)
    hybridkv.unpatch(offline_model)


def ask(client, parts, **settings):
    messages = [{"role": "user", "content": parts}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, **settings)


def test_an_image_chat_gives_the_offline_engines_tokens(served):
    _, client, offline = served
    image = picture(0)
    # What the server decodes: the PNG round trip is lossless for RGB.
    conversation = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}]
    (expected,) = offline.chat(conversation, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "What?"}]
    answer = ask(client, parts)
    assert answer.choices[0].message.content == expected.outputs[0].text
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    streamed = "".join(
        chunk.choices[0].delta.content or "" for chunk in ask(client, parts, stream=True) if chunk.choices
    )
    assert streamed == expected.outputs[0].text
    # The image is really read: another one changes the tokens (their text may be held-back partial UTF-8).
    tokens = [[t.bytes for t in ask(client, p, logprobs=True).choices[0].logprobs.content] for p in (
        parts, [{"type": "image_url", "image_url": {"url": data_url(picture(1))}}, parts[1]])]  # fmt: skip
    assert tokens[0] != tokens[1]
    stats = offline.stats()
    assert stats["images_encoded"] == 1


def test_bad_images_are_400s_and_nothing_runs(served):
    handle, client, _ = served
    steps = handle.engine.stats()["num_steps"]
    text = {"type": "text", "text": "What?"}
    not_an_image = "data:image/png;base64," + base64.b64encode(b"no").decode()
    cases = [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "not fetched"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "does not decode"),
        ({"type": "image_url", "image_url": {"url": not_an_image}}, "could not be decoded"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "audio, video and files"),
    ]  # fmt: skip
    for part, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            ask(client, [part, text])
    deadline = time.monotonic() + DEADLINE_SECONDS
    while handle.engine.stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert handle.engine.stats()["num_steps"] == steps


def test_a_remote_image_is_fetched_only_when_the_server_allows_it(tmp_path):
    """`--fetch-images` (`fetch_images=True`): an http URL is fetched, here from a loopback file server; a
    missing file is a clear error; without the flag the URL is refused (the 400 above)."""
    import functools
    import http.server
    import threading

    from hybridkv.serving.images import decode_image

    picture(0).save(tmp_path / "cat.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=files.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{files.server_address[1]}/cat.png"
        assert np.array_equal(np.asarray(decode_image(url, fetch=True)), np.asarray(picture(0)))
        with pytest.raises(ValueError, match="gave HTTP 404"):
            decode_image(url.replace("cat", "dog"), fetch=True)
        with pytest.raises(ValueError, match="--fetch-images"):
            decode_image(url)
    finally:
        files.shutdown()
        files.server_close()
