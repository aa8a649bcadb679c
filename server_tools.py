# server_tools.py: function calling for server.py. The tools go into the prompt through the model's own Jinja chat
# template (Qwen2.5/3, Llama 3.1+/3.2, Mistral, SmolLM3 and Hermes-style templates take `tools`); the model's reply is
# parsed back into OpenAI tool_calls. The call syntax is read off the template:
#     hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen, SmolLM3, Hermes, ...)
#     llama3   {"name": ..., "parameters": {...}} as the whole reply, maybe after <|python_tag|> (Llama 3.1+)
#     mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (Mistral)
# tool_choice "required" or a named function becomes a grammar (server_grammar.py) that forces that syntax.
import json
import re
import uuid
from dataclasses import dataclass, field

COMPACT = {"whitespace_flexible": False}  # llguidance's JSON options: no free whitespace between the tokens
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def detect_format(template: str):
    """The tool-call syntax a chat template teaches its model, or None when the template takes no tools."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    if "<|eot_id|>" in template or "<|python_tag|>" in template:
        return "llama3"
    return "hermes"  # templates that take tools without saying how calls look: Hermes' convention


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index=None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def _call(obj, names, fmt=None) -> ToolCall | None:
    """{"name", "arguments" | "parameters"} naming a known tool -> a ToolCall, else None. Mistral's templates refuse a
    call id that is not 9 letters and digits (raise_exception when the call comes back in the history): its ids are
    that (vLLM's form); others get OpenAI's call_ form."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    call = ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
    if fmt == "mistral":
        call.id = uuid.uuid4().hex[:9]
    return call


def _json_values(text: str) -> list:
    """The JSON values written one after another (separated by whitespace, ',' or ';'); [] if the text is not that."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i == len(text):
            break
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return []
        out.extend(v if isinstance(v, list) else [v])
    return out


def parse(fmt: str, text: str, names: set) -> tuple:
    """The model's reply -> (content or None, [ToolCall]). Text that is no well-formed call stays content."""
    calls = []
    if fmt == "hermes":
        for m in HERMES_CALL.finditer(text):
            calls += [c for c in map(lambda v: _call(v, names), _json_values(m.group(1))) if c]
        content = HERMES_CALL.sub("", text).strip() if calls else text
    else:
        head = {"llama3": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}[fmt]
        body = text.strip()
        start = body.find(head)
        if start >= 0:
            body = body[start + len(head):]
        elif not body.startswith(("{", "[")):
            return text, []
        values = _json_values(body)
        calls = [c for c in (_call(v, names, fmt) for v in values) if c]
        if len(calls) != len(values):
            return text, []
        content = text[:start].strip() if start > 0 else ""
    return (content or None) if calls else text, calls


def opening(fmt: str) -> str:
    """The text that starts a tool call: streaming holds the reply back from it on (llama3: a reply that starts
    with '{' is held back whole)."""
    return {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}[fmt]


def call_schema(tools: list) -> dict:
    """The JSON schema of one call of one of these tools: {"name": <its name>, "arguments": <its parameters>}."""
    return {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


def forced_grammar(fmt: str, tools: list, many: bool, special: dict) -> str:
    """A Lark grammar (llguidance's dialect) that admits only tool calls of these tools in the model's syntax: one,
    or with `many` one or more. `special`: the tokenizer's special tokens (text -> id), written as <[id]>."""
    schema = call_schema(tools)
    if fmt == "llama3":
        schema = {"anyOf": [{**s, "properties": {"name": s["properties"]["name"],
                                                 "parameters": s["properties"]["arguments"]},
                             "required": ["name", "parameters"]} for s in schema["anyOf"]]}
    lit = lambda s: f"<[{special[s]}]>" if s in special else json.dumps(s)
    schema = {**schema, "x-guidance": COMPACT}
    js, nl = f"%json {json.dumps(schema)}", json.dumps("\n")
    if fmt == "hermes":
        more = f" ({nl} one)*" if many else ""
        return f'start: one{more}\none: {lit("<tool_call>")} {nl} call {nl} {lit("</tool_call>")}\ncall: {js}\n'
    if fmt == "mistral":
        more = ' (", " call)*' if many else ""
        return f'start: {lit("[TOOL_CALLS]")} "[" call{more} "]"\ncall: {js}\n'
    more = ' ("; " call)*' if many else ""
    return f"start: call{more}\ncall: {js}\n"


def check_tools(tools, choice) -> tuple:
    """Validate `tools` and `tool_choice`; returns (tools, "auto" | "none" | "required" | a function name).
    Raises ValueError(message, param)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}", "tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                             "(only function tools are supported)", "tools")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return tools, "auto"
    if choice in ("auto", "none", "required"):
        return tools, choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in names:
            return tools, name
        raise ValueError(f"tool_choice names the function {json.dumps(name)}, which is not in 'tools'", "tool_choice")
    raise ValueError("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                     "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def template_message(m: dict, i: int) -> dict:
    """An OpenAI assistant message with tool_calls or a tool message -> the form HF chat templates read (arguments as
    a dict, tool_call_id kept). Raises ValueError(message)."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m["role"] == "tool":
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}]: a tool message needs 'content' (the tool's result as a string)")
        out["tool_call_id"] = m.get("tool_call_id")
        if m.get("name"):
            out["name"] = m["name"]
        return out
    calls = []
    for c in m["tool_calls"]:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ValueError(f"messages[{i}].tool_calls: each call needs function.name and function.arguments")
        args = f.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise ValueError(f"messages[{i}].tool_calls: function.arguments is not JSON") from None
        calls.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args},
                      "name": f["name"], "arguments": args})
    out["tool_calls"] = calls
    return out
