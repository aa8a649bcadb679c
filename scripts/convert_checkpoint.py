#!/usr/bin/env python
"""Convert a checkpoint of a supported family into checkpoints/<NAME>/model.pth (+ config.json, tokenizer files).

    python scripts/convert_checkpoint.py SRC [--output_dir checkpoints/NAME] [--name NAME] [--dtype bfloat16]

SRC (detected automatically) is one of
  * a Hugging Face directory: config.json + model*.safetensors or pytorch_model*.bin (single or sharded) of any
    architecture in HF_ARCHS (Llama-style families, GPT-2, GPT-J, Falcon, MPT; CodeGen2.5 / XGen are Llama);
  * a Meta directory: params.json + consolidated.NN.pth (model-parallel shards are merged);
  * a llama2.c training checkpoint ckpt.pt ({"model": state_dict, "model_args": {...}});
  * a GGUF file (an arch in GGUF_ARCHS; F32/F16/BF16 and quantized tensors are dequantized).
Meta, llama2.c, GGUF (arch llama) and GPT-J (rotate_every_two, on its rotary_dim) store Q/K in the adjacent-pair
rotary layout and are permuted into the Hugging Face half-split layout that model.py uses. Weights keep the source
float dtype (GGUF: float32) unless --dtype.
The GGUF reader is scripts/convert_gguf.py, what the readers share and the all-or-nothing writer scripts/convert_io.py.
"""
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from common import TOKENIZER_FILES, ArgumentParser, cli, copy_tokenizer_files  # noqa: E402  (before torch: Ctrl-C)
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from convert_gguf import load_gguf  # noqa: E402  (scripts/, beside this file)
from convert_io import ConvertError, Source, _oneline, _require, checked_weight, publish, torch_load  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from model_configs import FAMILIES  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HF_MODEL_TYPES = FAMILIES  # model_type -> transformers class (model_configs.py: the one table)
HF_ARCHS = tuple(dict.fromkeys(FAMILIES.values()))

# canonical tensor -> source name ("{0}" = layer index, "{1}" = expert index)
_L = "model.layers.{0}."
HF_NAMES = dict(tok="model.embed_tokens.weight", norm="model.norm.weight", output="lm_head.weight",
                q=_L + "self_attn.q_proj.weight", k=_L + "self_attn.k_proj.weight", v=_L + "self_attn.v_proj.weight",
                q_bias=_L + "self_attn.q_proj.bias", k_bias=_L + "self_attn.k_proj.bias",
                v_bias=_L + "self_attn.v_proj.bias", q_norm=_L + "self_attn.q_norm.weight",
                k_norm=_L + "self_attn.k_norm.weight", o=_L + "self_attn.o_proj.weight", o_bias=_L + "self_attn.o_proj.bias",
                gate=_L + "mlp.gate_proj.weight", up=_L + "mlp.up_proj.weight", down=_L + "mlp.down_proj.weight",
                gate_bias=_L + "mlp.gate_proj.bias", up_bias=_L + "mlp.up_proj.bias", down_bias=_L + "mlp.down_proj.bias",
                attn_norm=_L + "input_layernorm.weight", ffn_norm=_L + "post_attention_layernorm.weight")
