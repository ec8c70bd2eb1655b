"""Upstream inference servers: their config, HTTP client, SSE decoder, replicas and health.

This package knows OpenAI-compatible servers over HTTP and nothing of the
serving layer; ``serving/upstream.py`` makes a backend of it.
"""
