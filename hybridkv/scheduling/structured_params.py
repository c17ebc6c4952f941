"""What a request's structured output must match (`StructuredOutputsParams`, vLLM's fields): plain data, checked on
construction, with no torch and no grammar library, so that sampling parameters (and the scheduling layer that holds
them) carry it without importing what enforces it (hybridkv/sampling/structured_outputs.py: the grammars, their matchers
and the logits' masks)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match, vLLM's fields: exactly one of `json` (a JSON schema, as a dict or its
    text), `regex`, `choice` (the output is one of these strings), `grammar` (EBNF as vLLM's examples write it,
    `root ::= ...`, or a Lark grammar, llguidance's dialect), `json_object=True` (any JSON object) or `structural_tag`
    (free text in which each trigger starts a structure: `{"structures": [{"begin": "<function=f>", "schema": {...},
    "end": "</function>"}], "triggers": ["<function="]}`, as a dict or its text, vLLM's shape). For JSON:
    `disable_any_whitespace` True writes it compactly and False lets any whitespace sit between its tokens (vLLM's
    default); left None, hybridkv writes it compactly (a model free to add whitespace can fill max_tokens with it);
    `whitespace_pattern` is the regex whitespace must match instead; `disable_additional_properties` forbids
    properties a schema's object does not list (`"additionalProperties": false` where it says nothing)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got {given or 'none'}")
        if self.structural_tag is not None:
            object.__setattr__(self, "structural_tag", json.dumps(_structural_tag(self.structural_tag)))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise TypeError(f"structured_outputs json must be a JSON schema (a dict or its text), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise TypeError(f"structured_outputs {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice):
                raise TypeError(f"structured_outputs choice must be a list of non-empty strings, got {self.choice!r}")
            if not self.choice:
                raise ValueError("structured_outputs choice must list at least one string")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise TypeError(f"structured_outputs json_object must be a bool, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (value is None and name == "disable_any_whitespace")):
                raise TypeError(f"structured_outputs {name} must be a bool, got {value!r}")
        if self.whitespace_pattern is not None and not (
            isinstance(self.whitespace_pattern, str) and self.whitespace_pattern
        ):
            raise TypeError(f"structured_outputs whitespace_pattern must be a regex, got {self.whitespace_pattern!r}")
        shapes_json = self.disable_any_whitespace is not None or self.disable_additional_properties
        if (shapes_json or self.whitespace_pattern is not None) and self.json is None and not self.json_object:
            raise ValueError(
                "structured_outputs' disable_any_whitespace, disable_additional_properties and whitespace_pattern "
                "shape JSON: give them with json or json_object"
            )

    @property
    def key(self) -> tuple[str, str]:
        """The constraint as (kind, text): what compiled grammars are cached by (a JSON kind's text holds its
        options too)."""
        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            text = schema if isinstance(schema, str) else json.dumps(schema)  # key order is the output's
            options = (self.disable_any_whitespace, self.disable_additional_properties, self.whitespace_pattern)
            return ("json" if self.json is not None else "json_object"), json.dumps([text, options])
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        if self.structural_tag is not None:
            return "structural_tag", self.structural_tag
        return "grammar", self.grammar or ""

    def json_schema(self) -> dict[str, Any]:
        """The JSON kinds' schema as llguidance compiles it: `json_object`'s any object; with
        `disable_additional_properties`, every object schema that says nothing of them closed."""
        schema: Any = self.json if self.json is not None else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"structured_outputs json is not a JSON schema: {exc}") from None
        return _closed(schema) if self.disable_additional_properties else schema

    def json_options(self) -> dict[str, Any]:
        """llguidance's JSON options: compact unless `disable_any_whitespace` is False; `whitespace_pattern`."""
        options: dict[str, Any] = {"whitespace_flexible": self.disable_any_whitespace is False}
        if self.whitespace_pattern is not None:
            options["whitespace_pattern"] = self.whitespace_pattern
        return options


def _closed(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` in every object schema that does not set it (vLLM's
    `disable_additional_properties`), however deep."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _structural_tag(value: Any) -> dict[str, Any]:
    """vLLM's structural tag, checked: `structures` (each a `begin` string, a JSON `schema` and an `end` string; `begin`
    starts with one of the triggers) and `triggers` (non-empty strings)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"structured_outputs structural_tag is not JSON: {exc}") from None
    if not isinstance(value, dict) or not isinstance(value.get("structures"), list) or not value["structures"]:
        raise ValueError(
            'structured_outputs structural_tag needs {"structures": [{"begin": ..., "schema": ..., "end": ...}, ...], '
            f'"triggers": [...]}}, got {value!r}'
        )
    triggers = value.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(
            f"structured_outputs structural_tag needs triggers, a list of non-empty strings, got {triggers!r}"
        )
    for structure in value["structures"]:
        if not isinstance(structure, dict) or not all(isinstance(structure.get(k), str) for k in ("begin", "end")):
            raise ValueError(f"a structural_tag structure needs begin and end strings, got {structure!r}")
        if not any(structure["begin"].startswith(trigger) for trigger in triggers):
            raise ValueError(
                f"a structural_tag structure's begin {structure['begin']!r} starts with no trigger {triggers}"
            )
        if not isinstance(structure.get("schema", {}), dict):
            raise ValueError(f"a structural_tag structure's schema must be a JSON schema, got {structure['schema']!r}")
    return value
