# Function calling through real chat templates, end to end with the `openai` client: Llama 3.1's and 3.2's and
# Mistral's templates exactly as their tokenizer_config.json carries them (tests/data/chat_templates/, copied from
# llama.cpp's models/templates, which fetches them from the Hugging Face repos: meta-llama/Llama-3.1-8B-Instruct,
# meta-llama/Llama-3.2-3B-Instruct, mistralai/Mistral-Nemo-Instruct-2407), on a tiny random model whose tokenizer
# has each family's special tokens. The prompt with tools must be what transformers renders from the same template;
# the reply is forced into the family's call syntax by tool_choice (the grammar server_tools.py builds), parsed into
# OpenAI tool_calls, streamed and not, and the call and its result go back through the template (Mistral's template
# refuses call ids that are not 9 letters and digits).
import json

import pytest
from conftest import REPO, TEXT, hf_to_model, tiny_hf
from test_server import ServerProcess
from test_server_clients import TIME, USER, WEATHER

TEMPLATES = REPO / "tests" / "data" / "chat_templates"
FAMILIES = {  # template -> (call syntax, special tokens, bos, eos)
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                                    "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                                         "<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                                         "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
                                                         "[/TOOL_RESULTS]"], "<s>", "</s>"),
}
FAMILIES["meta-llama-Llama-3.2-3B-Instruct"] = FAMILIES["meta-llama-Llama-3.1-8B-Instruct"]


def family_checkpoint(d, name):
    """A tiny random Llama whose BPE tokenizer has the family's special tokens and the real template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from checkpoint import checkpoint_state, save_checkpoint
    from tokenizer import load_tokenizer
    _, specials, bos, eos = FAMILIES[name]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d.mkdir(parents=True, exist_ok=True)
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token=bos, eos_token=eos, add_bos_token=False, chat_template=(TEMPLATES / f"{name}.jinja").read_text())))
    hf = tiny_hf("llama", seed=7, vocab_size=load_tokenizer(d).vocab_size, max_position_embeddings=2048)
    save_checkpoint(checkpoint_state(hf_to_model(hf)), d / "model.pth")
    return d


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def fam(request, tmp_path_factory):
    d = family_checkpoint(tmp_path_factory.mktemp("templates") / request.param, request.param)
    s = ServerProcess("--checkpoint_path", d / "model.pth", "--full_batch_size", 2, "--max_seq_length", 2048,
                      "--threads", 1)
    s.dir, s.fmt = d, FAMILIES[request.param][0]
    yield s
    s.stop()


def hf_prompt(d, messages, tools=None) -> list:
    """transformers' rendering of the checkpoint's own template (tokenizer_config.json), as token ids."""
    from transformers import PreTrainedTokenizerFast
    t = PreTrainedTokenizerFast.from_pretrained(str(d))
    return t.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                 return_dict=True)["input_ids"]


def check_id(fam, call_id):
    assert call_id.isalnum() and len(call_id) == 9 if fam.fmt == "mistral" else call_id.startswith("call_")


def test_tools_go_through_the_real_template_and_forced_calls_are_parsed(fam):
    import server_tools as T
    assert T.detect_format(json.loads((fam.dir / "tokenizer_config.json").read_text())["chat_template"]) == fam.fmt
    c = fam.client
    plain = c.chat.completions.create(model=fam.model, messages=USER, max_tokens=2)
    assert plain.usage.prompt_tokens == len(hf_prompt(fam.dir, USER))
    r = c.chat.completions.create(model=fam.model, messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                  max_tokens=200, temperature=0, parallel_tool_calls=False)  # (a random model
    # given the grammar of several calls may write calls until max_tokens: a cut reply is no call)
    assert r.usage.prompt_tokens == len(hf_prompt(fam.dir, USER, [WEATHER, TIME])) > plain.usage.prompt_tokens
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and choice.message.content is None
    for call in choice.message.tool_calls:
        check_id(fam, call.id)
        assert call.type == "function" and call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        assert args["city"] in ("Paris", "Oslo", "Lima") if call.function.name == "get_weather" else args == {}
    # tool_choice "none": the template renders no tools and nothing is parsed
    r = c.chat.completions.create(model=fam.model, messages=USER, tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens and not r.choices[0].message.tool_calls


def test_streamed_named_call_and_its_result_go_back_through_the_template(fam):
    c = fam.client
    chunks = [x for x in c.chat.completions.create(
        model=fam.model, messages=USER, tools=[WEATHER, TIME], max_tokens=200, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
        if x.choices]
    content = "".join(x.choices[0].delta.content or "" for x in chunks)
    assert content == ""  # neither the call's JSON nor [TOOL_CALLS] / <|python_tag|> leaks into the content
    calls = [t for x in chunks for t in x.choices[0].delta.tool_calls or []]
    assert [t.function.name for t in calls] == ["get_weather"] and calls[0].index == 0
    check_id(fam, calls[0].id)
    args = json.loads(calls[0].function.arguments)
    assert args["city"] in ("Paris", "Oslo", "Lima")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather",
                                                             "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 C"}]
    r = c.chat.completions.create(model=fam.model, messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
    ref = [history[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 C"}]
    assert r.usage.prompt_tokens == len(hf_prompt(fam.dir, ref, [WEATHER]))
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # an id the template refuses (Mistral: not 9 letters and digits) is a 400 naming the template's reason
    bad = [history[0], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "id": "call_1"}]},
           {**history[2], "tool_call_id": "call_1"}]
    if fam.fmt == "mistral":
        status, body = fam.post("v1/chat/completions", json.dumps(dict(model=fam.model, messages=bad,
                                                                       max_tokens=2)).encode())
        assert status == 400 and "length 9" in body["error"]["message"]
