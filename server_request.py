# server_request.py: server.py's request checking. A chat or completion body becomes one Options (the prompt ids and
# everything that shapes the reply) or an ApiError (a 4xx JSON error naming the field). Every field a request may carry
# is listed in CHAT_FIELDS / COMPLETION_FIELDS: any other field is refused by name, so nothing is silently ignored.
# Fields accepted without effect on the reply: user, store (false), metadata, service_tier, prompt_cache_key,
# safety_identifier (bookkeeping of OpenAI's own service).
import json
from dataclasses import dataclass, field as dfield
from typing import Optional

import server_tools as T
from server_grammar import GrammarError

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "metadata", "service_tier",
          "store", "prompt_cache_key", "safety_identifier", "response_format", "ignore_eos", "top_k", "regex",
          "grammar"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "parallel_tool_calls"}
COMPLETION_FIELDS = COMMON | {"prompt", "max_completion_tokens", "echo", "suffix", "best_of"}


class ApiError(Exception):
    """A bad request: answered as {"error": {"message", "type", "param", "code"}} with a 4xx status."""

    def __init__(self, status: int, message: str, param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message, type="invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def field(body: dict, name: str, kind, default=None, check=None, why=""):
    """body[name] (absent or null: default) if it has the JSON type `kind` and passes check, else a 400."""
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, kind) and not (isinstance(v, bool) and kind is not bool)
    if not ok or (check and not check(v)):
        raise ApiError(400, f"'{name}' must be {why or kind.__name__}, got {json.dumps(v)[:80]}", name)
    return v


@dataclass
class Options:
    """One request, checked: what the Engine and a Job need to produce its choices."""
    ids: list
    chat: bool
    max_tokens: int
    stops: list
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    seed: Optional[int] = None
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    logprobs: Optional[int] = None       # None: none; k: the chosen token's logprob and the k likeliest
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = dfield(default_factory=dict)  # token id -> added to its logit
    echo: str = ""                       # completions: the prompt text put before the reply
    grammar: Optional[str] = None        # an llguidance grammar the reply must follow
    grammar_param: str = ""              # the field it comes from
    tool_format: Optional[str] = None    # server_tools.py's call syntax, when the reply is parsed for tool calls
    tool_names: set = dfield(default_factory=set)
    parallel_calls: bool = True          # parallel_tool_calls: false keeps the first call only


def chat_message(m, i: int) -> dict:
    """One OpenAI chat message -> the dict the chat template reads (text content, or a list of text parts; tool calls
    and tool results as HF templates expect them)."""
    if not isinstance(m, dict):
        raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'", "messages")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise ApiError(400, f"messages[{i}]: unknown role {json.dumps(role)} (expected one of {', '.join(ROLES)})",
                       "messages")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"messages[{i}]: only text content parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if role == "tool" or (role == "assistant" and m.get("tool_calls")):
        try:
            return T.template_message({**m, "role": role, "content": content}, i)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}]: 'content' must be a string", "messages")
    return {"role": ROLES[role], "content": content}


def response_grammar(body: dict, grammars) -> Optional[str]:
    """response_format / regex / grammar -> an llguidance grammar (None: free text)."""
    fmt = field(body, "response_format", dict)
    given = [k for k in ("regex", "grammar") if body.get(k) is not None] + \
        (["response_format"] if fmt and fmt.get("type") != "text" else [])
    if len(given) > 1:
        raise ApiError(400, f"{' and '.join(given)} cannot be combined: give one of them", given[1])
    try:
        if body.get("regex") is not None:
            return grammars.regex(field(body, "regex", str))
        if body.get("grammar") is not None:
            return grammars.gbnf_or_lark(field(body, "grammar", str))
        if not fmt or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return grammars.json_schema({"type": "object"})
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ApiError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                    "{...}}}", "response_format")
            return grammars.json_schema(spec.get("schema") or {"type": "object"})
    except GrammarError as e:
        raise ApiError(400, str(e), next(iter(given), "response_format")) from None
    raise ApiError(400, f"response_format type {json.dumps(fmt.get('type'))} is not supported (text, json_object, "
                        "json_schema)", "response_format")


def tool_grammar(fmt, tools, choice, many, special, answer: Optional[str]) -> Optional[str]:
    """The grammar a tool_choice imposes: "required" / a named function force a call; "auto" with a response format
    lets the reply be a call or that format."""
    forced = choice not in ("auto", "none")
    if not forced and answer is None:
        return None
    pick = [t for t in tools if t["function"]["name"] == choice] if choice not in ("auto", "required") else tools
    lark = T.forced_grammar(fmt, pick, many, special).replace("start:", "calls:", 1)
    if forced:
        return "start: calls\n" + lark
    try:
        schema = json.loads(answer)["grammars"][0]["json_schema"]
    except (ValueError, KeyError, IndexError):
        raise ApiError(400, "tools with tool_choice auto combine with a JSON response_format only", "tools") from None
    return f"start: calls | answer\nanswer: %json {json.dumps({**schema, 'x-guidance': T.COMPACT})}\n" + lark


