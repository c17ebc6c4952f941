"""Tool calls: OpenAI's `tools` / `tool_choice` on top of a model's chat template and structured outputs.

The tools reach the model through its own chat template (`apply_chat_template(..., tools=...)`); what the
model writes back is parsed by one small parser per output format:

- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}` per call;
- `llama3_json` (Llama 3.1-3.3): the whole answer one JSON object `{"name": ..., "parameters": {...}}` (or
  several separated by `;`), after an optional `<|python_tag|>`;
- `pythonic` (Gemma 3's and Llama 4's examples): `[name(arg=value, ...), ...]`, in a ```tool_code block or not;
- `openai` (gpt-oss's harmony format; vLLM's name): messages to `functions.NAME`
  (`... to=functions.NAME ...<|message|>{...}<|call|>`), the content being the `final` channel's text.

The parser is named (`--tool-call-parser`) or found in the template (the first whose marker it holds).
`tool_choice="required"` and a named function do not depend on the format: the output is constrained with
structured outputs to a JSON list of calls (each `{"name": one of the tools, "parameters": its schema}`) or
to the named function's arguments, so even a weak model returns valid calls (vLLM's approach).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

PARSER_NAMES = ("hermes", "mistral", "llama3_json", "pythonic", "openai")
# How a template that writes or reads each format shows it (first match wins).
_TEMPLATE_MARKERS = (
    ("hermes", "<tool_call>"),
    ("mistral", "[TOOL_CALLS]"),
    ("openai", "<|channel|>"),
    ("llama3_json", "<|python_tag|>"),
)
_HARMONY_CALL = re.compile(
    r"to=functions\.([\w.\-]+)[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)(?:<\|call\|>|$)",
    re.S,
)
_HARMONY_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parser_for_template(template: str | None) -> str | None:
    """The parser whose marker the chat template holds, or None."""
    for name, marker in _TEMPLATE_MARKERS:
        if template and marker in template:
            return name
    return None


def check_parser(name: str | None) -> str | None:
    if name is not None and name not in PARSER_NAMES:
        raise ValueError(f"tool call parser {name!r} is not one of {', '.join(PARSER_NAMES)}")
    return name


def start_marker(parser: str) -> str:
    """Text that starts the calls in `parser`'s format: a stream holds its text back from there."""
    markers = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{", "pythonic": "["}
    return markers.get(parser, " to=functions.")


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """The content before the calls (None when there is none) and the calls `text` holds in `parser`'s format;
    text that does not parse as calls is all content, with no calls."""
    try:
        calls, start = _PARSERS[parser](text)
    except (ValueError, SyntaxError, TypeError, KeyError, AttributeError):
        return text, []
    if not calls:
        return text, []
    if parser == "openai":  # the content is the final channel's text, wherever it is
        final = _HARMONY_FINAL.search(text)
        return (final.group(1).strip() or None) if final else None, calls
    content = text[:start].strip()
    return content or None, calls


def _hermes(text: str) -> tuple[list[ToolCall], int]:
    start = text.find("<tool_call>")
    if start < 0:
        return [], 0
    bodies = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], flags=re.S)
    return [_call(json.loads(body)) for body in bodies if body.strip()], start


def _mistral(text: str) -> tuple[list[ToolCall], int]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return [], 0
    rest = text[start + len("[TOOL_CALLS]") :].strip()
    if rest.startswith("["):
        return [_call(item) for item in json.loads(rest)], start
    calls = []  # v11 and later: name[ARGS]{...} per call, each after its own [TOOL_CALLS]
    for piece in rest.split("[TOOL_CALLS]"):
        name, _, arguments = piece.partition("[ARGS]")
        calls.append(ToolCall(name.strip(), json.dumps(json.loads(arguments))))
    return calls, start


def _llama3_json(text: str) -> tuple[list[ToolCall], int]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return [], 0
    return [_call(json.loads(piece)) for piece in _split_json_objects(body)], 0


