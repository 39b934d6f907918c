"""Structured outputs and tool calls over the OpenAI-compatible API, through the official `openai`
package and langchain-openai, against the demo model (one in-process server for the module).

The oracles are independent of the grammar engine: `jsonschema` validates JSON outputs against
their schemas, Python's `re` matches regex outputs, the tool's own schema validates the
arguments of tool calls, and a streamed call must reassemble to the call the same greedy
request returns whole. The demo model knows nothing of JSON: whatever it emits parses only
because the grammar allows nothing else.
"""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest
import torch
import transformers

from meshserve.api.client import InferenceClient
from meshserve.api.http.chat import ChatTemplate
from meshserve.api.http.server import HttpServer
from meshserve.core.checkpoint_files import load_tokenizer
from meshserve.core.structured_outputs import StructuredOutputs
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.workers.grammar import GrammarCompiler
from tests.integration.api_harness import SPLIT, ServerLoop, demo_service, rpc_error

pytestmark = pytest.mark.timeout(240)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 2,
              "items": {"type": "object", "properties": {"sku": {"enum": ["a1", "b2", "c3"]},
                                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                        "required": ["sku", "qty"], "additionalProperties": False}},
    "express": {"type": "boolean"}}, "required": ["items", "express"], "additionalProperties": False}
STATUS = {"type": "object", "properties": {"status": {"enum": ["ok", "failed"]},
                                           "code": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                                              {"type": "null"}]}},
          "required": ["status", "code"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "The for statement is used to"}]


@pytest.fixture(scope="module")
def server():
    service = demo_service(max_model_len=512, num_kv_blocks=128)
    loop = ServerLoop()
    loop.run(service.start())
    http = HttpServer(loop.front(service), port=0, chat_template=ChatTemplate.load(DEMO_MODEL_DIR))
    loop.run(http.start())
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="none", max_retries=0, timeout=120)
    grpc_client = InferenceClient(loop.serve(service).address)
    # The same service behind a server that parses Hermes-style calls (tool_choice auto)
    hermes = HttpServer(loop.front(service), port=0,
                        chat_template=ChatTemplate.load(DEMO_MODEL_DIR, tool_call_parser="hermes"))
    loop.run(hermes.start())
    hermes_client = openai.OpenAI(base_url=f"{hermes.url}/v1", api_key="none", max_retries=0, timeout=120)
    yield {"client": client, "url": http.url, "grpc": grpc_client, "hermes": hermes_client}
    grpc_client.close()
    loop.run(hermes.stop(grace=0))
    loop.run(http.stop(grace=0))
    loop.close(service)


def _schema_format(schema: dict, name: str = "out") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [PERSON, ORDER, STATUS], ids=["person", "order", "status"])
def test_json_schema_outputs_validate_greedy_and_sampled(server, schema):
    client = server["client"]
    greedy = client.chat.completions.create(model="", messages=MESSAGES, temperature=0, max_tokens=80,
                                            response_format=_schema_format(schema))
    sampled = client.chat.completions.create(model="", messages=MESSAGES, temperature=1.0, seed=7, n=2,
                                             max_tokens=80, response_format=_schema_format(schema))
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_completions_take_structured_outputs_and_guided_fields(server):
    client = server["client"]
    out = client.completions.create(model="", prompt="Python supports", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.choices[0].text), out.choices[0].text
    choices = ["alpha", "beta gamma", "delta"]
    out = client.completions.create(model="", prompt="Python supports", max_tokens=10, temperature=1.0, n=3,
                                    extra_body={"guided_choice": choices})
    assert all(c.text in choices for c in out.choices), [c.text for c in out.choices]
    stream = client.completions.create(model="", prompt="An exception", max_tokens=60, temperature=0, stream=True,
                                       extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream if c.choices)), PERSON)
    out = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_json": PERSON}, "guided"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
])
def test_invalid_constraints_are_400_naming_the_field(server, body, field):
    client = server["client"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="", messages=MESSAGES, max_tokens=5, extra_body=body)
    assert exc.value.body["message"].startswith(field), exc.value.body


