# Stand-ins for every family's tokenizer (test_family_tokenizers.py): a SentencePiece or BPE model trained here on a
# small corpus with the configuration of the family's real tokenizer and its published chat template (data files in
# tests/data/chat_templates/), plus the texts and conversations the tests run through them.
import io
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_tokenizer as G  # noqa: E402
import tokenizer as T  # noqa: E402
import tokenizer_tiktoken as TT  # noqa: E402
from test_tokenizer_bin import PROMPTS, corpus, mixed_text  # noqa: E402

# ------------------------------------------------------------------------------------------ published chat templates
# gemma: gemma-7b-it / gemma-2-*-it; gemma3; phi3: Phi-3-mini-4k / Phi-3.5-mini-instruct; phi4: Phi-4-mini-instruct;
# mistral: Mistral-7B-Instruct-v0.1, Mixtral-8x7B-Instruct-v0.1; smollm3: SmolLM3-3B (data files, byte for byte)
TEMPLATES = REPO / "tests" / "data" / "chat_templates"
GEMMA_TEMPLATE, GEMMA3_TEMPLATE, PHI3_TEMPLATE, PHI4_TEMPLATE, MISTRAL_TEMPLATE, SMOLLM3_TEMPLATE = (
    (TEMPLATES / f"{n}.jinja").read_text(encoding="utf-8") for n in ("gemma", "gemma3", "phi3", "phi4", "mistral", "smollm3"))

FIM = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
CODEGEN25_FIM = FIM + ["<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
                       "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<empty_output>",
                       "<commit_before>", "<commit_msg>", "<commit_after>", "<reponame>"]
PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
              "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]

CODE = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
        "for (int i = 0; i < 100; i++) {\n\t\tprintf(\"%d\\n\", i * 2);\n\t}\n",
        "const x = {a: 1, b: [2, 3]};  // 12345 67890\n\n\n", "SELECT * FROM t WHERE id = 42;\r\n",
        "    \n\t  \t\n" * 3, "x" + " " * 37 + "y" + "\t" * 11 + "z"]
TEXTS = PROMPTS + CODE + corpus(30, seed=11) + mixed_text(80, seed=12) + ["日本語の文章です。中文句子。🤖🎉👍🏽 1234567",
                                                                         "Ünïcödé ǅ ſ İ ß ﬁ 123.456,789 ٣٤٥",
         "CamelCase XMLHttpRequest iPhone McDONALD'S don'T it'LL ǅungla ǈa Ǉ ʰa e\u0301t\u0301 \u0301x \u0301\u0302",
         "a/b/\n/c //\n\r\n x'S'll 'd ''re ABCdef aBC ÀÉÎõü ΣΑΣ σας Добрый ДЕНЬ ᾈᾀ ﬀ \u05d0\u05b0 ँक ☃'s",
         "1234567 12,345.6789 x1y22z333w4444 ²³¹¼½¾ 12²34 ١٢٣٤ «quote» — dash… ¿qué? ¡sí! $5+3<=9^2~|` (a)[b]{c}"]


def family_texts(specials):
    """The varied texts, plus the family's own special tokens written inside text, alone and back to back."""
    rng = random.Random(3)
    sp = list(specials)
    mixed = ["".join(rng.choice(sp + [" ", "\n", "hi", "x y", "12", "é", "🤖", "  "]) for _ in range(rng.randint(1, 12)))
             for _ in range(40)] if sp else []
    return TEXTS + mixed + ["".join(sp), " ".join(sp), "\n".join(sp)]


CONVS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "  Tell me a joke \n"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}],
    [{"role": "system", "content": "Be brief. /no_think"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "\nb "}, {"role": "user", "content": "日本 🤖\n"}],
    [{"role": "user", "content": "first"}, {"role": "assistant", "content": " ok\n"},
     {"role": "user", "content": " second"}, {"role": "assistant", "content": "done"},
     {"role": "user", "content": "third\t"}],
]


# ------------------------------------------------------------------------------------------ stand-in tokenizers
def train_sp(d: Path, cfg: dict, template=None, vocab_size=420, **kw) -> Path:
    import sentencepiece as spm
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus() + CODE * 5), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, character_coverage=0.9995, max_sentence_length=100000, minloglevel=2,
        num_threads=1, **kw)
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **({"chat_template": template} if template else {})}))
    return d


def gemma(d, template):
    """Gemma's tokenizer.model: BPE, byte fallback, no dummy prefix, digits split, whitespace pieces, <pad> <eos>
    <bos> <unk> = 0 1 2 3, <start_of_turn>/<end_of_turn> user-defined; generation_config's eos [<eos>, <end_of_turn>]."""
    train_sp(d, {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True, "tokenizer_class": "GemmaTokenizer"},
             template, add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
             eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
             user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"])
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 6]}))
    return d


def llama_sp(d, cfg, template):
    return train_sp(d, cfg, template, add_dummy_prefix=True)


