# tokenizer.bin (scripts/export_tokenizer_bin.py) and the C++ tokenizer the runners share (runner-common/tokenizer.h):
# on varied and randomly mixed text the C++ encoder gives the ids and the C++ decoder the text of the libraries
# themselves (`tokenizers` on the tokenizer.json, `sentencepiece` on the tokenizer.model), and the C++ stream decoder
# tokenizer.py's; for a tiny trained SentencePiece model and tiny byte-level BPE tokenizers of every pre-tokenizer
# flavour (and the real SmolLM2 one when it is present); the SentencePiece file is byte-identical to llama2.c's
# export; broken files give clear errors.
# The C++ side is runner-common/tok_tool.cpp, compiled here with one g++ call (seconds, no libtorch).
import io
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
import export_tokenizer_bin as E  # noqa: E402
import gguf_tokenizer as G  # noqa: E402
import tokenizer as T  # noqa: E402

BUILD = REPO / "runner-common" / "build"
TOOL = BUILD / "tok_tool"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")

PROMPTS = [
    "", " ", "  ", "\n", "Hello world", "Once upon a time", "  leading and trailing spaces   ", "tabs\tand\t\ttabs",
    "lines\nand\n\n\nmore\r\nlines\n", "digits 1234567 and 3.14159, 2024-01-01 v2.0 x86_64",
    "café naïve façade Ærøskøbing São Paulo", "日本語のテキストと中文和한국어", "emoji 🤖🎉 thumbs 👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "I'm it's we'll THEY'RE you've she'd 'S ſ", "   \t  \n  \t", "mixed ١٢٣ ½ ² Ⅻ 12", "x  \n  y \n\n z\t\n",
    "code: def f(x):\n    return x ** 2  # comment\n", "a" * 60, "nbsp\u00a0x\u2028y\u3000z\x0bw\x85v\x1cu",
    "decomposed e\u0301", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "x<|im_end|>y<|endoftext|>",
    "<s>[INST] hi [/INST]</s><unk>", "not special: <|im_sta rt|> <im_end>", "!!!??? ... --- *** \"quoted\" (paren)",
    "URL https://example.com/a?b=c&d=1#frag", "\u2581lower one eighth block \u2581\u2581x", "ǅ ǈ ʰ ᾈ", "\ufeffbom",
    "1234567890123456789 0.000001 1e-10 4294967296 ١٢٣٤٥٦٧٨٩٠ ๑๒๓", "a    b\t\t\tc\n\n\n\nd \u00a0\u00a0 e      \n",
    "DON'T can't Y'ALL we'RE it’s rock'n'roll 'tis", "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "x = {'a': [1, 2], \"b\": None}  # dict\n\n\n    return\r\n", "Ångström Øresund Łódź ﬁ ǆ", "한국어 テスト 🧑🏾‍💻 🏳️‍🌈 ❤️",
    "<|im_start|>system\nBe brief.<|im_end|><|im_start|>user\n", "a<|im_start|>b<|im_end|>c<|endoftext|>",
]


def mixed_text(n=150, seed=5):
    """Random mixes of words, digit runs, whitespace runs, contractions, code, accents/CJK/emoji, special tokens."""
    rng = random.Random(seed)
    pool = ["the", "Hello", "wörld", "naïve", "e\u0301", "語", "日本", "한", "🤖", "👍🏽", "👨‍👩‍👧", "1", "42", "2024",
            "3.14", "١٢", "'s", "'LL", "'t", "don't", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0",
            "\u3000", "(", ")", "{", "}", "==", "->", "#", "__init__", "x_1", ".", ",", "!?", "...", "<|im_end|>",
            "<|im_start|>", "<|endoftext|>", "<s>", "</s>", "\u2581", "\ufeff", "Ⅻ", "ǅ", "ſ"]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def reference(d: Path):
    """(encode(text, bos), decode(ids)) by the libraries themselves on d's files: `tokenizers` for a tokenizer.json,
    `sentencepiece` for a tokenizer.model (whose control pieces written in the text are split out first, the
    convention tokenizer.py documents); BOS from tokenizer_config.json, prepended unless the text starts with it."""
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    if (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        lib = Tokenizer.from_file(str(d / "tokenizer.json"))
        bos_id = lib.token_to_id(cfg["bos_token"])
        lib_encode = lambda t: lib.encode(t, add_special_tokens=False).ids  # noqa: E731
        decode = lambda ids: lib.decode(ids, skip_special_tokens=False)  # noqa: E731
    else:
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
        ctrl = {sp.id_to_piece(i): i for i in range(sp.vocab_size()) if sp.is_control(i) or sp.is_unknown(i)}
        rx = re.compile("(" + "|".join(map(re.escape, sorted(ctrl, key=len, reverse=True))) + ")")
        lib_encode = lambda t: [i for part in rx.split(t) if part  # noqa: E731
                                for i in ([ctrl[part]] if part in ctrl else sp.encode(part))]
        decode = lambda ids: sp.decode([i for i in ids if 0 <= i < sp.vocab_size()])  # noqa: E731
        bos_id = sp.bos_id()

    def encode(text, bos=bool(cfg.get("add_bos_token"))):
        ids = lib_encode(text)
        return [bos_id] + ids if bos and ids[:1] != [bos_id] else ids
    return encode, decode


def corpus(n=400, seed=0):
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over the lazy dog hello world tokenizer model llama smol café naïve über "
             "once upon a time there was 日本 語 中文 🤖 🎉 def return import print self x y 2024 3.14 42 don't I'm it's "
             "Ærø ½ ١٢").split()
    seps = [" ", " ", " ", "  ", "\n", "\t", ", ", ". ", "\n\n", "   "]
    return ["".join(rng.choice(words) + rng.choice(seps) for _ in range(rng.randint(5, 25))) for _ in range(n)]


# ----------------------------------------------------------------------------------------------------------- fixtures
def make_sp_dir(d: Path, vocab_size=400, chat_template=LLAMA2_TEMPLATE) -> Path:
    """A tiny Llama-style SentencePiece model: BPE, byte fallback, identity normalizer, dummy prefix."""
    import sentencepiece as spm
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        character_coverage=0.9995, max_sentence_length=100000, minloglevel=2, num_threads=1)
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    if chat_template:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


