#!/usr/bin/env python
# The peer baseline for bench.py --rows peer: write a model.py checkpoint as GGUF (llama arch) and time llama.cpp's
# decode on it (llama-cpp-python: `CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36`, ~8 min build).
#
#     python scripts/llamacpp_peer.py write --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --type f32|f16|q8_0|q4_0|q4_1
#     python scripts/llamacpp_peer.py time  --gguf <file> [--threads N] [--max_new_tokens 128] [--prompt "Once upon a time"]
#
# Quantized files keep the token embedding (tied output) in Q8_0, as quantize.py keeps it int8. Q4_1 (a scale and a
# minimum per 32 weights) has our asymmetric int4 g32's 5 bits per weight; Q4_0 (a scale only) 4.5 bits.
# The tokenizer is written as the byte-level BPE of tokenizer.json with the `smollm` pre-tokenizer (the default
# model's); the timing feeds llama.cpp our own token ids, so the pre-tokenizer name does not change what is timed.
#
# GGUF keeps Q/K rows in Meta's adjacent-pair rotary layout (llama.cpp's LLAMA rope), model.py the Hugging Face
# half-split one: the writer permutes them back exactly as llama.cpp's convert_hf_to_gguf.py does. The prompt is
# tokenized with our tokenizer and fed to llama.cpp as ids, so both sides decode the same sequence; greedy = argmax of
# llama.cpp's last logits. Decode timing: warm-up eval first, then max_new_tokens - 1 single-token evals (the same count
# generate.py times), wall clock and llama.cpp's own eval time. Needs llama-cpp-python (pip) and gguf.
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import ArgumentParser, at_least, atomic_path, checkpoint_file, cli, peak_memory_mb  # noqa: E402

TYPES = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


