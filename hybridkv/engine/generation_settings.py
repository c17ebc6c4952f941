"""`GenerationSettings`: what the model's generation config and the tokenizer set for every request, read as they are
now.

The EOS ids (`model.generation_config.eos_token_id` and the tokenizer's `eos_token_id`) end every sample, and with
`generation_config="auto"` the generation config's sampling settings are the defaults of a request without its own
(`LLMEngine.get_default_sampling_params`). Both are edited after loading as a matter of course (a chat model's
`generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")`), and `generate` reads them at each
call: so does the engine, for each request it checks (`follow`). A check reads the fields they come from and
compares them with the last ones (a few microseconds); the ids and defaults are derived again only when one changed.
"""

from __future__ import annotations

from typing import Any

from hybridkv.execution.inputs import eos_token_ids
from hybridkv.scheduling.sampling_params import GENERATION_CONFIG_FIELDS, generation_config_defaults


class GenerationSettings:
    """The EOS ids (`eos_token_ids`) and default sampling settings (`default_sampling`, {} unless `read_defaults`) of
    a model and tokenizer, as of the last `follow`."""

    def __init__(self, model: Any, tokenizer: Any, read_defaults: bool) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.read_defaults = read_defaults
        self._generation_config: Any = None
        self._sources: tuple[Any, ...] | None = None
        self.eos_token_ids: list[int] = []
        self.default_sampling: dict[str, Any] = {}
        self.follow()

    def follow(self) -> bool:
        """Read the settings again if what they come from changed since the last call; whether it had."""
        generation_config = getattr(self.model, "generation_config", None)
        sources = self._read_sources(generation_config)
        if generation_config is self._generation_config and sources == self._sources:
            return False
        # The settings before their sources: another thread's `follow` meanwhile reads them again, never stale ones.
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        self.default_sampling = generation_config_defaults(generation_config) if self.read_defaults else {}
        self._generation_config, self._sources = generation_config, sources
        return True

    def _read_sources(self, generation_config: Any) -> tuple[Any, ...]:
        """The generation config's EOS and sampling fields, and the tokenizer's EOS id."""
        eos = getattr(generation_config, "eos_token_id", None)
        fields = (
            tuple(_frozen(getattr(generation_config, name, None)) for name in GENERATION_CONFIG_FIELDS)
            if self.read_defaults
            else ()
        )
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        return (_frozen(eos), fields, tokenizer_eos)


def _frozen(value: Any) -> Any:
    """A list (of EOS ids) as a tuple: an in-place edit of the config's list is then seen."""
    return tuple(value) if isinstance(value, list) else value
