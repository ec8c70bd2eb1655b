"""Template analysis: the format of each family, learned by rendering its own template."""

from __future__ import annotations

import time

import pytest

from sluice.core.syntax import CallId, CallObject, JsonArgs, Lit, Name, ReasoningSyntax, TaggedArgs
from sluice.local.templates import ChatTemplate
from sluice.parsers.analysis import analyze
from sluice.parsers.families import format_for
from sluice.templates import bundled, names


def template(name: str) -> ChatTemplate:
    source = bundled(name)
    assert source is not None
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>", model_id=name)


def test_qwen3_coder_writes_parameters_in_markup() -> None:
    syntax = analyze(template("Qwen3-Coder").render_probe).tools
    assert syntax is not None
    assert syntax.call == (
        Lit("<tool_call>\n<function="),
        Name(),
        Lit(">\n"),
        TaggedArgs("<parameter=", ">\n", "", "\n</parameter>\n"),
        Lit("</function>\n</tool_call>"),
    )
    assert syntax.section_start == "" and syntax.separator == "\n"


def test_hermes_writes_a_json_object_in_tags() -> None:
    syntax = analyze(template("NousResearch-Hermes-3-Llama-3.1-8B-tool_use").render_probe).tools
    assert syntax is not None
    assert syntax.call == (
        Lit("<tool_call>\n"),
        CallObject(args_keys=("arguments",)),
        Lit("\n</tool_call>"),
    )


def test_sections_separators_and_ids() -> None:
    deepseek = analyze(template("deepseek-ai-DeepSeek-V3.1").render_probe).tools
    assert deepseek is not None
    assert deepseek.section_start == "<｜tool▁calls▁begin｜>"
    assert deepseek.section_end == "<｜tool▁calls▁end｜>"
    assert deepseek.call == (
        Lit("<｜tool▁call▁begin｜>"),
        Name(),
        Lit("<｜tool▁sep｜>"),
        JsonArgs(),
        Lit("<｜tool▁call▁end｜>"),
    )
    mistral = analyze(template("Mistral-Small-3.2-24B-Instruct-2506").render_probe).tools
    assert mistral is not None
    assert mistral.call == (
        Lit("[TOOL_CALLS]"),
        Name(),
        Lit("[CALL_ID]"),
        CallId(),
        Lit("[ARGS]"),
        JsonArgs(),
    )
    nemo = analyze(template("mistralai-Mistral-Nemo-Instruct-2407").render_probe).tools
    assert nemo is not None
    assert (nemo.section_start, nemo.separator, nemo.section_end) == ("[TOOL_CALLS][", ", ", "]")
    assert nemo.call == (CallObject(args_keys=("arguments",), id_key="id"),)


@pytest.mark.parametrize(
    "name,markers",
    [
        ("Qwen-Qwen3-0.6B", ("<think>", "</think>")),
        ("ByteDance-Seed-OSS", ("<seed:think>", "</seed:think>")),
        ("GLM-4.7-Flash", ("<think>", "</think>")),
        ("Cohere2MoE", ("<|START_THINKING|>", "<|END_THINKING|>")),
        # the generation prompt writes the reasoning's first words itself
        (
            "Apriel-1.6-15b-Thinker-fixed",
            ("", "[BEGIN FINAL RESPONSE]", "Here are my reasoning steps:\n"),
        ),
        ("Qwen-Qwen2.5-7B-Instruct", None),
    ],
)
def test_reasoning_markers(name: str, markers: tuple[str, ...] | None) -> None:
    found = analyze(template(name).render_probe).reasoning
    assert found == (ReasoningSyntax(*markers) if markers else None)


def test_a_template_without_tools_gets_the_generic_format() -> None:
    t = template("google-gemma-2-2b-it")
    assert format_for(t.source, t.render_probe).name == "generic"
    llama = template("meta-llama-Llama-3.1-8B-Instruct")
    assert format_for(llama.source, llama.render_probe).name == "llama3"
    qwen = template("Qwen3-Coder")
    assert format_for(qwen.source, qwen.render_probe, "hermes").name == "hermes"


def test_analysis_takes_well_under_50_ms_a_template() -> None:
    slowest = 0.0
    for name in names():
        t = template(name)
        started = time.perf_counter()
        format_for(t.source, t.render_probe)
        slowest = max(slowest, time.perf_counter() - started)
    assert slowest < 0.2  # a shared, loaded machine: the budget is 50 ms, typical is < 15


def test_a_template_that_renders_arguments_as_given_gets_json_text() -> None:
    from sluice.core.request import GenerationRequest
    from sluice.local.plan import OutputPlan

    t = template("meetkai-functionary-medium-v3.2")
    fmt = format_for(t.source, t.render_probe)
    assert fmt.tools is not None and fmt.tools.arguments_text and fmt.opening == ">>>"
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": {"a": 1}}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    plan = OutputPlan.build(GenerationRequest(messages=messages), fmt=fmt)
    prompt = t.render(plan.prepare_messages(messages))
    assert '>>>get\n{"a": 1}' in prompt and prompt.endswith(">>>")


def test_a_template_that_names_only_think_still_splits_reasoning() -> None:
    source = "{% for m in messages %}{{ m['content'] }}{% endfor %}{# <think> #}"
    t = ChatTemplate(source, bos_token="", eos_token="", model_id="x")
    assert format_for(source, t.render_probe).reasoning == ReasoningSyntax("<think>", "</think>")


def test_gpt_oss_sees_earlier_reasoning_as_thinking() -> None:
    from sluice.core.request import GenerationRequest
    from sluice.local.plan import OutputPlan

    t = template("openai-gpt-oss-120b")
    fmt = format_for(t.source, t.render_probe)
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Look it up.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    plan = OutputPlan.build(GenerationRequest(messages=messages), fmt=fmt)
    prompt = t.render(plan.prepare_messages(messages))
    assert "<|channel|>analysis<|message|>Look it up.<|end|>" in prompt
    both = [messages[0], {**messages[1], "content": "Let me see."}, messages[2]]
    prompt = t.render(plan.prepare_messages(both))  # one or the other, as it asks: no error
    assert "Look it up." not in prompt
