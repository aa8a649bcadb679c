#!/usr/bin/env python
"""Write a tokenizer as tokenizer.bin for the C++ runners (runner-aoti/, runner-et/).

    python scripts/export_tokenizer_bin.py checkpoints/SmolLM2-135M-Instruct/ -o tokenizer.bin
    python scripts/export_tokenizer_bin.py path/to/tokenizer.model -o tokenizer.bin --llama2c   # llama2.c's exact file

The file starts with llama2.c's format (uint32 max_token_length, then per token: float32 score, uint32 length, bytes),
so llama2.c's run.c reads it unchanged. For a SentencePiece model those bytes are exactly what llama2.c's
tokenizer.py export writes. An extension follows (tagged sections, located through a 16-byte footer) with what an
exact encoder needs and llama2.c's format lacks: token types, special tokens, BOS/EOS/stop ids, the byte-level BPE
merge ranks, the pre-tokenizer kind and the Unicode class tables (\\p{L}, \\p{N}, \\s) it uses, and the chat template
kind. runner-common/README.md documents the layout.
"""
import datetime
import json
import math
import struct
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from common import ArgumentParser, cli, write_atomic  # noqa: E402
from gguf_tokenizer import LLAMA3_PATTERN, O200K_PATTERN, QWEN2_PATTERN  # noqa: E402
from tokenizer import FALCON_PIPELINE, GPT2_PATTERN, bytes_to_unicode, load_tokenizer  # noqa: E402

EXT_MAGIC = b"LLTOKEXT"
FOOTER_MAGIC = b"LLTOKEND"
VERSION = 1

KIND_SENTENCEPIECE, KIND_BPE = 1, 2
# pre-tokenizer regexes the C++ encoder implements by hand
PRE_NONE, PRE_GPT2, PRE_LLAMA3, PRE_QWEN2, PRE_O200K, PRE_FALCON = 0, 1, 2, 3, 4, 5
PRE_KINDS = {GPT2_PATTERN: PRE_GPT2, LLAMA3_PATTERN: PRE_LLAMA3, QWEN2_PATTERN: PRE_QWEN2, O200K_PATTERN: PRE_O200K,
             FALCON_PIPELINE: PRE_FALCON}
CHAT_NONE, CHAT_CHATML, CHAT_LLAMA2, CHAT_LLAMA3, CHAT_ZEPHYR = 0, 1, 2, 3, 4
CHAT_GEMMA, CHAT_PHI3, CHAT_PHI4, CHAT_MISTRAL, CHAT_SMOLLM3 = 5, 6, 7, 8, 9
CHAT_NAMES = {CHAT_NONE: "none", CHAT_CHATML: "chatml", CHAT_LLAMA2: "llama2", CHAT_LLAMA3: "llama3",
              CHAT_ZEPHYR: "zephyr", CHAT_GEMMA: "gemma", CHAT_PHI3: "phi3", CHAT_PHI4: "phi4", CHAT_MISTRAL: "mistral",
              CHAT_SMOLLM3: "smollm3"}
SMOLLM3_HEAD = "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nToday Date: "
# INFO flags
F_DIGITS_SPLIT, F_NFC, F_IGNORE_MERGES, F_ADD_PREFIX_SPACE = 1, 2, 4, 8
F_SP_ADD_DUMMY_PREFIX, F_SP_REMOVE_EXTRA_WS, F_SP_BYTE_FALLBACK, F_SP_NOT_BPE, F_SP_NOT_IDENTITY = 16, 32, 64, 128, 256
F_SP_PREFIX_FIRST = 512
# TYPE values (one byte per token)
T_NORMAL, T_SPECIAL, T_BYTE, T_UNKNOWN, T_UNUSED, T_USER, T_HOLE = 0, 1, 2, 3, 4, 5, 6
T_BYTELEVEL = 0x80  # BPE: the vocab string is made of byte-level characters (an ignore_merges lookup may hit it)


class ExportError(Exception):
    pass


