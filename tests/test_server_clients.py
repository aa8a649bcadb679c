# server.py against the clients people point at it, offline: the `openai` client for every request field (logprobs,
# n, penalties, logit_bias, echo, response_format, tools), langchain-openai (invoke, stream, with_structured_output,
# bind_tools) and the OpenAI Agents SDK (one function tool through its chat-completions model). A tiny random model
# whose chat template is server_tools.jinja (Hermes-style tools, as Qwen2.5's); its prompts are checked against
# transformers' own rendering of that template. Structured output is validated with `jsonschema` on 20 generated schemas.
import asyncio
import json
import random
from typing import Literal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from conftest import REPO
from test_server import SLOTS, ServerProcess, assert_serves_as_before, completion, make_checkpoint

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp("clients") / "tiny-tools")
    s = ServerProcess("--checkpoint_path", d / "model.pth", "--full_batch_size", SLOTS, "--max_seq_length", 1024,
                      "--threads", 1, "--chat_template", REPO / "server_tools.jinja")
    s.dir = d
    yield s
    s.stop()


def hf_prompt_tokens(d, messages, tools=None) -> int:
    """The prompt length transformers' apply_chat_template gives for server_tools.jinja (the reference rendering)."""
    from transformers import PreTrainedTokenizerFast
    t = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    t.chat_template = (REPO / "server_tools.jinja").read_text()
    return len(t.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"])


# ------------------------------------------------------------------------------------------------- refused fields
@pytest.mark.parametrize("path,body,param", [
    ("chat/completions", {"audio": {}}, "audio"),
    ("chat/completions", {"modalities": ["text"]}, "modalities"),
    ("chat/completions", {"functions": [WEATHER["function"]]}, "functions"),
    ("chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"store": True}, "store"),
    ("chat/completions", {"tools": [{"type": "web_search"}]}, "tools"),
    ("chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"regex": "[a-z]+", "ignore_eos": True}, "ignore_eos"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"),
    ("completions", {"made_up_field": 1}, "made_up_field"),
    ("completions", {"logit_bias": {"99999": 5}}, "logit_bias"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
])
def test_unsupported_fields_are_refused_by_name(srv, path, body, param):
    base = {"messages": USER} if path.startswith("chat") else {"prompt": "Hi"}
    status, err = srv.post("/v1/" + path, json.dumps({**base, **body, "max_tokens": 2}).encode())
    assert status == 400 and err["error"]["param"] == param and param in err["error"]["message"], err


def test_model_without_tool_support_gets_a_clear_400(tmp_path):
    d = make_checkpoint(tmp_path / "tiny-plain")  # ChatML without tools
    s = ServerProcess("--checkpoint_path", d / "model.pth", "--full_batch_size", 1, "--threads", 1)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            s.client.chat.completions.create(model=s.model, messages=USER, tools=[WEATHER])
        assert "no tool support" in e.value.body["message"] and e.value.body["param"] == "tools"
    finally:
        s.stop()


# ------------------------------------------------------------------------------------------------- sampling fields
def test_logprobs_chat_and_completions_streamed_too(srv):
    r = srv.client.chat.completions.create(model=srv.model, messages=USER, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:  # greedy: the chosen token is the likeliest, listed first among 3 in falling order
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob) and c.logprob <= 0
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert bytes(c.bytes).decode() == c.token
    chunks = [c for c in srv.client.chat.completions.create(
        model=srv.model, messages=USER, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert [t.token for c in chunks for t in c.choices[0].logprobs.content] == [c.token for c in content]
    # completions: tokens / token_logprobs / top_logprobs / text_offset
    c = srv.client.completions.create(model=srv.model, prompt="Once upon", max_tokens=6, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == 6 and lp.text_offset[0] == 0
    assert all(max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    streamed = list(srv.client.completions.create(model=srv.model, prompt="Once upon", max_tokens=6, temperature=0,
                                                  logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    assert [t for s in streamed if s.choices[0].logprobs for t in s.choices[0].logprobs.tokens] == lp.tokens


def test_n_choices_echo_and_seeds(srv):
    r = srv.client.chat.completions.create(model=srv.model, messages=USER, max_tokens=8, n=3, temperature=1.0,
                                           seed=7, extra_body={"ignore_eos": True})
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert r.usage.completion_tokens == 24
    again = srv.client.chat.completions.create(model=srv.model, messages=USER, max_tokens=8, n=3, temperature=1.0,
                                               seed=7, stream=True, extra_body={"ignore_eos": True})
    got = ["", "", ""]
    for c in again:
        got[c.choices[0].index] += c.choices[0].delta.content or ""
    assert got == texts
    greedy = srv.client.completions.create(model=srv.model, prompt="The sky", max_tokens=6, n=2, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text == completion(srv, "The sky", max_tokens=6,
                                                                          temperature=0)[0]
    echoed = srv.client.completions.create(model=srv.model, prompt="The sky", max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "The sky" + greedy.choices[0].text


def test_logit_bias_and_penalties(srv):
    from tokenizer import load_tokenizer
    tok = load_tokenizer(srv.dir)
    a, b = tok.encode(" the", bos=False)[0], tok.encode(" and", bos=False)[0]
    assert a != b

    def counts(**more):
        lp = srv.client.completions.create(model=srv.model, prompt="Once upon", max_tokens=10, temperature=0,
                                           logprobs=0, extra_body={"ignore_eos": True}, **more).choices[0].logprobs
        return lp.tokens.count(tok.decode([a])), lp.tokens.count(tok.decode([b]))
    assert sum(counts()) < 10
    assert counts(logit_bias={str(a): 100}) == (10, 0)  # the biased token every time
    both = {str(a): 100, str(b): 100}  # a and b 100 above the rest: only they are ever chosen
    assert sum(counts(logit_bias=both)) == 10
    # penalized for each use, they take turns; rewarded for each use, the first one chosen keeps winning
    assert min(counts(logit_bias=both, frequency_penalty=2.0)) >= 3
    assert max(counts(logit_bias=both, frequency_penalty=-2.0)) == 10
    assert min(counts(logit_bias=both, presence_penalty=2.0)) >= 1
    assert max(counts(logit_bias=both, presence_penalty=-2.0)) == 10


def test_get_model_by_id_metrics_and_health(srv):
    assert srv.client.models.retrieve(srv.model).id == srv.model
    with pytest.raises(openai.NotFoundError):
        srv.client.models.retrieve("gpt-4o")
    completion(srv, "Hi", max_tokens=3)
    with urllib.request.urlopen(srv.url + "metrics", timeout=10) as r:
        text = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"llamaflat_requests", "llamaflat_generation_tokens", "llamaflat_time_to_first_token_seconds",
            "llamaflat_inter_token_seconds", "llamaflat_queue_length", "llamaflat_slots_busy"} <= names
    assert 'llamaflat_requests_total{endpoint="completions"}' in text


def test_api_key(tmp_path):
    d = make_checkpoint(tmp_path / "tiny-key")
    s = ServerProcess("--checkpoint_path", d / "model.pth", "--full_batch_size", 1, "--threads", 1,
                      "--api_key", "sesame", api_key="sesame")
    try:
        assert s.client.completions.create(model=s.model, prompt="Hi", max_tokens=2).choices[0].finish_reason
        bad = openai.OpenAI(base_url=s.url + "v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=s.model, prompt="Hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert s.health()["status"] == "ok"  # /health and the page stay open
    finally:
        s.stop()


# ------------------------------------------------------------------------------------------------- function calling
def test_tools_go_through_the_template_and_calls_come_back(srv):
    c = srv.client
    plain = c.chat.completions.create(model=srv.model, messages=USER, max_tokens=2)
    r = c.chat.completions.create(model=srv.model, messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                  max_tokens=300, temperature=0)
    assert r.usage.prompt_tokens == hf_prompt_tokens(srv.dir, USER, [WEATHER, TIME]) > plain.usage.prompt_tokens
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo", "Lima")
    # a named function, streamed: the call arrives as tool_calls deltas, no tag leaks into the content
    chunks = [x for x in c.chat.completions.create(
        model=srv.model, messages=USER, tools=[WEATHER, TIME], max_tokens=300, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
        if x.choices]
    assert "<tool_call>" not in "".join(x.choices[0].delta.content or "" for x in chunks)
    calls = [t for x in chunks for t in x.choices[0].delta.tool_calls or []]
    assert [t.function.name for t in calls] == ["get_weather"] and calls[0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call and its result go back through the template (tool_calls and role "tool" messages)
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 C"}]
    r = c.chat.completions.create(model=srv.model, messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
    ref = [history[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": json.loads(calls[0].function.arguments)}}]},
        {"role": "tool", "content": "Sunny, 21 C"}]
    assert r.usage.prompt_tokens == hf_prompt_tokens(srv.dir, ref, [WEATHER])
    # tool_choice auto with a JSON response format (as the Agents SDK sends for an output type): a call or the JSON
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for seed in range(4):
        r = c.chat.completions.create(model=srv.model, messages=USER, tools=[WEATHER], max_tokens=300, seed=seed,
                                      response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                                              "schema": answer}})
        m = r.choices[0].message
        assert (m.tool_calls and m.tool_calls[0].function.name == "get_weather") or \
            jsonschema.validate(json.loads(m.content), answer) is None
    # tool_choice "none": the tools stay out of the prompt, nothing is parsed
    r = c.chat.completions.create(model=srv.model, messages=USER, tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens and not r.choices[0].message.tool_calls


def test_forced_call_grammars_of_each_family_admit_a_call(srv):
    """The grammar tool_choice "required" imposes, per syntax: a well-formed call is accepted whole and ends it,
    an unknown tool or an argument outside its schema is not."""
    import server_tools as T
    from server_grammar import Grammars
    from tokenizer import load_tokenizer
    tok = load_tokenizer(srv.dir)
    g = Grammars(tok, tok.vocab_size)
    calls = {"hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Lima"}}\n</tool_call>',
             "llama3": '{"name":"get_weather","parameters":{"city":"Lima"}}',
             "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Lima"}}]'}
    for fmt, text in calls.items():
        lark = T.forced_grammar(fmt, [WEATHER, TIME], False, {})
        m = g.matcher(g.lark(lark)).m
        assert all(m.consume_token(t) for t in tok.encode(text, bos=False)) and m.is_accepting(), fmt
        for bad in (text.replace("get_weather", "get_wether"), text.replace("Lima", "Rome")):
            m = g.matcher(g.lark(lark)).m
            assert not all(m.consume_token(t) for t in tok.encode(bad, bos=False)), (fmt, bad)
        assert T.parse(fmt, text, {"get_weather"})[1][0].arguments == '{"city": "Lima"}'


def test_tool_call_parsers_of_each_family():
    import server_tools as T
    names = {"get_weather"}
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for fmt, text in [("hermes", f"Let me see.\n<tool_call>\n{call}\n</tool_call>"),
                      ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
                      ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
                      ("mistral", f"[TOOL_CALLS][{call}]")]:
        content, calls = T.parse(fmt, text, names)
        assert [(x.name, json.loads(x.arguments)) for x in calls] == [("get_weather", {"city": "Oslo"})], fmt
        assert content == ("Let me see." if fmt == "hermes" else None)
    assert T.parse("hermes", "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>", names)[1] == []
    assert T.parse("llama3", "The answer is {x}.", names) == ("The answer is {x}.", [])
    assert T.detect_format((REPO / "server_tools.jinja").read_text()) == "hermes"
    assert T.detect_format("{{ messages }}") is None


# ------------------------------------------------------------------------------------------------- structured output
def random_schema(rng: random.Random, depth=0) -> dict:
    """A JSON schema a random model completes within a few dozen tokens (bounded strings, numbers, arrays)."""
    kinds = ["integer", "boolean", "enum", "string", "number"] + (["object", "array"] if depth < 2 else [])
    k = rng.choice(kinds)
    if k == "integer":
        return {"type": "integer", "minimum": -50, "maximum": 50}
    if k == "number":
        return {"type": "number", "minimum": 0, "maximum": 9}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 3, None, True], rng.randint(1, 4))}
    if k == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if k == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 2)}
    props = {f"k{i}": random_schema(rng, depth + 1) for i in range(rng.randint(1, 3))}
    return {"type": "object", "properties": props, "required": sorted(rng.sample(sorted(props), len(props) // 2 + 1)),
            "additionalProperties": False}


def test_structured_output_validates_against_20_generated_schemas(srv):
    rng = random.Random(43)
    schemas = [{"type": "object", "properties": {"answer": random_schema(rng), "items": random_schema(rng)},
                "required": ["answer", "items"], "additionalProperties": False} for _ in range(20)]

    def ask(i):
        r = srv.client.chat.completions.create(
            model=srv.model, messages=USER, max_tokens=200, temperature=1.0, seed=i, stream=i % 2 == 1,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i],
                                                                    "strict": True}})
        if i % 2:
            return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        return r.choices[0].message.content
    with ThreadPoolExecutor(4) as ex:
        for s, text in zip(schemas, ex.map(ask, range(20))):
            jsonschema.validate(json.loads(text), s)
    # json_object beside free requests in one batch; a regex (extension)
    free = srv.client.chat.completions.create(model=srv.model, messages=USER, max_tokens=12, temperature=0)
    r = srv.client.chat.completions.create(model=srv.model, messages=USER, max_tokens=150, temperature=0,
                                           response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)
    assert free.choices[0].message.content != r.choices[0].message.content
    text = completion(srv, "Call me at", max_tokens=20, temperature=1.0, extra_body={"regex": r"[0-9]{3}-[0-9]{4}"})[0]
    assert len(text) == 8 and text[3] == "-" and (text[:3] + text[4:]).isdigit()
    # llama-server's GBNF, and Lark
    for grammar in ('root ::= "yes" | "no" | "maybe"', 'start: ("yes" | "no" | "maybe")'):
        for seed in range(3):
            assert completion(srv, "Well?", max_tokens=20, temperature=1.0, seed=seed,
                              extra_body={"grammar": grammar})[0] in ("yes", "no", "maybe")


# ------------------------------------------------------------------------------------------------- langchain, agents
def test_langchain_openai_invoke_stream_structured_output_and_bind_tools(srv):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, ConfigDict, Field

    def chat_model(max_tokens):
        return ChatOpenAI(base_url=srv.url + "v1", api_key="none", model=srv.model, temperature=0,
                          max_tokens=max_tokens, max_retries=0)
    llm = chat_model(12)
    said = llm.invoke("What is the weather in Paris?")
    assert said.content and said.usage_metadata["output_tokens"] <= 12
    assert "".join(c.content for c in llm.stream("What is the weather in Paris?")) == said.content

    class Weather(BaseModel):
        model_config = ConfigDict(extra="forbid")  # no extra keys: a random model would add them without end
        city: str = Field(max_length=8)
        sunny: bool
        degrees: int = Field(ge=-30, le=45)

    for method in ("json_schema", "function_calling"):
        got = chat_model(200).with_structured_output(Weather, method=method).invoke("Weather in Paris?")
        assert isinstance(got, Weather), method
    tooled = chat_model(300).bind_tools([WEATHER], tool_choice="any")
    msg = tooled.invoke("Weather in Oslo?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert msg.tool_calls[0]["args"]["city"] in ("Paris", "Oslo", "Lima")


def test_openai_agents_sdk_calls_its_function_tool(srv):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    set_tracing_disabled(True)
    asked = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny in {city}"

    async def run():
        client = openai.AsyncOpenAI(base_url=srv.url + "v1", api_key="none", max_retries=0)
        agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                      model=OpenAIChatCompletionsModel(model=srv.model, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0))
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    result = asyncio.run(run())
    assert len(asked) >= 1 and isinstance(result.final_output, str)


# ------------------------------------------------------------------------------------------------- under load
def _leave_mid_stream(srv, **kw):
    stream = srv.client.chat.completions.create(model=srv.model, messages=USER, max_tokens=400, stream=True, **kw)
    for i, _ in enumerate(stream):
        if i >= 2:
            break
    stream.close()
    return 200


def test_8_clients_with_every_feature_disconnects_and_bad_requests(srv):
    """No 5xx, no slot left busy, and the same greedy text afterwards."""
    c = srv.client
    want = completion(srv, "The sky", max_tokens=12, temperature=0)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}

    def ok(f):
        def run():
            f()
            return 200
        return run
    work = [
        ok(lambda: c.chat.completions.create(model=srv.model, messages=USER, max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})),
        ok(lambda: c.chat.completions.create(model=srv.model, messages=USER, tools=[WEATHER], tool_choice="required",
                                             max_tokens=300, stream=True).close()),
        ok(lambda: c.chat.completions.create(model=srv.model, messages=USER, max_tokens=8, n=2, logprobs=True,
                                             top_logprobs=2, presence_penalty=1, logit_bias={"5": 3})),
        ok(lambda: list(c.completions.create(model=srv.model, prompt="The sky", max_tokens=8, top_p=0.5,
                                             stream=True, echo=True))),
        lambda: _leave_mid_stream(srv),
        lambda: _leave_mid_stream(srv, tools=[WEATHER], tool_choice="required"),
        lambda: srv.post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "audio": {}}')[0],
        lambda: srv.post("/v1/completions", b'{"prompt": "x", "regex": "(unclosed"}')[0],
        lambda: srv.post("/v1/completions", b'{"prompt": "x", "max_tokens": 2')[0],
        lambda: srv.post("/v1/chat/completions", json.dumps({"messages": USER, "tools": [WEATHER],
                                                             "tool_choice": "sometimes"}).encode())[0],
    ] * 2
    with ThreadPoolExecutor(8) as ex:
        statuses = list(ex.map(lambda f: f(), work))
    assert all(s < 500 for s in statuses) and statuses.count(400) == 8, statuses
    assert_serves_as_before(srv, want)


# ------------------------------------------------------------------------------------------------- default model
def test_default_model_with_each_client():
    """The default model (SmolLM2, whose own template takes no tools: server_tools.jinja gives it Hermes tools): the
    openai client's forced call and JSON schema, langchain's structured output and the Agents SDK's tool."""
    from common import default_checkpoint
    default_checkpoint()
    s = ServerProcess("--full_batch_size", 4, "--max_seq_length", 2048, "--threads", 2, "--chat_template",
                      REPO / "server_tools.jinja")
    try:
        r = s.client.chat.completions.create(model=s.model, messages=USER, tools=[WEATHER], tool_choice="required",
                                             max_tokens=80, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls"
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
        schema = {"type": "object", "properties": {"capital": {"type": "string"}, "population_millions": {
            "type": "number"}}, "required": ["capital", "population_millions"], "additionalProperties": False}
        r = s.client.chat.completions.create(
            model=s.model, messages=[{"role": "user", "content": "The capital of France, as JSON."}], max_tokens=80,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
        got = json.loads(r.choices[0].message.content)
        jsonschema.validate(got, schema)
        assert "Paris" in got["capital"]

        from langchain_openai import ChatOpenAI
        from pydantic import BaseModel
        llm = ChatOpenAI(base_url=s.url + "v1", api_key="none", model=s.model, temperature=0, max_tokens=80)

        class Capital(BaseModel):
            city: str
            country: str
        cap = llm.with_structured_output(Capital, method="json_schema").invoke("What is the capital of France?")
        assert isinstance(cap, Capital) and "Paris" in cap.city
        msg = llm.bind_tools([WEATHER], tool_choice="any").invoke("What is the weather in Paris?")
        assert msg.tool_calls[0]["args"] == {"city": "Paris"}

        from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
        set_tracing_disabled(True)
        asked = []

        @function_tool
        def get_weather(city: str) -> str:
            """The weather in a city."""
            asked.append(city)
            return f"Sunny, 21 degrees in {city}"
        agent = Agent(name="weather", instructions="Use the weather tool, then answer.", tools=[get_weather],
                      model=OpenAIChatCompletionsModel(model=s.model, openai_client=openai.AsyncOpenAI(
                          base_url=s.url + "v1", api_key="none", max_retries=0)),
                      model_settings=ModelSettings(tool_choice="required", max_tokens=80, temperature=0))
        result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
        assert asked and "Paris" in asked[0] and result.final_output
    finally:
        s.stop()
