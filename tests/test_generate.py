# generate.py: the loop against transformers' greedy decoding, sampling rules, --compile, the CLI and its errors.
import gc
import weakref
import os

import pytest
import torch
from conftest import assert_clean_error, hf_greedy, run_cli

import engine
import fast_cpu
import torch_internals as TI
import fast_cpu_quant
from quantize import load_model
from tokenizer import load_tokenizer


def test_cli_greedy_matches_transformers(tiny_checkpoint):
    d, hf = tiny_checkpoint
    tok = load_tokenizer(d)
    prompt = "Once upon a time there was"
    expected = tok.decode(hf_greedy(hf, tok.encode(prompt), 24))
    r = run_cli("generate.py", "--checkpoint_path", d / "model.pth", "--prompt", prompt, "--max_new_tokens", 24,
                "--temperature", 0)
    assert r.returncode == 0, r.stderr
    assert r.stdout == prompt + expected + "\n"
    assert "decode" in r.stderr and "tok/s" in r.stderr and "peak memory" in r.stderr


def test_eager_generation_leaves_the_compiler_unimported(tiny_checkpoint):
    """generate.py without --compile (and every error line) never imports Dynamo or Inductor: they were half of its
    start (--help: 5.1 -> 2.7 s, medians of 5, 2 cores); an int4 model's layouts included (fast_cpu_quant)."""
    d, _ = tiny_checkpoint
    code = ("import sys, generate, quantize\n"
            f"m = quantize.load_model({str(d / 'model.pth')!r})\n"
            "quantize.quantize_model(m, 'int4', 32, log=False)\n"
            "generate.generate(generate.TorchBackend(m, 1, 64), [[1, 2, 3]], 4, generate.torch.device('cpu'))\n"
            "print(sorted({n.split('.')[1] for n in sys.modules if n.startswith(('torch._dynamo', 'torch._inductor'))}))")
    r = run_cli("-c", code)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]


