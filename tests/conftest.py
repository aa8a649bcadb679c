# Shared test helpers: tiny random Hugging Face models (the independent reference) and their model.py twins.
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: one thread per worker (two spinning teams on 2 cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # collapse), for the scripts the tests start too
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def tiny_hf(arch: str, seed: int = 0, vocab_size: int = 256, tie: bool = False, **overrides):
    """A small random transformers model of the given family, weights scaled so logits are well separated."""
    import transformers

    kinds = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    cfg_cls, model_cls = kinds[arch]
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0,
              tie_word_embeddings=tie)
    if arch == "qwen3":
        kw["head_dim"] = 24  # deliberately != hidden_size / heads
    kw.update(overrides)
    torch.manual_seed(seed)
    hf = model_cls(cfg_cls(**kw)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    return hf


def hf_to_model(hf):
    """model.py's Transformer holding the same weights as a transformers Llama/Mistral/Qwen2/Qwen3 model
    (the converter has its own copy of this mapping; this one is deliberately independent of it)."""
    from model import ModelArgs, Transformer

    args = ModelArgs.from_hf_config(hf.config.to_dict())
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    out = {"tok_embeddings.weight": sd["embed_tokens.weight"], "norm.weight": sd["norm.weight"],
           "output.weight": sd.get("lm_head.weight", sd["embed_tokens.weight"])}
    for i in range(args.n_layer):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        out[p + "attention.wqkv.weight"] = torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"])
        if args.attn_bias:
            out[p + "attention.wqkv.bias"] = torch.cat([sd[a + f"{n}_proj.bias"] for n in "qkv"])
        if args.qk_norm:
            out[p + "attention.q_norm.weight"] = sd[a + "q_norm.weight"]
            out[p + "attention.k_norm.weight"] = sd[a + "k_norm.weight"]
        out[p + "attention.wo.weight"] = sd[a + "o_proj.weight"]
        out[p + "feed_forward.w1.weight"] = sd[p + "mlp.gate_proj.weight"]
        out[p + "feed_forward.w3.weight"] = sd[p + "mlp.up_proj.weight"]
        out[p + "feed_forward.w2.weight"] = sd[p + "mlp.down_proj.weight"]
        out[p + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[p + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    model = Transformer(args)
    model.load_state_dict(out)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by recomputing the full sequence each step (no cache): slow and obviously right."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.fixture
def cpu():
    return torch.device("cpu")


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = ("The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot who liked to paint. "
        "It painted the sea, the sky and 42 boats in the harbour! Numbers like 3.14159 and 2026 are fine too. ") * 20


def make_bpe_tokenizer(out_dir: Path, vocab_size: int = 320) -> Path:
    """Train a small byte-level BPE with the `tokenizers` library and write tokenizer.json + tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out_dir.mkdir(parents=True, exist_ok=True)
    tk.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token="<|im_start|>", eos_token="<|im_end|>", add_bos_token=False, chat_template=CHATML)))
    return out_dir


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """checkpoints-style directory: a random tiny Llama (weights from a transformers model) + a BPE tokenizer.
    Returns (directory, the transformers model)."""
    from checkpoint import checkpoint_state, save_checkpoint

    d = make_bpe_tokenizer(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    from tokenizer import load_tokenizer
    hf = tiny_hf("llama", seed=11, vocab_size=load_tokenizer(d).vocab_size, max_position_embeddings=128)
    save_checkpoint(checkpoint_state(hf_to_model(hf)), d / "model.pth")
    return d, hf


def run_cli(*args, stdin=None, timeout=600):
    """Run a repo script in a subprocess; returns CompletedProcess (text)."""
    import subprocess
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          input=stdin, timeout=timeout)


def assert_clean_error(r, pattern: str = ""):
    """A bad input must give a non-zero exit and a one-line `error: ...`, never a traceback."""
    import re
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    assert re.search(pattern, errors[0], re.I), errors[0]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is several times faster than two on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The quick tier (`python -m pytest -q tests -m quick`, a few minutes on 2 cores): model, tokenizer, generate,
# quantize and convert on tiny models, without torch.compile, exports or the default model's download.
QUICK_FILES = ("test_model.py", "test_tokenizer.py", "test_generate.py", "test_quantize.py", "test_qkernels.py",
               "test_convert.py", "test_x86_8da4w.py")
NOT_QUICK = ("compile", "accelerator", "xnnpack", "gptq_model", "prepare_default", "real_smollm2", "speed",
             "bad_input_gives", "cli_errors", "x86_kernels")


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the edit loop's tier (tests/conftest.py QUICK_FILES)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.fspath.basename in QUICK_FILES and not any(w in item.name for w in NOT_QUICK):
            item.add_marker(pytest.mark.quick)
