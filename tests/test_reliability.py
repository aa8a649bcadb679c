# Issue 46, the loading half (tests/test_reliability_io.py has the writing half): what a file claims is checked
# before it is trusted.
# One test per class of the bad-input sweep (the samples of ../shared/reliability/ that a test needs are copied into
# tests/data/reliability/), each also run on fresh corruptions (other fields, other tensors, other offsets), so the
# fix is for the class and not the sample. Loader-level cases run in this process (checkpoint.load_model: the one path
# every CLI loads through); each CLI is run once as a real command line on the sample.
import hashlib
import json
import random
import re
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_clean_error, make_bpe_tokenizer, run_cli

sys.path.insert(0, str(REPO / "scripts"))
DATA = REPO / "tests" / "data" / "reliability"
SAMPLE = DATA / "cfg_nlocal0"  # _config n_local_heads 0: ZeroDivisionError in every loader before issue 46


def tiny_checkpoint(d: Path) -> Path:
    """A random 2-layer model (GQA, 320 tokens) + a BPE tokenizer in d; returns model.pth."""
    from checkpoint import checkpoint_state, save_checkpoint
    from model import ModelArgs, Transformer
    torch.manual_seed(0)
    m = Transformer(ModelArgs(n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128, vocab_size=320,
                              block_size=64))
    make_bpe_tokenizer(d)
    save_checkpoint(checkpoint_state(m), d / "model.pth")
    return d / "model.pth"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("good"))


def rewritten(good: Path, d: Path, edit) -> Path:
    """A copy of good's checkpoint with edit(state dict) applied, saved by plain torch.save (no checks: as a lying
    file from elsewhere would be)."""
    sd = torch.load(good, weights_only=True)
    edit(sd)
    torch.save(sd, d / "model.pth")
    return d / "model.pth"


def load_error(path) -> str:
    import quantize
    with pytest.raises(ValueError) as e:
        quantize.load_model(path)
    return str(e.value)


def digest(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


# ------------------------------------------------------------------------------------------- lying _config
LIES = [("n_local_heads", 0, "n_local_heads must be"), ("n_local_heads", 3, "multiple of n_local_heads"),
        ("norm_eps", -1, "norm_eps must be in"), ("norm_eps", "1e-5", "norm_eps must be a finite number"),
        ("rope_base", 0, "rope_base must be > 0"), ("rope_base", float("nan"), "rope_base must be a finite"),
        ("sliding_window", True, "sliding_window must be an integer"), ("sliding_layers", 3, "sliding_layers must"),
        ("nope_layers", [0, 7], "layer indices in"), ("mlp_act", "relu", "mlp_act must be one of"),
        ("rope_scaling", {"factor": 8.0}, r"rope_scaling \(llama3\) lacks low_freq_factor"),
        ("rope_scaling", {"rope_type": "linear"}, r"rope_scaling \(linear\) lacks factor"),
        ("rope_scaling", {"rope_type": "longrope", "original_max_position_embeddings": 16, "short_factor": [1.0],
                          "long_factor": [1.0]}, "short_factor must be a list of 8"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 2}, "rope_type must be one of"),
        ("rope_scaling", {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1, "high_freq_factor": 4,
                          "original_max_position_embeddings": 16}, "rope_scaling.factor must be a positive"),
        ("n_layer", 10**9, "n_layer must be in"), ("n_layer", 40, "n_layer is 40 but the file holds 2 layers"),
        ("vocab_size", 1000, "tok_embeddings.weight is"), ("intermediate_size", 96, "feed_forward.w1.weight is")]


@pytest.mark.parametrize("field,value,message", LIES, ids=[f"{f}={v!r:.20}" for f, v, _ in LIES])
def test_lying_config_is_one_clear_error(good, tmp_path, field, value, message):
    path = rewritten(good, tmp_path, lambda sd: sd.update(_config=json.dumps({**json.loads(sd["_config"]),
                                                                              field: value})))
    t0 = time.perf_counter()
    assert re.search(rf"^checkpoint {re.escape(str(path))}: .*{message}", load_error(path))
    assert time.perf_counter() - t0 < 30  # n_layer 1e9 used to hang


