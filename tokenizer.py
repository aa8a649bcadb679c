# Tokenizers for LLaMA-family checkpoints, read from a Hugging Face tokenizer.json, a SentencePiece tokenizer.model,
# or the vocabulary embedded in a GGUF file.
#
# Over 500 lines because it holds two tokenizer families (SentencePiece, our own byte-level BPE with four
# pre-tokenizers), three file formats (tokenizer.json, tokenizer.model, GGUF), chat templates and streaming decode;
# the BPE is written out rather than borrowed so it can be checked against independent libraries.
#
#   * SentencePieceTokenizer (Llama 2, TinyLlama, Mistral v0.1): the sentencepiece library does the work.
#   * BPETokenizer (SmolLM2, Llama 3, Qwen2.5/3): byte-level BPE in pure Python, GPT-2 style:
#       text -> split out special tokens -> pre-tokenize (optional digit split, then a regex) -> map each UTF-8 byte to a
#       printable unicode char (bytes_to_unicode) -> apply merges by rank -> ids.
#
#   tok = load_tokenizer("checkpoints/SmolLM2-135M-Instruct")     # directory, tokenizer.json, tokenizer.model or *.gguf
#   ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
#   s = tok.stream(); print("".join(s.put(i) for i in ids) + s.flush())
import json
import os
import tempfile
import unicodedata
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Optional

import regex

# Pre-tokenization regexes (`regex` module syntax), as in the Hugging Face tokenizer.json files and llama.cpp.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
DIGIT_PATTERN = r"\p{N}"  # Hugging Face Digits(individual_digits=True): every numeric char is its own pre-token

# GGUF tokenizer.ggml.pre -> (pattern, digits_split, NFC normalizer, ignore_merges), following llama.cpp's llama-vocab.cpp.
# ("default" is treated as plain GPT-2; llama.cpp's own "default" regex list differs slightly.)
_GPT2 = (GPT2_PATTERN, False, False, False)
_DIGITS_GPT2 = (GPT2_PATTERN, True, False, False)
_LLAMA3 = (LLAMA3_PATTERN, False, False, True)
_QWEN2 = (QWEN2_PATTERN, False, True, False)
PRE_TYPES = {"gpt2": _GPT2, "gpt-2": _GPT2, "default": _GPT2, "phi-2": _GPT2,
             "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2,
             "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3,
             "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}

# tokens that end a turn / the text in the supported model families; those present become stop ids
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>")
# GGUF token types (same numbering as SentencePiece's piece types)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@lru_cache(maxsize=None)
def bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable unicode char map (space -> 'Ġ', newline -> 'Ċ', ...)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    kind = ""

    def __init__(self, vocab_size: int, bos_id: Optional[int], eos_id: int, add_bos: bool,
                 special_tokens: dict, chat_template: Optional[str] = None, stop_ids=()):
        self.vocab_size, self.bos_id, self.eos_id, self.add_bos = vocab_size, bos_id, eos_id, add_bos
        self.special_tokens = dict(special_tokens)  # text -> id, matched literally in encode() input
        self.special_text = {i: t for t, i in self.special_tokens.items()}
        self.chat_template = chat_template
        self.stop_ids = {eos_id, *stop_ids} | {self.special_tokens[t] for t in END_TOKENS if t in self.special_tokens}
        alts = sorted(self.special_tokens, key=len, reverse=True)  # longest first = leftmost-longest match
        self._special_rx = regex.compile("|".join(map(regex.escape, alts))) if alts else None

    def token_text(self, i: Optional[int]) -> Optional[str]:
        return None if i is None else self.special_text.get(i)

    def encode(self, text: str, bos: Optional[bool] = None) -> list:
        """Text -> ids. Special tokens written in the text ("<|im_start|>") become their ids. With bos (default:
        self.add_bos) BOS is prepended, unless the text itself already starts with the BOS token (chat templates)."""
        ids = []
        pos = 0
        for m in self._special_rx.finditer(text) if self._special_rx else ():
            ids += self._encode_ordinary(text[pos:m.start()]) if m.start() > pos else []
            ids.append(self.special_tokens[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self._encode_ordinary(text[pos:])
        if (self.add_bos if bos is None else bos) and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def _encode_ordinary(self, text: str) -> list:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json chat_template / GGUF "
                             "tokenizer.chat_template); use a plain prompt instead")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.token_text(self.bos_id) or "", eos_token=self.token_text(self.eos_id) or "")

    def __repr__(self):
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"add_bos={self.add_bos}, stop_ids={sorted(self.stop_ids)})")


