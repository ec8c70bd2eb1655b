"""Required and named calls constrained in the family's own syntax."""

from __future__ import annotations

from sluice.core.syntax import CallId, CallObject, JsonArgs, Lit, Name, TaggedArgs, ToolSyntax
from sluice.grammar.native import syntax_grammar
from sluice.grammar.spec import ToolSpec
from tests.support.bytegrammar import matches

WEATHER = ToolSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
NOARGS = ToolSpec("now", {})
QWEN = ToolSyntax(
    call=(
        Lit("<tool_call>\n<function="),
        Name(),
        Lit(">\n"),
        TaggedArgs("<parameter=", ">\n", "", "\n</parameter>\n"),
        Lit("</function>\n</tool_call>"),
    ),
    separator="\n",
)


def test_markup_arguments_follow_the_schema() -> None:
    g = syntax_grammar([WEATHER, NOARGS], QWEN, max_calls=2)
    one = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan\nJosé\n</parameter>\n"
    assert matches(g, one + "</function>\n</tool_call>")
    with_days = one + "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    assert matches(g, with_days)
    assert matches(g, with_days + "\n<tool_call>\n<function=now>\n</function>\n</tool_call>")
    assert not matches(g, one.replace("city", "town") + "</function>\n</tool_call>")
    assert not matches(g, one + "<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>")
    assert not matches(g, "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>")
    assert not matches(g, "<tool_call>\n<function=other>\n</function>\n</tool_call>")


def test_one_call_only() -> None:
    g = syntax_grammar([NOARGS], QWEN, max_calls=1)
    call = "<tool_call>\n<function=now>\n</function>\n</tool_call>"
    assert matches(g, call)
    assert not matches(g, call + "\n" + call)


def test_json_arguments_and_ids() -> None:
    mistral = ToolSyntax(
        call=(Lit("[TOOL_CALLS]"), Name(), Lit("[CALL_ID]"), CallId(), Lit("[ARGS]"), JsonArgs())
    )
    g = syntax_grammar([WEATHER], mistral, max_calls=1)
    assert matches(g, '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}')
    assert not matches(g, '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"town": "Paris"}')
    nemo = ToolSyntax(
        call=(CallObject(id_key="id"),),
        section_start="[TOOL_CALLS][",
        section_end="]",
        separator=", ",
    )
    g = syntax_grammar([WEATHER], nemo, max_calls=2)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}'
    assert matches(g, f"[TOOL_CALLS][{call}, {call}]")
    assert not matches(g, f"[TOOL_CALLS][{call}")


def test_control_token_markup_is_matched_as_the_token() -> None:
    """A family's markup that is a control token in the model's vocabulary is written
    as that token (llguidance never matches a control token with text)."""
    import llguidance

    from sluice.engine.llg_gate import with_special_tokens
    from tests.support.bytegrammar import _TOKENIZER

    lark = 'start: "[CALLS]" "x" | "y"\nv: %json {"const": "[CALLS]"}\n'
    out = with_special_tokens(lark, {"[CALLS]": 256})
    assert out.splitlines()[0] == 'start: (<[256]>) "x" | "y"'
    assert out.splitlines()[1] == lark.splitlines()[1]  # JSON schemas stay as they are
    grammar = llguidance.LLMatcher.grammar_from_lark(out.splitlines()[0])
    matcher = llguidance.LLMatcher(_TOKENIZER, grammar, log_level=0)
    assert matcher.consume_tokens([256, ord("x")]) and matcher.is_accepting()
    text = llguidance.LLMatcher(_TOKENIZER, grammar, log_level=0)
    assert not text.consume_tokens(list(b"[CALLS]x"))


def test_the_first_call_goes_on_from_the_prompts_markup() -> None:
    # functionary v3.2: the generation prompt wrote ">>>", the model writes the recipient
    functionary = ToolSyntax(call=(Lit(">>>"), Name(), Lit("\n"), JsonArgs()))
    g = syntax_grammar([WEATHER, NOARGS], functionary, max_calls=2, opened=">>>")
    assert matches(g, 'get_weather\n{"city": "Paris"}')
    assert matches(g, 'get_weather\n{"city": "Paris"}>>>now\n{}')
    assert not matches(g, '>>>get_weather\n{"city": "Paris"}')
    assert not matches(g, 'get_weather\n{"city": "Paris"}now\n{}')


def test_calls_named_by_their_key() -> None:
    apertus = ToolSyntax(
        call=(CallObject(name_is_key=True),),
        section_start="<|tools_prefix|>[",
        section_end="]<|tools_suffix|>",
        separator=", ",
    )
    g = syntax_grammar([WEATHER], apertus, max_calls=1)
    assert matches(g, '<|tools_prefix|>[{"get_weather": {"city": "Paris"}}]<|tools_suffix|>')
    assert not matches(g, '<|tools_prefix|>[{"get_weather": {"days": 2}}]<|tools_suffix|>')