# every size field, every kind of wrong value: the class, not the samples
SIZE_FIELDS = ("block_size", "vocab_size", "n_layer", "n_head", "dim", "intermediate_size", "head_dim")
WRONG = ("7", None, 2.5, -3, 0, True, [1], {"a": 1})


@pytest.mark.parametrize("field", SIZE_FIELDS)
def test_every_size_field_refuses_every_wrong_value(good, tmp_path, field):
    from model import ModelArgs
    cfg = json.loads(torch.load(good, weights_only=True)["_config"])
    for value in WRONG:
        if value is None and field in ("intermediate_size", "head_dim"):
            continue  # None is their documented default
        with pytest.raises(ValueError, match=rf"^{field} must be"):
            ModelArgs.from_dict({**cfg, field: value})


def test_config_json_beside_an_old_checkpoint_is_checked_too(good, tmp_path):
    cfg = json.loads(torch.load(good, weights_only=True)["_config"])
    rewritten(good, tmp_path, lambda sd: sd.pop("_config"))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "dim": "64"}))
    assert re.search(r": config.json: dim must be an integer, got \"64\"$", load_error(tmp_path / "model.pth"))


# ------------------------------------------------------------------------------------------- lying _quantization
@pytest.fixture(scope="module")
def quantized(good, tmp_path_factory) -> Path:
    import quantize
    from checkpoint import checkpoint_state, save_checkpoint
    m = quantize.load_model(good)
    recipe = quantize.quantize_model(m, "int4", 32, log=False)
    out = tmp_path_factory.mktemp("q") / "model.pth"
    save_checkpoint(checkpoint_state(m, quantization=recipe), out)
    return out


def recipe_edits():
    import quantize
    drop = [(f"drop-{k}", lambda r, k=k: r.pop(k), f"lacks {k}" if k != "format" else "unsupported quantization")
            for k in quantize.RECIPE_KEYS]
    return drop + [("groupsize-0", lambda r: r["linear"].update(groupsize=0), "linear.groupsize must be one of"),
                   ("bits-3", lambda r: r["linear"].update(bits=3), "linear must be a scheme with bits 4 or 8"),
                   ("skip-int", lambda r: r.update(skip=[1]), "skip must be a list"),
                   ("act-int4", lambda r: r.update(act="int4"), "act must be null"),
                   ("mode-int3", lambda r: r.update(mode="int3"), "mode must be one of"),
                   ("groupsize-64", lambda r: (r.update(groupsize=64), r["linear"].update(groupsize=64)),
                    r"qweight.scales is float32 \(128, 2\), its config and recipe say floating-point \(128, 1\)")]


@pytest.mark.parametrize("edit", recipe_edits(), ids=lambda e: e[0] if isinstance(e, tuple) else "")
def test_lying_recipe_is_one_clear_error(quantized, tmp_path, edit):
    _, change, message = edit

    def lie(sd):
        recipe = json.loads(sd["_quantization"])
        change(recipe)
        sd["_quantization"] = json.dumps(recipe)
    path = rewritten(quantized, tmp_path, lie)
    assert re.search(rf"^checkpoint {re.escape(str(path))}: .*{message}", load_error(path))


# ------------------------------------------------------------------------------------------- state dict entries
@pytest.mark.parametrize("edit,message", [
    (lambda sd: sd.update({5: torch.zeros(1)}), "state dict key 5 is not a string"),
    (lambda sd: sd.update({"norm.weight": [1.0]}), "norm.weight is a list, not a tensor"),
    (lambda sd: sd.update(_config={"dim": 64}), "_config is not a JSON object string"),
    (lambda sd: sd.update({"tok_embeddings.weight": sd["tok_embeddings.weight"].int()}),
     "tok_embeddings.weight is int32 .* say floating-point"),
], ids=["int-key", "list-value", "dict-config", "int-embedding"])
def test_entries_of_the_wrong_kind_are_refused(good, tmp_path, edit, message):
    def drop_checksums_and(sd):
        sd.pop("_checksums")
        edit(sd)
    assert re.search(message, load_error(rewritten(good, tmp_path, drop_checksums_and)))