# ----------------------------------------------------------------------------------------------------------- llama2.c
def llama2c_entries(sp):
    """(bytes, score) per token, exactly as llama2.c's tokenizer.py export computes them."""
    out = []
    for i in range(sp.vocab_size()):
        t = sp.id_to_piece(i)
        s = sp.get_score(i)
        if i == sp.bos_id():
            t = "\n<s>\n"
        elif i == sp.eos_id():
            t = "\n</s>\n"
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            t = chr(int(t[3:5], 16))  # llama2.c: '<0x01>' -> '\x01' (then utf-8 encoded, so 0x80.. take two bytes)
        t = t.replace("\u2581", " ")
        out.append((t.encode("utf-8"), s))
    return out


def pack_entries(entries) -> bytes:
    """llama2.c's layout: uint32 max_token_length, then per token float32 score, uint32 length, bytes."""
    max_len = max((len(b) for b, _ in entries), default=0)
    parts = [struct.pack("<I", max_len)]
    for b, s in entries:
        parts.append(struct.pack("<fI", s, len(b)))
        parts.append(b)
    return b"".join(parts)


# ----------------------------------------------------------------------------------------------------------- helpers
def _i32s(values) -> bytes:
    values = list(values)
    return struct.pack(f"<i{len(values)}i", len(values), *values)


