"""Tool calls and structured output in the Python API: definitions, choices and response
formats normalised; every tool-call format parsed from realistic text (whole and in
pieces); constrained calls that validate; a tool loop's result turn that EXTENDs the
whole cache; a tool wait that keeps a cache hot (real MLX, tiny models, real pool)."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel

import kvactor
from kvactor.actors.agent import check_history
from kvactor.actors.enums import FinishReason, Match
from kvactor.actors.models import LoadedModel, make_tiny_model
from kvactor.actors.models._bpe import ByteLevelBPETokenizer, tiny_byte_tokenizer, tiny_vocab
from kvactor.actors.records import ToolCallDelta
from kvactor.actors.tools import ToolFormat, ToolStream, detect_format, tool_request
from kvactor.actors.tools._parse import parse_tool_calls
from kvactor.actors.tools._request import response_constraint, tool_definition

tiny = functools.partial(make_tiny_model, 0, head_dim=64)


def add(a: int, b: int = 2) -> int:
    """Add two integers."""
    return a + b


class Lookup(BaseModel):
    """Find a file by name."""

    name: str
    limit: int = 3


def test_tool_definitions_from_every_shape() -> None:
    fn = tool_definition(add)["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["required"] == ["a"]
    assert fn["parameters"]["properties"]["a"] == {"type": "integer"}
    model = tool_definition(Lookup)["function"]
    assert model["name"] == "Lookup" and model["parameters"]["required"] == ["name"]
    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    openai = {"type": "function", "function": {"name": "s", "parameters": params}}
    anthropic = {"name": "s", "description": "d", "input_schema": params}
    assert tool_definition(openai)["function"]["parameters"] == params
    assert tool_definition(anthropic)["function"]["parameters"] == params
    with pytest.raises(ValueError, match="name"):
        tool_definition({"type": "function", "function": {"parameters": params}})
    with pytest.raises(TypeError):
        tool_definition(42)


def test_tool_choices_and_response_formats() -> None:
    tools = [add, Lookup]
    for choice, want in [
        (None, ("auto", None)),
        ("required", ("required", None)),
        ({"type": "any"}, ("required", None)),
        ({"type": "function", "function": {"name": "add"}}, ("function", "add")),
        ({"type": "tool", "name": "Lookup"}, ("function", "Lookup")),
        ("none", ("none", None)),
    ]:
        request = tool_request(tools, choice)
        assert request is not None and (request.choice, request.name) == want
    with pytest.raises(ValueError, match="not among the tools"):
        tool_request(tools, {"type": "tool", "name": "nope"})
    with pytest.raises(ValueError, match="needs tools"):
        tool_request(None, "required")
    with pytest.raises(ValueError, match="share a name"):
        tool_request([add, add])
    assert tool_request() is None
    assert response_constraint({"type": "text"}) is None
    assert response_constraint({"type": "json_object"}).source == '{"type": "object"}'  # type: ignore[union-attr]
    wrapped = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}
    assert json.loads(response_constraint(wrapped).source) == {"type": "integer"}  # type: ignore[union-attr]
    assert "name" in json.loads(response_constraint(Lookup).source)["properties"]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="response_format"):
        tool_request(response_format={"type": "json_schema", "json_schema": {}})


def test_histories_with_tool_calls_and_results() -> None:
    history = check_history(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]
    )
    assert history[0]["content"] == "hi you"
    assert history[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert history[1]["content"] == "" and history[2]["tool_call_id"] == "c1"
    bad: list[Any] = [
        [{"role": "tool", "content": "42"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
            },
            {"role": "user", "content": "x"},
        ],
        [{"role": "user", "content": "x", "extra": 1}],
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
    ]
    for messages in bad:
        with pytest.raises(ValueError):
            check_history(messages)


FORMATS = {
    "hermes": ToolFormat("hermes", True, "<tool_call>"),
    "generic": ToolFormat("generic", False, "<tool_call>"),
    "llama3": ToolFormat("llama3", True, "", args_key="parameters"),
    "mistral": ToolFormat("mistral", True, "[TOOL_CALLS]"),
    "mistral-args": ToolFormat("mistral-args", True, "[TOOL_CALLS]"),
}
ARGS = {"city": 'Paris, "FR" {}', "days": [1, {"x": "]}"}]}
REALISTIC = {
    "hermes": "I'll look that up.\n<tool_call>\n"
    + json.dumps({"name": "weather", "arguments": ARGS})
    + '\n</tool_call>\n<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>',
    "generic": "<tool_call>"
    + json.dumps({"name": "weather", "arguments": ARGS})
    + '</tool_call>\n<tool_call>{"arguments": {}, "name": "clock"}</tool_call>',
    "llama3": "<|python_tag|>" + json.dumps({"name": "weather", "parameters": ARGS}),
    "mistral": "[TOOL_CALLS] ["
    + json.dumps({"name": "weather", "arguments": ARGS})
    + ', {"name": "clock", "arguments": {}}]',
    "mistral-args": "[TOOL_CALLS]weather[ARGS]" + json.dumps(ARGS) + "[TOOL_CALLS]clock[ARGS]{}",
}


@pytest.mark.parametrize("name", sorted(REALISTIC))
def test_every_format_parses_whole_and_in_pieces(name: str) -> None:
    fmt, text = FORMATS[name], REALISTIC[name]
    content, calls = parse_tool_calls(fmt, text)
    expected = [("weather", ARGS)] + ([] if name == "llama3" else [("clock", {})])
    assert [(c.name, c.arguments) for c in calls] == expected
    assert "tool_call" not in content and "TOOL_CALLS" not in content and "{" not in content
    for seed in range(5):
        rng = random.Random(seed)
        stream = ToolStream(fmt)
        events: list[str | ToolCallDelta] = []
        at = 0
        while at < len(text):
            step = rng.randint(1, 7)
            events += stream.feed(text[at : at + step])
            at += step
        events += stream.close()
        assert [(c.name, c.arguments) for c in stream.calls] == expected
        pieces = "".join(e for e in events if isinstance(e, str))
        assert pieces == stream.content == content
        args: dict[int, str] = {}
        for e in events:
            if isinstance(e, ToolCallDelta):
                if e.id is not None:
                    assert e.index not in args and e.name == expected[e.index][0]
                    args[e.index] = ""
                args[e.index] += e.arguments
        assert [json.loads(args[i]) for i in sorted(args)] == [a for _, a in expected]
        assert [c.id for c in stream.calls] == [
            e.id for e in events if isinstance(e, ToolCallDelta) and e.id is not None
        ]


def test_text_that_only_looks_like_a_call_stays_content() -> None:
    assert parse_tool_calls(FORMATS["llama3"], 'Use {"a": 1} here') == ('Use {"a": 1} here', [])
    assert parse_tool_calls(FORMATS["hermes"], "a <tool and more") == ("a <tool and more", [])


def _tokenizer(template: str, extra_special: tuple[str, ...] = ()) -> ByteLevelBPETokenizer:
    tokens, merges, types = tiny_vocab()
    return ByteLevelBPETokenizer(
        tokens + list(extra_special),
        merges,
        token_types=types + [3] * len(extra_special),
        bos_token_id=1,
        eos_token_ids=(2,),
        chat_template=template,
    )


#: A ChatML template that renders tools and tool messages the way Qwen 2.5's does.
HERMES_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}{% else %}{{ 'You are helpful.' }}{% endif %}"
    "{{ '\\n\\n# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nCall them in <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant' }}"
    "{% if m.content %}{{ '\\n' + m.content }}{% endif %}"
    "{% for c in m.tool_calls %}{% if c.function %}{% set c = c.function %}{% endif %}"
    '{{ \'\\n<tool_call>\\n{"name": "\' + c.name + \'", "arguments": \' }}'
    "{{ c.arguments | tojson }}{{ '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_formats_are_read_from_the_template() -> None:
    assert detect_format(tiny_byte_tokenizer()).name == "generic"
    assert detect_format(_tokenizer(HERMES_TEMPLATE)).name == "hermes"
    llama = '{% if tools %}<|python_tag|>{% endif %}{"name": ..., "parameters": ...}'
    assert detect_format(_tokenizer(llama)).name == "llama3"
    mistral = _tokenizer(
        "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", ("[TOOL_CALLS]",)
    )
    fmt = detect_format(mistral)
    assert fmt.name == "mistral" and fmt.marker == mistral.encode("[TOOL_CALLS]")[0]
    assert len(fmt.new_id()) == 9 and fmt.new_id().isalnum()


def _hermes_model() -> LoadedModel:
    return dataclasses.replace(tiny(), tokenizer=_tokenizer(HERMES_TEMPLATE))


PARAMS = {
    "type": "object",
    "properties": {
        "expr": {"type": "string", "maxLength": 8},
        "op": {"enum": ["add", "mul"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["expr", "op", "n"],
}
CALC = {
    "type": "function",
    "function": {"name": "calc", "description": "math", "parameters": PARAMS},
}


@pytest.mark.parametrize("model", [tiny, _hermes_model], ids=["generic", "hermes"])
async def test_a_tool_loop_extends_the_whole_cache_and_waits_hot(model: Any) -> None:
    async with kvactor.open(model, tool_wait_s=60.0) as session:
        agent = await session.spawn_agent("a")
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You compute."},
            {"role": "user", "content": "what is 6 times 7?"},
        ]
        tools = [CALC, add]
        stream = agent.stream_chat(messages, tools=tools, tool_choice="required", max_tokens=600)
        events = [e async for e in stream.events()]
        done = stream.completion
        assert done is not None and done.finish_reason is FinishReason.TOOL_CALLS
        assert done.tool_calls and "<tool_call>" not in done.text
        assert not any(isinstance(e, str) and "tool_call" in e for e in events)
        for call in done.tool_calls:
            assert call.name in ("calc", "add")
            if call.name == "calc":
                jsonschema.validate(call.arguments, PARAMS)
        held = await agent.cache_info()
        assert held.tool_wait_s > 50 and (await session.stats()).tool_waits == 1
        messages.append(
            {
                "role": "assistant",
                "content": done.text or None,
                "tool_calls": [c.message() for c in done.tool_calls],
            }
        )
        messages += [
            {"role": "tool", "tool_call_id": c.id, "content": "42"} for c in done.tool_calls
        ]
        second = await agent.chat(messages, tools=tools, max_tokens=5)
        assert second.match is Match.EXTEND
        assert second.timings.reused_tokens / held.tokens >= 0.95
        assert (await agent.cache_info()).tool_wait_s == 0.0  # its result came
        named = await agent.chat(
            messages[:2], tools=tools, tool_choice={"type": "function", "function": {"name": "add"}}
        )
        assert [c.name for c in named.tool_calls] == ["add"]
        assert isinstance(named.tool_calls[0].arguments["a"], int)


async def test_a_response_format_constrains_the_answer() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    async with kvactor.open(tiny) as session:
        agent = await session.spawn_agent("a")
        done = await agent.generate("answer", response_format=schema, max_tokens=50)
        assert json.loads(done.text) in ({"ok": True}, {"ok": False})
        fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
        either = await agent.chat(
            [{"role": "user", "content": "go"}], tools=[add], response_format=fmt, max_tokens=80
        )
        if either.tool_calls:
            assert either.tool_calls[0].name == "add"
        else:
            jsonschema.validate(json.loads(either.text), schema)
        with pytest.raises(ValueError, match="constraint"):
            await agent.generate("x", response_format={"type": "nope"})
        with pytest.raises(ValueError, match="raw"):
            await agent.complete("x", tools=[add])


def test_a_cache_waiting_on_tools_is_demoted_after_idle_ones_until_its_ttl_ends() -> None:
    import mlx.core as mx

    from kvactor.actors.hot import CachePool, LRUPolicy
    from kvactor.kernels.float_turn import FloatTurnCache
    from kvactor.kernels.qcodec import DEFAULT_CODEC

    lm = tiny()
    FloatTurnCache.prepare(lm.model)
    pool = CachePool(
        None,
        LRUPolicy(),
        persistent=False,
        codec=DEFAULT_CODEC,
        geometry=lm.geometry,
        ready_copies=False,
    )
    sizes = {}
    for agent in ("tools", "idle"):  # "tools" is the least recently used
        entry = pool.claim(agent)
        work = entry.kv.activate()
        lm.model(mx.array([[7 + i for i in range(30)]]), cache=work.layers)
        entry.kv.tokens.extend(7 + i for i in range(30))
        pool.end_turn(agent, entry, finished=True)
        sizes[agent] = entry.kv.stored_bytes
    pool.tool_wait("tools", 60.0)
    waiting = {c.agent: (c.waiting, c.tool_wait) for c in pool.candidates()}
    assert waiting == {"tools": (True, True), "idle": (False, False)}
    assert pool.info("tools").tool_wait_s > 59 and pool.tool_waits == 1
    pool.limit = sum(sizes.values())
    assert pool.make_room(sizes["tools"], turn=True)
    assert "tools" in pool and "idle" not in pool
    pool.tool_wait("tools", 0.0)  # its TTL is over: an idle cache like any other
    pool.limit = pool.committed()  # full
    assert pool.make_room(1, turn=True) and "tools" not in pool


@pytest.mark.parametrize("name", sorted(REALISTIC))
def test_each_format_grammar_accepts_the_calls_it_parses(name: str) -> None:
    from kvactor.actors.tools import GrammarCompiler

    tokenizer = tiny_byte_tokenizer()
    fmt = FORMATS[name]
    weather = {
        "type": "function",
        "function": {"name": "weather", "parameters": {"type": "object"}},
    }
    request = tool_request([weather, add], {"type": "tool", "name": "weather"})
    assert request is not None
    constraint = fmt.constraint(request)
    assert constraint is not None
    row = GrammarCompiler(tokenizer).compile(constraint)
    body = json.dumps({"name": "weather", fmt.args_key: ARGS})
    text = {
        "hermes": f"<tool_call>\n{body}\n</tool_call>",
        "generic": f"<tool_call>{body}</tool_call>",
        "llama3": body,
        "mistral": f"[TOOL_CALLS] [{body}]",
        "mistral-args": "[TOOL_CALLS]weather[ARGS]" + json.dumps(ARGS),
    }[name]
    for token in tokenizer.encode(text):
        assert row.consume(token), (text, row.error)
    assert row.done
    assert [c.name for c in parse_tool_calls(fmt, text)[1]] == ["weather"]