@pytest.mark.parametrize("seed", range(3))
def test_nan_or_inf_weights_are_refused_at_load(good, tmp_path, seed):
    rng = random.Random(seed)
    sd = torch.load(good, weights_only=True)
    name = rng.choice(sorted(k for k, v in sd.items() if isinstance(v, torch.Tensor)))
    bad = rng.choice([float("nan"), float("inf"), float("-inf")])

    def poison(sd):
        sd[name] = sd[name].clone()
        sd[name].view(-1)[rng.randrange(sd[name].numel())] = bad
    assert f"tensor {name} holds NaN or infinite values" in load_error(rewritten(good, tmp_path, poison))


def test_save_checkpoint_writes_nothing_it_would_refuse(good, tmp_path):
    from checkpoint import save_checkpoint
    sd = torch.load(good, weights_only=True)
    sd["norm.weight"] = torch.full_like(sd["norm.weight"], float("nan"))
    with pytest.raises(ValueError, match="norm.weight holds NaN"):
        save_checkpoint(sd, tmp_path / "a.pth")
    sd = torch.load(good, weights_only=True)
    sd["_config"] = json.dumps({**json.loads(sd["_config"]), "n_head": 0})
    with pytest.raises(ValueError, match="_config: n_head must be"):
        save_checkpoint(sd, tmp_path / "b.pth")
    assert list(tmp_path.iterdir()) == []


def tensor_spans(path: Path) -> list:
    """(start, length) of every tensor's bytes inside a torch.save zip (stored uncompressed)."""
    spans = []
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            if "/data/" in info.filename and info.file_size:
                f.seek(info.header_offset + 26)
                n, extra = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                spans.append((info.header_offset + 30 + n + extra, info.file_size))
    return spans


@pytest.mark.parametrize("seed", range(5))
def test_a_flipped_bit_in_tensor_data_is_caught_by_the_checksum(good, tmp_path, seed):
    rng = random.Random(seed)
    data = bytearray(good.read_bytes())
    start, length = rng.choice(tensor_spans(good))
    data[start + rng.randrange(length)] ^= 1 << rng.randrange(8)
    (tmp_path / "model.pth").write_bytes(data)
    assert re.search(r"tensor \S+ is corrupt \(its CRC32 differs", load_error(tmp_path / "model.pth"))


def test_files_without_checksums_still_load(good, tmp_path):
    import quantize
    quantize.load_model(rewritten(good, tmp_path, lambda sd: sd.pop("_checksums")))


# ------------------------------------------------------------------------------------------- every CLI, one line
SAMPLE_RUNS = {
    "generate": ["generate.py", "--checkpoint_path", "{ck}", "--prompt", "hi", "--max_new_tokens", "2"],
    "quantize": ["quantize.py", "--checkpoint_path", "{ck}", "--mode", "int8"],
    "eval": ["eval.py", "--checkpoint_path", "{ck}", "--text_file", "tests/data/eval_text.txt"],
    "aoti_export": ["aoti_export.py", "--checkpoint_path", "{ck}", "--output_path", "{out}/m.pt2"],
    "et_export": ["et_export.py", "--checkpoint_path", "{ck}", "--output_path", "{out}/m.pte"],
    "export_onnx": ["export_onnx.py", "--checkpoint_path", "{ck}", "--output_dir", "{out}/onnx"],
    "compile_qaic": ["compile_qaic.py", "--checkpoint_path", "{ck}", "--output_dir", "{out}/qaic", "--dry_run"],
}


@pytest.mark.parametrize("cli_name", SAMPLE_RUNS)
def test_every_loader_gives_one_error_line_and_writes_nothing(tmp_path, cli_name):
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in SAMPLE.iterdir():
        (ck / f.name).write_bytes(f.read_bytes())
    before = digest(ck)
    (tmp_path / "out").mkdir()
    r = run_cli(*[a.format(ck=ck, out=tmp_path / "out") for a in SAMPLE_RUNS[cli_name]], timeout=300)
    assert_clean_error(r, r"ck/model\.pth: _config: n_local_heads must be in \[1, 4096\], got 0$")
    assert digest(ck) == before and list((tmp_path / "out").iterdir()) == []