BPE_PRE = {"smollm": "digits+bytelevel", "gpt2": "bytelevel", "llama3": G.LLAMA3_PATTERN, "qwen2": G.QWEN2_PATTERN}


def make_bpe_dir(d: Path, variant="smollm", vocab_size=500, chat_template=SMOLLM2_TEMPLATE, texts=None) -> Path:
    """A tiny byte-level BPE tokenizer.json (SmolLM2-style by default: digit split + GPT-2 regex, ChatML), trained on
    texts (default: corpus())."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(ignore_merges=variant == "llama3"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts or corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIALS,
        show_progress=False))
    pre = BPE_PRE[variant]
    if pre == "digits+bytelevel":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif pre != "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pre), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.save(str(d / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}
    if chat_template:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def build_tok_tool() -> Path:
    """Compile runner-common/tok_tool.cpp once (rebuilt when a source is newer than the binary)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: cannot build the C++ tokenizer")
    srcs = [REPO / "runner-common" / "tok_tool.cpp", *sorted((REPO / "runner-common").glob("*.h"))]
    if TOOL.exists() and TOOL.stat().st_mtime > max(s.stat().st_mtime for s in srcs):
        return TOOL
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = TOOL.with_name(f"tok_tool.{os.getpid()}.tmp")
    r = subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(tmp), str(srcs[0])], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    os.replace(tmp, TOOL)
    return TOOL