def test_cli_batch_of_prompts_equals_each_alone(tiny_checkpoint, tmp_path):
    d, hf = tiny_checkpoint
    tok = load_tokenizer(d)
    prompts = ["The quick brown fox", "It", "Numbers like 3.14159 and 2026 are"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    r = run_cli("generate.py", "--checkpoint_path", d / "model.pth", "--prompts_file", tmp_path / "p.txt",
                "--max_new_tokens", 12, "--temperature", 0, "--quiet")
    assert r.returncode == 0, r.stderr
    blocks = [b.strip("\n") for b in r.stdout.split("-" * 40)][:3]
    for p, block in zip(prompts, blocks):
        ids = tok.encode(p)
        out = hf_greedy(hf, ids, 12)
        if tok.eos_id in out:  # the CLI stops at end of sequence
            out = out[:out.index(tok.eos_id)]
        assert block == p + tok.decode(out)


def test_compile_matches_eager(tiny_checkpoint, cpu):
    d, _ = tiny_checkpoint
    model = load_model(d / "model.pth")
    prompts = [[5, 17, 33, 2, 90], [7, 8, 9]]
    eager = engine.TorchBackend(model, 2, 48)
    want, _ = engine.generate(eager, prompts, 20, cpu)
    compiled = engine.TorchBackend(model, 2, 48, compile=True)
    got, _ = engine.generate(compiled, prompts, 20, cpu)
    assert got == want
    got1, _ = engine.generate(compiled, prompts[:1], 20, cpu)
    assert got1 == want[:1]


@pytest.mark.skipif(not fast_cpu.ONEDNN, reason="PyTorch built without oneDNN")
def test_compiled_prompts_use_packed_weights(tiny_checkpoint, cpu, monkeypatch):
    """--compile gives each block's float32 weights a oneDNN-packed copy (fast_cpu.pack_prompt_weights, hung on the
    weight) that the compiled prompts multiply by (rows > 1 only), a copy that stops being used once its weight
    changes in place and is freed with the model."""
    d, _ = tiny_checkpoint
    want_model = load_model(d / "model.pth")
    model = load_model(d / "model.pth")
    compiled = engine.TorchBackend(model, 1, 48, compile=True)
    blocks = [m.weight for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    copies = [weakref.ref(fast_cpu_quant.packed_copy(w)) for w in blocks]
    assert all(c() is not None for c in copies)
    assert fast_cpu_quant.packed_copy(model.output.inner.weight) is None  # a prompt needs one row of it
    used = []
    plain = fast_cpu._linear_onednn
    monkeypatch.setattr(fast_cpu, "_linear_onednn", lambda x, w, b: used.append(w.is_mkldnn) or plain(x, w, b))
    ids, pos = torch.tensor([[5, 17, 33, 2, 90, 7, 8]]), torch.arange(7)
    want = engine.TorchBackend(want_model, 1, 48).forward(ids, pos)
    used.clear()  # (eager calls it too, with the plain weights)
    got = compiled.forward(ids, pos)
    assert used.count(True) == len(blocks) and used.count(False) == 1  # (the output projection: plain)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # an in-place change: the compiled prompt reads the new weight, not the stale copy
        model.layers[0].inner.feed_forward.w2.weight.mul_(3)
        want_model.layers[0].feed_forward.w2.weight.mul_(3)
    used.clear()
    got = compiled.forward(ids, pos)
    assert used.count(True) == len(blocks) - 1 and used.count(False) == 2
    assert (got - want).abs().max() > 1e-2
    ref = engine.TorchBackend(want_model, 1, 48).forward(ids, pos)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    del compiled, model, ref, blocks
    torch._dynamo.reset()  # (the compiled callers' caches hold the model's tensors)
    gc.collect()
    assert all(c() is None for c in copies)


def test_compiled_bfloat16_tracks_float32(tiny_checkpoint, cpu):
    """Compiled bfloat16 decode computes what eager bfloat16 does, to bfloat16's own error: teacher-forced over 30
    positions, its logits are no further from float32's than eager bfloat16's are, and pick the same tokens wherever
    float32's choice is clear. (Greedy generation alone compares near-tied logits of a random model: the two roundings
    part after a few tokens.)"""
    d, _ = tiny_checkpoint
    ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(0))

    def logits(dtype, compile):
        b = engine.TorchBackend(load_model(d / "model.pth", dtype=dtype), 1, 48, compile=compile)
        return torch.cat([b.forward(ids[:, i:i + 1], torch.tensor([i])) for i in range(30)], 1).float()

    ref, eager, compiled = logits(torch.float32, False), logits(torch.bfloat16, False), logits(torch.bfloat16, True)
    err = lambda x: (x - ref).abs().max().item()
    assert err(compiled) <= 2 * err(eager) and err(eager) < 0.05 * ref.abs().max().item()
    # where float32's top two logits are further apart than that error, all three pick the same token
    top2 = ref.topk(2, -1).values
    sure = (top2[..., 0] - top2[..., 1]) > 2 * max(err(compiled), err(eager))
    assert sure.sum() >= 10  # (19 of the 30 here)
    for x in (eager, compiled):
        assert torch.equal(x.argmax(-1)[sure], ref.argmax(-1)[sure])


def count_packed_lookups(monkeypatch) -> list:
    """fast_cpu._PACKED, counting its reads: the keys of the packed weights the products looked up, in order."""
    looked_up = []

    class Counted(dict):
        def __getitem__(self, key):
            looked_up.append(key)
            return super().__getitem__(key)

    monkeypatch.setattr(fast_cpu, "_PACKED", Counted(fast_cpu._PACKED))
    return looked_up


def prompt_then_step(forward, ids):
    """The logits of an 8-token prompt, then of one decode step (ids [1, 9])."""
    return torch.cat([forward(ids[:, :8], torch.arange(8)), forward(ids[:, 8:], torch.tensor([8]))], 1)


def written_logits(d, ids, dtype):
    """prompt_then_step's logits of the model as written (no fast_cpu modules) at dtype, float32."""
    m = load_model(d / "model.pth", dtype=dtype)
    m.setup_caches(1, 48)
    with torch.inference_mode():
        return prompt_then_step(m, ids).float()


def assert_within_bfloat16(got, ref, written):
    """got (bfloat16 with fast_cpu's modules) is no further from float32's ref than the model as written in
    bfloat16 is, and picks float32's tokens."""
    err, err_written = (got - ref).abs().max().item(), (written - ref).abs().max().item()
    assert err <= 2 * err_written and err_written < 0.05 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.skipif(not TI.onednn_bf16(), reason="no oneDNN bfloat16 products on this CPU (AVX2): plain linears")
def test_bfloat16_weights_held_once_packed(tiny_checkpoint, cpu, monkeypatch):
    """A bfloat16 model on CPU holds each linear weight once, in oneDNN's packed layout (fast_cpu.PackedLinear): the
    stored layout is gone, and eager products and every product of the compiled prompt and decode graphs read the
    packed one (one opaque op each: no copy of Inductor's beside it), for the logits of the model as written, within
    bfloat16's rounding (measured against float32: no further than the model as written is)."""
    d, _ = tiny_checkpoint
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(1))
    ref, written = written_logits(d, ids, torch.float32), written_logits(d, ids, torch.bfloat16)
    looked_up = count_packed_lookups(monkeypatch)
    for compile in (False, True):
        b = engine.TorchBackend(load_model(d / "model.pth", dtype=torch.bfloat16), 1, 48, compile=compile)
        packed = [m for m in b.model.modules() if isinstance(m, fast_cpu.PackedLinear)]
        assert len(packed) == 5 * len(b.model.layers) + 1  # wqkv, wo, w1, w2, w3; output
        assert not any(isinstance(m, torch.nn.Linear) for m in b.model.modules())
        fast_cpu._PACKED.update({int(m.key): m.weight_packed for m in packed})
        looked_up.clear()
        got = prompt_then_step(b.forward, ids).float()
        assert sorted(looked_up) == (sorted(2 * [int(m.key) for m in packed]) if compile else [])
        assert_within_bfloat16(got, ref, written)


