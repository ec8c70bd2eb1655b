"""Ollama's API on the real SmolLM2 through the official ``ollama`` library, on the local
model and on an upstream model (a second sluice in front of the first, slot ``up``,
translated from OpenAI chat)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from sluice.models.catalog import resolve_model
from tests.support.real_server import QUIET, wait_idle
from tests.support.servers import gateway_in_front, serve_process

pytestmark = pytest.mark.integration

BACKENDS = ["smollm2", "up-smollm2"]
GREEDY = {"temperature": 0, "num_predict": 24}
ASK = [{"role": "user", "content": "Name three colors."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def gateway(base: str) -> Iterator[str]:
    with gateway_in_front(base) as url:
        yield url


@pytest.fixture
def client(base: str, gateway: str, request: pytest.FixtureRequest) -> ollama.Client:
    wait_idle(base, within=10)
    model = request.node.callspec.params["model"]
    return ollama.Client(host=base if model == "smollm2" else gateway, timeout=120)


@pytest.mark.parametrize("model", BACKENDS)
def test_chat_streamed_and_not(client: ollama.Client, model: str) -> None:
    whole = client.chat(model=model, messages=ASK, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count and whole.prompt_eval_count and whole.prompt_eval_count > 5
    assert whole.total_duration and whole.eval_duration is not None
    parts = list(client.chat(model=f"{model}:latest", messages=ASK, options=GREEDY, stream=True))
    assert len(parts) > 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    # Greedy: the stream says what the whole answer said.
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


@pytest.mark.parametrize("model", BACKENDS)
def test_generate_and_a_json_schema_format(client: ollama.Client, model: str) -> None:
    text = client.generate(model=model, prompt="Once upon a time", options=GREEDY)
    assert text.response and text.done
    person = client.chat(
        model=model,
        messages=[{"role": "user", "content": "Give a person as JSON."}],
        format=PERSON,
        options={"temperature": 0, "num_predict": 64},
    )
    value = json.loads(person.message.content)
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


@pytest.mark.parametrize("model", BACKENDS)
def test_a_tool_result_in_the_history_is_answered(client: ollama.Client, model: str) -> None:
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18C and sunny", "tool_name": "get_weather"},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    answer = client.chat(model=model, messages=messages, tools=tools, options=GREEDY)
    assert answer.done and (answer.message.content or answer.message.tool_calls)


def test_discovery_on_the_local_server(base: str) -> None:
    wait_idle(base, within=10)
    c = ollama.Client(host=base, timeout=60)
    names = [m.model for m in c.list().models]
    assert "smollm2-135m-instruct" in names and "gemma-3-270m" in names
    smol = next(m for m in c.list().models if m.model == "smollm2-135m-instruct")
    assert smol.size and smol.size > 50_000_000 and smol.details is not None
    assert smol.details.quantization_level == "Q4_1" and smol.details.family == "llama"
    shown = c.show("smollm2")
    assert shown.capabilities is not None and {"completion", "tools"} <= set(shown.capabilities)
    assert shown.template and "<|im_start|>" in shown.template
    running = [m.model for m in c.ps().models]
    assert "smollm2-135m-instruct" in running


def test_discovery_through_a_gateway_lists_upstream_models(gateway: str) -> None:
    c = ollama.Client(host=gateway, timeout=60)
    assert "up-smollm2" in [m.model for m in c.list().models]
    assert "tools" in (c.show("up-smollm2").capabilities or [])


def test_delete_a_model_file_of_the_models_folder(tmp_path: Path) -> None:
    """A file in the models folder is unloaded and deleted (a symlink, not its target);
    packaged models, unknown names and Ollama's Modelfile routes are refused."""
    packaged = resolve_model("smollm2").path
    folder = tmp_path / "me" / "tiny"
    folder.mkdir(parents=True)
    (folder / "mine.gguf").symlink_to(packaged)
    env = {"SLUICE_MODELS_DIR": str(tmp_path)}
    with serve_process("--parallel", "1", "--ctx", "256", *QUIET, env=env) as url:
        client = ollama.Client(host=url, timeout=120)
        assert "mine" in [m.model for m in client.list().models]
        assert client.generate(model="mine", prompt="Hi", options={"num_predict": 2}).done
        assert "mine" in [m.model for m in client.ps().models]
        assert client.delete("mine:latest").status == "success"
        assert "mine" not in [m.model for m in client.list().models]
        assert "mine" not in [m.model for m in client.ps().models]
        assert not (tmp_path / "me").exists() and packaged.is_file()
        with pytest.raises(ollama.ResponseError) as missing:
            client.delete("mine")
        assert missing.value.status_code == 404
        with pytest.raises(ollama.ResponseError) as ours:
            client.delete("smollm2-135m-instruct")
        assert ours.value.status_code == 400 and "packaged model" in ours.value.error
        with pytest.raises(ollama.ResponseError) as copy:
            client.copy("smollm2-135m-instruct", "other")
        assert copy.value.status_code == 400 and "aliases" in copy.value.error
        assert client.generate(model="smollm2-135m-instruct", prompt="Hi").done
