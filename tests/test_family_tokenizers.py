# Every model family's tokenizer and chat template, in Python (tokenizer.py) and in C++ (tokenizer.bin through
# runner-common, driven by tok_tool), against code nobody here wrote: `sentencepiece`, `tokenizers`, `tiktoken` and
# transformers' tokenizer classes and apply_chat_template. No network: each family gets a stand-in trained here on a
# small corpus with the *configuration* of its real tokenizer (SentencePiece flags, pre-tokenizer / normalizer /
# decoder settings, added and special tokens), and its published chat template (written below as data).
#   Gemma 1/2/3          SentencePiece BPE, byte fallback, no dummy prefix, <bos>/<eos>, <start_of_turn> user-defined
#   Phi-3-mini           Llama 2's tokenizer.model + added tokens past it (<|user|> <|assistant|> <|end|> ...)
#   Mistral v0.1 / Mixtral / Codestral   Llama-style SentencePiece, [INST] template (no system message)
#   StarCoder2           byte-level BPE, individual digits, <|endoftext|> + FIM tokens, no chat template
#   SmolLM3              Llama-3-style Split regex + ignore_merges; a template tokenizer.bin cannot render
#   Phi-4-mini           o200k Split regex (letter-case classes, marks, contractions glued to words)
#   GPT-2, GPT-NeoX/MPT  ByteLevel GPT-2 regex (NeoX: NFC normalizer, whitespace-run added tokens)
#   Falcon               Punctuation + ByteLevel + Digits + 3-digit Split
#   CodeGen2.5, XGen     tiktoken ranks (GPT-2 / cl100k regex) + whitespace-run ranks + FIM special tokens
import base64
import json
import random
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import export_tokenizer_bin as E  # noqa: E402
import gguf_tokenizer as G  # noqa: E402
import tokenizer as T  # noqa: E402
import tokenizer_tiktoken as TT  # noqa: E402
from test_tokenizer_bin import build_tok_tool, c_chat, c_decode, c_encode, export_bin, py_stream  # noqa: E402
from family_standins import CONVS, PHI3_ADDED, TEXTS, family_texts, make_family, tiktoken_family  # noqa: E402

SP_FAMILIES = ["gemma", "gemma3", "phi3", "mistral"]
BPE_FAMILIES = ["starcoder2", "smollm3", "phi4", "gpt2", "neox", "falcon"]
CHAT = {"gemma": "gemma", "gemma3": "gemma", "phi3": "phi3", "phi4": "phi4", "mistral": "mistral", "smollm3": "smollm3",
        "starcoder2": "none", "gpt2": "none", "neox": "none", "falcon": "none"}


@pytest.fixture(scope="module")
def tool():
    return build_tok_tool()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {n: make_family(n, root / n) for n in SP_FAMILIES + BPE_FAMILIES}


@pytest.fixture(scope="module")
def tiktokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiktoken")
    return {n: (root / n, *tiktoken_family(n, root / n)) for n in ("codegen25", "xgen")}  # (dir, encoding, base)


@pytest.fixture(scope="module")
def bins(dirs, tiktokens, tmp_path_factory):
    root = tmp_path_factory.mktemp("family_bins")
    all_dirs = {**dirs, **{n: v[0] for n, v in tiktokens.items()}}
    return {n: export_bin(d, root / f"{n}.bin") for n, d in all_dirs.items()}