@pytest.mark.skipif(SPLIT, reason="the fault is injected into the compile of an engine in this process")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_grammar_the_engine_fails_to_compile_is_400_and_the_server_serves_on(server, monkeypatch, stream):
    """The front-end's tokenizer-free check passes; the driver rank's compile raises (fault
    injection): that request alone is refused before anything streamed, naming the field."""
    broken = StructuredOutputs.regex("(maybe|perhaps)")
    real = GrammarCompiler._compile

    def failing_compile_fault(self, spec):
        if spec == broken:
            raise RuntimeError("fault injection: no compile")
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", failing_compile_fault)
    client = server["client"]
    with pytest.raises(openai.BadRequestError) as exc:
        out = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=5, stream=stream,
                                             extra_body={"structured_outputs": {"regex": broken.source}})
        if stream:
            list(out)
    message = exc.value.body["message"]
    assert message.startswith("structured_outputs") and "response_format" in message, message
    assert "fault injection: no compile" in message
    out = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=5, temperature=0,
                                         extra_body={"structured_outputs": {"regex": "(yes|no)"}})
    assert out.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls_parse_to_valid_arguments(server, tool_choice):
    client = server["client"]
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for temperature in (0, 1.0):
        out = client.chat.completions.create(model="", messages=MESSAGES, tools=list(tools.values()),
                                             tool_choice=tool_choice, temperature=temperature, seed=3, max_tokens=80,
                                             parallel_tool_calls=False)  # (the demo model would go on listing calls)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id
            schema = tools[call.function.name]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(server, tool_choice):
    client = server["client"]
    kw = dict(model="", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0,
              max_tokens=80, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or part.id
            call["name"] += part.function.name or "" if part.function else ""
            call["arguments"] += part.function.arguments or "" if part.function else ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert all(c["id"] for c in calls.values())


def test_auto_tool_calls_are_parsed_from_the_models_text_whole_and_streamed(server):
    """The demo model writes no tool calls of itself: a regex makes it write a Hermes call after
    some text, which the server's parser must split into content and a call."""
    client = server["hermes"]
    regex = r'Checking\.<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    kw = dict(model="", messages=MESSAGES, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
              extra_body={"structured_outputs": {"regex": regex}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    content, calls = "", {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            calls.setdefault(part.index, []).append(part)
    assert content == "Checking." and len(calls) == 1
    got = [(p.function.name, p.function.arguments) for p in calls[0]]
    assert got == [(call.function.name, call.function.arguments)]
    plain = client.chat.completions.create(model="", messages=MESSAGES, tools=[WEATHER], max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_langchain_structured_output_and_bind_tools(server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=150)

    llm = ChatOpenAI(base_url=f"{server['url']}/v1", api_key="none", model="meshserve-demo", temperature=0,
                     max_tokens=60, max_retries=0)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("The for statement is used to")
        assert isinstance(person, Person), (method, person)
    # (any object: the demo model closes the one it starts after about 130 tokens)
    longer = ChatOpenAI(base_url=f"{server['url']}/v1", api_key="none", model="meshserve-demo", temperature=0,
                        max_tokens=300, max_retries=0)
    anything = longer.with_structured_output(None, method="json_mode").invoke(
        "Answer in JSON: the for statement")
    assert isinstance(anything, dict)
    bound = llm.bind_tools([WEATHER, TIME], tool_choice="get_time")
    message = bound.invoke("What time is it?")
    assert [c["name"] for c in message.tool_calls] == ["get_time"]
    jsonschema.validate(message.tool_calls[0]["args"], TIME["function"]["parameters"])


def test_grpc_takes_structured_outputs_and_the_new_sampling_fields(server):
    client = server["grpc"]
    out = client.generate("An exception", max_tokens=60, temperature=0,
                          structured_outputs={"json": json.dumps(STATUS)})
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), STATUS)
    out = client.generate("An exception", max_tokens=10, temperature=0, structured_outputs={"choice": {
        "choices": ["red", "green"]}}, min_tokens=0, logit_bias={5: 1.0}, bad_words=["blue"])
    assert out.text in ("red", "green")
    long_prompt = "The for statement is used to " * 8
    first = client.generate(long_prompt, max_tokens=2, temperature=0, truncate_prompt_tokens=5)
    assert first.usage.prompt_tokens == 5
    client.generate(long_prompt, max_tokens=2, temperature=0)
    again = client.generate(long_prompt, max_tokens=2, temperature=0)
    # the same prompt again: its full blocks come from the prefix cache
    assert again.usage.prompt_tokens == 50 and again.usage.cached_tokens >= 32
    exc = rpc_error(lambda: client.generate("x", max_tokens=2, structured_outputs={"regex": "(a"}))
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.details().startswith("structured_outputs.regex=")


def test_http_sampling_fields_usage_and_stop_on_the_last_token(server):
    client = server["client"]
    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    allowed = tokenizer.encode(" loop body", add_special_tokens=False).ids
    out = client.completions.create(model="", prompt="Python supports", max_tokens=6, temperature=1.0, seed=1,
                                    logprobs=0, extra_body={"allowed_token_ids": allowed,
                                                            "logit_bias": {str(allowed[0]): 100}})
    assert out.choices[0].logprobs.tokens == [tokenizer.decode([allowed[0]])] * 6  # +100 wins every draw
    out = client.completions.create(model="", prompt="The for statement is used to " * 4, max_tokens=2,
                                    extra_body={"truncate_prompt_tokens": 3})
    assert out.usage.prompt_tokens == 3 and out.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(model="", prompt="An exception is raised when", max_tokens=5, stream=True,
                                       temperature=0, stream_options={"include_usage": True,
                                                                      "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in stream]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 5
    # A stop string completed by the last token max_tokens allows: "stop", with the stop string as the reason.
    whole = client.completions.create(model="", prompt="An exception is raised when", max_tokens=6, temperature=0,
                                      logprobs=0).choices[0]
    last = whole.logprobs.tokens[-1]
    assert last.strip() and whole.text.find(last) == len(whole.text) - len(last)
    cut = client.completions.create(model="", prompt="An exception is raised when", max_tokens=6, temperature=0,
                                    stop=[last]).choices[0]
    assert (cut.finish_reason, cut.model_extra["stop_reason"], cut.text) == ("stop", last, whole.text[:-len(last)])


def test_prompt_logprobs_over_http_and_grpc(server):
    """The engine's values (tested against HF in tests/unit/engine/test_prompt_logprobs.py) in vLLM's
    shape over HTTP and as TokenLogprobs over gRPC; the same prompt gives the same numbers."""
    prompt = "Python supports many kinds of"
    out = server["client"].completions.create(model="", prompt=prompt, max_tokens=1, temperature=0,
                                              extra_body={"prompt_logprobs": 2})
    plps = out.choices[0].model_extra["prompt_logprobs"]
    ids = load_tokenizer(DEMO_MODEL_DIR).encode(prompt).ids
    assert len(plps) == len(ids) == out.usage.prompt_tokens and plps[0] is None
    for token, entry in zip(ids[1:], plps[1:]):
        assert str(token) in entry and sorted(v["rank"] for v in entry.values() if "rank" in v) == [1, 2]
    streamed = server["client"].completions.create(model="", prompt=prompt, max_tokens=1, temperature=0, stream=True,
                                                   extra_body={"prompt_logprobs": 2})
    first = next(c for c in streamed if c.choices)
    assert first.choices[0].model_extra["prompt_logprobs"] == plps
    got = server["grpc"].generate(prompt, max_tokens=1, temperature=0, prompt_logprobs=2).prompt_logprobs
    assert [lp.token_id for lp in got] == ids[1:]
    for lp, entry in zip(got, plps[1:]):
        assert abs(lp.logprob - entry[str(lp.token_id)]["logprob"]) < 1e-5
        assert [t.token_id for t in lp.top] == [int(k) for k, v in entry.items() if "rank" in v]


def test_prompt_logprobs_once_per_request_with_several_samples(server):
    """n / best_of > 1 (vLLM's behaviour): the prompt's logprobs, computed once, equal HF's log-softmax
    in float64; completions repeat them in every choice (streamed: each choice's first chunk), chat
    has them once at the top, gRPC once in the stream."""
    prompt = "Python supports many kinds of"
    ids = load_tokenizer(DEMO_MODEL_DIR).encode(prompt).ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float64).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)  # [L, V]

    def assert_equal_hf(entries):  # vLLM's shape: None, then {"<id>": {"logprob", "rank"?, "decoded_token"}}
        assert len(entries) == len(ids) and entries[0] is None
        for i, entry in enumerate(entries[1:], start=1):
            assert abs(entry[str(ids[i])]["logprob"] - want[i - 1, ids[i]].item()) < 1e-3
            ranked = sorted((v["rank"], int(k)) for k, v in entry.items() if "rank" in v)
            assert [t for _, t in ranked] == torch.topk(want[i - 1], 2).indices.tolist()

    client = server["client"]
    for extra in ({"prompt_logprobs": 2}, {"prompt_logprobs": 2, "best_of": 3}):
        out = client.completions.create(model="", prompt=prompt, max_tokens=2, n=2, seed=3, extra_body=extra)
        assert len(out.choices) == 2
        first = out.choices[0].model_extra["prompt_logprobs"]
        assert_equal_hf(first)
        assert out.choices[1].model_extra["prompt_logprobs"] == first
    streamed = client.completions.create(model="", prompt=prompt, max_tokens=2, n=3, seed=3, stream=True,
                                         extra_body={"prompt_logprobs": 2})
    carrying = {}
    for chunk in streamed:
        for choice in chunk.choices:
            if choice.model_extra.get("prompt_logprobs") is not None:
                assert choice.index not in carrying  # once per choice
                carrying[choice.index] = choice.model_extra["prompt_logprobs"]
    assert sorted(carrying) == [0, 1, 2] and all(v == first for v in carrying.values())
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                          n=2, extra_body={"prompt_logprobs": 2})
    assert len(chat.choices) == 2 and chat.model_extra["prompt_logprobs"] == first  # (the demo template adds nothing)
    responses = list(server["grpc"].stream(prompt, max_tokens=2, n=2, seed=3, prompt_logprobs=2))
    carrying = [r for r in responses if r.prompt_logprobs]
    assert len(carrying) == 1 and [lp.token_id for lp in carrying[0].prompt_logprobs] == ids[1:]
    for i, lp in enumerate(carrying[0].prompt_logprobs, start=1):
        assert abs(lp.logprob - want[i - 1, ids[i]].item()) < 1e-3
    with pytest.raises(openai.BadRequestError) as info:  # beam search computes none: refused, not ignored
        client.completions.create(model="", prompt=prompt, max_tokens=2, n=2,
                                  extra_body={"use_beam_search": True, "prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs" and "use_beam_search" in info.value.body["message"]
