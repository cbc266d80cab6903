"""A server of several models (one session, one memory limit): the real ``openai`` client
against uvicorn on 127.0.0.1, requests routed by ``model``, on tiny random models."""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import openai
import pytest
from multimodels import MODELS, A, B, swap_limit
from serving import metric, running

import kvactor
from kvactor.server._cli import _options, served_models

ASK = [{"role": "user", "content": "write a haiku"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


async def _alone(spec: Any) -> str:
    async with kvactor.open(spec) as session:
        agent = await session.spawn_agent("a")
        return (await agent.chat(ASK, max_tokens=6)).text


async def test_requests_route_by_model_and_models_lists_each() -> None:
    want = {"router": await _alone(A), "coder": await _alone(B)}
    assert want["router"] != want["coder"]
    async with running(None, models=MODELS) as (session, base):
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as raw:
            client: Any = raw  # typed loosely, as test_server.py's clients
            for name in ("router", "coder"):
                done = await client.chat.completions.create(
                    model=name, messages=ASK, max_tokens=6, temperature=0
                )
                assert done.choices[0].message.content == want[name]
                assert done.model == name
                text = ""
                async for chunk in await client.chat.completions.create(
                    model=name, messages=ASK, max_tokens=6, temperature=0, stream=True
                ):
                    text += chunk.choices[0].delta.content or ""
                assert text == want[name]
            default = await client.chat.completions.create(
                model="default", messages=ASK, max_tokens=6, temperature=0
            )
            assert default.choices[0].message.content == want["router"]
            with pytest.raises(openai.NotFoundError, match="'router', 'coder'"):
                await client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2)
            listed = await client.models.list()
            assert [m.id for m in listed.data] == ["router", "coder"]
            assert all((m.model_extra or {})["loaded"] is True for m in listed.data)
            # A named agent runs one model: asking it for another is a 400.
            headers = {"X-Agent-Id": "bob"}
            await client.chat.completions.create(
                model="coder", messages=ASK, max_tokens=2, extra_headers=headers
            )
            assert session.model_of("bob") == "coder"
            with pytest.raises(openai.BadRequestError, match="runs model 'coder'"):
                await client.chat.completions.create(
                    model="router", messages=ASK, max_tokens=2, extra_headers=headers
                )
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{base}/metrics")).text
        assert metric(text, "kvactor_memory_limit_bytes") > 0
        assert metric(text, "kvactor_models_loaded") == 2


async def test_a_tight_limit_loads_the_model_a_request_names() -> None:
    limit = swap_limit()
    async with running(None, models=MODELS, memory_limit=limit) as (session, base):
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as raw:
            client: Any = raw  # typed loosely, as test_server.py's clients
            for name in ("router", "coder", "router"):
                await client.chat.completions.create(model=name, messages=ASK, max_tokens=3)
                listed = {
                    m.id: (m.model_extra or {})["loaded"] for m in (await client.models.list()).data
                }
                assert listed[name] is True
                assert list(listed.values()).count(True) == 1
        stats = await session.stats()
        assert stats.model_loads >= 2 and stats.memory_peak_bytes <= limit


def _args(*models: str, model: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(models=list(models), model=model)


def test_serve_takes_one_model_or_several_named() -> None:
    assert served_models(_args("a.gguf")) == ("a.gguf", None)
    assert served_models(_args(model="a.gguf")) == ("a.gguf", None)
    assert served_models(_args("r=a.gguf", "c=b")) == (None, {"r": "a.gguf", "c": "b"})
    for bad, match in (
        (_args("r=a", "b"), "NAME=PATH"),
        (_args("r=a", "r=b"), "twice"),
        (_args("r=a", model="x"), "not both"),
    ):
        with pytest.raises(ValueError, match=match):
            served_models(bad)


def test_the_serve_command_line_takes_several_models_and_a_limit() -> None:
    from kvactor.cli._main import build_parser

    args = build_parser().parse_args(
        ["serve", "--model", "router=a.gguf", "--model", "coder=b", "--memory-limit", "64M"]
    )
    assert served_models(args) == (None, {"router": "a.gguf", "coder": "b"})
    assert args.memory_limit == 64 << 20
    one = build_parser().parse_args(["serve", "--model", "a.gguf"])
    assert served_models(one) == ("a.gguf", None) and one.memory_limit is None
    assert "memory_limit" not in _options(one)  # open()'s default: 3/4 of RAM
    unbounded = build_parser().parse_args(["serve", "a.gguf", "--memory-limit", "none"])
    assert _options(unbounded)["memory_limit"] is None
    assert _options(args)["memory_limit"] == 64 << 20
