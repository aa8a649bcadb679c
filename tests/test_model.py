# model.py against Hugging Face transformers (an implementation nobody here wrote), on tiny random configs.
import pytest
import torch
from conftest import REPO, hf_greedy, hf_to_model, tiny_hf

from engine import TorchBackend, generate
from model import Attention, ModelArgs, Transformer, transformer_configs

ARCHS = [("llama", {}), ("llama", {"tie": True}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}),
         ("llama", {"rope_scaling": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=32)})]


@pytest.mark.parametrize("arch,kw", ARCHS, ids=["llama", "llama-tied", "mistral", "qwen2", "qwen3", "llama3-rope"])
@torch.no_grad()
def test_logits_prefill_and_every_decode_step(arch, kw):
    hf = tiny_hf(arch, **kw)
    model = hf_to_model(hf)
    model.setup_caches(1, 64)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits
    got = model(ids[:, :24], torch.arange(24))
    assert (got - ref[:, :24]).abs().max() <= 1e-4
    for t in range(24, 40):  # one token at a time through the cache
        got = model(ids[:, t:t + 1], torch.tensor([t]))
        assert (got[:, 0] - ref[:, t]).abs().max() <= 1e-4, f"decode step at position {t}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_batch_of_different_lengths(arch, cpu):
    hf = tiny_hf(arch, seed=3)
    model = hf_to_model(hf)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 3, 17, 1)]
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    backend = TorchBackend(model, max_batch_size=4, max_seq_length=64)
    out, stats = generate(backend, prompts, 32, cpu)  # one padded batch, per-row positions
    assert out == expected
    assert stats["decode_steps"] == 31
    out1, _ = generate(backend, prompts[:1], 32, cpu)  # batch 1, shared positions
    assert out1 == expected[:1]


def test_padding_rows_do_not_disturb_others():
    hf = tiny_hf("mistral", seed=5)
    model = hf_to_model(hf)
    model.setup_caches(2, 32)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(2))
    pos = torch.stack([torch.arange(8), torch.tensor([0, 1, 2, -1, -1, -1, -1, -1])])
    with torch.no_grad():
        got = model(ids, pos)
        assert torch.isfinite(got).all()
        assert (got[0] - hf(ids[:1]).logits[0]).abs().max() <= 1e-4
        assert (got[1, :3] - hf(ids[1:, :3]).logits[0]).abs().max() <= 1e-4


def test_logits_at_gives_the_named_rows_logits():
    """Prefill asks only for each prompt's last token: rows of different lengths (padded), checked against
    transformers on each prompt alone; the engine's prefill takes this path and returns the same rows."""
    hf = tiny_hf("llama", seed=6)
    model = hf_to_model(hf)
    model.setup_caches(2, 32)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(4))
    pos = torch.stack([torch.arange(7), torch.tensor([0, 1, 2, 3, -1, -1, -1])])
    with torch.no_grad():
        got = model(ids, pos, logits_at=torch.tensor([6, 3]))
        assert got.shape == (2, 1, model.config.vocab_size)
        assert (got[0, 0] - hf(ids[:1]).logits[0, 6]).abs().max() <= 1e-4
        assert (got[1, 0] - hf(ids[1:, :4]).logits[0, 3]).abs().max() <= 1e-4
        from engine import prefill
        backend = TorchBackend(model, 2, 32)
        last = prefill(backend, [ids[0].tolist(), ids[1, :4].tolist()], torch.device("cpu"))
        assert (last - got[:, 0]).abs().max() <= 1e-5


def test_batch_index_writes_the_named_slot():
    hf = tiny_hf("llama", seed=4)
    model = hf_to_model(hf)
    model.setup_caches(3, 32)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids[:, :5], torch.arange(5).view(1, 5), batch_index=torch.tensor([[2]]))
        assert (got - ref[:, :5]).abs().max() <= 1e-4
        assert model.layers[0].attention.kv_cache.k_cache[:2].abs().sum() == 0  # other slots untouched
        got = model(ids[:, 5:], torch.tensor([[5]]), batch_index=torch.tensor([[2]]))
        assert (got[:, 0] - ref[:, 5]).abs().max() <= 1e-4


def test_config_from_hf_and_named_configs():
    hf = tiny_hf("qwen2")
    a = ModelArgs.from_hf_config(hf.config.to_dict())
    assert (a.attn_bias, a.qk_norm, a.n_local_heads, a.head_dim) == (True, False, 2, 16)
    a = ModelArgs.from_hf_config(tiny_hf("qwen3").config.to_dict())
    assert (a.qk_norm, a.head_dim) == (True, 24)
    smol = ModelArgs.from_name("SmolLM2-135M-Instruct")
    assert (smol.n_layer, smol.dim, smol.n_head, smol.n_local_heads, smol.vocab_size) == (30, 576, 9, 3, 49152)
    assert smol.tie_embeddings and ModelArgs.from_name("Meta-Llama-3.1-8B-Instruct").rope_scaling
    for name in transformer_configs:  # every named config builds (on the meta device: no memory)
        with torch.device("meta"):
            Transformer(ModelArgs.from_name(name))
    with pytest.raises(ValueError, match="unknown model name"):
        ModelArgs.from_name("not-a-model")


