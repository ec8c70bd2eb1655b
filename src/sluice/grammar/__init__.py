"""Grammars for constrained decoding: JSON schemas and tool-call shapes.

They are written in llguidance's Lark dialect and run on llguidance's matcher
(``sluice.engine.llg_gate``): a schema goes to llguidance's own JSON-schema
compiler whole, and only the framing of tool calls around the schemas is
written here. llguidance computes a token mask in tens of microseconds and is
built not to blow up on hostile schemas, so schemas are limited only by their
size (``--max-schema-bytes``). Any schema llguidance cannot compile is an
:class:`InvalidRequest` naming the request field.

Example::

    hermes = CallFraming(call_open="<tool_call>", call_close="</tool_call>")
    g = tool_call_grammar([ToolSpec("get_weather", schema)], hermes, max_calls=1)
    g = json_schema_grammar(schema, param="response_format.json_schema.schema")
"""

from sluice.grammar.build import json_object_grammar, json_schema_grammar, tool_call_grammar
from sluice.grammar.spec import CallFraming, ToolSpec

__all__ = [
    "CallFraming",
    "ToolSpec",
    "json_object_grammar",
    "json_schema_grammar",
    "tool_call_grammar",
]