@pytest.mark.skipif(not TI.cpu_has("avx2"), reason="this CPU has no AVX2: fast_cpu_kernels does not run")
def test_bfloat16_without_onednn_runs_the_stored_weights(tiny_checkpoint, cpu, monkeypatch):
    """Where oneDNN has no bfloat16 products (AVX2 without AVX-512; forced here, so every CPU with AVX2 runs the test),
    a bfloat16 model's linears are fast_cpu.Bf16Linear over the weights as loaded (no packed or float32 copy),
    eager and compiled: the logits of the model as written within bfloat16's rounding, and its tokens."""
    d, _ = tiny_checkpoint
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(1))
    ref, written = written_logits(d, ids, torch.float32), written_logits(d, ids, torch.bfloat16)
    monkeypatch.setattr(TI, "onednn_bf16", lambda: False)
    for compile in (False, True):
        model = load_model(d / "model.pth", dtype=torch.bfloat16)
        stored = {p.data_ptr() for p in model.parameters() if p.dim() == 2}
        b = engine.TorchBackend(model, 1, 48, compile=compile)
        lins = [m for m in b.model.modules() if isinstance(m, fast_cpu.Bf16Linear)]
        assert len(lins) == 5 * len(b.model.layers) + 1  # wqkv, wo, w1, w2, w3; output
        assert not any(type(m) in (torch.nn.Linear, fast_cpu.PackedLinear) for m in b.model.modules())
        assert all(m.weight.dtype == torch.bfloat16 and m.weight.data_ptr() in stored for m in lins)
        got = prompt_then_step(b.forward, ids).float()
        assert_within_bfloat16(got, ref, written)


