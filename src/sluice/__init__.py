"""sluice: a streaming-first LLM server."""

__version__ = "0.1.0"
