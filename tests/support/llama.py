"""The real llama.cpp runner on a packaged model, for tests that need real tokens or grammars."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sluice.engine.llama_runner import LlamaRunner, LlamaRunnerConfig
from sluice.models.catalog import resolve_model


@contextlib.contextmanager
def real_runner(
    name: str = "smollm2", n_ctx: int = 512, n_parallel: int = 1
) -> Iterator[LlamaRunner]:
    """One sequence (by default), one thread (other servers share the cores); closed on exit."""
    config = LlamaRunnerConfig(
        model_path=str(resolve_model(name).path), n_parallel=n_parallel, n_ctx=n_ctx, n_threads=1
    )
    runner = LlamaRunner.load(config)
    try:
        yield runner
    finally:
        runner.close()
