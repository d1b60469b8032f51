"""Chat templates render in Hugging Face's Jinja environment: raise_exception,
strftime_now, loop controls, HF's tojson and {% generation %}, so Llama-3-style templates
(written here; nothing is fetched) render as transformers renders them."""
import datetime
import json

import pytest

from research.model.tokenizer import Tokenizer, chat_template_env
from tests.model.gguf_writer import byte_vocab

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]

# In the manner of Llama 3.2's template: date from strftime_now, tools as tojson(indent=4),
# raise_exception for a conversation it cannot lay out, content | trim.
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Mistral-style role alternation check, plus {% continue %} / {% break %} and
# {% generation %} (HF's assistant-mask block).
ALTERNATING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if message['role'] == 'stop' %}{% break %}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 1) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}[A]{{ message['content'] }}"
    "{% endgeneration %}{% else %}[U]{{ message['content'] }}{% endif %}"
    "{% endfor %}")


def _tokenizer(template: str) -> Tokenizer:
    tokens, merges, types = byte_vocab()
    tokens, types = tokens + LLAMA3_SPECIALS, types + [3] * len(LLAMA3_SPECIALS)
    return Tokenizer(tokens, merges, types, pre="default", bos_id=tokens.index(
        "<|begin_of_text|>"), eos_id=tokens.index("<|eot_id|>"), chat_template=template)


def test_llama3_template_renders_as_transformers_does():
    tok = _tokenizer(LLAMA3_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief. "},
                {"role": "user", "content": "  Hi there\n"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "the thin tin"}]
    text = tok.apply_chat_template(messages, date_string="04 Dec 2026")
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 04 Dec 2026\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nthe thin tin<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode(text)
    assert ids[:2] == [tok.token_to_id("<|begin_of_text|>"),
                       tok.token_to_id("<|start_header_id|>")]
    assert tok.decode(ids) == text


def test_strftime_now_is_todays_date():
    tok = _tokenizer(LLAMA3_TEMPLATE)
    before = datetime.datetime.now().strftime("%d %b %Y")
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    after = datetime.datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {before}\n" in text or f"Today Date: {after}\n" in text


def test_tools_render_with_hf_tojson():
    tok = _tokenizer(LLAMA3_TEMPLATE)
    tool = {"name": "get_weather", "description": "Weather in <city> & café",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    text = tok.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}],
                                   tools=[tool], date_string="1 Jan 2026")
    assert "Environment: ipython\n" in text
    # json.dumps(indent=4, ensure_ascii=False): no HTML escaping of <, > or &, no \u00e9
    assert (json.dumps(tool, indent=4, ensure_ascii=False) + "\n\nWeather in Paris?<|eot_id|>"
            in text)
    with pytest.raises(ValueError, match="chat template: Cannot put tools in the first user"):
        tok.apply_chat_template([{"role": "system", "content": "s"}], tools=[tool])


def test_tojson_takes_hf_keywords():
    env = chat_template_env()
    out = env.from_string("{{ x | tojson(separators=(',', ':'), sort_keys=true) }}").render(
        x={"b": 1, "a": "<é>"})
    assert out == '{"a":"<é>","b":1}'
    assert env.from_string("{{ x | tojson(ensure_ascii=true) }}").render(x="é") == '"\\u00e9"'


def test_loop_controls_generation_block_and_raise_exception():
    tok = _tokenizer(ALTERNATING_TEMPLATE)
    ok = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
          {"role": "assistant", "content": "b"}, {"role": "stop", "content": ""},
          {"role": "user", "content": "never"}]
    assert tok.apply_chat_template(ok) == "[U]a[A]b"
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="chat template: Conversation roles must alternate"):
        tok.apply_chat_template(bad)


def test_template_that_does_not_parse_is_a_value_error():
    tok = _tokenizer("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(ValueError, match="chat template does not parse"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])


def test_sandbox_still_refuses_unsafe_access():
    tok = _tokenizer("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])
