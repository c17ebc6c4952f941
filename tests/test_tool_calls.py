"""Tool-call parsing (one parser per output format) and the schemas that force a call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from hybridkv.serving import tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def calls(parser, text):
    content, parsed = tool_calls.parse(parser, text)
    return content, [(call.name, json.loads(call.arguments)) for call in parsed]


def test_each_format_parses_its_calls_and_keeps_the_content_before_them():
    hermes = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    hermes += '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert calls("hermes", hermes) == ("Let me look.", [("get_weather", {"city": "Oslo"}), ("get_time", {})])
    mistral = 'Sure[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}}]'
    assert calls("mistral", mistral) == ("Sure", [("get_weather", {"city": "Lima"})])
    mistral_v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}'
    assert calls("mistral", mistral_v11) == (None, [("get_weather", {"city": "Rome"}), ("get_time", {})])
    llama = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pune"}}; {"name": "get_time", "parameters": {}}'
    )
    assert calls("llama3_json", llama) == (None, [("get_weather", {"city": "Pune"}), ("get_time", {})])
    pythonic = '```tool_code\n[get_weather(city="Kyiv"), get_time()]\n```'
    assert calls("pythonic", pythonic) == (None, [("get_weather", {"city": "Kyiv"}), ("get_time", {})])
    harmony = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
    )
    assert calls("openai", harmony) == (None, [("get_weather", {"city": "Oslo"})])
    recipient_first = "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
    assert calls("openai", recipient_first) == (None, [("get_time", {})])


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", "no call here"),
        ("hermes", "<tool_call>{not json</tool_call>"),
        ("mistral", "[TOOL_CALLS][{broken"),
        ("llama3_json", "The answer is {42}"),
        ("pythonic", "[1, 2, 3]"),
        ("pythonic", "[get_weather('Oslo')]"),
        ("openai", "<|channel|>final<|message|>It is sunny.<|return|>"),
    ],
)
def test_text_that_is_not_calls_is_content(parser, text):
    assert tool_calls.parse(parser, text) == (text, [])


def test_the_parser_is_found_in_the_template_or_named():
    assert tool_calls.parser_for_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_calls.parser_for_template("[TOOL_CALLS] {{ x }}") == "mistral"
    assert tool_calls.parser_for_template("<|start|>assistant<|channel|>final") == "openai"
    assert tool_calls.parser_for_template("{{ messages }}") is None
    with pytest.raises(ValueError, match="is not one of"):
        tool_calls.check_parser("json")


def test_required_calls_so_far_name_each_call_once_and_grow_its_arguments():
    text = '[{"name": "get_weather", "parameters": {"city": "O\\"slo", "days": [1, 2]}}, '
    text += '{"name": "get_time", "parameters": {}}]'
    seen = []
    for end in range(len(text) + 1):
        calls = tool_calls.required_calls_so_far(text[:end])
        assert [name for name, _, _ in calls] == ["get_weather", "get_time"][: len(calls)]
        for index, (_, arguments, complete) in enumerate(calls):  # each call's arguments only grow
            if index < len(seen):
                assert arguments.startswith(seen[index][0]) and (complete or not seen[index][1])
        seen = [(arguments, complete) for _, arguments, complete in calls]
    assert seen == [('{"city": "O\\"slo", "days": [1, 2]}', True), ("{}", True)]
    assert json.loads(seen[0][0]) == {"city": 'O"slo', "days": [1, 2]}


def test_required_and_named_choices_force_valid_calls():
    tools = tool_calls.check_tools([WEATHER, TIME])
    schema, named = tool_calls.forced_schema(tools, "required")
    assert named is None
    output = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(output, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)  # city is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    parsed = tool_calls.forced_calls(json.dumps(output), None)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    schema, named = tool_calls.forced_schema(tools, {"type": "function", "function": {"name": "get_weather"}})
    assert (named, schema) == ("get_weather", WEATHER["function"]["parameters"])
    assert tool_calls.forced_calls('{"city": "Oslo"}', named)[0].arguments == '{"city": "Oslo"}'
    # Cut short by max_tokens: the call as far as it went (issue 63: never the raw JSON as content).
    assert [(c.name, c.arguments) for c in tool_calls.forced_calls('{"city": "Os', named)] == [
        ("get_weather", '{"city": "Os')
    ]
    cut = json.dumps(output)[:-3]  # get_time's arguments begun: "{"
    assert [(c.name, c.arguments) for c in tool_calls.forced_calls(cut, None)] == [
        ("get_weather", '{"city": "Oslo"}'),
        ("get_time", "{"),
    ]
    with pytest.raises(ValueError, match="not in tools"):
        tool_calls.forced_schema(tools, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="a second function"):
        tool_calls.check_tools([WEATHER, WEATHER])
    with pytest.raises(ValueError, match="needs a name"):
        tool_calls.check_tools([{"type": "function", "function": {}}])
