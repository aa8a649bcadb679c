# tiktoken-format tokenizers (CodeGen2.5, XGen), for tokenizer.py: a converted checkpoint carries them as
#   tokenizer.tiktoken     tiktoken's own BPE file (tiktoken.load.load_tiktoken_bpe reads it): "base64(bytes) rank"
#   tiktoken_config.json   {"pattern": pat_str, "special_tokens": {text: id}, "eos_token", "bos_token", "add_bos_token"}
# tokenizer_json() turns them into a byte-level BPE tokenizer.json that the `tokenizers` library (and tokenizer.bin's
# C++ encoder) run exactly as tiktoken does; save_tiktoken() writes them from a `tiktoken.Encoding`, and
# salesforce_encoding() rebuilds the Encoding CodeGen2.5's / XGen's tokenization_*.py build at load time (their
# repositories ship no ranks: the base encoding's come from tiktoken itself), without running that code.
import base64
import json
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent
if str(REPO / "scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "scripts"))
from common import TIKTOKEN_FILES, write_atomic  # noqa: E402
from gguf_tokenizer import LLAMA3_PATTERN  # noqa: E402  (the same splits as cl100k's regex)

# tiktoken's own spellings of the GPT-2 (r50k/p50k/gpt2) and cl100k regexes (possessive quantifiers, `\s++$`): the same
# splits as GPT2_PATTERN and gguf_tokenizer.LLAMA3_PATTERN, which tokenizer.py and tokenizer.bin use in their place
TIKTOKEN_R50K = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
TIKTOKEN_CL100K = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$"""
                   r"""|\s*[\r\n]|\s+(?!\S)|\s""")


def tokenizer_json(data: bytes, cfg: dict, path: str, gpt2_pattern: str, byte_chars: dict) -> str:
    """A tiktoken BPE file (lines "base64(token bytes) rank", tiktoken.load.load_tiktoken_bpe's format) and
    tiktoken_config.json ({"pattern": pat_str, "special_tokens": {text: id}, "eos_token", "bos_token"}) as a
    byte-level BPE tokenizer.json the `tokenizers` library runs exactly as tiktoken does: the pieces of the pattern;
    a piece that is a token stays whole (ignore_merges); else adjacent parts merge, lowest rank of the merged bytes
    first (a merge for every split of a token into two tokens, ordered by the token's rank). gpt2_pattern and
    byte_chars: tokenizer.py's GPT2_PATTERN and bytes_to_unicode()."""
    ranks = {}
    try:
        for line in data.decode("ascii").splitlines():
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
        pattern, special = cfg["pattern"], {str(t): int(i) for t, i in cfg.get("special_tokens", {}).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a tiktoken BPE file with its tiktoken_config.json ({type(e).__name__}: {e})") from None
    if len(set(ranks.values())) != len(ranks) or any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"{path}: tiktoken ranks must be distinct and cover all 256 single bytes")
    if set(special.values()) & set(ranks.values()):
        raise ValueError(f"{path}: a special token's id is also a rank")
    pattern = {TIKTOKEN_R50K: gpt2_pattern, TIKTOKEN_CL100K: LLAMA3_PATTERN}.get(pattern, pattern)
    u = byte_chars
    text = {b: "".join(u[c] for c in b) for b in ranks}
    merges = sorted((r, k, text[b[:k]], text[b[k:]]) for b, r in ranks.items() for k in range(1, len(b))
                    if b[:k] in ranks and b[k:] in ranks)
    tj = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
          "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for t, i in sorted(special.items(), key=lambda x: x[1])],
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
              {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
          "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                    "vocab": {**{text[b]: r for b, r in ranks.items()}, **special},  # (the library takes an
                    "merges": [[a, b] for _, _, a, b in merges]}}  # added token's id from the vocab, where it is)
    return json.dumps(tj, ensure_ascii=False)


def save_tiktoken(enc, out_dir, eos_token: Optional[str] = None, bos_token: Optional[str] = None) -> list:
    """Write a `tiktoken.Encoding` as tokenizer.tiktoken + tiktoken_config.json (what tokenizer.py loads; the
    converted-checkpoint form of CodeGen2.5's / XGen's tokenizers). Returns the file names."""
    ranks = "".join(f"{base64.b64encode(b).decode()} {r}\n" for b, r in sorted(enc._mergeable_ranks.items(),
                                                                              key=lambda x: x[1]))
    cfg = {"pattern": enc._pat_str, "special_tokens": dict(enc._special_tokens), "eos_token": eos_token,
           "bos_token": bos_token, "add_bos_token": False}
    write_atomic(Path(out_dir) / "tokenizer.tiktoken", ranks)
    write_atomic(Path(out_dir) / "tiktoken_config.json", json.dumps(cfg, ensure_ascii=False, indent=1))
    return list(TIKTOKEN_FILES)


# tokenizer_config.json's tokenizer_class -> (tiktoken base encoding, whitespace / tab runs appended as ranks,
# special tokens appended after the base's): what each model's tokenization_*.py does in tiktoken_tokenizer()
_FIM = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<filename>", "<gh_stars>", "<issue_start>",
        "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>",
        "<empty_output>", "<commit_before>", "<commit_msg>", "<commit_after>", "<reponame>"]
SALESFORCE = {"CodeGen25Tokenizer": ("gpt2", True, _FIM), "XgenTokenizer": ("gpt2", True, _FIM),
              "Xgen15BTokenizer": ("cl100k_base", False, _FIM[4:])}


def salesforce_encoding(tokenizer_class: str, base):
    """The tiktoken.Encoding of a CodeGen2.5 / XGen checkpoint (tokenizer_config.json's tokenizer_class) built on
    `base`, the tiktoken.Encoding SALESFORCE names (tiktoken.get_encoding(name): tiktoken's download or its cache)."""
    import tiktoken
    if tokenizer_class not in SALESFORCE:
        raise ValueError(f"unknown tiktoken tokenizer class {tokenizer_class!r} (known: {', '.join(SALESFORCE)})")
    _, runs, specials = SALESFORCE[tokenizer_class]
    ranks, idx = dict(base._mergeable_ranks), base.n_vocab
    if runs:
        for run in [" " * n for n in reversed(range(2, 32))] + ["\t" * n for n in reversed(range(2, 10))]:
            ranks[run.encode("ascii")] = idx
            idx += 1
    special = dict(base._special_tokens)
    for t in specials:
        special[t] = idx
        idx += 1
    return tiktoken.Encoding(name=f"{base.name}-{tokenizer_class}", pat_str=base._pat_str, mergeable_ranks=ranks,
                             special_tokens=special)


def convert_salesforce(src_dir, out_dir, base=None) -> list:
    """When src_dir's tokenizer_config.json names a CodeGen2.5 / XGen tokenizer class (SALESFORCE), write its
    tokenizer.tiktoken + tiktoken_config.json into out_dir and return their names; else []. The base encoding's ranks
    come from tiktoken (tiktoken.get_encoding: downloaded once, or from $TIKTOKEN_CACHE_DIR) unless `base` is given."""
    cfg_path = Path(src_dir) / "tokenizer_config.json"
    cls = json.loads(cfg_path.read_text()).get("tokenizer_class") if cfg_path.is_file() else None
    if cls not in SALESFORCE:
        return []
    if base is None:
        import tiktoken
        print(f"{cls}: building its tiktoken tokenizer on tiktoken's {SALESFORCE[cls][0]} ranks", file=sys.stderr)
        try:
            base = tiktoken.get_encoding(SALESFORCE[cls][0])
        except Exception as e:  # no network and no cached copy
            raise ValueError(f"{cls} needs tiktoken's {SALESFORCE[cls][0]} ranks, which could not be had "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); set "
                             f"TIKTOKEN_CACHE_DIR to a folder holding them") from None
    return save_tiktoken(salesforce_encoding(cls, base), out_dir, eos_token="<|endoftext|>")