@pytest.mark.skipif(not fast_cpu.ONEDNN, reason="PyTorch built without oneDNN")
def test_large_float32_weights_held_once_packed(tiny_checkpoint, cpu, monkeypatch):
    """From FLOAT32_PACKED_FROM bytes of float32 linear weights (here: any), a compiled model holds them packed once,
    as bfloat16's (no frozen copy of Inductor's beside them): its prompt and decode logits are float32's."""
    d, _ = tiny_checkpoint
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    m = load_model(d / "model.pth")
    m.setup_caches(1, 48)
    with torch.inference_mode():
        ref = prompt_then_step(m, ids)
    monkeypatch.setattr(fast_cpu, "FLOAT32_PACKED_FROM", 0)
    looked_up = count_packed_lookups(monkeypatch)
    eager = engine.TorchBackend(load_model(d / "model.pth"), 1, 48)  # eager: no freezing, nothing to pack for
    assert not any(isinstance(m, fast_cpu.PackedLinear) for m in eager.model.modules())
    b = engine.TorchBackend(load_model(d / "model.pth"), 1, 48, compile=True)
    packed = [m for m in b.model.modules() if isinstance(m, fast_cpu.PackedLinear)]
    assert len(packed) == 5 * len(b.model.layers) + 1 and all(m.weight_packed.dtype == torch.float32 for m in packed)
    assert not any(isinstance(m, torch.nn.Linear) for m in b.model.modules())
    looked_up.clear()  # every product of the compiled prompt and decode graphs reads the packed weight
    got = prompt_then_step(b.forward, ids)
    assert sorted(looked_up) == sorted(2 * [int(m.key) for m in packed])
    assert torch.allclose(got.float(), ref, atol=1e-4 * ref.abs().max().item(), rtol=0)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_prefill_chunks_and_continuous_batching_equal_plain(tiny_checkpoint, cpu):
    d, _ = tiny_checkpoint
    model = load_model(d / "model.pth")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 11, 2, 8, 3)]
    single = engine.TorchBackend(model, 1, 40)
    want = [engine.generate(single, [p], 16, cpu, stop_ids={7})[0][0] for p in prompts]
    got = [engine.generate(single, [p], 16, cpu, stop_ids={7}, prefill_chunk=4)[0][0] for p in prompts]
    assert got == want
    cb = engine.TorchBackend(model, 2, 40)
    got, st = engine.generate_continuous(cb, prompts, 16, cpu, 2, stop_ids={7})
    assert got == want and st["new_tokens"] == sum(map(len, want))


def test_sampling_rules():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    S = engine.Sampling
    assert S().sample(logits).item() == 0
    p = S(1.0, top_k=2).probs(logits)
    assert (p[0, 2:] == 0).all() and torch.allclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]
    p = S(1.0, top_p=0.7).probs(logits)  # smallest prefix reaching 0.7: the top two
    assert full[0] < 0.7 <= full[0] + full[1]
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], full[:2] / full[:2].sum())
    # a seeded generator reproduces the draw; frequencies follow the distribution
    draws = [S(1.0, generator=torch.Generator().manual_seed(s)).sample(logits).item() for s in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
    assert (freq - full).abs().max() < 0.04
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert S(0.8, 3, 0.9, g1).sample(logits.repeat(4, 1)).tolist() == S(0.8, 3, 0.9, g2).sample(logits.repeat(4, 1)).tolist()


def test_seed_makes_sampling_reproducible(tiny_checkpoint):
    d, _ = tiny_checkpoint
    args = ["generate.py", "--checkpoint_path", d / "model.pth", "--prompt", "It painted", "--max_new_tokens", 16,
            "--temperature", 0.9, "--top_p", 0.95, "--seed", 7, "--quiet"]
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == 0 and a.stdout == b.stdout


def test_chat_reuses_the_cache(tiny_checkpoint, cpu):
    """Continuing from the cached prefix gives exactly what processing the whole conversation afresh gives."""
    d, _ = tiny_checkpoint
    tok = load_tokenizer(d)
    model = load_model(d / "model.pth")
    backend = engine.TorchBackend(model, 1, 128)
    turn1 = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Paint the sea"}]))
    out1, _ = engine.generate(backend, [turn1], 10, cpu)
    conv = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Paint the sea"},
                                               {"role": "assistant", "content": tok.decode(out1[0])},
                                               {"role": "user", "content": "and the sky"}]))
    common = 0
    cached = turn1 + out1[0][:-1]
    while common < min(len(cached), len(conv) - 1) and cached[common] == conv[common]:
        common += 1
    assert common >= len(turn1)
    resumed, _ = engine.generate(backend, [conv[common:]], 10, cpu, start_pos=common)
    fresh, _ = engine.generate(engine.TorchBackend(model, 1, 128), [conv], 10, cpu)
    assert resumed == fresh
    r = run_cli("generate.py", "--checkpoint_path", d / "model.pth", "--chat", "--max_new_tokens", 8,
                "--temperature", 0, stdin="Paint the sea\nand the sky\n\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") >= 2


