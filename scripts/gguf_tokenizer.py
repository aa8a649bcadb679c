#!/usr/bin/env python
"""The tokenizer embedded in a GGUF file, as the Hugging Face files tokenizer.py (and transformers) read.

    python scripts/gguf_tokenizer.py model.gguf OUT_DIR

A "gpt2" vocabulary (SmolLM2, Llama 3, Qwen2, StarCoder2, GPT-2, MPT, Falcon, Phi-4-mini) becomes a byte-level BPE
tokenizer.json with the pre-tokenizer its tokenizer.ggml.pre names, a "llama" one (Llama 2, TinyLlama, Mistral,
Gemma: no space prefix, byte pieces; Phi-3) a SentencePiece tokenizer.model; tokenizer_config.json carries BOS/EOS, add_bos and the chat
template, and generation_config.json the end-of-turn ids when the GGUF names some. tokenizer_files() builds them in
memory (tokenizer.py loads a *.gguf through it); save_tokenizer_from_gguf() writes them (convert_checkpoint.py).
Below tokenizer.py: imports nothing from this repo but common.py.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import ArgumentParser, cli, write_atomic  # noqa: E402

# Pre-tokenizer regexes of the Llama 3 and Qwen2 tokenizer.json files (a Split step before ByteLevel); GPT-2 style
# vocabularies use ByteLevel's built-in regex instead (tokenizer.GPT2_PATTERN spells it out).
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# tiktoken's o200k regex (GPT-4o; Phi-4-mini's tokenizer.json splits with it)
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""])

# GGUF tokenizer.ggml.pre (the names llama.cpp's convert_hf_to_gguf.py writes) -> (the Hugging Face pre_tokenizer
# steps of that family's tokenizer.json, NFC normalizer, ignore_merges). "default" is treated as plain GPT-2. Falcon
# gets its own tokenizer.json pipeline (llama.cpp approximates it with regexes).
def _bytelevel(regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": regex}


def _split(pattern: str) -> list:
    return [{"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}, _bytelevel(False)]


_GPT2 = ([_bytelevel(True)], False, False)
_DIGITS_GPT2 = ([{"type": "Digits", "individual_digits": True}, _bytelevel(True)], False, False)
_LLAMA3, _QWEN2, _O200K = (_split(LLAMA3_PATTERN), False, True), (_split(QWEN2_PATTERN), True, False), \
    (_split(O200K_PATTERN), False, False)
_FALCON = ([{"type": "Punctuation", "behavior": "Contiguous"}, _bytelevel(True),
            {"type": "Digits", "individual_digits": False}, _split("[0-9][0-9][0-9]")[0]], False, False)
PRE_TYPES = {"gpt2": _GPT2, "gpt-2": _GPT2, "default": _GPT2, "phi-2": _GPT2,
             "mpt": (_GPT2[0], True, False),  # GPT-NeoX's tokenizer: NFC
             "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2,
             "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
             "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "gpt-4o": _O200K, "falcon": _FALCON}

# GGUF token types (same numbering as SentencePiece's piece types)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def read_gguf_tokenizer(path) -> dict:
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


def _common(kv: dict, path) -> dict:
    tokens = kv["tokenizer.ggml.tokens"]
    types = kv.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    eos = kv.get("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise ValueError(f"{path}: GGUF tokenizer has no tokenizer.ggml.eos_token_id")
    stop = [kv[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if kv.get(k) is not None]
    return dict(tokens=tokens, types=types, bos=kv.get("tokenizer.ggml.bos_token_id"), eos=eos, stop=stop,
                unk=kv.get("tokenizer.ggml.unknown_token_id"), pad=kv.get("tokenizer.ggml.padding_token_id"),
                chat_template=kv.get("tokenizer.chat_template"), add_bos=kv.get("tokenizer.ggml.add_bos_token"))


def _hf_tokenizer_json(kv: dict, c: dict, path) -> tuple:
    """A "gpt2" vocabulary as a Hugging Face tokenizer.json dict, and whether BOS is added."""
    pre = kv.get("tokenizer.ggml.pre", "default")  # llama.cpp treats a missing pre as "default"
    if pre not in PRE_TYPES:
        raise ValueError(f"{path}: unsupported tokenizer.ggml.pre {pre!r} (supported: {', '.join(PRE_TYPES)})")
    steps, nfc, ignore_merges = PRE_TYPES[pre]
    tokens, types = c["tokens"], c["types"]
    pre_tokenizer = steps[0] if len(steps) == 1 else {"type": "Sequence", "pretokenizers": steps}
    add_bos = c["add_bos"] if c["add_bos"] is not None else PRE_TYPES[pre] is _LLAMA3
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
    merges = list(kv.get("tokenizer.ggml.merges", []))
    if any(len(m.split(" ")) != 2 for m in merges):
        raise ValueError(f"{path}: malformed tokenizer.ggml.merges entry")
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
          "normalizer": {"type": "NFC"} if nfc else None, "pre_tokenizer": pre_tokenizer, "post_processor": post,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                    "vocab": vocab, "merges": merges}}
    return tj, bool(add_bos)


def _sentencepiece_proto(kv: dict, c: dict):
    """A "llama" vocabulary as a SentencePiece ModelProto (BPE, like Llama's tokenizer.model)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError as e:
        raise NotImplementedError(f"cannot build a SentencePiece model here ({e})") from None
    tokens, types = c["tokens"], c["types"]
    scores = kv.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    m = pb.ModelProto()
    for t, s, ty in zip(tokens, scores, types):
        m.pieces.add(piece=t, score=float(s), type=int(ty) if int(ty) in (1, 2, 3, 4, 5, 6) else NORMAL)
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = len(tokens)
    ts.byte_fallback = BYTE in types
    for field in ("unk", "bos", "eos", "pad"):
        i = c[field]
        setattr(ts, f"{field}_id", i if i is not None and 0 <= i < len(tokens) else -1)
        if i is not None and 0 <= i < len(tokens):
            setattr(ts, f"{field}_piece", tokens[i])
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = bool(kv.get("tokenizer.ggml.add_space_prefix", True))
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    return m


def tokenizer_files(gguf_path) -> dict:
    """The GGUF's tokenizer as {file name: text or bytes}: tokenizer.json or tokenizer.model, tokenizer_config.json,
    and generation_config.json when the GGUF names end-of-turn tokens (eot/eom ids) besides EOS."""
    kv = read_gguf_tokenizer(gguf_path)
    kind = kv["tokenizer.ggml.model"]
    c = _common(kv, gguf_path)
    files = {}
    if kind == "gpt2":
        tj, add_bos = _hf_tokenizer_json(kv, c, gguf_path)
        files["tokenizer.json"] = json.dumps(tj, ensure_ascii=False, indent=1)
        cls = "PreTrainedTokenizerFast"
    elif kind == "llama":
        files["tokenizer.model"] = _sentencepiece_proto(kv, c).SerializeToString()
        add_bos = True if c["add_bos"] is None else bool(c["add_bos"])
        cls = "LlamaTokenizer"
    else:
        raise ValueError(f"{gguf_path}: unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
    name = lambda i: c["tokens"][i] if i is not None and 0 <= i < len(c["tokens"]) else None  # noqa: E731
    cfg = {"tokenizer_class": cls, "add_bos_token": add_bos, "add_eos_token": False, "bos_token": name(c["bos"]),
           "eos_token": name(c["eos"]), "unk_token": name(c["unk"]), "pad_token": name(c["pad"]),
           "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30}
    if c["chat_template"]:
        cfg["chat_template"] = c["chat_template"]
    files["tokenizer_config.json"] = json.dumps(cfg, ensure_ascii=False, indent=2)
    if set(c["stop"]) - {c["eos"]}:
        files["generation_config.json"] = json.dumps({"eos_token_id": [c["eos"], *c["stop"]]}, indent=2)
    return files


def save_tokenizer_from_gguf(gguf_path, out_dir) -> list:
    """Write the GGUF's tokenizer files into out_dir (each atomically); returns their names."""
    files = tokenizer_files(gguf_path)
    for name, data in files.items():
        write_atomic(Path(out_dir) / name, data)
    return list(files)


def main(argv=None):
    ap = ArgumentParser(description="Write a GGUF file's tokenizer as Hugging Face tokenizer files.")
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out_dir", type=Path)
    a = ap.parse_args(argv)
    print(f"wrote {', '.join(save_tokenizer_from_gguf(a.gguf, a.out_dir))} in {a.out_dir}")


if __name__ == "__main__":
    cli(main)