def render_chat_template(template: str, messages: list, add_generation_prompt: bool = True, **variables) -> str:
    """Render a Hugging Face Jinja chat template the way transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except Exception as e:  # template errors, raise_exception(), or e.g. TypeError on a None content
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from None


class StreamDecoder:
    """Incremental detokenizer. put(id) returns the newly completed text: it decodes a small window of recent tokens
    with one already-printed token group as context (keeps SentencePiece's leading spaces) and emits the difference,
    holding text back while it ends in an incomplete UTF-8 sequence (U+FFFD). flush() returns whatever is left."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.ids, self.prefix, self.read = tok, [], 0, 0

    def put(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        done = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        if len(text) > len(done) and (final or not text.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done):]
        return ""


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 / SmolLM2 / Llama 3 / Qwen2), pure Python."""
    kind = "bpe"

    def __init__(self, vocab: dict, merges: list, special_tokens: dict, pattern: str, digits_split: bool = False,
                 nfc: bool = False, ignore_merges: bool = False, add_prefix_space: bool = False, **meta):
        self.vocab = vocab                                   # byte-level-unicode token string -> id
        self.merges = [tuple(m) for m in merges]             # rank order
        self.pattern, self.digits_split, self.nfc = pattern, digits_split, nfc
        self.ignore_merges, self.add_prefix_space = ignore_merges, add_prefix_space
        self.ranks = {m: r for r, m in enumerate(self.merges)}
        self.id_to_token = {i: t for t, i in vocab.items()}
        self.unk_id = meta.pop("unk_id", None)
        ids = list(vocab.values()) + list(special_tokens.values())
        super().__init__(vocab_size=max(ids) + 1, special_tokens=special_tokens, **meta)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._rx = regex.compile(pattern)
        self._digits_rx = regex.compile(DIGIT_PATTERN)
        self._cache, self._bytes = {}, {}

    def token_text(self, i):
        return None if i is None else self.special_text.get(i, self.id_to_token.get(i))

    def pre_tokenize(self, text: str) -> list:
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        if self.add_prefix_space and not text.startswith(" "):
            text = " " + text
        chunks = _split_isolated(self._digits_rx, text) if self.digits_split else [text]
        return [w for c in chunks for w in _split_isolated(self._rx, c)]

    def _encode_ordinary(self, text: str) -> list:
        ids = []
        for word in self.pre_tokenize(text):
            ids += self._cache.get(word) or self._bpe(word)
        return ids

    def _bpe(self, word: str) -> list:
        parts = [self.byte_encoder[b] for b in word.encode("utf-8")]
        joined = "".join(parts)
        if self.ignore_merges and joined in self.vocab:
            parts = [joined]
        while len(parts) > 1:  # merge the lowest-rank adjacent pair everywhere, until no pair has a merge
            rank = min(self.ranks.get(pair, 1 << 62) for pair in zip(parts, parts[1:]))
            if rank == 1 << 62:
                break
            a, b = self.merges[rank]
            out, i = [], 0
            while i < len(parts):
                if parts[i] == a and i + 1 < len(parts) and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out
        ids = [self.vocab.get(p, self.unk_id) for p in parts]
        ids = [i for i in ids if i is not None]  # a byte missing from the vocab (and no unk): dropped, as HF does
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[word] = ids
        return ids

    def _token_bytes(self, i: int) -> bytes:
        b = self._bytes.get(i)
        if b is None:
            if i in self.special_text:
                b = self.special_text[i].encode("utf-8")
            else:
                t = self.id_to_token.get(i, "")
                b = bytes(self.byte_decoder[c] for c in t) if all(c in self.byte_decoder for c in t) else t.encode()
            self._bytes[i] = b
        return b

    def decode(self, ids, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        return b"".join(self._token_bytes(i) for i in ids if not (skip_special and i in self.special_text)).decode(
            "utf-8", errors="replace")


def _split_isolated(rx, text: str) -> list:
    """Split text at every match of rx, keeping matches and the gaps between them (HF Split behavior "Isolated")."""
    out, pos = [], 0
    for m in rx.finditer(text):
        if m.start() > pos:
            out.append(text[pos:m.start()])
        if m.end() > m.start():
            out.append(m.group())
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece model (Llama 2 style) through the sentencepiece library."""
    kind = "sentencepiece"

    def __init__(self, sp, add_bos: bool = True, chat_template: Optional[str] = None, stop_ids=()):
        self.sp = sp
        n = sp.get_piece_size()
        special = {sp.id_to_piece(i): i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)}
        special = {t: i for t, i in special.items() if t}
        if sp.eos_id() < 0:
            raise ValueError("SentencePiece model has no EOS piece")
        super().__init__(vocab_size=n, bos_id=sp.bos_id() if sp.bos_id() >= 0 else None, eos_id=sp.eos_id(),
                         add_bos=add_bos, special_tokens=special, chat_template=chat_template, stop_ids=stop_ids)

    def _encode_ordinary(self, text: str) -> list:
        return self.sp.encode(text)

    def decode(self, ids, skip_special: bool = False) -> str:  # control tokens (<s>, </s>) always decode to ""
        return self.sp.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])


