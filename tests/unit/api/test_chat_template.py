"""Chat templates render exactly as HF transformers' `apply_chat_template` renders them.

Three templates in the styles of real checkpoints (Llama-3: bos_token and trim; Qwen2.5:
multi-line with `{%- %}`, tools through `tojson` with non-ASCII text; Gemma: raise_exception
on a bad conversation, role renaming) are written into checkpoint folders beside the demo
model's tokenizer; transformers loads each folder and is the oracle for the text and for the
token ids (the rendered text's own special tokens, none added by the tokenizer).
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from tokenizers import Tokenizer

from meshserve.api.http.chat import ChatTemplate
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.errors import ConfigError

transformers = pytest.importorskip("transformers")

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

CHAT = [{"role": "user", "content": "  What does the for statement do?  "},
        {"role": "assistant", "content": "It iterates over the items of any sequence."},
        {"role": "user", "content": "And the with statement, naïvely? 日本語"}]
WITH_SYSTEM = [{"role": "system", "content": "You answer in one sentence."}, *CHAT]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look up a topic — ü",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def _checkpoint(tmp_path, name: str, template: str, *, as_file: bool = False):
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(DEMO_MODEL_DIR / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if as_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _ids(result) -> list[int]:
    return list(result["input_ids"] if hasattr(result, "keys") else result)


def _tokenize_with_specials():
    tokenizer = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))

    async def tokenize(text: str) -> list[int]:  # as the service tokenizes: the post-processor adds BOS
        return tokenizer.encode(text).ids

    return tokenize


@pytest.mark.parametrize("name,template,as_file,conversations", [
    ("llama3", LLAMA3, False, [CHAT, WITH_SYSTEM, CHAT[:1]]),
    ("qwen", QWEN, True, [CHAT, WITH_SYSTEM, CHAT[:1]]),
    ("gemma", GEMMA, False, [CHAT, CHAT[:1]]),
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(tmp_path, name, template, as_file, conversations, add_generation_prompt):
    folder = _checkpoint(tmp_path, name, template, as_file=as_file)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ours = ChatTemplate.load(folder)
    tokenize = _tokenize_with_specials()
    for messages in conversations:
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        got = ours.render(messages, add_generation_prompt=add_generation_prompt)
        assert got == want
        want_ids = _ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt))
        assert asyncio.run(ours.prompt_ids(got, tokenize)) == want_ids


def test_tools_render_through_tojson_as_transformers_does(tmp_path):
    folder = _checkpoint(tmp_path, "qwen", QWEN)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    want = hf.apply_chat_template(WITH_SYSTEM, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    got = ChatTemplate.load(folder).render(WITH_SYSTEM, tools=TOOLS, add_generation_prompt=True)
    assert got == want and "— ü" in got  # not escaped to \\u2014


def test_raise_exception_becomes_a_clear_config_error(tmp_path):
    template = ChatTemplate.load(_checkpoint(tmp_path, "gemma", GEMMA))
    with pytest.raises(ConfigError, match="System role not supported") as info:
        template.render(WITH_SYSTEM)
    assert info.value.field == "messages"
    with pytest.raises(ConfigError, match="roles must alternate"):
        template.render([CHAT[0], CHAT[0]])


def test_where_the_template_comes_from(tmp_path):
    none = _checkpoint(tmp_path, "plain", "")
    config = json.loads((none / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (none / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.load(none) is None  # a model without a template: the route answers 400
    override = tmp_path / "mine.jinja"
    override.write_text("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    got = ChatTemplate.load(none, override=override).render(CHAT[:1])
    assert got == "<|begin_of_text|>[user]   What does the for statement do?  \n"
    both = _checkpoint(tmp_path, "both", LLAMA3)  # the file wins over tokenizer_config.json's entry
    (both / "chat_template.jinja").write_text(GEMMA)
    assert ChatTemplate.load(both).source == GEMMA
    with pytest.raises(ConfigError, match="chat_template"):
        ChatTemplate.load(none, override=tmp_path / "missing.jinja")
    with pytest.raises(ConfigError, match="a valid Jinja2 template"):
        ChatTemplate.load(none, override=_write(tmp_path / "bad.jinja", "{% for m in messages %}"))


def test_the_sandbox_refuses_attribute_escapes(tmp_path):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    template = ChatTemplate.load(_checkpoint(tmp_path, "evil", evil))
    with pytest.raises(ConfigError):
        template.render(CHAT)


def test_the_demo_model_chats_out_of_the_box():
    template = ChatTemplate.load(DEMO_MODEL_DIR)
    hf = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    for messages in (CHAT, WITH_SYSTEM):
        assert template.render(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # one user message is its text: chat continues it as a completion of the same text would
    text = template.render([{"role": "user", "content": "Python supports"}])
    ids = asyncio.run(template.prompt_ids(text, _tokenize_with_specials()))
    assert ids == Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json")).encode("Python supports").ids


def _write(path, text):
    path.write_text(text)
    return path