def test_nested_values_are_written_as_nested_markup() -> None:
    from sluice.parsers.families import MINIMAX_M3

    assert MINIMAX_M3.tools is not None
    ns = "]<]minimax[>["
    tool = ToolSpec(
        "f",
        {
            "type": "object",
            "properties": {
                "point": {"type": "object", "properties": {"x": {"type": "number"}}},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["point", "tags"],
        },
    )
    g = syntax_grammar([tool], MINIMAX_M3.tools, max_calls=1)
    head, tail = f'{ns}<tool_call>\n{ns}<invoke name="f">', f"{ns}</invoke>\n{ns}</tool_call>"
    point = f"{ns}<point>{ns}<x>1.5{ns}</x>{ns}</point>"
    assert matches(g, f"{head}{point}{ns}<tags>{ns}<item>a{ns}</item>{ns}</tags>{tail}")
    assert matches(g, f"{head}{point}{ns}<tags>{ns}</tags>{tail}")
    assert not matches(g, f'{head}{ns}<point>{{"x": 1.5}}{ns}</point>{ns}<tags>{ns}</tags>{tail}')
    assert not matches(g, f"{head}{point}{ns}<tags>a{ns}</tags>{tail}")


def test_kimi_k3_writes_each_argument_s_type_and_the_call_s_index() -> None:
    from sluice.parsers.families import KIMI_K3

    assert KIMI_K3.tools is not None
    g = syntax_grammar([WEATHER], KIMI_K3.tools, max_calls=2)
    call = (
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
        "<|close|>call<|sep|>"
    )
    assert matches(g, f"<|open|>tools<|sep|>{call}<|close|>tools<|sep|>")
    assert matches(g, f"<|open|>tools<|sep|>{call}{call.replace('1', '2')}<|close|>tools<|sep|>")
    wrong = call.replace('type="number"', 'type="string"')
    assert not matches(g, f"<|open|>tools<|sep|>{wrong}<|close|>tools<|sep|>")


def test_text_before_a_control_token_runs_until_the_token() -> None:
    """A string value whose closing markup opens with a control token ends at that
    token (a stop string is text, and never sees a control token)."""
    import llguidance

    from sluice.engine.llg_gate import with_special_tokens
    from tests.support.bytegrammar import _TOKENIZER

    lark = 'start: "<" v\nv[stop="[END]x"]: /(.|\\n)*/\n'
    out = with_special_tokens(lark, {"[END]": 256})
    assert out.splitlines()[1].startswith('v: LAZY_TEXT_1 (<[256]> "x")')
    grammar = llguidance.LLMatcher.grammar_from_lark(out)
    matcher = llguidance.LLMatcher(_TOKENIZER, grammar, log_level=0)
    assert matcher.consume_tokens([*b"<a [EN] b", 256, ord("x")]) and matcher.is_accepting()
    # nor the token's text: a reader sees the same characters, and takes the first
    matcher = llguidance.LLMatcher(_TOKENIZER, grammar, log_level=0)
    assert matcher.validate_tokens([*b"<a [END] b"]) == len(b"<a [END")
    kept = with_special_tokens('v[stop="</p>"]: /(.|\\n)*/', {"[END]": 256})
    assert kept == 'v[stop="</p>"]: /(.|\\n)*/'  # text closers stay lazy stops


def test_python_and_gemma_arguments_follow_the_schema() -> None:
    from sluice.core.syntax import GemmaArgs, PythonArgs

    tool = ToolSpec(
        "f",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "ok": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "extra": {"type": "object"},
            },
            "required": ["city"],
        },
    )
    lfm2 = ToolSyntax(
        call=(Name(), PythonArgs()),
        section_start="<|tool_call_start|>[",
        section_end="]<|tool_call_end|>",
        separator=", ",
    )
    g = syntax_grammar([tool], lfm2, max_calls=2)
    assert matches(g, '<|tool_call_start|>[f(city="Paris")]<|tool_call_end|>')
    assert matches(
        g,
        '<|tool_call_start|>[f(city="Paris", ok=True, tags=["a"], extra={"n": None}), '
        'f(city="Oslo", tags=[])]<|tool_call_end|>',
    )
    assert not matches(g, "<|tool_call_start|>[f(ok=True)]<|tool_call_end|>")  # city required
    assert not matches(g, "<|tool_call_start|>[f(city=Paris)]<|tool_call_end|>")

    gemma = ToolSyntax(call=(Lit("<|tool_call>call:"), Name(), GemmaArgs(), Lit("<tool_call|>")))
    g = syntax_grammar([tool], gemma, max_calls=1)
    q = '<|"|>'
    assert matches(g, f"<|tool_call>call:f{{city:{q}Paris{q}}}<tool_call|>")
    # keys in sorted order, as the template writes them; any value where the schema is open
    assert matches(
        g,
        f"<|tool_call>call:f{{city:{q}Paris{q},extra:{{n:[1,{q}x{q}]}},ok:true,"
        f"tags:[{q}a{q},{q}b{q}]}}<tool_call|>",
    )
    assert not matches(g, '<|tool_call>call:f{city:"Paris"}<tool_call|>')
    assert not matches(g, "<|tool_call>call:f{ok:true}<tool_call|>")