def phi3(d):
    """Llama 2's tokenizer.model plus added tokens past it, named in tokenizer_config's added_tokens_decoder with
    Phi-3's flags: rstrip on </s> and on every added token but <|endoftext|>; legacy false."""
    llama_sp(d, {}, None)
    import sentencepiece as spm
    n = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model")).vocab_size()
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": t in PHI3_ADDED[1:] + ["</s>"],
                      "single_word": False, "special": t != "</s>"}
             for i, t in [(0, "<unk>"), (1, "<s>"), (2, "</s>")] + [(n + k, t) for k, t in enumerate(PHI3_ADDED)]}
    cfg = {"add_bos_token": False, "add_eos_token": False, "bos_token": "<s>", "eos_token": "<|endoftext|>",
           "pad_token": "<|endoftext|>", "unk_token": "<unk>", "legacy": False, "added_tokens_decoder": added,
           "tokenizer_class": "LlamaTokenizer", "chat_template": PHI3_TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def train_bpe(d: Path, pre, specials, cfg, template=None, normalizer=None, ignore_merges=False, added=(),
              vocab_size=700) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(corpus() + CODE * 5, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=list(specials),
        show_progress=False))
    if added:
        tok.add_tokens(list(added))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **({"chat_template": template} if template else {})}))
    return d


def bytelevel(regex=True):
    from tokenizers import pre_tokenizers
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex)


def split(pattern):
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"), bytelevel(False)])


def make_family(name: str, d: Path) -> Path:
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
    eot = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    if name == "gemma":
        return gemma(d, GEMMA_TEMPLATE)
    if name == "gemma3":
        return gemma(d, GEMMA3_TEMPLATE)
    if name == "phi3":
        return phi3(d)
    if name == "mistral":
        return llama_sp(d, {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                            "tokenizer_class": "LlamaTokenizer"}, MISTRAL_TEMPLATE)
    if name == "starcoder2":
        return train_bpe(d, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), bytelevel()]),
                         ["<|endoftext|>", *FIM, "<file_sep>", "<repo_name>", "<issue_start>"],
                         {**eot, "add_bos_token": False, "tokenizer_class": "GPT2Tokenizer"})
    if name == "smollm3":
        return train_bpe(d, split(G.LLAMA3_PATTERN), ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>",
                                                      "<|im_end|>", "<think>", "</think>"],
                         {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}, SMOLLM3_TEMPLATE,
                         ignore_merges=True)
    if name == "phi4":
        return train_bpe(d, split(G.O200K_PATTERN), ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>",
                                                   "<|end|>", "<|tool|>", "<|/tool|>"],
                         {**eot, "add_bos_token": False}, PHI4_TEMPLATE)
    if name == "gpt2":
        return train_bpe(d, bytelevel(), ["<|endoftext|>"], {"model_max_length": 1024})
    if name == "neox":  # GPT-NeoX-20B's tokenizer, which MPT uses
        runs = [AddedToken(" " * n, normalized=True, special=False) for n in range(24, 1, -1)]
        return train_bpe(d, bytelevel(), ["<|endoftext|>", "<|padding|>"], {**eot, "add_bos_token": False},
                         normalizer=normalizers.NFC(), added=runs)
    if name == "falcon":
        pre = pre_tokenizers.Sequence([pre_tokenizers.Punctuation("contiguous"), bytelevel(),
                                       pre_tokenizers.Digits(individual_digits=False),
                                       pre_tokenizers.Split(Regex("[0-9][0-9][0-9]"), "isolated")])
        return train_bpe(d, pre, [">>TITLE<<", ">>ABSTRACT<<", ">>INTRODUCTION<<", ">>SUMMARY<<", ">>COMMENT<<",
                                  ">>ANSWER<<", ">>QUESTION<<", ">>DOMAIN<<", ">>PREFIX<<", ">>SUFFIX<<", ">>MIDDLE<<",
                                  "<|endoftext|>"], {"eos_token": "<|endoftext|>", "add_bos_token": False})
    raise KeyError(name)


def tiktoken_family(name: str, d: Path):
    """CodeGen2.5 (GPT-2 base) / XGen-15B (cl100k base) as their tokenization_*.py build them (the recipe
    tokenizer_tiktoken.salesforce_encoding follows): on a base encoding -- here a tiny trained ranks table with the
    base's real regex and special-token layout -- whitespace and tab runs appended as ranks (CodeGen2.5), then the
    FIM / repository special tokens. Saved as tokenizer.tiktoken + tiktoken_config.json."""
    import tiktoken
    gpt2 = name == "codegen25"
    lib = train_bpe(d / "train", split(T.GPT2_PATTERN if gpt2 else G.LLAMA3_PATTERN), [], {})
    vocab = json.loads((lib / "tokenizer.json").read_text())["model"]["vocab"]
    dec = {c: b for b, c in T.bytes_to_unicode().items()}
    order = sorted(vocab, key=lambda t: (len(t) > 1, vocab[t] if len(t) > 1 else dec[t]))
    ranks = {bytes(dec[c] for c in t): r for r, t in enumerate(order)}
    n = len(ranks)
    special = ({"<|endoftext|>": n} if gpt2 else  # cl100k: a hole at n, <|endofprompt|> last
               {"<|endoftext|>": n + 1, "<|fim_prefix|>": n + 2, "<|fim_middle|>": n + 3, "<|fim_suffix|>": n + 4,
                "<|endofprompt|>": n + 20})
    base = tiktoken.Encoding(name="gpt2" if gpt2 else "cl100k_base", mergeable_ranks=ranks, special_tokens=special,
                             pat_str=TT.TIKTOKEN_R50K if gpt2 else TT.TIKTOKEN_CL100K)
    enc = TT.salesforce_encoding("CodeGen25Tokenizer" if gpt2 else "Xgen15BTokenizer", base)
    TT.save_tiktoken(enc, d, eos_token="<|endoftext|>")
    return enc, base
