"""scripts/convert_checkpoint.py's GGUF reader: llama.cpp's tensor names of every GGUF_ARCHS family, the metadata
they are configured by, and the file's own claims checked before a byte is trusted (check_layout: each tensor's
offset and byte size against its type, as ggml's gguf.cpp does, so F32 data labelled F16 is refused, not read as
garbage). F32/F16/BF16 and quantized tensors are dequantized to float32.
"""
import dataclasses
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from convert_io import ConvertError, Source, _oneline  # noqa: E402  (scripts/, beside this file)
from gguf_tokenizer import save_tokenizer_from_gguf  # noqa: E402
from model import ModelArgs  # noqa: E402

GGUF_NAMES = dict(tok="token_embd.weight", norm="output_norm.weight", output="output.weight",
                  q="blk.{}.attn_q.weight", k="blk.{}.attn_k.weight", v="blk.{}.attn_v.weight",
                  q_bias="blk.{}.attn_q.bias", k_bias="blk.{}.attn_k.bias", v_bias="blk.{}.attn_v.bias",
                  q_norm="blk.{}.attn_q_norm.weight", k_norm="blk.{}.attn_k_norm.weight",
                  o="blk.{}.attn_output.weight", gate="blk.{}.ffn_gate.weight", up="blk.{}.ffn_up.weight",
                  down="blk.{}.ffn_down.weight", attn_norm="blk.{}.attn_norm.weight",
                  ffn_norm="blk.{}.ffn_norm.weight")
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "starcoder2", "smollm3", "gpt2", "gptj",
              "falcon", "mpt")
GGUF_PERMUTED = ("llama", "smollm3", "gptj")  # Q/K in the adjacent-pair rotary layout (llama.cpp's rope type NORM)
GGUF_LAYER_NORM = ("starcoder2", "gpt2", "gptj", "falcon", "mpt")  # LayerNorm archs: attention.layer_norm_epsilon
GGUF_FAMILY_NAMES = {  # what differs from llama's names
    "gemma2": dict(post_attn_norm="blk.{}.post_attention_norm.weight", post_ffn_norm="blk.{}.post_ffw_norm.weight"),
    "phi3": dict(qkv="blk.{}.attn_qkv.weight", gate_up="blk.{}.ffn_up.weight"),
    "starcoder2": dict(gate="blk.{}.ffn_up.weight", gate_bias="blk.{}.ffn_up.bias", down_bias="blk.{}.ffn_down.bias",
                       o_bias="blk.{}.attn_output.bias", attn_norm_bias="blk.{}.attn_norm.bias",
                       ffn_norm_bias="blk.{}.ffn_norm.bias", norm_bias="output_norm.bias"),
    "moe": dict(router="blk.{}.ffn_gate_inp.weight", experts_gate="blk.{}.ffn_gate_exps.weight",
                experts_up="blk.{}.ffn_up_exps.weight", experts_down="blk.{}.ffn_down_exps.weight"),
}
GGUF_FAMILY_NAMES["gemma3"] = GGUF_FAMILY_NAMES["gemma2"]
# GPT-2, GPT-J, Falcon, MPT as llama.cpp's convert_hf_to_gguf.py names them (GPT-2's Conv1D weights transposed there,
# Falcon's query_key_value reordered there to q, k, v rows; GPT-J's q/k keep rotate_every_two: permuted here)
_GB = {k: f"blk.{{}}.{t}.bias" for k, t in (("qkv_bias", "attn_qkv"), ("o_bias", "attn_output"),
                                            ("gate_bias", "ffn_up"), ("down_bias", "ffn_down"),
                                            ("attn_norm_bias", "attn_norm"), ("ffn_norm_bias", "ffn_norm"))}
GGUF_FAMILY_NAMES.update({
    "gpt2": dict(_GB, pos="position_embd.weight", qkv="blk.{}.attn_qkv.weight", gate="blk.{}.ffn_up.weight",
                 norm_bias="output_norm.bias"),
    "gptj": dict(_GB, gate="blk.{}.ffn_up.weight", norm_bias="output_norm.bias", output_bias="output.bias"),
    "falcon": dict(_GB, qkv="blk.{}.attn_qkv.weight", gate="blk.{}.ffn_up.weight", ffn_norm="blk.{}.attn_norm_2.weight",
                   ffn_norm_bias="blk.{}.attn_norm_2.bias", norm_bias="output_norm.bias"),
    "mpt": dict(qkv="blk.{}.attn_qkv.weight", gate="blk.{}.ffn_up.weight"),
})


