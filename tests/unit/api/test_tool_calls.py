"""Tool-call parsing (the formats Llama 3.x, Hermes/Qwen, DeepSeek and GPT-OSS write), tool_choice
checks, and streaming: deltas fed in any split must reassemble to what the whole text parses to."""

import json

import jsonschema
import pytest

from meshserve.api.tools.choice import ToolMode, ToolRequest
from meshserve.api.tools.parsers import PARSERS, detect_parser, parser_named
from meshserve.api.tools.streaming import ToolStream, split_output
from meshserve.errors import ConfigError

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}

CASES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
               "Let me check."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', None),
    "deepseek_v3": ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Checking."),
    "openai": ("<|channel|>analysis<|message|>Need weather and time.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|><|start|>assistant'
               '<|channel|>commentary to=functions.get_time<|message|>{"zone": "CET"}<|call|>', None),
}
WANT = [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("name", sorted(CASES))
def test_parsers_split_content_and_calls(name):
    text, content = CASES[name]
    got_content, calls = PARSERS[name].parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == WANT
    assert (got_content or None) == content


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_text_is_content_for_every_parser(name):
    assert PARSERS[name].parse("The for statement repeats {a block}.") == ("The for statement repeats {a block}.", [])


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_auto_calls_reassemble_to_the_parsed_whole(name, step):
    text, content = CASES[name]
    tools = ToolRequest.of([WEATHER, TIME], "auto")
    stream = ToolStream(tools, PARSERS[name])
    parts = [p for i in range(0, len(text), step) for p in stream.feed(text[i:i + step])] + stream.finish()
    streamed_content = "".join(p.get("content", "") for p in parts)
    calls = [c for p in parts for c in p.get("tool_calls", ())]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == WANT
    assert [c["index"] for c in calls] == [0, 1] and all(c["id"].startswith("call_") for c in calls)
    assert streamed_content.strip() == (content or "")
    assert stream.called


def test_named_calls_stream_their_arguments_as_they_come():
    tools = ToolRequest.of([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    stream = ToolStream(tools, None)
    text = '{"city": "Oslo"}'
    parts = [p for ch in text for p in stream.feed(ch)] + stream.finish()
    assert parts[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(p["tool_calls"][0]["function"]["arguments"] for p in parts[1:])
    assert args == text and len(parts) == len(text) + 1
    assert split_output(tools, None, text)[1][0].arguments == '{"city": "Oslo"}'


def test_required_and_named_grammars_accept_only_valid_calls():
    required = ToolRequest.of([WEATHER, TIME], "required", parallel=False)
    schema = json.loads(required.grammar().source)
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    for bad in ([], [{"name": "get_time", "parameters": {"zone": "PST"}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time", "parameters": {"zone": "UTC"}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = ToolRequest.of([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert json.loads(named.grammar().source) == TIME["function"]["parameters"]
    assert ToolRequest.of([WEATHER], "auto").grammar() is None
    assert ToolRequest.of(None, None).mode is ToolMode.NONE and ToolRequest.of([WEATHER], None).mode is ToolMode.AUTO


@pytest.mark.parametrize("tools, choice, field", [
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice.function.name"),
    ([WEATHER, WEATHER], "auto", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}], "auto",
     "tools[0].function.parameters"),
    ([{"type": "retrieval"}], "auto", "tools[0]"),
])
def test_bad_tools_name_the_field(tools, choice, field):
    with pytest.raises(ConfigError) as err:
        ToolRequest.of(tools, choice)
    assert err.value.field == field


def test_parser_detection_and_names():
    assert detect_parser("{% for t in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert detect_parser("<|start_header_id|>ipython<|end_header_id|> {{ t.parameters }}").name == "llama3_json"
    assert detect_parser("{{'<｜tool▁calls▁begin｜>'}}").name == "deepseek_v3"
    assert detect_parser("<|start|>assistant<|channel|>final").name == "openai"
    assert detect_parser("{{ bos_token }}{{ message['content'] }}") is None
    with pytest.raises(ConfigError) as err:
        parser_named("mistral")
    assert err.value.field == "tool_call_parser" and "hermes" in str(err.value)


# Qwen 2.5's way of writing calls and tool results (trimmed): arguments through tojson.
TOOL_TEMPLATE = """{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}
<|im_start|>assistant
{%- for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{%- elif message.role == "tool" %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{%- else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
<|im_start|>assistant
"""


def test_tool_messages_render_as_transformers_renders_them(tmp_path):
    import transformers

    from meshserve.api.http.chat import ChatTemplate
    from meshserve.api.http.protocol import ChatMessage
    from tests.unit.api.test_chat_template import _checkpoint

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    openai_messages = [{"role": "user", "content": "Weather in Oslo?"},
                       {"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}]
    folder = _checkpoint(tmp_path, "qwen_tools", TOOL_TEMPLATE)
    hf_messages = json.loads(json.dumps(openai_messages))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}  # transformers takes objects
    want = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        hf_messages, tools=[WEATHER], tokenize=False)
    got = ChatTemplate.load(folder).render([ChatMessage(**m).for_template() for m in openai_messages],
                                           tools=[WEATHER], add_generation_prompt=False)
    assert got == want and '"arguments": {"city": "Oslo"}' in got and "<tool_response>\n12 C, rain" in got
