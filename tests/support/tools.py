"""Two function tools with strict parameter schemas, as the real-model tests send them."""

from __future__ import annotations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_books",
        "description": "Search a library catalogue",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 60},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
            },
            "required": ["query", "max_results"],
            "additionalProperties": False,
        },
    },
}