def test_export_with_dynamic_length():
    from torch.export import Dim, export

    model = hf_to_model(tiny_hf("llama"))
    model.setup_caches(1, 32)
    T = Dim("T", min=1, max=32)
    ep = export(model, (torch.zeros(1, 4, dtype=torch.long), torch.arange(4)),
                dynamic_shapes={"idx": {1: T}, "input_pos": {0: T}}, strict=False)
    ids = torch.randint(0, 256, (1, 7))
    model.setup_caches(1, 32)
    with torch.no_grad():
        ref = model(ids, torch.arange(7))
    assert torch.allclose(ep.module()(ids, torch.arange(7)), ref, atol=1e-5)


@torch.no_grad()
def test_mask_argument_over_a_swapped_longer_cache():
    """The documented swap points: a caller assigns a longer KVCache to every layer and passes its own bool mask
    [1, 1, T, S'] over it (what lookahead decoding does); the logits still match transformers'."""
    from model import KVCache
    hf = tiny_hf("qwen3", seed=6)
    model = hf_to_model(hf)
    model.setup_caches(1, 32)
    S2 = 40  # 8 slots beyond the model's own cache length
    for layer in model.layers:
        layer.attention.kv_cache = KVCache(1, S2, model.config.n_local_heads, model.config.head_dim, torch.float32)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    ref = hf(ids).logits
    causal = torch.arange(S2).view(1, S2) <= torch.arange(12).view(12, 1)
    got = model(ids, torch.arange(12), mask=causal.view(1, 1, 12, S2))
    assert (got - ref).abs().max() <= 1e-4
    additive = torch.zeros(1, 1, 1, S2).masked_fill(torch.arange(S2) > 12, float("-inf"))
    got = model(torch.tensor([[7]]), torch.tensor([12]), mask=additive)  # one more token, additive float mask
    ref = hf(torch.cat([ids, torch.tensor([[7]])], 1)).logits[:, -1]
    assert (got[:, 0] - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_cpu_attends_over_the_filled_cache_slots_only(compiled, one_thread):
    """On CPU the layers read cache slots 0..newest position (fast_cpu.FilledSlots), not the whole static cache:
    NaN in the slots past it must not reach the logits (read and masked, 0 * NaN would), eager and torch.compile, and
    the logits still match transformers'."""
    hf = tiny_hf("llama", seed=5)
    model = hf_to_model(hf)
    backend = TorchBackend(model, max_batch_size=1, max_seq_length=64, compile=compiled)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    ref = hf(ids).logits
    got = [backend.forward(ids[:, :12], torch.arange(12))[:, -1]]
    for attn in (m for m in model.modules() if isinstance(m, Attention)):
        for c in (attn.kv_cache.k_cache, attn.kv_cache.v_cache):
            c[:, :, 12:] = float("nan")
    for t in range(12, 20):  # each decode step overwrites its own slot first
        got.append(backend.forward(ids[:, t:t + 1], torch.tensor([t]))[:, -1])
    got = torch.stack(got, 1)
    assert torch.isfinite(got).all()
    assert (got - ref[:, 11:20]).abs().max() <= 1e-4


def test_model_py_is_the_network_only():
    """model.py holds the network: no custom ops, compiler settings, compile/export branches or data-dependent
    sizes (fast_cpu.py's modules bring those in at the swap points)."""
    src = (REPO / "model.py").read_text()
    for banned in ("torch.ops", "torch.library", "_inductor", "is_compiling", "is_exporting", "is_tracing", ".item()",
                   "packed_copy", "import quantize", "import qops", "import fast_cpu"):
        assert banned not in src, banned


def test_plain_torch_compile_matches_eager(one_thread):
    """torch.compile(model) of model.py as written (no accelerator) gives eager's greedy tokens."""
    hf = tiny_hf("llama", seed=3)
    eager, plain = hf_to_model(hf), hf_to_model(hf)
    for m in (eager, plain):
        m.setup_caches(1, 48)
    compiled = torch.compile(plain, fullgraph=True)

    class Bare:  # a backend over a callable (engine.py's contract)
        max_batch_size, max_seq_length, prefill_chunk = 1, 48, None

        def __init__(self, fn):
            self.fn = fn

        def forward(self, tokens, input_pos):
            with torch.inference_mode():
                return self.fn(tokens, input_pos)

    want, _ = generate(Bare(eager), [[1, 7, 42, 9]], 20, torch.device("cpu"))
    got, _ = generate(Bare(compiled), [[1, 7, 42, 9]], 20, torch.device("cpu"))
    assert got == want and len(want[0]) == 20


def test_without_the_accelerator_the_tokens_are_the_same(monkeypatch, one_thread):
    """engine.py without fast_cpu.py (as if the file were deleted): the same greedy tokens as with it, eager and
    --compile."""
    import engine
    hf = tiny_hf("llama", seed=4)
    prompts = [[3, 14, 15, 92, 65], [2, 7]]
    cpu = torch.device("cpu")
    fast = [generate(TorchBackend(hf_to_model(hf), 2, 48, compile=c), prompts, 16, cpu)[0] for c in (False, True)]
    monkeypatch.setattr(engine, "fast_cpu", None)
    plain = [generate(TorchBackend(hf_to_model(hf), 2, 48, compile=c), prompts, 16, cpu)[0] for c in (False, True)]
    assert fast[0] == fast[1] == plain[0] == plain[1]


def test_unknown_model_type_is_refused():
    """A config.json of a family model.py does not implement is refused by name, not read with Llama's rules."""
    cfg = tiny_hf("llama").config.to_dict()
    with pytest.raises(ValueError, match="unsupported model_type 'bloom'"):
        ModelArgs.from_hf_config({**cfg, "model_type": "bloom"})