HF_FAMILY_NAMES = {  # what differs from Llama's layout
    # Gemma 2/3: four norms per layer; HF's post_attention_layernorm is on the attention output here
    "Gemma2ForCausalLM": dict(post_attn_norm=_L + "post_attention_layernorm.weight",
                              ffn_norm=_L + "pre_feedforward_layernorm.weight",
                              post_ffn_norm=_L + "post_feedforward_layernorm.weight"),
    # Phi-3: fused projections, split here (q, k, v rows; gate then up rows)
    "Phi3ForCausalLM": dict(qkv=_L + "self_attn.qkv_proj.weight", gate_up=_L + "mlp.gate_up_proj.weight"),
    # StarCoder2: LayerNorm with bias, plain MLP c_fc -> c_proj with biases (c_fc is w1, the activated one)
    "Starcoder2ForCausalLM": dict(gate=_L + "mlp.c_fc.weight", gate_bias=_L + "mlp.c_fc.bias",
                                  down=_L + "mlp.c_proj.weight", down_bias=_L + "mlp.c_proj.bias",
                                  attn_norm_bias=_L + "input_layernorm.bias",
                                  ffn_norm_bias=_L + "post_attention_layernorm.bias", norm_bias="model.norm.bias"),
    # Mixtral: the router and 8 experts, as save_pretrained writes them (block_sparse_moe.experts.N.w1/w2/w3), or
    # transformers 5's fused tensors (mlp.experts.gate_up_proj [E, 2I, D], down_proj [E, D, I])
    "MixtralForCausalLM": dict(router=_L + "block_sparse_moe.gate.weight", router_alt=_L + "mlp.gate.weight",
                               expert_gate=_L + "block_sparse_moe.experts.{1}.w1.weight",
                               expert_up=_L + "block_sparse_moe.experts.{1}.w3.weight",
                               expert_down=_L + "block_sparse_moe.experts.{1}.w2.weight",
                               experts_gate_up=_L + "mlp.experts.gate_up_proj",
                               experts_down=_L + "mlp.experts.down_proj"),
}
HF_FAMILY_NAMES["Gemma3ForCausalLM"] = HF_FAMILY_NAMES["Gemma2ForCausalLM"]
# GPT-2, GPT-J, Falcon, MPT: their own names (under "transformer."); every norm is a LayerNorm ("_bias" = its bias)
_T = "transformer.h.{0}."
_LN = lambda key, name: {key: name + ".weight", key + "_bias": name + ".bias"}  # noqa: E731
HF_FAMILY_NAMES.update({
    # GPT-2: Conv1D weights are stored [in, out] (transposed here); fused c_attn is q, k, v rows
    "GPT2LMHeadModel": dict(tok="transformer.wte.weight", pos="transformer.wpe.weight", qkv=_T + "attn.c_attn.weight",
                            qkv_bias=_T + "attn.c_attn.bias", o=_T + "attn.c_proj.weight",
                            o_bias=_T + "attn.c_proj.bias",
                            gate=_T + "mlp.c_fc.weight", gate_bias=_T + "mlp.c_fc.bias", down=_T + "mlp.c_proj.weight",
                            down_bias=_T + "mlp.c_proj.bias", **_LN("norm", "transformer.ln_f"),
                            **_LN("attn_norm", _T + "ln_1"), **_LN("ffn_norm", _T + "ln_2")),
    # GPT-J: q/k/v separate, q/k permuted from rotate_every_two; one LayerNorm (parallel block), biased lm_head
    "GPTJForCausalLM": dict(tok="transformer.wte.weight", q=_T + "attn.q_proj.weight", k=_T + "attn.k_proj.weight",
                            v=_T + "attn.v_proj.weight", o=_T + "attn.out_proj.weight", gate=_T + "mlp.fc_in.weight",
                            gate_bias=_T + "mlp.fc_in.bias", down=_T + "mlp.fc_out.weight",
                            down_bias=_T + "mlp.fc_out.bias", output_bias="lm_head.bias",
                            **_LN("norm", "transformer.ln_f"), **_LN("attn_norm", _T + "ln_1")),
    # Falcon: fused query_key_value reordered to q, k, v rows (_falcon_qkv); norms named by the block layout (load_hf)
    "FalconForCausalLM": dict(tok="transformer.word_embeddings.weight",
                              qkv=_T + "self_attention.query_key_value.weight",
                              qkv_bias=_T + "self_attention.query_key_value.bias", o=_T + "self_attention.dense.weight",
                              o_bias=_T + "self_attention.dense.bias", gate=_T + "mlp.dense_h_to_4h.weight",
                              gate_bias=_T + "mlp.dense_h_to_4h.bias", down=_T + "mlp.dense_4h_to_h.weight",
                              down_bias=_T + "mlp.dense_4h_to_h.bias", **_LN("norm", "transformer.ln_f")),
    # MPT: fused Wqkv (q, k, v rows), LayerNorms without bias, no linear biases
    "MptForCausalLM": dict(tok="transformer.wte.weight", norm="transformer.norm_f.weight",
                           qkv="transformer.blocks.{0}.attn.Wqkv.weight",
                           o="transformer.blocks.{0}.attn.out_proj.weight",
                           gate="transformer.blocks.{0}.ffn.up_proj.weight",
                           down="transformer.blocks.{0}.ffn.down_proj.weight",
                           attn_norm="transformer.blocks.{0}.norm_1.weight",
                           ffn_norm="transformer.blocks.{0}.norm_2.weight"),
})
FALCON_NORMS = {  # (parallel_attn, parallel_norms) -> the attention's and the MLP's LayerNorm
    (False, 1): ("input_layernorm", "post_attention_layernorm"), (True, 1): ("input_layernorm", None),
    (True, 2): ("ln_attn", "ln_mlp")}