def _hf_to_meta(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a Q or K projection from half-split rotary order to adjacent pairs (convert_hf_to_gguf's permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(args):
    import gguf
    from quantize import load_model
    m = load_model(args.checkpoint_path)  # (its own dtype, mapped: each tensor becomes float32 only as it is written)
    if m.quantization:
        raise ValueError("write a float checkpoint: the GGUF quantization is done here")
    ck = checkpoint_file(args.checkpoint_path)
    out = Path(args.output or ck.with_name(f"{ck.stem}-{args.type}.gguf"))
    qt = getattr(gguf.GGMLQuantizationType, TYPES[args.type])
    print(f"writing {out} ({TYPES[args.type]}) ...", file=sys.stderr)
    with atomic_path(out) as tmp:
        _write_gguf(gguf, m, ck, qt, tmp, args.type)
    print(out)


def _write_gguf(gguf, m, ck, qt, out, kind):
    c = m.config
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(ck.parent.name)
    w.add_context_length(c.block_size)
    w.add_embedding_length(c.dim)
    w.add_block_count(c.n_layer)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_local_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_base)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2, "q4_1": 3}[kind])
    # tokenizer: byte-level BPE straight from tokenizer.json
    tj = json.loads((ck.parent / "tokenizer.json").read_text())
    special = {t["id"]: t["content"] for t in tj["added_tokens"]}
    vocab = {**tj["model"]["vocab"], **{v: k for k, v in special.items()}}
    tokens = [None] * c.vocab_size
    for t, i in vocab.items():
        tokens[i] = t
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    merges = [" ".join(x) if isinstance(x, list) else x for x in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(c.vocab_size)])
    w.add_token_merges(merges)
    tc = json.loads((ck.parent / "tokenizer_config.json").read_text())
    ids = {v: k for k, v in special.items()}
    w.add_bos_token_id(ids.get(tc.get("bos_token"), 1))
    w.add_eos_token_id(ids.get(tc.get("eos_token"), 2))
    w.add_add_bos_token(False)

    def tensor(name, t, quant=True):
        a = t.detach().float().numpy()
        if a.ndim == 1 or not quant:
            a = a.astype(np.float32)
            tt = gguf.GGMLQuantizationType.F32
        elif qt == gguf.GGMLQuantizationType.F16:
            a, tt = a.astype(np.float16), qt
        elif qt == gguf.GGMLQuantizationType.F32:
            tt = qt
        else:
            # our int8/int4 recipes keep the (tied) embedding table int8: Q8_0 for it in a Q4_0 / Q4_1 file
            tt = gguf.GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else qt
            a = gguf.quants.quantize(a, tt)
        w.add_tensor(name, a, raw_dtype=tt)

    tensor("token_embd.weight", m.tok_embeddings.weight)
    hd, nq, nkv = c.head_dim, c.n_head, c.n_local_heads
    for i, L in enumerate(m.layers):
        a, f = L.attention, L.feed_forward
        wq, wk, wv = a.wqkv.weight.split([nq * hd, nkv * hd, nkv * hd])
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", L.attention_norm.weight)
        tensor(p + "attn_q.weight", torch.from_numpy(_hf_to_meta(wq.float().numpy(), nq)))
        tensor(p + "attn_k.weight", torch.from_numpy(_hf_to_meta(wk.float().numpy(), nkv)))
        tensor(p + "attn_v.weight", wv)
        tensor(p + "attn_output.weight", a.wo.weight)
        tensor(p + "ffn_norm.weight", L.ffn_norm.weight)
        tensor(p + "ffn_gate.weight", f.w1.weight)
        tensor(p + "ffn_up.weight", f.w3.weight)
        tensor(p + "ffn_down.weight", f.w2.weight)
    tensor("output_norm.weight", m.norm.weight)
    if not c.tie_embeddings:
        tensor("output.weight", m.output.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def time_decode(args):
    try:
        import llama_cpp
    except ImportError:
        raise ImportError("llama-cpp-python is not installed (CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install "
                          "llama-cpp-python==0.3.36)") from None
    if not Path(args.gguf).is_file():
        raise FileNotFoundError(f"GGUF not found: {args.gguf}")
    from tokenizer import load_tokenizer
    tok = load_tokenizer(args.tokenizer_path or Path(args.gguf).parent)
    ids = tok.encode(args.prompt)
    llm = llama_cpp.Llama(str(args.gguf), n_ctx=args.n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                          n_batch=512, verbose=False)
    V = llm.n_vocab()

    def last_argmax():  # llm.scores is not filled without logits_all: read the last row's logits directly
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(V,)).argmax())

    results = []
    for run in range(args.runs + 1):  # run 0 warms up (weights paged in, threads spun up)
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm.ctx)
        t0 = time.perf_counter()
        llm.eval(ids)
        nxt = last_argmax()
        t1 = time.perf_counter()
        out = [nxt]
        for _ in range(args.max_new_tokens - 1):
            llm.eval([nxt])
            nxt = last_argmax()
            out.append(nxt)
        t2 = time.perf_counter()
        perf = llama_cpp.llama_perf_context(llm.ctx)
        st = dict(ttft_s=t1 - t0, prefill_tok_s=len(ids) / (t1 - t0), decode_tok_s=(args.max_new_tokens - 1) / (t2 - t1),
                  llama_eval_tok_s=perf.n_eval / (perf.t_eval_ms / 1000) if perf.t_eval_ms else 0.0,
                  llama_prompt_tok_s=perf.n_p_eval / (perf.t_p_eval_ms / 1000) if perf.t_p_eval_ms else 0.0)
        if run:
            results.append(st)
    text = tok.decode(out)
    med = {k: float(np.median([r[k] for r in results])) for k in results[0]}
    med.update(prompt_tokens=len(ids), new_tokens=len(out), threads=args.threads, gguf=str(args.gguf),
               decode_runs=[r["decode_tok_s"] for r in results],
               peak_rss_mb=peak_memory_mb(torch.device("cpu")))
    if not args.quiet:
        print(args.prompt + text, file=sys.stderr)
    print(json.dumps(dict(med, tokens=out[:32])))


def main(argv=None):
    p = ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--checkpoint_path", type=Path, required=True)
    w.add_argument("--type", choices=list(TYPES), default="f32")
    w.add_argument("--output", type=Path)
    t = sub.add_parser("time")
    t.add_argument("--gguf", type=Path, required=True)
    t.add_argument("--tokenizer_path", type=Path)
    t.add_argument("--threads", type=int, default=1, rule=at_least(1))
    t.add_argument("--prompt", default="Once upon a time")
    t.add_argument("--max_new_tokens", type=int, default=128, rule=at_least(1))
    t.add_argument("--n_ctx", type=int, default=512, rule=at_least(1))
    t.add_argument("--runs", type=int, default=3, rule=at_least(1))
    t.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    write(args) if args.cmd == "write" else time_decode(args)


if __name__ == "__main__":
    cli(main)