def parse_request(body: dict, chat: bool, srv) -> Options:
    """Check a request body against the server `srv` (its tokenizer, context, slots, grammars). Raises ApiError."""
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if unknown:
        raise ApiError(400, f"unsupported field '{unknown[0]}': this server does not implement it "
                            f"(refused rather than ignored)", unknown[0])
    model = body.get("model")
    if model not in (None, "", srv.name):
        raise ApiError(404, f"The model `{model}` does not exist: this server serves `{srv.name}`", "model",
                       "model_not_found")
    if field(body, "store", bool, False):
        raise ApiError(400, "'store' must be false: this server keeps no completions", "store")
    slots = len(srv.engine.req)
    n = field(body, "n", int, 1, lambda v: 1 <= v <= slots, f"an integer in [1, {slots}] (the server's slots)")
    opts = dict(n=n)
    if not chat:
        if body.get("suffix") not in (None, ""):
            raise ApiError(400, "'suffix' (fill in the middle) is not supported", "suffix")
        field(body, "best_of", int, n, lambda v: v == n, f"equal to n ({n}): best_of > n is not supported")
    grammar = response_grammar(body, srv.grammars)
    opts["grammar_param"] = next((k for k in ("regex", "grammar") if body.get(k) is not None), "response_format")
    tool_names: set = set()
    if chat:
        messages = field(body, "messages", list, None, len, "a non-empty list of messages")
        if messages is None:
            raise ApiError(400, "'messages' is required", "messages")
        messages = [chat_message(m, i) for i, m in enumerate(messages)]
        tools, variables = None, {}
        if body.get("tools") is not None or body.get("tool_choice") not in (None, "none", "auto"):
            try:
                tools, choice = T.check_tools(body.get("tools"), body.get("tool_choice"))
            except ValueError as e:
                raise ApiError(400, *e.args) from None
            fmt = T.detect_format(srv.tok.chat_template)
            if fmt is None:
                raise ApiError(400, f"the chat template of {srv.name} has no tool support (it takes no `tools`): "
                                    "function calling needs a model whose template does, or --chat_template FILE",
                               "tools")
            many = field(body, "parallel_tool_calls", bool, True)
            if choice != "none":
                variables["tools"] = tools
                opts.update(tool_format=fmt, tool_names={t["function"]["name"] for t in tools}, parallel_calls=many)
                opts["grammar_param"] = "tools" if choice != "auto" else opts["grammar_param"]
                try:
                    g = tool_grammar(fmt, tools, choice, many, srv.tok.special_tokens, grammar)
                    grammar = srv.grammars.lark(g) if g else grammar
                except GrammarError as e:
                    raise ApiError(400, str(e), "tools") from None
        try:
            ids = srv.tok.encode(srv.render(messages, **variables), bos=False)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' is required and must be a string (one prompt per request)", "prompt")
        ids = srv.tok.encode(prompt)
        if field(body, "echo", bool, False):
            opts["echo"] = prompt
    if not ids:
        raise ApiError(400, "the prompt is empty (and the tokenizer adds no BOS): nothing to condition on")
    if len(ids) >= srv.context:
        raise ApiError(400, f"This model's maximum context length is {srv.context} tokens, but the prompt has "
                            f"{len(ids)} tokens (the reply needs at least one more).",
                       "messages" if chat else "prompt", "context_length_exceeded")
    positive = dict(check=lambda v: v >= 1, why="an integer >= 1")
    max_tokens = field(body, "max_completion_tokens", int, None, **positive)
    if max_tokens is None:
        max_tokens = field(body, "max_tokens", int, srv.context - len(ids) if chat else 16, **positive)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", "stop")
    if chat:
        want = field(body, "logprobs", bool, False)
        top = field(body, "top_logprobs", int, None, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
        if top is not None and not want:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        opts["logprobs"] = (top or 0) if want else None
    else:
        opts["logprobs"] = field(body, "logprobs", int, None, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
        if opts["logprobs"] is not None and opts.get("echo"):
            raise ApiError(400, "'echo' with 'logprobs' (the prompt's logprobs) is not supported", "echo")
    if grammar and field(body, "ignore_eos", bool, False):
        raise ApiError(400, "'ignore_eos' cannot be combined with a response format, regex, grammar or forced tool "
                            "call: the reply ends where its grammar does", "ignore_eos")
    penalty = dict(check=lambda v: -2 <= v <= 2, why="a number in [-2, 2]")
    bias = field(body, "logit_bias", dict, {})
    vocab = srv.grammars.vocab_size
    try:
        bias = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise ApiError(400, "'logit_bias' maps token ids to numbers in [-100, 100]", "logit_bias") from None
    if not all(0 <= k < vocab and -100 <= v <= 100 for k, v in bias.items()):
        raise ApiError(400, f"'logit_bias' maps token ids (< {vocab}) to numbers in [-100, 100]", "logit_bias")
    return Options(
        ids, chat, max_tokens, [s for s in stops if s],
        temperature=float(field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")),
        top_p=float(field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=field(body, "top_k", int, None, lambda v: v >= 0, "an integer >= 0") or None,  # vLLM's extension
        seed=field(body, "seed", int), ignore_eos=field(body, "ignore_eos", bool, False),
        stream=field(body, "stream", bool, False),
        include_usage=bool(field(body, "stream_options", dict, {}).get("include_usage")),
        presence_penalty=float(field(body, "presence_penalty", (int, float), 0.0, **penalty)),
        frequency_penalty=float(field(body, "frequency_penalty", (int, float), 0.0, **penalty)),
        logit_bias=bias, grammar=grammar, **opts)
