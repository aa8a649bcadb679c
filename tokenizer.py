# Tokenizers for LLaMA-family checkpoints, read from a Hugging Face tokenizer.json, a SentencePiece tokenizer.model,
# or the vocabulary embedded in a GGUF file. The libraries do the tokenizing:
#
#   * BPETokenizer (SmolLM2/3, Llama 3, Qwen2.5/3, StarCoder2, Phi-4-mini, GPT-2, GPT-NeoX/MPT, Falcon): byte-level
#     BPE through the `tokenizers` library (tokenizer.json as shipped; _parse_pre_tokenizer tells tokenizer.bin's
#     exporter which of the C++ encoder's pre-tokenizers it is). Also tiktoken-format ranks (CodeGen2.5, XGen:
#     tokenizer.tiktoken + tiktoken_config.json), turned into the same kind of tokenizer.json by tokenizer_tiktoken.py.
#   * SentencePieceTokenizer (Llama 2, TinyLlama, Mistral, Mixtral, Codestral, Gemma 1/2/3, Phi-3): the sentencepiece
#     library, plus the added tokens past the model's pieces that tokenizer_config.json names (Phi-3's <|user|>...),
#     their lstrip / rstrip, and legacy=false's dummy prefix (only at the start of the text).
#   * A *.gguf is first turned into those files in memory by scripts/gguf_tokenizer.py (imported lazily; it imports
#     nothing from here).
#
# This file adds what the stages need on top: BOS handling, special tokens and stop ids from tokenizer_config.json /
# generation_config.json, chat templates (rendered as transformers does) and streaming decode.
#
#   tok = load_tokenizer("checkpoints/SmolLM2-135M-Instruct")     # directory, tokenizer.json, tokenizer.model or *.gguf
#   ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
#   s = tok.stream(); print("".join(s.put(i) for i in ids) + s.flush())
import json
import re
import sys
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Optional

from common import REPO, TIKTOKEN_FILES, TOKENIZER_FILES, first_line  # noqa: F401  (re-exported)

# The regex ByteLevel(use_regex=True) splits with (GPT-2's, `regex` module syntax): `pattern` of such a tokenizer,
# written into tokenizer.bin for the C++ encoder. Split-regex tokenizers (Llama 3, Qwen2) carry theirs in the file.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Falcon's pre-tokenizer pipeline (Punctuation, ByteLevel with GPT-2's regex, Digits, Split [0-9]{3}): no one regex;
# BPETokenizer.pattern names it with this string (tokenizer.bin's C++ encoder implements it)
FALCON_PIPELINE = "falcon: Punctuation(Contiguous) + ByteLevel(GPT-2 regex) + Digits(contiguous) + [0-9][0-9][0-9]"
# Unicode White_Space: what an added token's lstrip / rstrip takes in (as the `tokenizers` library does)
WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# tokens that end a turn / the text in the supported model families; those present become stop ids
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>",
              "<eos>")


