"""GBNF grammars for constrained decoding: JSON schemas and tool-call shapes.

The JSON-schema translation is llama.cpp's own converter, as shipped in
llama-cpp-python (``llama_cpp.llama_grammar.SchemaConverter``, pure Python),
subclassed here where that port is unsafe or wrong on user input:

- Bounded repetitions (``minLength``/``maxLength``, ``minItems``/``maxItems``,
  a pattern's ``{m,n}``) are chains of small shared rules, each link charged
  against a per-grammar budget (``max_repeat``). The port writes every copy
  into nested groups, so a ``maxLength`` of 10**9 took the process to 20+ GB,
  and llama.cpp rejects its output past about a thousand copies. A maximum
  the output can never reach (above ``max_output_chars``) is compiled
  unbounded, which accepts exactly the same outputs up to that length.
- Regex patterns are translated here: the port writes ``\\d`` into the GBNF
  (which llama.cpp rejects), repeats whole escaped runs, and lets ``.`` or a
  pattern's ``"`` write a raw quote inside a JSON string.
- Literals escape backslashes and ``$ref`` names are rule names, so no schema
  text reaches the GBNF outside a quoted literal or a character class.
- Objects with many optional properties build in linear time.
- Wide grammars are bounded (``max_alternatives``). llama.cpp checks the whole
  vocabulary against every parse stack open at a point of the output, once
  per sampled token, on the engine thread every stream waits for: an enum of
  5,000 values cost about 1 s per token. Enum values and tool names are
  written as tries (a stack per distinct next character, not per value),
  optional properties as one choice after a shared comma, and the width (an
  upper bound on the open stacks, read off the GBNF: see ``_WidthAnalysis``;
  a stack that takes a space next counts twice) is a 400 past the limit.

Any failure on a schema is an :class:`InvalidRequest` naming the request field.

Example::

    hermes = CallFraming(call_open="<tool_call>", call_close="</tool_call>")
    g = tool_call_grammar([ToolSpec("get_weather", schema)], hermes, max_calls=1)
    g = json_schema_grammar(schema, param="response_format.json_schema.schema",
                            max_repeat=4096, max_output_chars=n_ctx * longest_piece,
                            max_alternatives=32)
"""

from sluice.grammar.build import (
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from sluice.grammar.integers import integer_range_rule
from sluice.grammar.pattern import gbnf_literal
from sluice.grammar.spec import (
    ALTERNATIVES_SETTING,
    DEFAULT_MAX_ALTERNATIVES,
    DEFAULT_MAX_REPEAT,
    REPEAT_SETTING,
    CallFraming,
    ToolSpec,
)

__all__ = [
    "ALTERNATIVES_SETTING",
    "DEFAULT_MAX_ALTERNATIVES",
    "DEFAULT_MAX_REPEAT",
    "REPEAT_SETTING",
    "CallFraming",
    "ToolSpec",
    "gbnf_literal",
    "integer_range_rule",
    "json_object_grammar",
    "json_schema_grammar",
    "tool_call_grammar",
]
