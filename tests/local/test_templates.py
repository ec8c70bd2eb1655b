"""Chat templates without a system role (Gemma's raise an exception on one): the
system text goes into the first user message, as llama.cpp does, instead of a 400."""

from __future__ import annotations

import pytest

from sluice.core.errors import TemplateError
from sluice.local.templates import ChatTemplate

# Gemma 2's template, as its GGUF carries it.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source, bos_token="<bos>", eos_token="<eos>", model_id="m")


def test_system_text_goes_into_the_first_user_message() -> None:
    gemma = template(GEMMA)
    assert not gemma.supports_system
    out = gemma.render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Weather?"},
        ]
    )
    assert out == (
        "<bos><start_of_turn>user\nBe brief.\n\nUse tools.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nWeather?<end_of_turn>\n<start_of_turn>model\n"
    )
    # Without a system message nothing changes; other refusals are still 400s.
    assert gemma.render([{"role": "user", "content": "Hi"}]).startswith(
        "<bos><start_of_turn>user\nHi"
    )
    with pytest.raises(TemplateError, match="must alternate"):
        gemma.render([{"role": "assistant", "content": "x"}])


def test_a_template_with_a_system_role_keeps_it() -> None:
    chatml = template(CHATML)
    assert chatml.supports_system
    out = chatml.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert out.startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU")


def test_features_of_the_families_templates() -> None:
    """What real templates use and plain Jinja2 lacks or refuses."""
    source = (
        "{% set ns = namespace(seen=[]) %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% do ns.seen.append(m.role) %}{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
        "{{ ns.seen | tojson }}|{{ messages | map(attribute='role') | tojson }}"
        "|{{ 'x' + undefined_thing }}|{{ enable_thinking }}"
        "|{{ {'b': 1, 'a': 2} | tojson(sort_keys=true, separators=(',', ':')) }}"
    )
    out = template(source).render(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "v"},
        ]
    )
    assert out == (
        '[u][a]["user", "assistant"]|["system", "user", "assistant", "user"]|x|True|{"a":2,"b":1}'
    )


def test_every_bundled_template_renders_a_conversation_with_tools() -> None:
    from sluice.templates import bundled, names

    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tools = [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": params}}
    ]
    call = {"id": "abcdef123", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "abcdef123", "content": "42"},
        {"role": "assistant", "content": "It is 42."},
        {"role": "user", "content": "Thanks"},
    ]
    failed = {}
    for name in names():
        t = template(bundled(name) or "")
        try:
            t.render(messages, extra={"tools": tools})
        except TemplateError as exc:
            failed[name] = str(exc)
    # functionary v3.2 concatenates the arguments as text (it wants them as a string);
    # Gemma 2 knows no tool role.
    assert set(failed) <= {"meetkai-functionary-medium-v3.2", "google-gemma-2-2b-it"}, failed


def test_a_requests_thinking_switch_reaches_templates_that_read_thinking() -> None:
    """Kimi K3 reads ``thinking`` (default on), not ``enable_thinking``: a request that
    turns thinking off opens the response block instead of the think block."""
    from sluice.templates import bundled

    k3 = ChatTemplate(bundled("Kimi-K3"), bos_token="", eos_token="", model_id="k3")
    hi = [{"role": "user", "content": "Hi"}]
    default = k3.render(hi)
    off = k3.render(hi, extra={"enable_thinking": False})
    assert default.endswith("<|open|>think<|sep|>"), default[-80:]
    assert off.endswith("<|open|>response<|sep|>"), off[-80:]
    # Granite 3.3 reads ``thinking`` too, default off: only a request turns it on.
    granite = ChatTemplate(
        bundled("ibm-granite-granite-3.3-2B-Instruct"), bos_token="", eos_token="", model_id="g"
    )
    assert "thoughts" not in granite.render(hi)
    assert "thoughts" in granite.render(hi, extra={"enable_thinking": True})