# ------------------------------------------------------------------------------------------ references
def sp_reference(d: Path, tok):
    """sentencepiece itself, with control pieces and added tokens written in the text split out first; an added
    token (past the model's pieces) decodes as a control piece does (to nothing, ending a run of byte pieces)."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    specials = dict(tok.special_tokens)
    added = {i for t, i in specials.items() if i >= sp.vocab_size()}

    def encode(text):
        ids, pos = [], 0
        while pos < len(text):
            hits = [(text.find(s, pos), -len(s), s) for s in specials if text.find(s, pos) >= 0]
            if not hits:
                break
            at, _, s = min(hits)
            ids += sp.encode(text[pos:at]) if at > pos else []
            ids.append(specials[s])
            pos = at + len(s)
        return ids + (sp.encode(text[pos:]) if pos < len(text) else [])
    return encode, lambda ids: sp.decode([sp.eos_id() if i in added else i for i in ids
                                          if 0 <= i < sp.vocab_size() or i in added])


def hf_tokenizer(d: Path):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(d))


# ------------------------------------------------------------------------------------------ tests: Python
@pytest.mark.parametrize("name", SP_FAMILIES)
def test_sentencepiece_families_python(dirs, name):
    d = dirs[name]
    tok = T.load_tokenizer(d)
    assert tok.kind == "sentencepiece"
    encode, decode = sp_reference(d, tok)
    ht = hf_tokenizer(d)
    texts = family_texts(tok.special_tokens)
    # sentencepiece itself (the control and added tokens written in the text split out first), where the dummy prefix
    # starts every piece of text (legacy; Phi-3 says legacy=false: the prefix only at the start of the text)
    for t in texts:
        ids = tok.encode(t, bos=False)
        assert ids == encode(t) or tok.prefix_first_only, (name, t)
        assert tok.decode(ids) == decode(ids)
    # transformers' own class (GemmaTokenizer / LlamaTokenizer from tokenizer.model + tokenizer_config.json: its
    # added tokens' rstrip, legacy) on every text, special tokens included: the same ids, the same text back. Mistral's
    # config names no `legacy`: transformers 5 then takes legacy=false, tokenizer.py sentencepiece's own behaviour;
    # they differ only where a special token is followed by text or the text starts with whitespace (or "\u2581").
    for t in texts if name != "mistral" else [t for t in TEXTS if "<" not in t and t[:1] not in " \t\n\u2581"]:
        assert tok.encode(t, bos=False) == ht.encode(t, add_special_tokens=False), (name, t)
        if not t.startswith(tok.token_text(tok.bos_id) or "\0"):  # (tokenizer.py adds no second BOS)
            assert tok.encode(t) == ht.encode(t), (name, t)
        if "<" not in t:
            assert tok.decode(tok.encode(t)) == ht.decode(tok.encode(t), skip_special_tokens=True), (name, t)
    if name.startswith("gemma"):  # <bos> once, <end_of_turn> ends a turn, whitespace is never dropped
        assert tok.bos_id == 2 and tok.eos_id == 1 and tok.stop_ids == {1, 6} and tok.add_bos
        assert tok.encode("<bos>hi")[:1] == [2] and tok.encode("<bos>hi").count(2) == 1
        assert tok.decode(tok.encode("  two  spaces ")) == "  two  spaces "
    if name == "phi3":  # the added tokens past the model: ids, vocab size, stop ids, decode to ""
        n = tok.sp.get_piece_size()
        assert tok.vocab_size == n + len(PHI3_ADDED) and tok.eos_id == n and tok.stop_ids == {n, n + 7}
        ids = tok.encode("<|user|>\nHi<|end|>\n<|assistant|>\n")  # rstrip: the newlines after them are theirs
        assert ids == [n + 10, *tok.sp.encode("Hi", add_bos=False)[1:], n + 7, n + 1] and not tok.add_bos
        assert tok.decode(ids) == decode(ids) and "<|" not in tok.decode(ids)


@pytest.mark.parametrize("name", BPE_FAMILIES)
def test_bpe_families_python(dirs, name):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    d = dirs[name]
    tok = T.load_tokenizer(d)
    lib = Tokenizer.from_file(str(d / "tokenizer.json"))
    # transformers on the tokenizer.json as shipped (not AutoTokenizer: with tokenizer_class GPT2Tokenizer, as
    # StarCoder2's config names it, transformers 5 rebuilds a plain GPT-2 pipeline and drops the Digits step)
    ht = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    texts = family_texts(tok.special_tokens)
    rng = random.Random(4)
    for t in texts:
        ids = tok.encode(t, bos=False)
        assert ids == lib.encode(t, add_special_tokens=False).ids == ht.encode(t, add_special_tokens=False), (name, t)
        assert tok.decode(ids) == lib.decode(ids, skip_special_tokens=False) == \
            ht.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False), (name, t)
        assert tok.decode(ids) == (unicodedata.normalize("NFC", t) if name == "neox" else t)
    for _ in range(100):  # random ids: bytes that are no UTF-8, special tokens mid-text
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 20))]
        assert tok.decode(ids) == lib.decode(ids, skip_special_tokens=False)
    end = {"starcoder2": "<|endoftext|>", "smollm3": "<|im_end|>", "phi4": "<|end|>", "gpt2": "<|endoftext|>",
           "neox": "<|endoftext|>", "falcon": "<|endoftext|>"}[name]
    assert tok.special_tokens[end] in tok.stop_ids and not tok.add_bos


@pytest.mark.parametrize("name", ["codegen25", "xgen"])
def test_tiktoken_families_python(tiktokens, name):
    """tokenizer.tiktoken + tiktoken_config.json: encode/decode equal to the tiktoken package."""
    d, enc, _ = tiktokens[name]
    tok = T.load_tokenizer(d)
    assert tok.kind == "bpe" and tok.vocab_size == enc.n_vocab and not tok.add_bos
    assert tok.pattern == (T.GPT2_PATTERN if name == "codegen25" else G.LLAMA3_PATTERN)
    assert T.load_tokenizer(d / "tokenizer.tiktoken").encode("a  b") == tok.encode("a  b")
    rng = random.Random(5)
    assert (b" " * 31 in enc._mergeable_ranks) == (name == "codegen25") and "<reponame>" in enc._special_tokens
    for t in family_texts(enc._special_tokens):
        ids = tok.encode(t)
        assert ids == enc.encode(t, allowed_special="all"), (name, t)
        assert tok.decode(ids) == enc.decode(ids) == t
    valid = sorted(set(enc._mergeable_ranks.values()) | set(enc._special_tokens.values()))  # (cl100k has holes)
    for _ in range(200):
        ids = [rng.choice(valid) for _ in range(rng.randint(1, 20))]
        assert tok.decode(ids) == enc.decode(ids)
    assert tok.stop_ids == {enc._special_tokens["<|endoftext|>"]}


def test_tiktoken_bad_files(tmp_path):
    (tmp_path / "tokenizer.tiktoken").write_text("IQ== 0\n")
    with pytest.raises(ValueError, match="tiktoken_config.json"):
        T.load_tokenizer(tmp_path)
    (tmp_path / "tiktoken_config.json").write_text(json.dumps({"pattern": TT.TIKTOKEN_R50K}))
    with pytest.raises(ValueError, match="256 single bytes"):
        T.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.tiktoken").write_text("not base64!! x\n")
    with pytest.raises(ValueError, match="not a tiktoken BPE file"):
        T.load_tokenizer(tmp_path)


# ------------------------------------------------------------------------------------------ tests: chat templates
def hf_render(d: Path, conv):
    ht = hf_tokenizer(d)
    try:
        return ht.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template's raise_exception (a system message Gemma 1/2 and Mistral refuse)
        return type(e).__name__


@pytest.mark.parametrize("name", ["gemma", "gemma3", "phi3", "mistral", "smollm3", "phi4", "starcoder2"])
def test_chat_templates(tool, dirs, bins, name):
    """tokenizer.py's rendering == transformers' apply_chat_template with the same template; tokenizer.bin's chat
    kind renders the same text in C++ and refuses what the template refuses (a system message: Gemma 1/2, Mistral)."""
    d = dirs[name]
    tok = T.load_tokenizer(d)
    convs = CONVS + [
        [{"role": "system", "content": "/think Be exact. "}, {"role": "user", "content": "q"},
         {"role": "assistant", "content": "\n\nthought"}, {"role": "user", "content": "again"}],
        [{"role": "system", "content": "Just this./system_override \n "}, {"role": "user", "content": "q"}],
        [{"role": "system", "content": "/no_think"}, {"role": "user", "content": "q"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}]]
    for conv in convs:
        want = hf_render(d, conv)
        if CHAT[name] == "none":  # StarCoder2: no template at all, in Python and in C++
            with pytest.raises(ValueError, match="no chat template"):
                tok.apply_chat_template(conv)
            rc, out, err = c_chat(tool, bins[name], conv)
            assert rc == 1 and "no chat template" in err
            continue
        try:
            got = tok.apply_chat_template(conv, add_generation_prompt=True)
        except ValueError:
            got = "TemplateError"
        assert got == want, (name, conv)
        rc, out, err = c_chat(tool, bins[name], conv)
        if got == "TemplateError":
            assert rc == 1 and "system message" in err, (name, conv, err)
        else:
            assert rc == 0 and out == got, (name, conv, err)
    if CHAT[name] != "none":
        assert E.CHAT_NAMES[E.detect_chat(tok)[0]] == CHAT[name]


def test_unrenderable_chat_template_is_refused(dirs, tmp_path):
    """A template none of the C++ renderings reproduces: tokenizer.bin export refuses it in one line (never wrong
    chat text), and --no_chat writes the file without chat."""
    import shutil
    import subprocess
    d = tmp_path / "odd"
    shutil.copytree(dirs["gpt2"], d)
    tpl = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}ASSISTANT:"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl}))
    cmd = [sys.executable, str(REPO / "scripts" / "export_tokenizer_bin.py"), str(d), "-o", str(tmp_path / "t.bin")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "none of the renderings" in r.stderr and "--no_chat" in r.stderr and not (tmp_path / "t.bin").exists()
    r = subprocess.run(cmd + ["--no_chat"], capture_output=True, text=True)
    assert r.returncode == 0 and "chat template none" in r.stderr and (tmp_path / "t.bin").exists()


# ------------------------------------------------------------------------------------------ tests: tokenizer.bin
def reference_for(name, dirs, tiktokens):
    if name in tiktokens:
        d, enc, _ = tiktokens[name]
        return (lambda t: enc.encode(t, allowed_special="all")), enc.decode, T.load_tokenizer(d)
    tok = T.load_tokenizer(dirs[name])
    if tok.kind == "sentencepiece":
        encode, decode = sp_reference(dirs[name], tok)
        if tok.prefix_first_only:  # Phi-3 (legacy=false, rstrip): transformers is the reference for the ids
            ht = hf_tokenizer(dirs[name])
            encode = lambda t: ht.encode(t, add_special_tokens=False)  # noqa: E731
    else:
        from tokenizers import Tokenizer
        lib = Tokenizer.from_file(str(dirs[name] / "tokenizer.json"))
        encode = lambda t: lib.encode(t, add_special_tokens=False).ids  # noqa: E731
        decode = lambda ids: lib.decode(ids, skip_special_tokens=False)  # noqa: E731
    return encode, decode, tok


@pytest.mark.parametrize("name", ["gemma", "phi3", "mistral", "starcoder2", "smollm3", "phi4", "gpt2", "neox",
                                  "falcon", "codegen25", "xgen"])
def test_tokenizer_bin_families(tool, dirs, tiktokens, bins, name):
    """C++ encode / decode / stream decode through tokenizer.bin == the library (and tokenizer.py)."""
    encode, decode, tok = reference_for(name, dirs, tiktokens)
    texts = family_texts(tok.special_tokens)
    if name == "neox":  # its NFC normalizer is not run by the C++ encoder: exact on NFC text (the exporter warns)
        texts = [unicodedata.normalize("NFC", t) for t in texts]
    for t, got in zip(texts, c_encode(tool, bins[name], texts, 0)):
        assert got == encode(t) == tok.encode(t, bos=False), (name, t)
    assert c_encode(tool, bins[name], ["hello"])[0] == tok.encode("hello")  # BOS as the tokenizer adds it
    rng = random.Random(6)
    seqs = [encode(t) for t in texts[:60]]
    valid = [i for i in range(tok.vocab_size) if tok.token_text(i) is not None]  # (tiktoken decode: no holes)
    seqs += [[rng.choice(valid) for _ in range(rng.randint(1, 25))] for _ in range(100)]
    for s, (dec, streamed) in zip(seqs, c_decode(tool, bins[name], seqs)):
        assert dec == tok.decode(s) == decode(s), (name, s)
        assert streamed == py_stream(tok, s), (name, s)


def test_tokenizer_bin_lstrip_rstrip(tool, dirs, tmp_path):
    """Added tokens that take in the whitespace around them (tokenizer.json lstrip / rstrip) in a byte-level BPE
    tokenizer: C++ through tokenizer.bin == the library."""
    import shutil
    from tokenizers import Tokenizer
    d = tmp_path / "strip"
    shutil.copytree(dirs["phi4"], d)
    j = json.loads((d / "tokenizer.json").read_text())
    for t in j["added_tokens"]:
        t["rstrip"], t["lstrip"] = t["content"] in ("<|end|>", "<|user|>"), t["content"] in ("<|user|>", "<|tool|>")
    (d / "tokenizer.json").write_text(json.dumps(j))
    lib = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok = T.load_tokenizer(d)
    b = export_bin(d, tmp_path / "t.bin")
    texts = family_texts(tok.special_tokens) + ["a \u3000\n<|user|> \t\n b<|end|>\n\n c <|tool|><|end|> \u2028"]
    for t, got in zip(texts, c_encode(tool, b, texts, 0)):
        assert got == lib.encode(t, add_special_tokens=False).ids == tok.encode(t), t


def test_tokenizer_bin_refuses_unimplemented_pre_tokenizers(dirs, tmp_path):
    """A byte-level pipeline the C++ encoder lacks (Falcon's, with isolated punctuation) runs in Python (the library
    runs it) and tokenizer.bin export refuses it: one error line, no file."""
    import subprocess
    from tokenizers import Tokenizer
    j = json.loads((dirs["falcon"] / "tokenizer.json").read_text())
    j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Isolated"
    d = tmp_path / "odd"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(j))
    (d / "tokenizer_config.json").write_text((dirs["falcon"] / "tokenizer_config.json").read_text())
    lib = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert T.load_tokenizer(d).encode("a,,b!!c") == lib.encode("a,,b!!c", add_special_tokens=False).ids
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "export_tokenizer_bin.py"), str(d), "-o",
                        str(tmp_path / "t.bin")], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "not one the C++ encoder implements" in r.stderr and not (tmp_path / "t.bin").exists()


def test_convert_salesforce(tiktokens, tmp_path):
    """What convert_checkpoint does for a CodeGen2.5 / XGen repository (tokenizer_config.json's tokenizer_class, no
    ranks shipped): the recipe on the base encoding, written as tokenizer.tiktoken + tiktoken_config.json."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "CodeGen25Tokenizer"}))
    _, enc, base = tiktokens["codegen25"]
    assert TT.convert_salesforce(src, out, base) == ["tokenizer.tiktoken", "tiktoken_config.json"]
    tok = T.load_tokenizer(out)
    for t in family_texts(enc._special_tokens)[:80]:
        assert tok.encode(t) == enc.encode(t, allowed_special="all"), t
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert TT.convert_salesforce(src, tmp_path / "none", base) == []


