"""`LayoutWatch`: whether the model still attends as the engine was built for it, and `ModelReshaped` when not.

`hybridkv.patch` builds the engine's layout once, from the model's text config as it is then: which layers attend
with which window or attention chunk, their heads and head dims, how many layers run, how far positions go
(hybridkv/patches/inspection.py); and it switches the model's attention to hybridkv's (hybridkv/patches/attention.py).
A forward reads much of that config again each time (Mistral's and Phi-3's layers pass `config.sliding_window` to
attention, the masks read it, `num_hidden_layers` bounds the layers that run, rotary embeddings read their
parameters), so after an edit `generate` computes with the new values while the engine's pages and windows keep the
old ones; and a model switched to another implementation (`model.set_attn_implementation("eager")`) no longer runs
hybridkv's attention in a step at all: each step would attend over its own rows only.

Neither change is followed (the layout is derived again only by patching again): `check()`, at the first step of
every engine call, raises `ModelReshaped` naming `hybridkv.patch(model)`. It reads each config object's attention
implementation and each field of `ATTENTION_CONFIG_FIELDS` from the text config's `__dict__` (transformers' config
attribute lookup costs about 3 us a name, a dict's well under 0.1 us): about 5 us a check.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import Any

import torch

from hybridkv.patches.attention import ATTN_IMPLEMENTATION

# The text config's values that shape attention (what the layout is built from, or what a forward reads again).
ATTENTION_CONFIG_FIELDS = (
    "num_hidden_layers",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "sliding_window_pattern",
    "attention_chunk_size",
    "no_rope_layers",
    "num_kv_shared_layers",
    "use_bidirectional_attention",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "global_head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "max_position_embeddings",
    "original_max_position_embeddings",
    "attn_temperature_tuning",
    "floor_scale",
    "attn_scale",
)
_ABSENT = object()
_IMPLEMENTATION_KEY = "_attn_implementation_internal"


class ModelReshaped(RuntimeError):
    """The model's attention implementation, or a config value that shapes its attention, changed since
    `hybridkv.patch`."""


class LayoutWatch:
    """The attention implementation and attention-shaping config one engine was built for (module docstring)."""

    def __init__(self, model: torch.nn.Module, attention_modules: Iterable[torch.nn.Module]) -> None:
        self.text_config = config = model.config.get_text_config()
        # What the model's attention layers read their implementation from (the probe's `attention_modules`), and the
        # model's own config: other modules' configs (a rotary embedding's copy, Granite SWA's) dispatch no attention.
        configs = [model.config, *(getattr(module, "config", None) for module in attention_modules)]
        self.attention_configs = list({id(c): c for c in configs if hasattr(c, "_attn_implementation")}.values())
        # Where each keeps it: transformers' `_attn_implementation` property reads `_attn_implementation_internal`
        # through the config's own `__getattribute__` (about 2.4 us); its `__dict__` answers in well under 0.1 us.
        self._implementations = [
            vars(config) for config in self.attention_configs if _IMPLEMENTATION_KEY in vars(config)
        ]
        if len(self._implementations) < len(self.attention_configs):  # another transformers: the property itself
            self._implementations = []
        # Each field where `setattr` keeps it: in the config's `__dict__`, under the name its `attribute_map` gives.
        # A field its class computes (a property: `rope_scaling` reads `rope_parameters` in transformers 5) is watched
        # through the fields it is computed from.
        stored = {name: config.attribute_map.get(name, name) for name in ATTENTION_CONFIG_FIELDS}
        # The config's `__dict__`, kept: `vars(config)` goes through transformers' `__getattribute__` too (about 2 us).
        self._values = values = vars(config)
        self.patched_values = {
            name: (key, _copy(values.get(key, _ABSENT)))
            for name, key in stored.items()
            if not isinstance(getattr(type(config), name, None), property)
        }
        # The fields the config held, read together by one `itemgetter` (a KeyError once one is deleted), and those
        # it lacked, which must stay out of its `__dict__`.
        held = [(key, patched) for key, patched in self.patched_values.values() if patched is not _ABSENT]
        self._read_held = _tuple_getter([key for key, _ in held])
        self._held = tuple(patched for _, patched in held)
        self._absent = frozenset(key for key, patched in self.patched_values.values() if patched is _ABSENT)
        # The implementations as `check` reads them (None where the property alone says: never equal to a list).
        self._installed = [ATTN_IMPLEMENTATION] * len(self._implementations) if self._implementations else None

    def check(self) -> None:
        """Raise `ModelReshaped`, naming the fix, if anything changed (`changed`). While nothing did it is one
        function: a comparison each of the implementations and the held fields and one set test, each in C (a step
        pays about a microsecond for each function it enters after a forward has evicted their code:
        benchmarks/cold_calls.py)."""
        values = self._values
        try:
            if (
                list(map(_read_implementation, self._implementations)) == self._installed
                and self._read_held(values) == self._held
                and values.keys().isdisjoint(self._absent)
            ):
                return
        except KeyError:  # a field was deleted: `changed` names it
            pass
        reason = self.changed()
        if reason is not None:
            raise ModelReshaped(
                f"{reason}: call hybridkv.patch(model) again (it builds the engine for the model as it is now, or "
                "says why it cannot), or set the value back"
            )

    def changed(self) -> str | None:
        """What changed since the model was patched, for a person; None while nothing did."""
        for config in self.attention_configs:
            implementation = config._attn_implementation
            if implementation != ATTN_IMPLEMENTATION:
                return (
                    f"the model's attention implementation is {implementation!r} "
                    f"(model.set_attn_implementation) where hybridkv.patch installed {ATTN_IMPLEMENTATION!r}, "
                    "through which the engine's steps attend over their pages"
                )
        values = self._values
        for name, (key, patched) in self.patched_values.items():
            now = values.get(key, _ABSENT)
            if now != patched:
                return (
                    f"config.{name} is {_shown(now)} but was {_shown(patched)} when the model was patched, and "
                    "hybridkv's KV layout and attention were built for that"
                )
        return None


_read_implementation = itemgetter(_IMPLEMENTATION_KEY)


def _tuple_getter(keys: list[str]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """A dict's values at `keys`, as a tuple (`itemgetter` gives a bare value for one key); KeyError for one missing."""
    if len(keys) > 1:
        return itemgetter(*keys)
    return lambda values: tuple(values[key] for key in keys)


def _copy(value: Any) -> Any:
    """A copy an in-place edit of the config's value leaves as it was (`layer_types[1] = ...`)."""
    return value if value is _ABSENT else copy.deepcopy(value)


def _shown(value: Any) -> str:
    return "unset" if value is _ABSENT else repr(value)