def _blob(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def _ranges(cps) -> list:
    """Sorted code points -> inclusive (lo, hi) ranges."""
    out = []
    for c in cps:
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def _range_section(ranges) -> bytes:
    flat = [v for r in ranges for v in r]
    return struct.pack(f"<I{len(flat)}I", len(ranges), *flat)


_ALL_CHARS = None


def _all_chars() -> str:
    global _ALL_CHARS
    if _ALL_CHARS is None:
        _ALL_CHARS = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    return _ALL_CHARS


def regex_class_ranges(cls: str) -> list:
    """Code-point ranges matched by a regex class, computed with the `regex` module (the syntax of the patterns)."""
    import regex
    return _ranges([ord(c) for m in regex.finditer(f"(?:{cls})+", _all_chars()) for c in m.group()])


def python_space_ranges() -> list:
    """Code points for which str.isspace() is true (str.strip() in the chat templates)."""
    return _ranges([c for c in range(0x110000) if chr(c).isspace()])


def casefold_table() -> list:
    """For the (?i:'s|'t|'re|'ve|'m|'ll|'d) alternatives: the code points `regex` matches case-insensitively for
    each of the letters s t r e v m l d (e.g. 'S', and U+017F for 's')."""
    import regex
    out = []
    for letter in "strevmld":
        rx = regex.compile(f"(?i:{letter})")
        out.append([c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF and rx.fullmatch(chr(c))])
    return out


# ----------------------------------------------------------------------------------------------------------- chat
def render_chat(kind: int, messages, add_generation_prompt=True, default_system=None, bos="", eos=""):
    """The renderings the C++ runner implements (runner-common/chat.h). Used to check a template's kind.
    default_system: chatml's default system prompt; smollm3's (think, no_think) default instructions."""
    out = ""
    if kind == CHAT_SMOLLM3:  # reasoning mode from /think, /no_think in the system message; today's date
        mode, system = "/think", messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        if system is not None:
            mode = "/no_think" if "/no_think" in system else "/think" if "/think" in system else mode
            custom = system.replace("/no_think", "").replace("/think", "").rstrip()
        if system is not None and "/system_override" in system:
            out = "<|im_start|>system\n" + custom.replace("/system_override", "").rstrip() + "<|im_end|>\n"
        else:
            today = datetime.datetime.now().strftime("%d %B %Y")
            out = SMOLLM3_HEAD + today + "\nReasoning Mode: " + mode + "\n\n## Custom Instructions\n\n" + \
                ((custom if system is not None and custom else default_system[mode != "/think"]) + "\n\n")
        think = "" if mode == "/think" else "<think>\n\n</think>\n"
        for m in messages:
            if m["role"] in ("user", "tool"):
                out += "<|im_start|>user\n" + m["content"] + "<|im_end|>\n"
            elif m["role"] == "assistant":
                out += "<|im_start|>assistant\n" + think + m["content"].lstrip("\n") + "<|im_end|>\n"
        if add_generation_prompt:
            out += "<|im_start|>assistant\n" + think
    elif kind == CHAT_GEMMA:  # Gemma 3 folds a system message into the first user turn (Gemma 1/2 refuse one)
        prefix, msgs = "", messages
        if msgs and msgs[0]["role"] == "system":
            prefix, msgs = msgs[0]["content"] + "\n\n", msgs[1:]
        out = bos
        for i, m in enumerate(msgs):
            role = "model" if m["role"] == "assistant" else m["role"]
            out += "<start_of_turn>" + role + "\n" + (prefix if i == 0 else "") + m["content"].strip() + "<end_of_turn>\n"
        if add_generation_prompt:
            out += "<start_of_turn>model\n"
    elif kind in (CHAT_PHI3, CHAT_PHI4):  # <|role|>\n content <|end|>\n (Phi-4-mini: no newlines)
        nl = "\n" if kind == CHAT_PHI3 else ""
        for m in messages:
            if m["role"] == "system" and not m["content"] and kind == CHAT_PHI3:
                continue  # Phi-3 leaves out an empty system message
            out += "<|" + m["role"] + "|>" + nl + m["content"] + "<|end|>" + nl
        out += "<|assistant|>" + nl if add_generation_prompt else eos
    elif kind == CHAT_MISTRAL:  # Mistral / Mixtral v0.1: BOS once, no strip, no system message
        out = bos
        for m in messages:
            out += "[INST] " + m["content"] + " [/INST]" if m["role"] == "user" else m["content"] + eos
    elif kind == CHAT_CHATML:
        if default_system is not None and (not messages or messages[0]["role"] != "system"):
            out += "<|im_start|>system\n" + default_system + "<|im_end|>\n"
        for m in messages:
            out += "<|im_start|>" + m["role"] + "\n" + m["content"] + "<|im_end|>\n"
        if add_generation_prompt:
            out += "<|im_start|>assistant\n"
    elif kind == CHAT_LLAMA2:
        system, msgs = None, messages
        if msgs and msgs[0]["role"] == "system":
            system, msgs = msgs[0]["content"], msgs[1:]
        for i, m in enumerate(msgs):
            content = m["content"]
            if i == 0 and system is not None:
                content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content
            if m["role"] == "user":
                out += bos + "[INST] " + content.strip() + " [/INST]"
            elif m["role"] == "assistant":
                out += " " + content.strip() + " " + eos
    elif kind == CHAT_LLAMA3:
        for i, m in enumerate(messages):
            out += (bos if i == 0 else "") + "<|start_header_id|>" + m["role"] + "<|end_header_id|>\n\n" + \
                m["content"].strip() + "<|eot_id|>"
        if add_generation_prompt:
            out += "<|start_header_id|>assistant<|end_header_id|>\n\n"
    elif kind == CHAT_ZEPHYR:
        for m in messages:
            out += "<|" + m["role"] + "|>\n" + m["content"] + eos + "\n"
        if add_generation_prompt:
            out += "<|assistant|>\n"
    else:
        raise ValueError(kind)
    return out


_PROBES = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": " a "}, {"role": "assistant", "content": "b\n"},
     {"role": "user", "content": "c"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}],
]