def test_tiktoken_text_file_roundtrip(tiktokens):
    """tokenizer.tiktoken is tiktoken's own format: tiktoken.load reads back the ranks we wrote."""
    from tiktoken.load import load_tiktoken_bpe
    d, enc, _ = tiktokens["xgen"]
    assert load_tiktoken_bpe(str(d / "tokenizer.tiktoken")) == enc._mergeable_ranks
    line = (d / "tokenizer.tiktoken").read_text().splitlines()[0].split()
    assert base64.b64decode(line[0]) in enc._mergeable_ranks


# ------------------------------------------------------------------------------------------ tests: GGUF vocabularies
def write_gguf(path: Path, d: Path, model: str, pre=None, **extra):
    """The family's vocabulary as llama.cpp's convert_hf_to_gguf.py stores it (tokens, types, merges or scores)."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    if model == "gpt2":
        j = json.loads((d / "tokenizer.json").read_text())
        added = {t["id"]: t for t in j["added_tokens"]}
        vocab = {**j["model"]["vocab"], **{t["content"]: i for i, t in added.items()}}
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        types = [(3 if added[i]["special"] else 4) if i in added else 1 for i in range(len(tokens))]
        w.add_tokenizer_pre(pre)
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]])
        w.add_eos_token_id(vocab[cfg.get("eos_token", "<|endoftext|>")])
    else:
        from sentencepiece import sentencepiece_model_pb2 as pb
        m = pb.ModelProto()
        m.ParseFromString((d / "tokenizer.model").read_bytes())
        tokens, types = [p.piece for p in m.pieces], [int(p.type) for p in m.pieces]
        w.add_token_scores([p.score for p in m.pieces])
        w.add_bos_token_id(m.trainer_spec.bos_id)
        w.add_eos_token_id(m.trainer_spec.eos_id)
        w.add_unk_token_id(m.trainer_spec.unk_id)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for k, v in extra.items():
        getattr(w, k)(v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name,pre", [("starcoder2", "starcoder"), ("smollm3", "llama-bpe"), ("phi4", "gpt-4o"),
                                      ("gpt2", "gpt-2"), ("neox", "mpt"), ("falcon", "falcon"), ("gemma", None)])
def test_gguf_vocabularies(dirs, tmp_path, name, pre):
    """A GGUF of the family (llama.cpp's tokenizer.ggml.pre name for it) encodes and decodes like the original."""
    d = dirs[name]
    ref = T.load_tokenizer(d)
    if pre is None:  # Gemma: a "llama" (SentencePiece) vocabulary without the space prefix, end of turn = eot id
        g = write_gguf(tmp_path / "m.gguf", d, "llama", add_add_space_prefix=False, add_add_bos_token=True,
                       add_eot_token_id=6)
    else:
        g = write_gguf(tmp_path / "m.gguf", d, "gpt2", pre)
    tok = T.load_tokenizer(g)
    assert tok.kind == ref.kind and tok.vocab_size == ref.vocab_size and tok.stop_ids >= {ref.eos_id}
    for t in family_texts(ref.special_tokens):
        ids = tok.encode(t, bos=False)
        assert ids == ref.encode(t, bos=False), (name, t)
        assert tok.decode(ids) == ref.decode(ids)
    if pre is None:
        assert tok.stop_ids == {1, 6} and tok.encode("hi")[0] == 2


def test_gguf_unknown_pre_is_refused(dirs, tmp_path):
    g = write_gguf(tmp_path / "m.gguf", dirs["gpt2"], "gpt2", "chatglm-bpe")
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.pre 'chatglm-bpe'") as e:
        T.load_tokenizer(g)
    assert "\n" not in str(e.value) and "gpt-4o" in str(e.value)