@pytest.mark.parametrize("case", ["missing", "garbage", "truncated", "too_long", "bad_tokenizer", "empty_prompts",
                                  "vocab_mismatch", "no_cuda", "too_big"])
def test_bad_input_gives_one_line_error(case, tiny_checkpoint, tmp_path):
    d, _ = tiny_checkpoint
    ck = d / "model.pth"
    args = ["--prompt", "hello", "--max_new_tokens", 4]
    pattern = ""
    if case == "missing":
        ck, pattern = tmp_path / "nope" / "model.pth", "not found"
    elif case == "garbage":
        ck = tmp_path / "garbage" / "model.pth"
        ck.parent.mkdir()
        ck.write_bytes(os.urandom(4096))
        (ck.parent / "tokenizer.json").write_bytes((d / "tokenizer.json").read_bytes())
        pattern = "cannot read checkpoint"
    elif case == "truncated":
        ck = tmp_path / "trunc" / "model.pth"
        ck.parent.mkdir()
        ck.write_bytes((d / "model.pth").read_bytes()[:50000])
        (ck.parent / "tokenizer.json").write_bytes((d / "tokenizer.json").read_bytes())
        pattern = "cannot read checkpoint"
    elif case == "too_long":
        args = ["--prompt", "The quick brown fox " * 40, "--max_seq_length", 64]
        pattern = "does not fit"
    elif case == "bad_tokenizer":
        bad = tmp_path / "badtok"
        bad.mkdir()
        (bad / "tokenizer.json").write_text("{not json")
        args += ["--tokenizer_path", bad]
    elif case == "empty_prompts":
        (tmp_path / "empty.txt").write_text("\n\n")
        args = ["--prompts_file", tmp_path / "empty.txt", "--max_new_tokens", 4]  # (not with --prompt: refused)
        pattern = "no prompts"
    elif case == "vocab_mismatch":
        big = tmp_path / "big"
        from conftest import make_bpe_tokenizer
        make_bpe_tokenizer(big, vocab_size=400)
        args += ["--tokenizer_path", big]
        pattern = "tokenizer"
    elif case == "no_cuda":
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        args += ["--device", "cuda"]
        pattern = "cuda"
    elif case == "too_big":  # a KV cache of ~300 GB: refused before loading, with what it needs and what there is
        args += ["--full_batch_size", 10 ** 7, "--max_seq_length", 64]
        pattern = r"needs about [\d.]+ GB .*KV cache [\d.]+ GB.* has [\d.]+ GB available"
    assert_clean_error(run_cli("generate.py", "--checkpoint_path", ck, *args), pattern)


def test_memory_needed_counts_weights_at_dtype_and_the_cache(tiny_checkpoint):
    """backends.memory_needed (the check before loading) reads sizes from the file's index: the float tensors at the
    requested dtype, and a cache of 2 x layers x slots x KV heads x head_dim x positions."""
    from backends import memory_needed
    from checkpoint import load_model
    d, _ = tiny_checkpoint
    m = load_model(d / "model.pth")
    n = sum(t.numel() for t in m.state_dict().values() if t.is_floating_point())
    c = m.config
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        weights, kv = memory_needed(d / "model.pth", dtype, 3, 64)
        assert weights >= n * size - c.vocab_size * c.dim * size  # (a tied output projection is stored once)
        assert weights <= n * size
        assert kv == 2 * c.n_layer * 3 * c.n_local_heads * c.head_dim * 64 * size