def export_bin(tok_dir: Path, out: Path, *extra) -> Path:
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "export_tokenizer_bin.py"), str(tok_dir), "-o", str(out),
                        *extra], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def c_encode(tool, bin_path, texts, bos=-1):
    data = b"\0".join(t.encode("utf-8") for t in texts)
    r = subprocess.run([str(tool), "encode", str(bin_path), str(bos)], input=data, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().split("\n")
    return [[int(x) for x in line.split()] for line in lines[:len(texts)]]


def c_decode(tool, bin_path, seqs):
    data = "".join(" ".join(map(str, s)) + "\n" for s in seqs).encode()
    r = subprocess.run([str(tool), "decode", str(bin_path)], input=data, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    out = []
    for line in r.stdout.decode().splitlines():
        a, b = line.split(" ")
        out.append(tuple(bytes.fromhex(x if x != "-" else "").decode("utf-8") for x in (a, b)))
    return out


def c_chat(tool, bin_path, messages):
    data = "\x1e".join(m["role"] + "\x1f" + m["content"] for m in messages).encode()
    r = subprocess.run([str(tool), "chat", str(bin_path)], input=data, capture_output=True)
    return r.returncode, r.stdout.decode("utf-8"), r.stderr.decode()


def py_stream(tok, ids):
    s = tok.stream()
    return "".join(s.put(i) for i in ids) + s.flush()


@pytest.fixture(scope="module")
def tool():
    return build_tok_tool()


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    dirs = {"sp": make_sp_dir(root / "sp")}
    for v in BPE_PRE:
        dirs[v] = make_bpe_dir(root / v, v)
    return dirs


@pytest.fixture(scope="module")
def bins(tok_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("bins")
    return {k: export_bin(d, root / f"{k}.bin") for k, d in tok_dirs.items()}


def smollm2_dir():
    d = REPO / "checkpoints" / "SmolLM2-135M-Instruct"
    return d if (d / "tokenizer.json").is_file() else None


# ----------------------------------------------------------------------------------------------------------- tests
def llama2c_reference(sp) -> bytes:
    """llama2.c's tokenizer.py export, written out again independently (struct "I" then "fI" per token)."""
    out = io.BytesIO()
    toks, scores = [], []
    for i in range(sp.vocab_size()):
        t = sp.id_to_piece(i)
        if i == sp.bos_id():
            t = "\n<s>\n"
        elif i == sp.eos_id():
            t = "\n</s>\n"
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            t = chr(int(t[3:5], 16))
        toks.append(t.replace("▁", " ").encode("utf-8"))
        scores.append(sp.get_score(i))
    out.write(struct.pack("I", max(len(t) for t in toks)))
    for t, s in zip(toks, scores):
        out.write(struct.pack("fI", s, len(t)))
        out.write(t)
    return out.getvalue()


def test_sentencepiece_llama2c_bytes(tok_dirs, bins, tmp_path):
    tok = T.load_tokenizer(tok_dirs["sp"])
    want = llama2c_reference(tok.sp)
    plain = export_bin(tok_dirs["sp"], tmp_path / "plain.bin", "--llama2c").read_bytes()
    assert plain == want
    full = bins["sp"].read_bytes()
    assert full[:len(want)] == want and full[-8:] == b"LLTOKEND"  # extension appended after llama2.c's bytes
    # llama2.c's reader: header, then vocab_size entries -- what it sees is identical
    (max_len,) = struct.unpack_from("<I", full)
    assert max_len == max(len(b) for b, _ in E.llama2c_entries(tok.sp))


@pytest.mark.parametrize("kind", ["sp", "smollm", "gpt2", "llama3", "qwen2"])
def test_encode_matches_library(tool, tok_dirs, bins, kind):
    encode, _ = reference(tok_dirs[kind])
    tok = T.load_tokenizer(tok_dirs[kind])
    prompts = PROMPTS + corpus(40, seed=7) + mixed_text()
    for p, g in zip(prompts, c_encode(tool, bins[kind], prompts)):
        assert g == encode(p) == tok.encode(p), f"{kind}: {p!r}"
    for bos in (0, 1):
        got = c_encode(tool, bins[kind], PROMPTS[:8], bos)
        assert got == [encode(p, bos=bool(bos)) for p in PROMPTS[:8]]


@pytest.mark.parametrize("kind", ["sp", "smollm"])
def test_decode_and_stream(tool, tok_dirs, bins, kind):
    """C++ decode = the library's decode; C++ stream decode = tokenizer.py's StreamDecoder."""
    encode, decode = reference(tok_dirs[kind])
    tok = T.load_tokenizer(tok_dirs[kind])
    rng = random.Random(1)
    seqs = [encode(p) for p in PROMPTS + mixed_text(50)]
    # random ids: byte tokens that do not form characters, control tokens mid-text, ids past the vocabulary
    seqs += [[rng.randrange(tok.vocab_size + 8) for _ in range(rng.randint(1, 30))] for _ in range(150)]
    seqs += [[rng.randrange(min(tok.vocab_size, 300)) for _ in range(rng.randint(1, 30))] for _ in range(100)]
    for s, (dec, streamed) in zip(seqs, c_decode(tool, bins[kind], seqs)):
        assert dec == decode(s) == tok.decode(s), s
        assert streamed == py_stream(tok, s), s


def test_python_utf8_replacement(tool, tok_dirs, bins):
    # every byte on its own and random byte soups through the byte tokens: CPython's "replace" semantics
    tok = T.load_tokenizer(tok_dirs["gpt2"])
    byte_id = {b: tok.hf.token_to_id(T.bytes_to_unicode()[b]) for b in range(256)}
    rng = random.Random(2)
    soups = [bytes([b]) for b in range(256)]
    soups += [bytes(rng.choice([0x41, 0x80, 0xBF, 0xC2, 0xE0, 0xED, 0xF0, 0xF4, 0xF5, 0xA0, 0x90, 0x8F, 0xE2, 0x82, 0xAC])
                    for _ in range(rng.randint(1, 12))) for _ in range(300)]
    seqs = [[byte_id[b] for b in s] for s in soups]
    for s, soup, (dec, streamed) in zip(seqs, soups, c_decode(tool, bins["gpt2"], seqs)):
        assert dec == soup.decode("utf-8", errors="replace")
        assert streamed == py_stream(tok, s)


@pytest.mark.parametrize("kind", ["sp", "smollm"])
def test_chat_template_rendering(tool, tok_dirs, bins, kind):
    tok = T.load_tokenizer(tok_dirs[kind])
    convs = E._PROBES + [
        [{"role": "user", "content": "  Tell me a joke \n"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    ]
    for conv in convs:
        rc, out, err = c_chat(tool, bins[kind], conv)
        assert rc == 0, err
        assert out == tok.apply_chat_template(conv, add_generation_prompt=True), conv


def test_no_chat_template_is_a_clear_error(tool, tmp_path):
    d = make_bpe_dir(tmp_path / "nochat", "gpt2", chat_template=None)
    b = export_bin(d, tmp_path / "t.bin")
    rc, out, err = c_chat(tool, b, [{"role": "user", "content": "hi"}])
    assert rc == 1 and "no chat template" in err


def test_plain_llama2c_file(tool, tok_dirs, tmp_path):
    """A tokenizer.bin from llama2.c itself (no extension) still encodes and decodes like the SentencePiece model."""
    encode, decode = reference(tok_dirs["sp"])
    plain = export_bin(tok_dirs["sp"], tmp_path / "plain.bin", "--llama2c")
    prompts = [p for p in PROMPTS if "<" not in p]  # llama2.c files do not name the special tokens' text
    assert c_encode(tool, plain, prompts) == [encode(p) for p in prompts]
    seqs = [encode(p) for p in PROMPTS]
    for s, (dec, _) in zip(seqs, c_decode(tool, plain, seqs)):
        assert dec == decode(s)


def test_smollm2_tokenizer(tool, tmp_path):
    d = smollm2_dir()
    if d is None:
        pytest.skip("the default model is not prepared (python scripts/download.py)")
    tok = T.load_tokenizer(d)
    encode, decode = reference(d)
    b = export_bin(d, tmp_path / "smol.bin")
    prompts = PROMPTS + corpus(30, seed=3) + mixed_text(100, seed=6)
    assert c_encode(tool, b, prompts) == [encode(p) for p in prompts]
    seqs = [encode(p) for p in prompts]
    assert [dec for dec, _ in c_decode(tool, b, seqs)] == [decode(s) for s in seqs]
    rc, out, _ = c_chat(tool, b, [{"role": "user", "content": "Hi"}])
    assert rc == 0 and out == tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_broken_files_are_clear_errors(tool, bins, tmp_path):
    good = bins["smollm"].read_bytes()
    cases = {
        "truncated.bin": good[:len(good) // 2],
        "truncated_tail.bin": good[:-5],
        "short.bin": good[:3],
        "empty.bin": b"",
        "random.bin": bytes(random.Random(0).randrange(256) for _ in range(5000)),
        "text.bin": b"this is not a tokenizer at all\n" * 50,
        "badfooter.bin": good[:-16] + struct.pack("<Q", len(good) * 3) + b"LLTOKEND",
    }
    for name, data in cases.items():
        p = tmp_path / name
        p.write_bytes(data)
        r = subprocess.run([str(tool), "info", str(p)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        assert r.returncode == 1, (name, r.returncode, r.stdout, r.stderr)
        assert r.stderr.startswith("error: ") and str(p) in r.stderr, (name, r.stderr)
    r = subprocess.run([str(tool), "info", str(tmp_path / "missing.bin")], capture_output=True, text=True)
    assert r.returncode == 1 and "cannot open" in r.stderr


def test_exporter_errors(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "export_tokenizer_bin.py"), str(tmp_path / "nope"),
                        "-o", str(tmp_path / "t.bin")], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1


def test_stop_id_outside_the_vocabulary_is_refused_at_export(tmp_path):
    """A config whose EOS id lies past the tokenizer's tokens (a tiny Phi-3 keeps Phi3Config's 32000) would give a
    tokenizer.bin the runners refuse at load: the exporter says so first, in one line, and writes nothing."""
    d = make_bpe_dir(tmp_path / "tok")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 32000]}))
    out = tmp_path / "t.bin"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "export_tokenizer_bin.py"), str(d), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    from tokenizers import Tokenizer
    n = Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size()
    assert len(errors) == 1 and "id 32000 " in errors[0] and f"{n} tokens" in errors[0], r.stderr
    assert not out.exists()


def test_long_words_merge_like_the_library(tool, tmp_path):
    """encode_bpe.h's merge (a heap of pair ranks over a linked list of symbols, O(n log n)) on words of 200k letters
    and long words with repeats, under a tokenizer with ~3000 merges among the letters: the same ids as the
    `tokenizers` library (the quadratic loop it replaced took ~9 s on the 200k word). Times are printed (-s)."""
    import time
    rng = random.Random(11)
    letters = "abcdefghijklmnopqrstuvwxyz"
    train = [" ".join("".join(rng.choice(letters[:rng.randint(3, 26)]) for _ in range(rng.randint(2, 12)))
                      for _ in range(50)) for _ in range(400)]
    d = make_bpe_dir(tmp_path / "letters", vocab_size=3500, texts=train)
    b = export_bin(d, tmp_path / "letters.bin")
    encode, _ = reference(d)
    chunk = "".join(rng.choice(letters) for _ in range(37))
    words = ["".join(rng.choice(letters) for _ in range(200_000)), "ab" * 20_000, "a" * 30_001,
             "".join(rng.choice("aab") for _ in range(50_000)), (chunk * 1500)[:50_000] + "q",
             " " + "".join(rng.choice(letters[:5]) for _ in range(20_000))]
    for w in words:
        t0 = time.perf_counter()
        got = c_encode(tool, b, [w])[0]
        took = time.perf_counter() - t0
        assert got == encode(w), (len(w), w[:40])
        print(f"tok_tool: {len(w)}-letter word in {took:.3f} s, {len(got)} ids")
    assert len(json.loads((d / "tokenizer.json").read_text())["model"]["merges"]) > 3000  # a real workout
