"""The local backend on a real model: load progress, the backend protocol, unload."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from sluice.config import Settings
from sluice.core.errors import ModelUnloaded
from sluice.core.events import ErrorEvent, Finish, Start, TextDelta
from sluice.core.request import GenerationRequest
from sluice.local.model import LocalModel
from sluice.local.offload import Offload
from sluice.models.catalog import packaged_specs, resolved
from sluice.models.registry import LoadOptions, ModelRegistry

SETTINGS = Settings(threads=1, ctx=256, parallel=1)


@pytest.fixture
def offload() -> Offload:
    return Offload(1)


def registry(offload: Offload) -> ModelRegistry:
    specs = packaged_specs()
    return ModelRegistry(
        lambda: specs,
        default=specs[0].name,
        loader=lambda spec, options, progress: LocalModel.load(
            resolved(spec), options, SETTINGS, offload, progress
        ),
        estimator=lambda spec, options: 0,
        budget_bytes=2**34,
    )


async def test_a_load_reports_progress_strictly_increasing_to_one(offload: Offload) -> None:
    models = registry(offload)
    seen: list[float] = []
    lease = await models.acquire("gemma-3-270m", progress=seen.append)
    try:
        assert lease.loaded_now
        assert len(seen) >= 5, seen  # llama.cpp's callback, per tensor batch
        assert all(b > a for a, b in itertools.pairwise(seen)), seen
        assert 0 <= seen[0] < 0.5 and seen[-1] == 1.0
    finally:
        lease.release()
        await models.close()


async def test_the_local_model_answers_a_neutral_request_and_ends_it_on_unload(
    offload: Offload,
) -> None:
    spec = next(s for s in packaged_specs() if s.name == "smollm2-135m-instruct")
    model = await asyncio.to_thread(
        LocalModel.load, resolved(spec), LoadOptions(), SETTINGS, offload, None
    )
    try:
        request = GenerationRequest(messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=1)
        stream = await model.open(request)
        events = [e async for e in stream]
        await stream.aclose()
        assert stream.meta.model == spec.name and stream.meta.prompt_owners == {0}
        assert isinstance(events[0], Start) and isinstance(events[-1], Finish)
        assert any(isinstance(e, TextDelta) and e.text for e in events)
        # A long generation, then unload: the stream ends with ModelUnloaded.
        long = GenerationRequest(prompts=["Once"], max_tokens=200)
        stream = await model.open(long)
        it = aiter(stream)
        assert isinstance(await anext(it), Start)
        await asyncio.to_thread(model.close)
        tail = [e async for e in it]
        assert isinstance(tail[-1], ErrorEvent) and isinstance(tail[-1].error, ModelUnloaded)
        with pytest.raises(ModelUnloaded):
            await model.open(request)  # and nothing new starts on it
    finally:
        await asyncio.to_thread(model.close)
        offload.close()