def _pythonic(text: str) -> tuple[list[ToolCall], int]:
    match = re.search(r"(?:```tool_code\s*)?(\[[\s\S]*\])\s*(?:```)?\s*$", text)
    if match is None:
        return [], 0
    tree = ast.parse(match.group(1).strip(), mode="eval").body
    if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
        return [], 0
    calls = []
    for call in tree.elts:
        if not isinstance(call.func, ast.Name) or call.args:
            raise ValueError("a pythonic tool call takes keyword arguments only")
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
        calls.append(ToolCall(call.func.id, json.dumps(arguments)))
    return calls, match.start()


def _harmony(text: str) -> tuple[list[ToolCall], int]:
    calls = [ToolCall(name, json.dumps(json.loads(body))) for name, body in _HARMONY_CALL.findall(text)]
    return calls, 0


def _call(item: Any) -> ToolCall:
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    return ToolCall(str(item["name"]), json.dumps(arguments))


def _split_json_objects(text: str) -> list[str]:
    decoder, pieces, index = json.JSONDecoder(), [], 0
    while index < len(text):
        _, end = decoder.raw_decode(text, index)
        pieces.append(text[index:end])
        index = end
        while index < len(text) and text[index] in " \n\t;":
            index += 1
    return pieces


_PARSERS = {
    "hermes": _hermes,
    "mistral": _mistral,
    "llama3_json": _llama3_json,
    "pythonic": _pythonic,
    "openai": _harmony,
}


# ---- tool_choice ---------------------------------------------------------------------------------------


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """OpenAI's tools by name: each `{"type": "function", "function": {"name", "parameters"?, ...}}`."""
    by_name = {}
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f'tools[{index}] must be {{"type": "function", "function": {{"name": ...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{index}].function needs a name")
        if name in by_name:
            raise ValueError(f"tools[{index}]: a second function named {name!r}")
        by_name[name] = function
    return by_name


def forced_schema(tools: dict[str, dict[str, Any]], choice: str | dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """For `tool_choice="required"` or a named function: the JSON schema the output is held to, and the
    named function (None for required, whose output is a list of calls)."""
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": _parameters(function)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, function in tools.items()
        ]
        return {"type": "array", "minItems": 1, "items": {"anyOf": items}}, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name not in tools:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools ({', '.join(tools) or 'none'})")
    return _parameters(tools[name]), name


def forced_calls(text: str, named: str | None) -> list[ToolCall]:
    """The calls of an output held to `forced_schema`'s schema, each with its arguments as the model wrote them (what a
    stream sends, piece by piece); an output cut short (max_tokens) gives its calls as far as they go: a named
    function's arguments so far, a list's calls whose name was written, their arguments so far."""
    if named is not None:  # the output is the arguments
        return [ToolCall(named, text.strip())]
    return [ToolCall(name, arguments) for name, arguments, _ in required_calls_so_far(text)]


def required_calls_so_far(text: str) -> list[tuple[str, str, bool]]:
    """(name, arguments text, complete) of each call in the text so far of an output held to tool_choice "required"'s
    schema: `[{"name": "f", "parameters": {...}}, ...]`, its properties in the schema's order (the grammar writes them
    so). A call is listed once its name is written; its arguments are the `parameters` value's text up to the end of
    `text`, complete once the value closes. A stream sends each call's name once and its arguments' new text."""
    calls: list[tuple[str, str, bool]] = []
    depth, in_string, escaped = 0, False, False
    key: str | None = None  # the last key read in a call's object (depth 2)
    named = False  # the current call's object has its name (its arguments are that call's)
    string_start = value_start = -1
    for index, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 2:
                    string = json.loads(text[string_start : index + 1])
                    if key is None:
                        key = string
                    elif key == "name":
                        calls.append((string, "", False))
                        key, named = None, True
            continue
        if char == '"':
            in_string, string_start = True, index
        elif char in "{[":
            depth += 1
            if depth == 2:
                key, named = None, False
            elif depth == 3 and key == "parameters" and named:
                value_start = index
        elif char in "}]":
            depth -= 1
            if depth == 2 and value_start >= 0:
                calls[-1] = (calls[-1][0], text[value_start : index + 1], True)
                key, value_start = None, -1
        elif char == "," and depth == 2:
            key = None
    if value_start >= 0:  # the last call's arguments, cut or still coming
        calls[-1] = (calls[-1][0], text[value_start:], False)
    return calls


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}