@lru_cache(maxsize=None)
def bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable unicode char map (space -> 'Ġ', newline -> 'Ċ', ...): how byte-level
    vocabularies spell bytes."""
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

    def token_text(self, i: Optional[int]) -> Optional[str]:
        return None if i is None else self.special_text.get(i)

    def encode(self, text: str, bos: Optional[bool] = None) -> list:
        """Text -> ids. Special tokens written in the text ("<|im_start|>") become their ids. With bos (default:
        self.add_bos) BOS is prepended, unless the text itself already starts with the BOS token (chat templates)."""
        ids = self._encode(text)
        if (self.add_bos if bos is None else bos) and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def _encode(self, text: str) -> list:
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

    class Generation(jinja2.ext.Extension):  # transformers' {% generation %}...{% endgeneration %} (SmolLM3): the body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, Generation])
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
    """Byte-level BPE: a `tokenizers.Tokenizer` (self.hf). pattern / digits_split / add_prefix_space / nfc /
    ignore_merges / unk_id / strip (added token -> 1 lstrip | 2 rstrip) describe its pipeline for tokenizer.bin."""
    kind = "bpe"

    def __init__(self, hf, pattern: str, digits_split=False, add_prefix_space=False, nfc=False, ignore_merges=False,
                 unk_id=None, strip=None, **meta):
        self.hf, self.pattern, self.digits_split, self.add_prefix_space = hf, pattern, digits_split, add_prefix_space
        self.nfc, self.ignore_merges, self.unk_id, self.strip = nfc, ignore_merges, unk_id, dict(strip or {})
        super().__init__(**meta)

    def token_text(self, i):
        return None if i is None else self.special_text.get(i, self.hf.id_to_token(i))

    def _encode(self, text: str) -> list:  # the _fast batch call skips computing offsets (~25% of the time)
        return self.hf.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, ids) -> str:  # special tokens as their text; bytes that are no UTF-8 become U+FFFD
        return self.hf.decode([i for i in map(int, ids) if i >= 0], skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece model (Llama 2 style) through the sentencepiece library; control pieces written in the text
    ("<s>", "</s>") and added tokens past the model's pieces (`added`: Phi-3's "<|user|>" = 32010 ...) are split out
    first and become their ids; both decode to "" (as control pieces do in sentencepiece). The text between them is
    encoded on its own (the dummy prefix, where the model has one, starts each such piece of text).
    User-defined pieces (Gemma's <start_of_turn>) are sentencepiece's own business: it keeps them whole."""
    kind = "sentencepiece"

    def __init__(self, sp, add_bos: bool = True, chat_template: Optional[str] = None, stop_ids=(), added=None,
                 eos: Optional[str] = None, strip=None, prefix_first_only=False):
        self.sp, self.strip, self.prefix_first_only = sp, dict(strip or {}), prefix_first_only
        n = sp.get_piece_size()
        special = {sp.id_to_piece(i): i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)}
        special = {t: i for t, i in special.items() if t}
        self.added = {t: i for t, i in (added or {}).items() if i >= n and t}
        special.update(self.added)
        user = {t: sp.piece_to_id(t) for t in END_TOKENS if sp.piece_to_id(t) != sp.unk_id()}
        eos_id = special.get(eos, user.get(eos, sp.eos_id())) if eos else sp.eos_id()  # tokenizer_config's eos_token
        if eos_id < 0:
            raise ValueError("SentencePiece model has no EOS piece")
        super().__init__(vocab_size=max([n - 1, *self.added.values()]) + 1,
                         bos_id=sp.bos_id() if sp.bos_id() >= 0 else None, eos_id=eos_id, add_bos=add_bos,
                         special_tokens=special, chat_template=chat_template, stop_ids=[*stop_ids, *user.values()])
        self._control = next((i for i in range(n) if sp.is_control(i)), None)  # what an added token decodes as
        alts = sorted(self.special_tokens, key=len, reverse=True)  # longest first = leftmost-longest match
        ws = f"[{''.join(WHITE_SPACE)}]*"  # lstrip / rstrip: the token takes in the whitespace before / after it
        self._special_rx = re.compile("|".join(f"(?P<t{k}>{ws if self.strip.get(t, 0) & 1 else ''}{re.escape(t)}"
                                               f"{ws if self.strip.get(t, 0) & 2 else ''})" for k, t in enumerate(alts)))\
            if alts else None
        self._alts = alts
        self._sp_first = sp
        if prefix_first_only:  # legacy=False: the dummy prefix only at the very start, and not before a space
            from sentencepiece import SentencePieceProcessor, sentencepiece_model_pb2 as pb
            m = pb.ModelProto()
            m.ParseFromString(sp.serialized_model_proto())
            m.normalizer_spec.add_dummy_prefix = False
            self._sp_rest = SentencePieceProcessor()
            self._sp_rest.LoadFromSerializedProto(m.SerializeToString())
        else:
            self._sp_rest = sp

    def token_text(self, i):
        n = self.sp.get_piece_size()
        return None if i is None else self.special_text.get(i, self.sp.id_to_piece(i) if 0 <= i < n else None)

    def _encode(self, text: str) -> list:
        ids, pos = [], 0

        def plain(a, b):
            lead_space = self.prefix_first_only and text[:1] in (" ", "\u2581")  # Metaspace adds no second one
            sp = self._sp_rest if a > 0 or lead_space else self.sp
            return sp.encode(text[a:b]) if b > a else []
        for m in self._special_rx.finditer(text) if self._special_rx else ():
            ids += plain(pos, m.start())
            ids.append(self.special_tokens[self._alts[int(m.lastgroup[1:])]])
            pos = m.end()
        return ids + plain(pos, len(text))

    def decode(self, ids) -> str:  # control tokens (<s>, </s>) always decode to ""; added tokens decode as they do
        n, ctrl = self.sp.get_piece_size(), self._control
        return self.sp.decode([int(i) if int(i) < n else ctrl for i in ids
                               if 0 <= int(i) < n or (int(i) in self.special_text and ctrl is not None)])