# ---------------------------------------------------------------------------------------------------------------------
# loading


def load_tokenizer(path) -> Tokenizer:
    """Load from a directory (tokenizer.json, else tokenizer.model), a tokenizer.json, a tokenizer.model or a *.gguf."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path not found: {p}")
    if p.is_dir():
        js, sp = p / "tokenizer.json", p / "tokenizer.model"
        if js.is_file():
            try:
                return _load_tokenizer_json(js)
            except _NotByteLevel:
                if not sp.is_file():
                    raise ValueError(f"{js}: not a byte-level BPE tokenizer and there is no tokenizer.model next to it")
        if sp.is_file():
            return _load_sentencepiece(sp)
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in directory {p}")
    with open(p, "rb") as f:
        head = f.read(4)
    if p.suffix == ".gguf" or head == b"GGUF":
        return _load_gguf(p)
    if p.suffix == ".json" or head[:1] == b"{":
        try:
            return _load_tokenizer_json(p)
        except _NotByteLevel as e:
            raise ValueError(str(e)) from None
    return _load_sentencepiece(p)


class _NotByteLevel(ValueError):
    pass


def _read_json(path: Path, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a valid {what} ({type(e).__name__}: {e})") from None


def _token_name(t):
    return t.get("content") if isinstance(t, dict) else t  # tokenizer_config tokens are strings or AddedToken dicts


def _hf_metadata(d: Path) -> dict:
    """What tokenizer_config.json / generation_config.json / chat_template.jinja next to the tokenizer say."""
    cfg = _read_json(d / "tokenizer_config.json", "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    gen = _read_json(d / "generation_config.json", "generation_config.json") if (d / "generation_config.json").is_file() else {}
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        tpl = next((t["template"] for t in tpl if t.get("name") == "default"), tpl[0]["template"] if tpl else None)
    if (d / "chat_template.jinja").is_file():
        tpl = (d / "chat_template.jinja").read_text(encoding="utf-8")
    elif (d / "chat_template.json").is_file():
        tpl = _read_json(d / "chat_template.json", "chat_template.json").get("chat_template", tpl)
    gen_eos = gen.get("eos_token_id")
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    return dict(bos=_token_name(cfg.get("bos_token")), eos=_token_name(cfg.get("eos_token")),
                add_bos=cfg.get("add_bos_token"), chat_template=tpl, gen_bos=gen.get("bos_token_id"), gen_eos=gen_eos)


def _parse_pre_tokenizer(pt) -> tuple:
    """HF pre_tokenizer -> (pattern, digits_split, add_prefix_space). Supported: [Digits(individual)] then one regex
    (ByteLevel use_regex=True = GPT-2 regex, or Split(Regex, Isolated) + ByteLevel(use_regex=False))."""
    steps = pt.get("pretokenizers", []) if pt and pt.get("type") == "Sequence" else [pt] if pt else []
    if not any(s.get("type") == "ByteLevel" for s in steps):  # e.g. Llama 2's Metaspace / no pre_tokenizer
        raise _NotByteLevel("not a byte-level BPE tokenizer.json (no ByteLevel pre_tokenizer)")
    pattern, digits, prefix = None, False, False
    for s in steps:
        t = s.get("type")
        if t == "Digits" and s.get("individual_digits") and pattern is None:
            digits = True
        elif t == "Split" and pattern is None and s.get("behavior") == "Isolated" and not s.get("invert"):
            pat = s.get("pattern", {})
            pattern = pat["Regex"] if "Regex" in pat else regex.escape(pat.get("String", ""))
        elif t == "ByteLevel":
            prefix = bool(s.get("add_prefix_space"))
            if s.get("use_regex", True):
                if pattern is not None:
                    raise ValueError("unsupported pre_tokenizer: two regex splits")
                pattern = GPT2_PATTERN
        else:
            raise ValueError(f"unsupported pre_tokenizer step {json.dumps(s)[:200]}")
    return pattern or r"(?s).+", digits, prefix


def _load_tokenizer_json(path: Path) -> BPETokenizer:
    j = _read_json(path, "tokenizer.json")
    model = j.get("model") if isinstance(j, dict) else None
    if not isinstance(model, dict) or "vocab" not in model:
        raise ValueError(f"{path}: not a Hugging Face tokenizer.json (no model.vocab)")
    if model.get("type", "BPE") != "BPE":
        raise _NotByteLevel(f"{path}: tokenizer model type {model.get('type')} is not supported (byte-level BPE only)")
    try:
        pattern, digits, prefix = _parse_pre_tokenizer(j.get("pre_tokenizer"))
    except _NotByteLevel as e:
        raise _NotByteLevel(f"{path}: {e}") from None
    except (ValueError, AttributeError, KeyError) as e:
        raise ValueError(f"{path}: {e}") from None
    for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
        if model.get(k):
            raise ValueError(f"{path}: BPE option {k}={model[k]!r} is not supported")
    norm = j.get("normalizer")
    norms = norm.get("normalizers", []) if norm and norm.get("type") == "Sequence" else [norm] if norm else []
    if any(n.get("type") != "NFC" for n in norms):
        raise ValueError(f"{path}: unsupported normalizer {json.dumps(norm)[:200]}")
    try:
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
        if any(len(m) != 2 for m in merges):
            raise ValueError("a merge is not a pair")
        vocab = {str(t): int(i) for t, i in model["vocab"].items()}
        special = {t["content"]: int(t["id"]) for t in j.get("added_tokens", [])}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{path}: malformed vocab/merges/added_tokens ({e})") from None
    meta = _hf_metadata(path.parent)
    everything = {**vocab, **special}

    def tid(name):
        return everything.get(name) if name is not None else None

    eos = tid(meta["eos"])
    if eos is None:
        eos = meta["gen_eos"][0] if meta["gen_eos"] else next((special[t] for t in END_TOKENS if t in special), None)
    if eos is None:
        raise ValueError(f"{path}: cannot tell the EOS token (no tokenizer_config.json eos_token)")
    bos = tid(meta["bos"]) if meta["bos"] is not None else meta["gen_bos"]
    add_bos = meta["add_bos"]
    if add_bos is None:  # Llama 3 style: BOS added by a TemplateProcessing post-processor
        pp = j.get("post_processor") or {}
        pps = pp.get("processors", []) if pp.get("type") == "Sequence" else [pp]
        single = [x for p in pps if p.get("type") == "TemplateProcessing" for x in p.get("single", [])]
        add_bos = bool(single) and "SpecialToken" in single[0]
        if add_bos and bos is None:
            bos = tid(single[0]["SpecialToken"]["id"])
    return BPETokenizer(vocab, merges, special, pattern, digits_split=digits, nfc=bool(norms),
                        ignore_merges=bool(model.get("ignore_merges")), add_prefix_space=prefix,
                        unk_id=tid(model.get("unk_token")), bos_id=bos, eos_id=eos, add_bos=bool(add_bos),
                        chat_template=meta["chat_template"], stop_ids=meta["gen_eos"])


def _load_sentencepiece(path: Path = None, proto: bytes = None, **kw) -> SentencePieceTokenizer:
    import sentencepiece as spm
    if path is not None:
        with open(path, "rb") as f:
            first = f.readline(200)
        if regex.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\s*", first):
            raise ValueError(f"{path}: looks like a tiktoken BPE file (Llama 3 original/tokenizer.model); "
                             f"use the Hugging Face tokenizer.json instead")
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto) if proto is not None else sp.Load(str(path))
    except Exception as e:  # sentencepiece raises RuntimeError/OSError with multi-line C++ messages
        raise ValueError(f"{path or 'GGUF vocabulary'}: not a valid SentencePiece model "
                         f"({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})") from None
    if path is not None:
        meta = _hf_metadata(Path(path).parent)
        kw = dict(add_bos=True if meta["add_bos"] is None else bool(meta["add_bos"]),
                  chat_template=meta["chat_template"], stop_ids=meta["gen_eos"])
    return SentencePieceTokenizer(sp, **kw)


# ---------------------------------------------------------------------------------------------------------------------
# GGUF


def _read_gguf_tokenizer(path) -> dict:
    """The tokenizer.* key/values of a GGUF file as Python values."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
    try:
        from gguf import GGUFReader
        fields = GGUFReader(str(path)).fields
        kv = {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}
    except Exception as e:
        raise ValueError(f"{path}: unreadable GGUF file ({type(e).__name__}: {e})") from None
    if "tokenizer.ggml.model" not in kv or "tokenizer.ggml.tokens" not in kv:
        raise ValueError(f"{path}: GGUF file has no embedded tokenizer (tokenizer.ggml.model/tokens)")
    return kv


