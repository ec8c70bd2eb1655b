"""Upstream inference servers: their config, HTTP client, SSE decoder, replicas and health.

The pool knows OpenAI-compatible servers over HTTP; ``backend.py`` makes a
backend of it (the same protocol as a local model), ``codec.py`` turns the
neutral request into an upstream's OpenAI body and its stream back into events.
"""
