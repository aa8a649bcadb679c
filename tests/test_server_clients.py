# server.py against the clients people point at it, offline: the `openai` client for every request field (logprobs,
# n, penalties, logit_bias, echo, response_format, tools), langchain-openai (invoke, stream, with_structured_output,
# bind_tools) and the OpenAI Agents SDK (one function tool through its chat-completions model). A tiny random model
# whose chat template is server_tools.jinja (Hermes-style tools, as Qwen2.5's); its prompts are checked against
# transformers' own rendering of that template. Structured output is validated with `jsonschema` on 20 generated schemas.
import asyncio
import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from conftest import REPO
from test_server import SLOTS, ServerProcess, cli_text, completion, make_checkpoint

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