_PROBES += [
    [{"role": "user", "content": " \n padded \t"}, {"role": "assistant", "content": "\n reply \n"},
     {"role": "user", "content": "é 🤖"}],
    [{"role": "system", "content": " sys \n"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": " a"},
     {"role": "user", "content": "v "}, {"role": "assistant", "content": "w"}, {"role": "user", "content": "x"}],
    [{"role": "system", "content": "/no_think"}, {"role": "user", "content": "q"}],  # (SmolLM3's reasoning modes)
    [{"role": "system", "content": "Terse. /no_think "}, {"role": "user", "content": "q"},
     {"role": "assistant", "content": "\n\na "}, {"role": "user", "content": "r"}],
    [{"role": "system", "content": "/think Exact."}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
     {"role": "user", "content": "r"}],
    [{"role": "system", "content": "Only this. /system_override \n"}, {"role": "user", "content": "q"}],
]


def detect_chat(tok):
    """(kind, default system prompt or None, no_system): the runner's rendering that reproduces tok's chat template
    on the probe conversations (no_system: the template refuses a system message, and so does the runner), or
    (CHAT_NONE, None, False) when there is no template. A template no kind reproduces raises ExportError."""
    if not getattr(tok, "chat_template", None):
        return CHAT_NONE, None, False

    def render(p):
        try:
            return tok.apply_chat_template(p, add_generation_prompt=True)
        except ValueError:
            return None
    want = [render(p) for p in _PROBES]
    no_system = all(w is None for p, w in zip(_PROBES, want) if p[0]["role"] == "system")
    if any(w is None for p, w in zip(_PROBES, want) if p[0]["role"] != "system"):
        raise ExportError("the chat template fails on plain user/assistant conversations: the C++ runner cannot "
                          "reproduce it (export with --no_chat to leave chat out of tokenizer.bin)")
    bos = tok.token_text(tok.bos_id) or ""
    eos = tok.token_text(tok.eos_id) or ""
    default_system = smollm3 = None
    head = "<|im_start|>system\n"
    if want[0].startswith(head) and "<|im_end|>\n" in want[0]:
        default_system = want[0][len(head):want[0].index("<|im_end|>\n")]
    mark, user = "## Custom Instructions\n\n", "\n\n<|im_start|>user\n"
    defaults = [w[w.find(mark) + len(mark):w.find(user)] for w in (want[0], want[6]) if w and mark in w and user in w]
    if want[0].startswith(SMOLLM3_HEAD) and len(defaults) == 2:  # its default instructions, /think and /no_think
        smollm3 = tuple(defaults)
    for kind in CHAT_NAMES:
        ds = default_system if kind == CHAT_CHATML else smollm3 if kind == CHAT_SMOLLM3 else None
        if kind == CHAT_SMOLLM3 and ds is None:
            continue
        if kind != CHAT_NONE and all(w is None or render_chat(kind, p, True, ds, bos, eos) == w
                                     for p, w in zip(_PROBES, want)):
            return kind, ds, no_system
    raise ExportError("the chat template is none of the renderings the C++ runner implements (" +
                      ", ".join(n for k, n in CHAT_NAMES.items() if k) + "): it would render wrong prompts "
                      "(export with --no_chat to leave chat out of tokenizer.bin)")


# ----------------------------------------------------------------------------------------------------------- export
def _sections_common(tok, n_vocab, kind, flags, unk_id, pre, types, byte_ids, chat) -> list:
    outside = sorted(i for i in {tok.eos_id, *tok.stop_ids} if not 0 <= i < n_vocab)
    if outside:  # the runner refuses such a file at load: say it here, about the tokenizer's own files
        raise ExportError(f"stop/EOS id{'s' if len(outside) > 1 else ''} {', '.join(map(str, outside))} outside the "
                          f"tokenizer's {n_vocab} tokens: fix eos_token_id in generation_config.json / config.json")
    bos = tok.bos_id if tok.bos_id is not None else -1
    system = chat[1] if isinstance(chat[1], tuple) else (chat[1] or "", "")  # (default system, SmolLM3's no-think one)
    info = struct.pack("<10i", n_vocab, kind, bos, tok.eos_id, int(bool(tok.add_bos)), chat[0], flags,
                       -1 if unk_id is None else unk_id, pre, 0)
    specials = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    spec = struct.pack("<i", len(specials)) + b"".join(struct.pack("<i", i) + _blob(t.encode("utf-8"))
                                                        for t, i in specials)
    sections = [(b"INFO", info), (b"STOP", _i32s(sorted(tok.stop_ids))), (b"TYPE", bytes(types)),
                (b"BYTE", struct.pack("<256i", *byte_ids)), (b"SPEC", spec),
                (b"CHAT", struct.pack("<i", chat[0]) + _blob(system[0].encode("utf-8")) +
                 struct.pack("<ii", int(chat[1] is not None), int(chat[2])) + _blob(system[1].encode("utf-8"))),
                (b"PYSP", _range_section(python_space_ranges()))]
    strip = sorted((tok.special_tokens[t], f) for t, f in tok.strip.items() if f and t in tok.special_tokens)
    if strip:  # added tokens that take in the whitespace before (1) / after (2) them
        sections.append((b"STRP", struct.pack("<i", len(strip)) + b"".join(struct.pack("<ii", i, f) for i, f in strip)))
    return sections


def added_entries(tok) -> list:
    """(bytes, score) for the ids past a SentencePiece model (Phi-3's added tokens): their text; holes empty."""
    n = tok.sp.vocab_size()
    return [(tok.special_text.get(i, "").encode("utf-8"), 0.0) for i in range(n, tok.vocab_size)]


def sentencepiece_sections(tok, entries, log, chat) -> list:
    from sentencepiece import sentencepiece_model_pb2 as pb
    sp = tok.sp
    proto = pb.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    n = tok.vocab_size
    ptype = {1: T_NORMAL, 2: T_UNKNOWN, 3: T_SPECIAL, 4: T_USER, 5: T_UNUSED, 6: T_BYTE}
    types = [ptype.get(p.type, T_NORMAL) for p in proto.pieces]
    types += [T_SPECIAL if i in tok.special_text else T_HOLE for i in range(len(types), n)]
    byte_ids = [-1] * 256
    for i, p in enumerate(proto.pieces):
        if p.type == 6:
            byte_ids[int(p.piece[3:5], 16)] = i
    ns, ts = proto.normalizer_spec, proto.trainer_spec
    flags = 0
    if ns.add_dummy_prefix:
        flags |= F_SP_ADD_DUMMY_PREFIX
    if tok.prefix_first_only:
        flags |= F_SP_PREFIX_FIRST
    if ns.remove_extra_whitespaces:
        flags |= F_SP_REMOVE_EXTRA_WS
    if ts.byte_fallback or any(b >= 0 for b in byte_ids):
        flags |= F_SP_BYTE_FALLBACK
    if ts.model_type != pb.TrainerSpec.BPE:
        flags |= F_SP_NOT_BPE
        log("warning: not a BPE SentencePiece model: the C++ encoder (merge by score) approximates its segmentation")
    if ns.name not in ("identity", "") or ns.precompiled_charsmap:
        flags |= F_SP_NOT_IDENTITY
        log(f"warning: SentencePiece normalizer {ns.name!r}: the C++ encoder does not normalize its input")
    unk = sp.unk_id() if sp.unk_id() >= 0 else None
    sections = _sections_common(tok, n, KIND_SENTENCEPIECE, flags, unk, PRE_NONE, types, byte_ids, chat)
    # the pieces as the encoder matches them ('▁' -> ' '), for every token whose llama2.c bytes differ from that
    # (BOS/EOS, byte tokens); plus the unknown surface for decode
    fixes = []
    for i, p in enumerate(proto.pieces):
        want = p.piece.replace("\u2581", " ").encode("utf-8")
        if entries[i][0] != want:
            fixes.append(struct.pack("<i", i) + _blob(want))
    sections.append((b"PIEC", struct.pack("<i", len(fixes)) + b"".join(fixes)))
    unk_surface = ts.unk_surface if ts.HasField("unk_surface") else " \u2047 "
    sections.append((b"UNKS", _blob(unk_surface.encode("utf-8"))))
    return sections


def bpe_export(tok, log, chat):
    """(llama2.c entries, extension sections) for a byte-level BPE tokenizer: its vocabulary and merges as the
    `tokenizers` library holds them (tok.hf), the pre-tokenizer facts tokenizer.py read from its tokenizer.json."""
    pre = PRE_KINDS.get(tok.pattern, -1)
    if pre < 0:
        raise ExportError(f"pre-tokenizer {tok.pattern[:300]!r} is not one the C++ encoder implements "
                          f"(ByteLevel's GPT-2 regex, with or without individual digits; the Llama 3 / cl100k, "
                          f"Qwen2 and o200k Split regexes; Falcon's pipeline)")
    model = json.loads(tok.hf.to_str())["model"]
    vocab = model["vocab"]  # byte-level-unicode token string -> id
    id_to_token = {i: t for t, i in vocab.items()}
    byte_encoder = bytes_to_unicode()
    byte_decoder = {c: b for b, c in byte_encoder.items()}
    n = tok.vocab_size
    types = [T_HOLE] * n
    for t, i in vocab.items():
        types[i] = T_NORMAL | (T_BYTELEVEL if all(c in byte_decoder for c in t) else 0)
    for t, i in tok.special_tokens.items():
        types[i] = T_SPECIAL | (types[i] & T_BYTELEVEL if id_to_token.get(i) is not None else 0)

    def token_bytes(i):  # what the token decodes to: a special token's text, else its vocab string's bytes
        if i in tok.special_text:
            return tok.special_text[i].encode("utf-8")
        t = id_to_token.get(i, "")
        return bytes(byte_decoder[c] for c in t) if all(c in byte_decoder for c in t) else t.encode("utf-8")

    entries_bytes = [token_bytes(i) if types[i] != T_HOLE else b"" for i in range(n)]
    # ignore_merges looks the whole word up among the vocab strings: make sure a byte-level token's bytes are those
    # of its vocab string (a special token whose text differs from its vocab string loses the flag)
    for i in range(n):
        if types[i] & T_BYTELEVEL:
            vb = bytes(byte_decoder[c] for c in id_to_token[i])
            if vb != entries_bytes[i]:
                types[i] &= ~T_BYTELEVEL
    byte_ids = [vocab.get(byte_encoder[b], -1) for b in range(256)]
    merges, score = [], {}
    skipped = 0
    for rank, m in enumerate(model["merges"]):
        a, b = m.split(" ") if isinstance(m, str) else m
        ia, ib, ir = vocab.get(a), vocab.get(b), vocab.get(a + b)
        if ia is None or ib is None or ir is None:
            skipped += 1
            merges.append((-1, -1, -1))  # keeps the ranks aligned; never matches
            continue
        merges.append((ia, ib, ir))
        score.setdefault(ir, -float(rank))
    if skipped:
        log(f"warning: {skipped} merges name tokens missing from the vocab; they are never applied")
    entries = [(entries_bytes[i], score.get(i, 0.0)) for i in range(n)]
    flags = 0
    if tok.digits_split:
        flags |= F_DIGITS_SPLIT
    if tok.nfc:
        flags |= F_NFC
        log("warning: this tokenizer NFC-normalizes its input; the C++ encoder does not (same ids for NFC text)")
    if tok.ignore_merges:
        flags |= F_IGNORE_MERGES
    if tok.add_prefix_space:
        flags |= F_ADD_PREFIX_SPACE
    sections = _sections_common(tok, n, KIND_BPE, flags, tok.unk_id, pre, types, byte_ids, chat)
    flat = [v for m in merges for v in m]
    sections.append((b"MERG", struct.pack(f"<i{len(flat)}i", len(merges), *flat)))
    sections.append((b"UNIL", _range_section(regex_class_ranges(r"\p{L}"))))
    sections.append((b"UNIN", _range_section(regex_class_ranges(r"\p{N}"))))
    sections.append((b"UNIS", _range_section(regex_class_ranges(r"\s"))))
    if pre in (PRE_LLAMA3, PRE_QWEN2, PRE_O200K):
        fold = casefold_table()
        sections.append((b"CASE", b"".join(_i32s(f) for f in fold)))
    if pre == PRE_FALCON:
        sections.append((b"UNIP", _range_section(regex_class_ranges(r"[\p{P}!-/:-@\[-`{-~]"))))
    if pre == PRE_O200K:
        sections.append((b"UNIU", _range_section(regex_class_ranges(r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"))))
        sections.append((b"UNIW", _range_section(regex_class_ranges(r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"))))
    sections.append((b"PATT", _blob(tok.pattern.encode("utf-8"))))
    return entries, sections


def build(tok, llama2c_only: bool = False, log=lambda *a: None, with_chat: bool = True) -> bytes:
    """The bytes of tokenizer.bin for a tokenizer.py Tokenizer (with_chat=False: chat kind none, whatever the
    template)."""
    chat = detect_chat(tok) if with_chat and not llama2c_only else (CHAT_NONE, None, False)
    if tok.kind == "sentencepiece":
        entries = llama2c_entries(tok.sp) + added_entries(tok)
        part_a = pack_entries(entries)
        if llama2c_only:
            return part_a
        sections = sentencepiece_sections(tok, entries, log, chat)
    elif tok.kind == "bpe":
        if llama2c_only:
            raise ExportError("--llama2c applies to SentencePiece tokenizers only (llama2.c cannot encode byte-level BPE)")
        entries, sections = bpe_export(tok, log, chat)
        part_a = pack_entries(entries)
    else:
        raise ExportError(f"unsupported tokenizer kind {tok.kind!r}")
    for b, s in entries:
        if not math.isfinite(s):
            raise ExportError("a token score is not finite")
    ext = [EXT_MAGIC, struct.pack("<II", VERSION, len(sections))]
    for tag, payload in sections:
        assert len(tag) == 4
        ext.append(tag + struct.pack("<I", len(payload)) + payload)
    offset = len(part_a)
    return part_a + b"".join(ext) + struct.pack("<Q", offset) + FOOTER_MAGIC


def vocab_fingerprint(tokenizer_bin: bytes) -> int:
    """runner-common/README.md's vocabulary fingerprint of a tokenizer.bin (et_export.py / aoti_export.py record it of
    build(tok)): FNV-1a 64 over part A's token records without their scores (per id: uint32 length, then the bytes)."""
    end = struct.unpack_from("<Q", tokenizer_bin, len(tokenizer_bin) - 16)[0] \
        if tokenizer_bin.endswith(FOOTER_MAGIC) else len(tokenizer_bin)
    h, pos = 0xCBF29CE484222325, 4  # after the uint32 max_token_length
    while pos < end:  # a record: float32 score (left out), uint32 length, the bytes
        n = struct.unpack_from("<I", tokenizer_bin, pos + 4)[0]
        for b in tokenizer_bin[pos + 4:pos + 8 + n]:
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        pos += 8 + n
    return h


def main(argv=None):
    p = ArgumentParser(description="Write tokenizer.bin (llama2.c format + extension) for the C++ runners.")
    p.add_argument("tokenizer", type=Path, help="checkpoint directory, tokenizer.json, tokenizer.model or *.gguf")
    p.add_argument("-o", "--output", type=Path, default=Path("tokenizer.bin"))
    p.add_argument("--llama2c", action="store_true",
                   help="SentencePiece only: write exactly llama2.c's tokenizer.bin (no extension)")
    p.add_argument("--no_chat", action="store_true",
                   help="leave the chat template out (for a template the C++ runner cannot render, e.g. SmolLM3's)")
    args = p.parse_args(argv)  # (common.ArgumentParser: the tokenizer exists, the output's folder too)
    tok = load_tokenizer(args.tokenizer)
    log = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    try:
        data = build(tok, args.llama2c, log, with_chat=not args.no_chat)
        chat = ("llama2 (llama2.c default)" if args.llama2c else "none (--no_chat)" if args.no_chat else
                CHAT_NAMES[detect_chat(tok)[0]] + (" (no system message)" if detect_chat(tok)[2] else ""))
    except ExportError as e:
        raise ValueError(str(e)) from None
    write_atomic(args.output, data)
    log(f"wrote {args.output}: {tok.kind}, {tok.vocab_size} tokens, chat template {chat}, {len(data)} bytes")


if __name__ == "__main__":
    cli(main)