# ---------------------------------------------------------------------------------------------------------------------
# loading: a set of tokenizer files, {name: Path on disk, or the text/bytes scripts/gguf_tokenizer.py made from a GGUF}


def load_tokenizer(path) -> Tokenizer:
    """Load from a directory (tokenizer.json, else tokenizer.model), a tokenizer.json, a tokenizer.model or a *.gguf."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path not found: {p}")
    if p.is_dir():
        files = {n: p / n for n in TOKENIZER_FILES if (p / n).is_file()}
        if not {"tokenizer.json", "tokenizer.model", "tokenizer.tiktoken"} & set(files):
            raise FileNotFoundError(f"no tokenizer.json, tokenizer.model or tokenizer.tiktoken in directory {p}")
        return _from_files(files, p)
    with open(p, "rb") as f:
        head = f.read(4)
    if p.suffix == ".gguf" or head == b"GGUF":
        if str(REPO / "scripts") not in sys.path:
            sys.path.insert(0, str(REPO / "scripts"))
        import gguf_tokenizer  # lazy: only a GGUF needs it (and the `gguf` package)
        return _from_files(gguf_tokenizer.tokenizer_files(p), p)
    name = ("tokenizer.json" if p.suffix == ".json" or head[:1] == b"{" else
            "tokenizer.tiktoken" if p.suffix == ".tiktoken" else "tokenizer.model")
    files = {n: p.parent / n for n in TOKENIZER_FILES  # the config files beside it
             if (p.parent / n).is_file() and n not in ("tokenizer.json", "tokenizer.model", "tokenizer.tiktoken")}
    return _from_files({**files, name: p}, p.parent)


class _NotByteLevel(ValueError):
    pass


def _from_files(files: dict, where: Path) -> Tokenizer:
    def label(name):
        return str(files[name]) if isinstance(files[name], Path) else f"{where} ({name})"

    def read(name, kind="text"):  # "bytes", "text" or "json"
        v = files[name]
        try:
            data = v.read_bytes() if isinstance(v, Path) else v if isinstance(v, bytes) else v.encode("utf-8")
            if kind == "bytes":
                return data
            return json.loads(data.decode("utf-8")) if kind == "json" else data.decode("utf-8")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{label(name)}: not a valid {name} ({type(e).__name__}: {e})") from None

    meta = _hf_metadata(files, read)
    if "tokenizer.tiktoken" in files:
        if "tiktoken_config.json" not in files:
            raise ValueError(f"{label('tokenizer.tiktoken')}: no tiktoken_config.json beside it (pattern, special tokens)")
        cfg = read("tiktoken_config.json", "json")
        meta = {**meta, "bos": meta["bos"] or cfg.get("bos_token"), "eos": meta["eos"] or cfg.get("eos_token"),
                "add_bos": meta["add_bos"] if meta["add_bos"] is not None else bool(cfg.get("add_bos_token"))}
        from tokenizer_tiktoken import tokenizer_json  # lazy: only a tiktoken file needs it
        return _load_bpe(tokenizer_json(read("tokenizer.tiktoken", "bytes"), cfg, label("tokenizer.tiktoken"),
                                        GPT2_PATTERN, bytes_to_unicode()),
                         label("tokenizer.tiktoken"), meta)
    if "tokenizer.json" in files:
        try:
            return _load_bpe(read("tokenizer.json"), label("tokenizer.json"), meta)
        except _NotByteLevel as e:
            if "tokenizer.model" not in files:
                raise ValueError(str(e)) from None
            j = json.loads(read("tokenizer.json"))  # the added tokens a SentencePiece model lacks (Phi-3) ...
            for t in j.get("added_tokens", []):
                if "content" in t:
                    meta["added"][t["content"]] = int(t["id"])
                    meta["strip"][t["content"]] = int(bool(t.get("lstrip"))) | 2 * int(bool(t.get("rstrip")))
            # ... and where it puts the dummy prefix: Prepend normalizer = every piece of text (legacy), Metaspace
            # prepend_scheme "first" = the start of the text only
            pre = j.get("pre_tokenizer") or {}
            meta["legacy"] = not (pre.get("type") == "Metaspace" and pre.get("prepend_scheme") == "first")
    return _load_sentencepiece(read("tokenizer.model", "bytes"), label("tokenizer.model"), meta)


def _token_name(t):
    return t.get("content") if isinstance(t, dict) else t  # tokenizer_config tokens are strings or AddedToken dicts


def _hf_metadata(files: dict, read) -> dict:
    """What tokenizer_config.json / generation_config.json / chat_template.jinja|json say."""
    cfg = read("tokenizer_config.json", "json") if "tokenizer_config.json" in files else {}
    gen = read("generation_config.json", "json") if "generation_config.json" in files else {}
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        tpl = next((t["template"] for t in tpl if t.get("name") == "default"), tpl[0]["template"] if tpl else None)
    if "chat_template.jinja" in files:
        tpl = read("chat_template.jinja")
    elif "chat_template.json" in files:
        tpl = read("chat_template.json", "json").get("chat_template", tpl)
    gen_eos = gen.get("eos_token_id")
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    added, strip = {}, {}
    for i, t in (cfg.get("added_tokens_decoder") or {}).items():
        if str(i).isdigit() and _token_name(t):
            added[_token_name(t)] = int(i)
            if isinstance(t, dict):
                strip[_token_name(t)] = int(bool(t.get("lstrip"))) | 2 * int(bool(t.get("rstrip")))
    return dict(bos=_token_name(cfg.get("bos_token")), eos=_token_name(cfg.get("eos_token")),
                add_bos=cfg.get("add_bos_token"), chat_template=tpl, gen_bos=gen.get("bos_token_id"), gen_eos=gen_eos,
                added=added, strip=strip, legacy=cfg.get("legacy", True))


def _parse_pre_tokenizer(pt) -> tuple:
    """HF pre_tokenizer -> (pattern, digits_split, add_prefix_space), what tokenizer.bin's C++ encoder implements:
    [Digits(individual)] then one regex (ByteLevel use_regex=True = GPT-2 regex, or Split(Regex, Isolated) +
    ByteLevel(use_regex=False)). Any other byte-level pipeline (Falcon's Punctuation + ByteLevel + Digits + Split)
    gives pattern None: tokenizer.py runs it (the `tokenizers` library does), tokenizer.bin refuses it."""
    steps = pt.get("pretokenizers", []) if pt and pt.get("type") == "Sequence" else [pt] if pt else []
    if not any(s.get("type") == "ByteLevel" for s in steps):  # e.g. Llama 2's Metaspace / no pre_tokenizer
        raise _NotByteLevel("not a byte-level BPE tokenizer.json (no ByteLevel pre_tokenizer)")
    falcon = [{"type": "Punctuation", "behavior": "Contiguous"}, {"type": "ByteLevel", "use_regex": True},
              {"type": "Digits", "individual_digits": False},
              {"type": "Split", "pattern": {"Regex": "[0-9][0-9][0-9]"}, "behavior": "Isolated", "invert": False}]
    if len(steps) == 4 and all(all(s.get(k, True) == v for k, v in f.items()) for s, f in zip(steps, falcon)):
        return (None if steps[1].get("add_prefix_space") else FALCON_PIPELINE), False, False
    pattern, digits, prefix, other = None, False, False, False
    for s in steps:
        t = s.get("type")
        if t == "Digits" and s.get("individual_digits") and pattern is None:
            digits = True
        elif t == "Split" and pattern is None and s.get("behavior") == "Isolated" and not s.get("invert"):
            pat = s.get("pattern", {})
            pattern = pat["Regex"] if "Regex" in pat else re.escape(pat.get("String", ""))
        elif t == "ByteLevel":
            prefix = bool(s.get("add_prefix_space"))
            if s.get("use_regex", True):
                other |= pattern is not None
                pattern = GPT2_PATTERN
        else:
            other = True
    return (None if other else pattern or r"(?s).+"), digits, prefix


def _load_bpe(text: str, path: str, meta: dict) -> BPETokenizer:
    try:
        j = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a valid tokenizer.json (JSONDecodeError: {e})") from None
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
    if any(n.get("type") != "NFC" for n in norms):  # the library runs it; tokenizer.bin refuses it (pattern None)
        pattern = None
    try:
        vocab = {str(t): int(i) for t, i in model["vocab"].items()}
        special = {t["content"]: int(t["id"]) for t in j.get("added_tokens", [])}
        strip = {t["content"]: int(bool(t.get("lstrip"))) | 2 * int(bool(t.get("rstrip"))) for t in j["added_tokens"]} \
            if special else {}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{path}: malformed vocab/added_tokens ({e})") from None
    from tokenizers import Tokenizer as HFTokenizer, decoders
    try:
        hf = HFTokenizer.from_str(text)
    except Exception as e:  # the library's own message, e.g. a merge naming a token missing from the vocab
        raise ValueError(f"{path}: the tokenizers library cannot load it ({first_line(e)})") from None
    hf.no_truncation()
    hf.no_padding()
    hf.decoder = decoders.ByteLevel()  # the bytes back, as the ByteLevel pre-tokenizer implies, whatever decoder it names
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
    if pattern is None:
        pre = json.dumps(j.get("pre_tokenizer"))
        pattern = f"(pre_tokenizer {pre[:150]}, normalizer {json.dumps(norm)[:100]})"  # no regex: the exporter refuses
    return BPETokenizer(hf, pattern, digits_split=digits, add_prefix_space=prefix, nfc=bool(norms),
                        ignore_merges=bool(model.get("ignore_merges")), unk_id=tid(model.get("unk_token")), strip=strip,
                        vocab_size=max(everything.values(), default=-1) + 1, special_tokens=special, bos_id=bos,
                        eos_id=eos, add_bos=bool(add_bos), chat_template=meta["chat_template"], stop_ids=meta["gen_eos"])


def sp_dummy_prefix(sp) -> bool:
    from sentencepiece import sentencepiece_model_pb2 as pb
    m = pb.ModelProto()
    m.ParseFromString(sp.serialized_model_proto())
    return m.normalizer_spec.add_dummy_prefix


def _load_sentencepiece(data: bytes, path: str, meta: dict) -> SentencePieceTokenizer:
    import sentencepiece as spm
    if re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\s*", data[:200].split(b"\n")[0]):
        raise ValueError(f"{path}: looks like a tiktoken BPE file (Llama 3 original/tokenizer.model); use the Hugging "
                         f"Face tokenizer.json, or name it tokenizer.tiktoken beside a tiktoken_config.json")
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(data)
    except Exception as e:  # sentencepiece raises RuntimeError/OSError with multi-line C++ messages
        raise ValueError(f"{path}: not a valid SentencePiece model "
                         f"({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})") from None
    return SentencePieceTokenizer(sp, add_bos=True if meta["add_bos"] is None else bool(meta["add_bos"]),
                                  chat_template=meta["chat_template"], stop_ids=meta["gen_eos"], added=meta["added"],
                                  eos=meta["eos"], strip=meta["strip"],
                                  prefix_first_only=not meta["legacy"] and sp_dummy_prefix(sp))


def main(argv=None):
    from common import ArgumentParser  # flags checked before anything loads
    ap = ArgumentParser(description="Encode a text and decode it back (a quick look at a tokenizer).")
    ap.add_argument("path", help="checkpoint directory, tokenizer.json, tokenizer.model or *.gguf")
    ap.add_argument("text")
    a = ap.parse_args(argv)
    tok = load_tokenizer(a.path)
    ids = tok.encode(a.text)
    print(tok)
    print(ids)
    print(repr(tok.decode(ids)))


if __name__ == "__main__":
    from common import cli
    cli(main)