def _gguf_common(kv: dict, path) -> dict:
    tokens = kv["tokenizer.ggml.tokens"]
    types = kv.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    eos = kv.get("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise ValueError(f"{path}: GGUF tokenizer has no tokenizer.ggml.eos_token_id")
    stop = [kv[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if kv.get(k) is not None]
    return dict(tokens=tokens, types=types, bos=kv.get("tokenizer.ggml.bos_token_id"), eos=eos, stop=stop,
                unk=kv.get("tokenizer.ggml.unknown_token_id"), pad=kv.get("tokenizer.ggml.padding_token_id"),
                chat_template=kv.get("tokenizer.chat_template"), add_bos=kv.get("tokenizer.ggml.add_bos_token"))


def _gguf_pre(kv: dict, path) -> tuple:
    pre = kv.get("tokenizer.ggml.pre", "default")  # llama.cpp treats a missing pre as "default"
    if pre not in PRE_TYPES:
        raise ValueError(f"{path}: unsupported tokenizer.ggml.pre {pre!r} (supported: {', '.join(PRE_TYPES)})")
    return pre, PRE_TYPES[pre]


def _gguf_bpe(kv: dict, path) -> BPETokenizer:
    c = _gguf_common(kv, path)
    pre, (pattern, digits, nfc, ignore_merges) = _gguf_pre(kv, path)
    vocab = {}
    for i, t in enumerate(c["tokens"]):
        vocab.setdefault(t, i)
    special = {t: i for i, (t, ty) in enumerate(zip(c["tokens"], c["types"])) if ty in (UNKNOWN, CONTROL, USER_DEFINED)}
    merges = [tuple(m.split(" ")) for m in kv.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise ValueError(f"{path}: malformed tokenizer.ggml.merges entry")
    add_bos = c["add_bos"] if c["add_bos"] is not None else pattern == LLAMA3_PATTERN
    return BPETokenizer(vocab, merges, special, pattern, digits_split=digits, nfc=nfc, ignore_merges=ignore_merges,
                        bos_id=c["bos"], eos_id=c["eos"], add_bos=bool(add_bos), chat_template=c["chat_template"],
                        stop_ids=c["stop"])


def _gguf_sentencepiece_proto(kv: dict, path):
    """Rebuild a SentencePiece ModelProto (BPE, like Llama's tokenizer.model) from a GGUF "llama" vocabulary."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError as e:
        raise NotImplementedError(f"cannot build a SentencePiece model here ({e})") from None
    c = _gguf_common(kv, path)
    tokens, types = c["tokens"], c["types"]
    scores = kv.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    m = pb.ModelProto()
    for t, s, ty in zip(tokens, scores, types):
        m.pieces.add(piece=t, score=float(s), type=int(ty) if int(ty) in (1, 2, 3, 4, 5, 6) else NORMAL)
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = len(tokens)
    ts.byte_fallback = BYTE in types
    for field, key in (("unk", "unk"), ("bos", "bos"), ("eos", "eos"), ("pad", "pad")):
        i = c[key]
        setattr(ts, f"{field}_id", i if i is not None and 0 <= i < len(tokens) else -1)
        if i is not None and 0 <= i < len(tokens):
            setattr(ts, f"{field}_piece", tokens[i])
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = bool(kv.get("tokenizer.ggml.add_space_prefix", True))
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    return m, c


def _load_gguf(path) -> Tokenizer:
    kv = _read_gguf_tokenizer(path)
    kind = kv["tokenizer.ggml.model"]
    if kind == "gpt2":
        return _gguf_bpe(kv, path)
    if kind == "llama":
        m, c = _gguf_sentencepiece_proto(kv, path)
        add_bos = True if c["add_bos"] is None else bool(c["add_bos"])
        return _load_sentencepiece(proto=m.SerializeToString(), add_bos=add_bos, chat_template=c["chat_template"],
                                   stop_ids=c["stop"])
    raise ValueError(f"{path}: unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")


def _write_atomic(path: Path, data) -> None:
    data = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; these are ordinary readable files
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp) if os.path.exists(tmp) else None
        raise


def _hf_tokenizer_json(kv: dict, path) -> tuple:
    c = _gguf_common(kv, path)
    pre, (pattern, digits, nfc, ignore_merges) = _gguf_pre(kv, path)
    tokens, types = c["tokens"], c["types"]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": pattern == GPT2_PATTERN}
    if pattern == GPT2_PATTERN:
        steps = ([{"type": "Digits", "individual_digits": True}] if digits else []) + [byte_level]
    else:
        steps = [{"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}, byte_level]
    pre_tokenizer = steps[0] if len(steps) == 1 else {"type": "Sequence", "pretokenizers": steps}
    add_bos = c["add_bos"] if c["add_bos"] is not None else pattern == LLAMA3_PATTERN
    bos_text = tokens[c["bos"]] if c["bos"] is not None and 0 <= c["bos"] < len(tokens) else None
    if add_bos and bos_text is not None:
        b = {"SpecialToken": {"id": bos_text, "type_id": 0}}
        post = {"type": "TemplateProcessing",
                "single": [b, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [b, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": bos_text, "type_id": 1}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos_text: {"id": bos_text, "ids": [c["bos"]], "tokens": [bos_text]}}}
    else:
        post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": ty != USER_DEFINED} for i, (t, ty) in enumerate(zip(tokens, types))
             if ty in (UNKNOWN, CONTROL, USER_DEFINED)]
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
          "normalizer": {"type": "NFC"} if nfc else None, "pre_tokenizer": pre_tokenizer, "post_processor": post,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                    "vocab": vocab, "merges": list(kv.get("tokenizer.ggml.merges", []))}}
    return tj, c, bool(add_bos)


def save_tokenizer_from_gguf(gguf_path, out_dir) -> list:
    """Write the GGUF's tokenizer as files load_tokenizer(out_dir) (and transformers) read. Returns the file names."""
    kv = _read_gguf_tokenizer(gguf_path)
    kind = kv["tokenizer.ggml.model"]
    files = {}
    if kind == "gpt2":
        tj, c, add_bos = _hf_tokenizer_json(kv, gguf_path)
        files["tokenizer.json"] = json.dumps(tj, ensure_ascii=False, indent=1)
        cls = "PreTrainedTokenizerFast"
    elif kind == "llama":
        m, c = _gguf_sentencepiece_proto(kv, gguf_path)
        add_bos = True if c["add_bos"] is None else bool(c["add_bos"])
        files["tokenizer.model"] = m.SerializeToString()
        cls = "LlamaTokenizer"
    else:
        raise NotImplementedError(f"{gguf_path}: cannot export GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
    name = lambda i: c["tokens"][i] if i is not None and 0 <= i < len(c["tokens"]) else None  # noqa: E731
    cfg = {"tokenizer_class": cls, "add_bos_token": add_bos, "add_eos_token": False, "bos_token": name(c["bos"]),
           "eos_token": name(c["eos"]), "unk_token": name(c["unk"]), "pad_token": name(c["pad"]),
           "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30}
    if c["chat_template"]:
        cfg["chat_template"] = c["chat_template"]
    files["tokenizer_config.json"] = json.dumps(cfg, ensure_ascii=False, indent=2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for fname, data in files.items():
        _write_atomic(out / fname, data)
    return list(files)


if __name__ == "__main__":
    import sys
    if len(sys.argv) != 3:
        sys.exit('usage: python tokenizer.py PATH "text"   (PATH: checkpoint dir, tokenizer.json, tokenizer.model, *.gguf)')
    try:
        tok = load_tokenizer(sys.argv[1])
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    ids = tok.encode(sys.argv[2])
    print(tok)
    print(ids)
    print(repr(tok.decode(ids)))