def check_layout(r, path: Path) -> None:
    """Every tensor's data where and as large as its type and shape say: tensors back to back from the data section's
    start, each padded to the file's alignment (ggml's gguf.cpp reads them so), the last one ending the file."""
    import gguf
    pos, prev = r.data_offset, None
    for t in sorted(r.tensors, key=lambda t: int(t.data_offset)):
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if int(t.n_elements) % block:
            raise ConvertError(f"GGUF tensor {t.name}: {int(t.n_elements)} values are not whole "
                               f"{t.tensor_type.name} blocks")
        if int(t.data_offset) != pos:
            raise ConvertError(f"GGUF tensor {prev.name if prev else '(first)'}: its type "
                               f"{prev.tensor_type.name if prev else ''} and shape end its data at byte {pos}, but the "
                               f"next tensor starts at {int(t.data_offset)}: the type does not match the data")
        last_end = pos + int(t.n_elements) // block * size
        pos, prev = -(-last_end // r.alignment) * r.alignment, t  # the next start: rounded up to the alignment
    end = os.path.getsize(path)
    if prev is not None and not last_end <= end <= pos:
        raise ConvertError(f"GGUF tensor {prev.name}: its type {prev.tensor_type.name} and shape end its data at byte "
                           f"{last_end}, but the file ends at {end}: the type does not match the data")


def load_gguf(path: Path) -> Source:
    import gguf
    import numpy as np
    try:
        r = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ConvertError(f"cannot read {path}: not a valid GGUF file ({type(e).__name__}: {_oneline(e)})") from None
    check_layout(r, path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ConvertError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHS)})")
    infos = {t.name: t for t in r.tensors}

    def load(t):
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
        if arr.size != int(np.prod(shape)):
            raise ConvertError(f"GGUF tensor {t.name} has {arr.size} values, expected {shape}")
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        return torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    def m(key, default=None):
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ConvertError(f"GGUF metadata {arch}.{key} is missing")
        return float(str(np.float32(v))) if isinstance(v, float) else v  # float32 metadata: 1e-05, not 9.99e-06

    if "token_embd.weight" not in infos:
        raise ConvertError(f"{path} has no token_embd.weight tensor")
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", "", "linear") and "rope_freqs.weight" not in infos:
        raise ConvertError(f"GGUF {arch}: unsupported rope scaling {scaling_type!r}")
    dim, n_head = int(m("embedding_length")), int(m("attention.head_count"))
    n_layer = int(m("block_count"))
    head_dim = int(m("attention.key_length", dim // n_head))
    vocab = int(infos["token_embd.weight"].shape[1])
    if int(meta.get(f"{arch}.vocab_size", vocab)) != vocab:
        raise ConvertError(f"GGUF vocab_size {meta[f'{arch}.vocab_size']} != token_embd rows {vocab}")
    fam = dict(_gguf_family(arch, meta, infos, n_layer, dim, n_head, head_dim, load, m))
    args = ModelArgs(block_size=int(m("context_length", 2048)), vocab_size=vocab, n_layer=n_layer,
                     n_head=n_head, dim=dim, intermediate_size=int(m("feed_forward_length")),
                     n_local_heads=int(m("attention.head_count_kv", n_head)),
                     head_dim=head_dim, rope_base=float(m("rope.freq_base", 1e4)),
                     norm_eps=float(m("attention.layer_norm_epsilon" if arch in GGUF_LAYER_NORM
                                      else "attention.layer_norm_rms_epsilon", 1e-5)),
                     attn_bias="blk.0.attn_q.bias" in infos or "blk.0.attn_qkv.bias" in infos,
                     qk_norm="blk.0.attn_q_norm.weight" in infos, **fam)
    if "rope_freqs.weight" in infos:  # llama.cpp stores Llama-3.1 rope scaling as per-frequency factors
        args = _match_rope_freqs(args, load(infos["rope_freqs.weight"]))
    names = dict(GGUF_NAMES, **GGUF_FAMILY_NAMES.get(arch, {}))
    if args.n_experts:
        names.update(GGUF_FAMILY_NAMES["moe"])

    def write_tokenizer(out_dir):
        try:
            save_tokenizer_from_gguf(path, out_dir)
        except (ImportError, ValueError, NotImplementedError) as e:
            print(f"warning: tokenizer not written ({_oneline(e)})", file=sys.stderr)

    return Source(args, names, {k: (lambda t=t: load(t)) for k, t in infos.items()}, torch.float32,
                  permute=arch in GGUF_PERMUTED, tokenizer=write_tokenizer,
                  ignore=("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"))


def _gguf_family(arch, meta, infos, n_layer, dim, n_head, head_dim, load, m):
    """ModelArgs fields of the family blocks, from the GGUF metadata llama.cpp's convert_hf_to_gguf.py writes (norm
    weights of the Gemma architectures already hold 1 + w there; their Q/K, Phi-3's and StarCoder2's are in the
    half-split rotary layout, only arch llama is permuted)."""
    get = lambda key: meta.get(f"{arch}.{key}")  # noqa: E731
    if arch.startswith("gemma"):
        yield from dict(mlp_act="gelu_tanh", embed_scale=True).items()
        if arch != "gemma":  # llama.cpp's attention scale: 1/sqrt(head_dim), 1/sqrt(dim / n_head) for the 27B models
            big = (arch, n_layer) in (("gemma2", 46), ("gemma3", 62))
            scale = get("attention.scale") or ((dim / n_head) ** -0.5 if big else None)
            yield from dict(sandwich_norm=True, attn_scale=float(scale) if scale else None).items()
    if arch == "gemma2":
        yield from dict(attn_softcap=get("attn_logit_softcapping"), final_softcap=get("final_logit_softcapping"),
                        sliding_window=get("attention.sliding_window") or 4096,
                        sliding_layers=list(range(0, n_layer, 2))).items()
    if arch == "gemma3":
        pattern = get("attention.sliding_window_pattern") or 6
        sliding = ([i for i, s in enumerate(pattern) if s] if isinstance(pattern, list)
                   else [i for i in range(n_layer) if (i + 1) % int(pattern)])
        yield from dict(sliding_window=get("attention.sliding_window"), sliding_layers=sliding,
                        rope_local_base=float(get("rope.freq_base_swa") or 10000.0)).items()
        if get("rope.scaling.type") == "linear":
            yield "rope_scaling", dict(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif get("rope.scaling.type") == "linear":
        raise ConvertError(f"GGUF {arch}: linear rope scaling is only implemented for gemma3")
    if arch == "phi3":
        yield "rotary_dim", int(get("rope.dimension_count") or head_dim)
        if get("attention.sliding_window"):
            yield "sliding_window", int(get("attention.sliding_window"))
        if "rope_factors_long.weight" in infos:
            yield "rope_scaling", dict(
                rope_type="longrope", short_factor=load(infos["rope_factors_short.weight"]).tolist(),
                long_factor=load(infos["rope_factors_long.weight"]).tolist(),
                original_max_position_embeddings=int(m("rope.scaling.original_context_length")),
                attention_factor=float(get("rope.scaling.attn_factor") or 1.0), factor=None)
    if arch == "starcoder2":  # every StarCoder2 release attends over a 4096-token window (absent from its GGUFs)
        yield from dict(norm_type="layer", mlp_act="gelu_tanh", mlp_gated=False, mlp_bias=True, attn_out_bias=True,
                        sliding_window=int(get("attention.sliding_window") or 4096)).items()
    elif arch != "phi3" and get("attention.sliding_window"):
        yield "sliding_window", int(get("attention.sliding_window"))
    if arch == "smollm3":  # no GGUF key: llama.cpp skips rotary on every 4th layer (n_no_rope_layer_step = 4)
        yield "nope_layers", [i for i in range(n_layer) if (i + 1) % 4 == 0] or None
    plain = dict(norm_type="layer", mlp_gated=False, mlp_act="gelu_tanh" if arch in ("gpt2", "gptj") else "gelu")
    bias = "blk.0.attn_qkv.bias" in infos
    if arch == "gpt2":
        yield from dict(plain, mlp_bias=True, attn_out_bias=True, learned_pos=True,
                        nope_layers=list(range(n_layer))).items()
    if arch == "gptj":
        yield from dict(plain, mlp_bias=True, parallel_attn=True, output_bias="output.bias" in infos,
                        rotary_dim=int(get("rope.dimension_count") or head_dim)).items()
    if arch == "falcon":  # llama.cpp runs every Falcon as a parallel block; attn_norm_2 = Falcon-40B's ln_mlp
        yield from dict(plain, mlp_bias=bias, attn_out_bias=bias, parallel_attn=True,
                        parallel_norms=2 if "blk.0.attn_norm_2.weight" in infos else 1).items()
    if arch == "mpt":
        if "blk.0.attn_q_norm.weight" in infos or "position_embd.weight" in infos:
            raise ConvertError("GGUF mpt: qk_ln and learned positions (no ALiBi) are not supported")
        yield from dict(plain, norm_bias=False, alibi=True, nope_layers=list(range(n_layer)),
                        alibi_bias_max=float(get("attention.max_alibi_bias") or 8),
                        clip_qkv=float(get("attention.clamp_kqv")) if get("attention.clamp_kqv") else None).items()
    if get("expert_count"):
        if arch != "llama":
            raise ConvertError(f"GGUF {arch}: mixture of experts is only implemented for Mixtral (arch llama)")
        yield from dict(n_experts=int(get("expert_count")), n_experts_per_tok=int(get("expert_used_count"))).items()


def _match_rope_freqs(args, factors):
    from model import rope_frequencies
    base = rope_frequencies(dataclasses.replace(args, rope_scaling=None))
    factor = float(factors.max())  # the divisor of the lowest frequencies; Meta's low/high factors 1 and 4
    for old in (2 ** k for k in range(4, 21)):  # original context: 8192 for Llama 3.1/3.2
        s = dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=old)
        if torch.allclose(base / rope_frequencies(dataclasses.replace(args, rope_scaling=s)), factors, rtol=1e-4):
            return dataclasses.replace(args, rope_scaling=s)
    raise ConvertError("GGUF rope_freqs.weight does not match a known Llama-3.1 rope scaling")