NORM_PLUS_ONE = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")  # x * (1 + w): stored as w + 1
META_NAMES = dict(tok="tok_embeddings.weight", norm="norm.weight", output="output.weight",
                  q="layers.{0}.attention.wq.weight", k="layers.{0}.attention.wk.weight",
                  v="layers.{0}.attention.wv.weight", o="layers.{0}.attention.wo.weight",
                  gate="layers.{0}.feed_forward.w1.weight", up="layers.{0}.feed_forward.w3.weight",
                  down="layers.{0}.feed_forward.w2.weight", attn_norm="layers.{0}.attention_norm.weight",
                  ffn_norm="layers.{0}.ffn_norm.weight")
def permute_rotary(w: torch.Tensor, n_heads: int, rotary_dim: int = 0) -> torch.Tensor:
    """Adjacent-pair rotary layout (Meta, llama2.c, GGUF llama; GPT-J's rotate_every_two) -> Hugging Face half-split,
    for weights and biases, on the first rotary_dim rows of each head (0 = all; GPT-J rotates 64 of 256)."""
    head_dim = w.shape[0] // n_heads
    r = rotary_dim or head_dim
    h = w.reshape(n_heads, head_dim, *w.shape[1:])
    rot = h[:, :r].reshape(n_heads, r // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(n_heads, r, *w.shape[1:])
    return torch.cat([rot, h[:, r:]], dim=1).reshape(w.shape)


def _falcon_qkv(w: torch.Tensor, args) -> torch.Tensor:
    """Falcon's fused query_key_value rows (weight or bias) -> q, k, v. Falcon-40B style (new_decoder_architecture):
    per KV group its query heads, then its key and its value; Falcon-7B (multi-query): already q..., k, v;
    otherwise (Falcon-RW style) q, k, v interleaved per head."""
    H, Hkv, D = args.n_head, args.n_local_heads, args.head_dim
    rest = w.shape[1:]
    if Hkv == 1 and H > 1:  # multi-query: [q heads, k, v]
        return w
    g = w.reshape(Hkv, H // Hkv + 2, D, *rest)
    q, k, v = g[:, :-2], g[:, -2], g[:, -1]
    return torch.cat([q.reshape(H * D, *rest), k.reshape(Hkv * D, *rest), v.reshape(Hkv * D, *rest)])


def meta_hidden_dim(dim, multiple_of, ffn_dim_multiplier=None):
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _copy_tokenizer(src_dir: Path):
    def write(out_dir):
        copy_tokenizer_files(src_dir, out_dir)  # every file of common.TOKENIZER_FILES there
        from tokenizer_tiktoken import convert_salesforce  # CodeGen2.5 / XGen: tiktoken ranks, built (no code run)
        convert_salesforce(src_dir, out_dir)
    return write


def tensor_table(files) -> dict:
    """name -> loader over .safetensors / .bin files (memory-mapped, loaded one tensor at a time)."""
    from safetensors import safe_open
    table = {}
    for f in files:
        if not f.is_file():
            raise ConvertError(f"missing weights file {f} (listed in the index)")
        if f.suffix == ".safetensors":
            try:
                h = safe_open(str(f), framework="pt")
                keys = list(h.keys())
            except Exception as e:
                raise ConvertError(f"cannot read {f}: not a valid safetensors file ({_oneline(e)})") from None
            table.update({k: (lambda h=h, k=k: h.get_tensor(k)) for k in keys})
        else:
            sd = torch_load(f)
            if not isinstance(sd, dict):
                raise ConvertError(f"{f} does not hold a state dict")
            table.update({k: (lambda v=v: v) for k, v in sd.items() if isinstance(v, torch.Tensor)})
    return table


def load_hf(d: Path) -> Source:
    try:
        cfg = json.loads((d / "config.json").read_text())
    except Exception as e:
        raise ConvertError(f"cannot read {d / 'config.json'}: {_oneline(e)}") from None
    arch = (cfg.get("architectures") or [None])[0] or HF_MODEL_TYPES.get(cfg.get("model_type"),
                                                                         f"model_type={cfg.get('model_type')}")
    if arch not in HF_ARCHS:
        raise ConvertError(f"unsupported architecture {arch!r} in {d / 'config.json'} (supported: {', '.join(HF_ARCHS)})")
    files = None
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (d / index).is_file():
            try:
                files = sorted({d / f for f in json.loads((d / index).read_text())["weight_map"].values()})
            except Exception as e:
                raise ConvertError(f"cannot read {d / index}: {_oneline(e)}") from None
            break
    files = files or sorted(d.glob("model*.safetensors")) or sorted(d.glob("pytorch_model*.bin"))
    if not files:
        raise ConvertError(f"no model*.safetensors or pytorch_model*.bin weights in {d}")
    try:
        args = ModelArgs.from_hf_config(cfg)
    except (KeyError, ValueError) as e:
        raise ConvertError(f"{arch}: unsupported config.json: {type(e).__name__} {_oneline(e)}") from None
    table = tensor_table(files)
    names = dict(HF_NAMES, **HF_FAMILY_NAMES.get(arch, {}))
    prefix = names["tok"].split(".")[0] + "."
    if names["tok"] not in table and names["tok"].removeprefix(prefix) in table:  # a bare LlamaModel / GPT2Model
        table = {prefix + k: v for k, v in table.items()}
    if arch == "FalconForCausalLM":
        ours = FALCON_NORMS[args.parallel_attn, args.parallel_norms]
        for key, theirs in zip(("attn_norm", "ffn_norm"), ours):
            names.update(_LN(key, _T + theirs) if theirs else {})
    table = {k: _hf_layout(arch, k, f, args) for k, f in table.items()}
    dtype = table[names["tok"]]().dtype if names["tok"] in table else torch.float32
    return Source(args, names, table, dtype, permute=arch == "GPTJForCausalLM", tied=args.tie_embeddings,
                  tokenizer=_copy_tokenizer(d), ignore=("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias"),
                  norm_offset=1.0 if arch in NORM_PLUS_ONE else 0.0)


def _hf_layout(arch: str, name: str, load, args):
    """The loader of one Hugging Face tensor, in nn.Linear's layout with q, k, v rows in model.py's order: GPT-2's
    Conv1D weights are [in, out] (transposed), Falcon's fused query_key_value is reordered (_falcon_qkv)."""
    if arch == "GPT2LMHeadModel" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
        return lambda: load().t().contiguous()
    if arch == "FalconForCausalLM" and ".query_key_value." in name:
        return lambda: _falcon_qkv(load(), args)
    return load


def load_meta(d: Path) -> Source:
    shards = sorted(d.glob("consolidated.*.pth"))
    try:
        p = json.loads((d / "params.json").read_text())
    except Exception as e:
        raise ConvertError(f"cannot read {d / 'params.json'}: {_oneline(e)}") from None
    _require(p, ("dim", "n_layers", "n_heads"), d / "params.json")
    sds = [torch_load(f) for f in tqdm(shards, desc="loading shards", disable=len(shards) < 2)]
    for f, sd in zip(shards, sds):
        if not isinstance(sd, dict) or "tok_embeddings.weight" not in sd:
            raise ConvertError(f"{f} is not a Meta consolidated checkpoint (no tok_embeddings.weight)")

    def merged(name):
        if len(sds) == 1 or sds[0][name].dim() == 1:  # norms are replicated on every shard
            return sds[0][name]
        if name == "tok_embeddings.weight":  # Llama 2 splits the embedding dim, Llama 3 the vocabulary
            return torch.cat([sd[name] for sd in sds], dim=int(sds[0][name].shape[1] != p["dim"]))
        if name.split(".")[-2] in ("wq", "wk", "wv", "w1", "w3", "output"):
            return torch.cat([sd[name] for sd in sds], dim=0)  # column-parallel
        return torch.cat([sd[name] for sd in sds], dim=1)  # row-parallel wo/w2

    tok = merged("tok_embeddings.weight")
    n_head = p["n_heads"]
    inter = meta_hidden_dim(p["dim"], p.get("multiple_of", 256), p.get("ffn_dim_multiplier"))
    w1 = merged("layers.0.feed_forward.w1.weight")
    if w1.shape[0] != inter:
        raise ConvertError(f"params.json gives intermediate size {inter} but w1 has {w1.shape[0]} rows")
    scaling = None
    if p.get("use_scaled_rope"):  # Llama 3.1: factor 8; Llama 3.2 1B/3B: factor 32
        factor = p.get("rope_scaling_factor") or (32.0 if (p["dim"], p["n_layers"]) in ((2048, 16), (3072, 28)) else 8.0)
        scaling = dict(factor=float(factor), low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)
    block_size = p.get("max_seq_len") or (131072 if scaling else 8192 if p.get("rope_theta") else 4096)
    args = ModelArgs(block_size=block_size,
                     vocab_size=tok.shape[0], n_layer=p["n_layers"], n_head=n_head, dim=p["dim"],
                     intermediate_size=inter, n_local_heads=p.get("n_kv_heads") or n_head,
                     rope_base=float(p.get("rope_theta", 10000.0)), norm_eps=p.get("norm_eps", 1e-5),
                     rope_scaling=scaling)
    if p.get("vocab_size", -1) not in (-1, tok.shape[0]):
        raise ConvertError(f"params.json vocab_size {p['vocab_size']} != embedding rows {tok.shape[0]}")
    table = {k: (lambda k=k: merged(k)) for k in sds[0]}
    return Source(args, META_NAMES, table, tok.dtype, permute=True, tokenizer=_copy_tokenizer(d),
                  ignore=("rope.freqs",))


def load_llama2c(path: Path) -> Source:
    ck = torch_load(path)
    if not (isinstance(ck, dict) and isinstance(ck.get("model"), dict) and isinstance(ck.get("model_args"), dict)):
        raise ConvertError(f"{path} is not a llama2.c checkpoint (expected keys 'model' and 'model_args')")
    sd = {k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()}
    a = ck["model_args"]
    _require(a, ("dim", "n_layers", "n_heads", "vocab_size"), f"{path} model_args")
    inter = a.get("hidden_dim") or meta_hidden_dim(a["dim"], a.get("multiple_of", 32))
    if "layers.0.feed_forward.w1.weight" in sd and sd["layers.0.feed_forward.w1.weight"].shape[0] != inter:
        raise ConvertError(f"model_args give hidden_dim {inter} but w1 has "
                           f"{sd['layers.0.feed_forward.w1.weight'].shape[0]} rows")
    args = ModelArgs(block_size=a.get("max_seq_len", 2048), vocab_size=a["vocab_size"], n_layer=a["n_layers"],
                     n_head=a["n_heads"], dim=a["dim"], intermediate_size=inter,
                     n_local_heads=a.get("n_kv_heads") or a["n_heads"], norm_eps=a.get("norm_eps", 1e-5))
    dtype = sd["tok_embeddings.weight"].dtype if "tok_embeddings.weight" in sd else torch.float32
    return Source(args, META_NAMES, {k: (lambda v=v: v) for k, v in sd.items()}, dtype, permute=True,
                  tokenizer=_copy_tokenizer(path.parent), ignore=("freqs_cos", "freqs_sin"))


def open_source(src: Path) -> Source:
    if not src.exists():
        raise ConvertError(f"no such file or directory: {src}")
    if src.is_file():
        with open(src, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return load_gguf(src)
        if src.suffix == ".gguf":
            raise ConvertError(f"{src} is not a GGUF file (bad magic {magic!r})")
        if src.name.startswith("consolidated.") or src.suffix == ".safetensors" or src.name in ("params.json", "config.json"):
            return open_source(src.parent)
        if src.suffix in (".pt", ".pth", ".ckpt", ".bin"):
            return load_llama2c(src)
        raise ConvertError(f"unknown checkpoint format: {src}")
    if (src / "config.json").is_file():
        return load_hf(src)
    if (src / "params.json").is_file() and list(src.glob("consolidated.*.pth")):
        return load_meta(src)
    if (src / "ckpt.pt").is_file():
        return load_llama2c(src / "ckpt.pt")
    ggufs = sorted(src.glob("*.gguf"))
    if len(ggufs) == 1:
        return load_gguf(ggufs[0])
    raise ConvertError(f"unknown checkpoint format in {src}: expected config.json + weights (Hugging Face), "
                       f"params.json + consolidated.*.pth (Meta), ckpt.pt (llama2.c) or a single .gguf file")


def build_state_dict(s: Source, dtype: torch.dtype):
    args, used = s.args, set()

    def get(key, i=None, required=True, e=None):
        name = s.names.get(key, "\0").format(i, e)
        if name not in s.tensors:
            if required:
                raise ConvertError(f"missing tensor {name}")
            return None
        used.add(name)
        return checked_weight(name, s.tensors[name]()).to(dtype)

    def norm(key, i=None):
        w = get(key, i)
        return (w.float() + s.norm_offset).to(dtype) if s.norm_offset and args.norm_type == "rms" else w

    def has(key, i):
        return s.names.get(key, "\0").format(i, 0) in s.tensors

    sd = {"tok_embeddings.weight": get("tok"), "norm.weight": norm("norm")}
    layer_norm_bias = args.norm_type == "layer" and args.norm_bias
    if layer_norm_bias:
        sd["norm.bias"] = get("norm_bias")
    if args.learned_pos:
        sd["pos_embeddings.weight"] = get("pos")
    if args.output_bias:
        sd["output.bias"] = get("output_bias")
    out = get("output", required=False)
    tied = s.tied if s.tied is not None else out is None or torch.equal(out, sd["tok_embeddings.weight"])
    if out is None and not tied:
        raise ConvertError(f"missing tensor {s.names['output']} (the config says the output is not tied)")
    if not tied:
        sd["output.weight"] = out
    args = dataclasses.replace(args, tie_embeddings=tied)
    q_size, kv_size = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
    for i in tqdm(range(args.n_layer), desc="converting layers"):
        p = f"layers.{i}."
        if has("qkv", i):  # fused (Phi-3, GPT-2, Falcon, MPT): q, k, v rows in model.py's order (see _hf_layout)
            q, k, v = get("qkv", i).split([q_size, kv_size, kv_size])
        else:
            q, k, v = get("q", i), get("k", i), get("v", i)
        rd = args.rotary_dim
        if s.permute:
            q, k = permute_rotary(q, args.n_head, rd), permute_rotary(k, args.n_local_heads, rd)
        sd[p + "attention.wqkv.weight"] = torch.cat([q, k, v])
        if args.attn_bias:
            if has("qkv_bias", i):
                qb, kb, vb = get("qkv_bias", i).split([q_size, kv_size, kv_size])
            else:
                qb, kb, vb = get("q_bias", i), get("k_bias", i), get("v_bias", i)
            if s.permute:
                qb, kb = permute_rotary(qb, args.n_head, rd), permute_rotary(kb, args.n_local_heads, rd)
            sd[p + "attention.wqkv.bias"] = torch.cat([qb, kb, vb])
        if args.qk_norm:
            sd[p + "attention.q_norm.weight"], sd[p + "attention.k_norm.weight"] = norm("q_norm", i), norm("k_norm", i)
        sd[p + "attention.wo.weight"] = get("o", i)
        if args.attn_out_bias:
            sd[p + "attention.wo.bias"] = get("o_bias", i)
        if args.n_experts:
            sd.update(_experts(get, has, i, args))
        else:
            sd.update(_mlp(get, has, i, args, p + "feed_forward."))
        norms = [("attention_norm", "attn_norm")]
        if not args.parallel_attn or args.parallel_norms == 2:  # a parallel block with one norm has no ffn_norm
            norms.append(("ffn_norm", "ffn_norm"))
        if args.sandwich_norm:
            norms += [("post_attention_norm", "post_attn_norm"), ("post_ffn_norm", "post_ffn_norm")]
        for ours, theirs in norms:
            sd[p + ours + ".weight"] = norm(theirs, i)
            if layer_norm_bias:
                sd[p + ours + ".bias"] = get(theirs + "_bias", i)
    extra = sorted(n for n in set(s.tensors) - used if not n.endswith(s.ignore) and n != s.names["output"])
    if extra:
        raise ConvertError(f"unsupported tensors in checkpoint (not part of model.py): {', '.join(extra[:4])}"
                           + (f" and {len(extra) - 4} more" if len(extra) > 4 else ""))
    with torch.device("meta"):
        expected = Transformer(args).state_dict()
    missing = sorted(set(expected) - set(sd) - ({"output.weight"} if tied else set()))
    if missing:
        raise ConvertError(f"the checkpoint lacks tensors the config needs: {', '.join(missing[:4])}")
    for name, t in sd.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ConvertError(f"shape mismatch for {name}: checkpoint {tuple(t.shape)}, "
                               f"config expects {tuple(expected[name].shape)}")
    return sd, args


def _mlp(get, has, i, args, p, e=None) -> dict:
    """One MLP's w1 (activated), w3 (gate partner, gated MLPs only), w2 (+ biases)."""
    sd = {}
    if has("gate_up", i):  # fused (Phi-3): gate rows, then up rows
        sd[p + "w1.weight"], sd[p + "w3.weight"] = get("gate_up", i).chunk(2)
    else:
        sd[p + "w1.weight"] = get("gate", i, e=e)
        if args.mlp_gated:
            sd[p + "w3.weight"] = get("up", i, e=e)
    sd[p + "w2.weight"] = get("down", i, e=e)
    if args.mlp_bias:
        sd[p + "w1.bias"], sd[p + "w2.bias"] = get("gate_bias", i), get("down_bias", i)
        if args.mlp_gated:
            sd[p + "w3.bias"] = get("up_bias", i)
    return sd


def _experts(get, has, i, args) -> dict:
    """Mixtral: router + per-expert w1/w3/w2, from per-expert tensors or transformers 5's fused [E, ...] ones."""
    p = f"layers.{i}.feed_forward."
    sd = {p + "gate.weight": get("router", i) if has("router", i) else get("router_alt", i)}
    fused, stacked = has("experts_gate_up", i), has("experts_gate", i)  # [E, 2I, D] (transformers 5), [E, I, D] (GGUF)
    if fused:
        gate, up = get("experts_gate_up", i).chunk(2, dim=1)
    elif stacked:
        gate, up = get("experts_gate", i), get("experts_up", i)
    if fused or stacked:
        down = get("experts_down", i)
    for e in range(args.n_experts):
        q = f"{p}experts.{e}."
        if fused or stacked:
            sd[q + "w1.weight"], sd[q + "w3.weight"], sd[q + "w2.weight"] = gate[e], up[e], down[e]
        else:
            sd[q + "w1.weight"] = get("expert_gate", i, e=e)
            sd[q + "w3.weight"] = get("expert_up", i, e=e)
            sd[q + "w2.weight"] = get("expert_down", i, e=e)
    return sd


def convert(src, output_dir, dtype=None) -> Path:
    """Convert SRC into output_dir (model.pth, config.json, tokenizer); returns the model.pth path. All files are
    published together or none (convert_io.publish): a failure leaves a previous conversion there whole.
    dtype: None (keep the source's float dtype; GGUF gives float32), a torch.dtype or one of DTYPES' names."""
    src, out = Path(src), Path(output_dir)
    written = {(out / n).resolve() for n in ("model.pth", "config.json", *TOKENIZER_FILES)}
    if out.resolve() == src.resolve() or src.resolve() in written:  # the conversion would replace its own input
        raise ConvertError(f"output directory {out} must differ from the source's directory")
    s = open_source(src)
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    sd, args = build_state_dict(s, dtype or s.dtype)
    config = dataclasses.asdict(args)
    sd["_config"] = json.dumps(config)
    publish(out, sd, config, s.tokenizer)
    return out / "model.pth"


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", help="Hugging Face dir, Meta dir (params.json + consolidated.*.pth), llama2.c ckpt.pt, or .gguf")
    ap.add_argument("--output_dir", default=None, help="default: checkpoints/<name>")
    ap.add_argument("--name", default=None, help="model name (default: the source's directory or file name)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: keep the source dtype")
    a = ap.parse_args(argv)
    src = Path(a.src)
    name = a.name or (src.stem if src.is_file() and src.suffix == ".gguf" else src.resolve().name)
    out_dir = Path(a.output_dir or REPO / "checkpoints" / name)
    try:
        path = convert(src, out_dir, a.dtype)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # corrupt or unexpected files: one line, no traceback
        print(f"error: converting {src} failed: {type(e).__name__}: {_oneline(e)}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {path} and {out_dir / 'config.json'}")


if __name__ == "__main__":
    cli(main)
