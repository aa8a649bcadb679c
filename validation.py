# validation.py: what a checkpoint claims, checked before it is trusted (llama.cpp's and safetensors' rule). The one
# validation every loader goes through: ModelArgs fields (types, ranges, rope scaling keys, sizes that can be built:
# model_configs.ModelArgs.__post_init__ calls check_fields and check_rope_scaling) and a state dict's entries (names,
# types, finite values, the per-tensor CRC32 that checkpoint.save_checkpoint stores: checkpoint.load_model calls check_state).
# A failure is one ValueError naming the field or the tensor. Imports nothing from this repo.
import json
import math
import numbers
import typing
import zlib
from dataclasses import fields

# The largest value each size field may take: above every published model (Llama 3.1 405B: 126 layers, dim 16384;
# Gemma 3: 262k vocabulary; llama.cpp: 512 layers at most), far below what hangs building the network (n_layer 1e9
# took minutes allocating ~30 MB/s on the meta device).
SIZE_LIMITS = dict(block_size=1 << 24, vocab_size=1 << 24, n_layer=1024, n_head=4096, dim=1 << 17,
                   intermediate_size=1 << 20, n_local_heads=4096, head_dim=4096, rotary_dim=4096,
                   sliding_window=1 << 31, n_experts=1024, n_experts_per_tok=1024, parallel_norms=2)
POSITIVE_FLOATS = ("rope_base", "norm_eps", "alibi_bias_max", "attn_scale", "attn_softcap", "final_softcap",
                   "rope_local_base", "clip_qkv")
CHOICES = dict(norm_type=("rms", "layer"), mlp_act=("silu", "gelu_tanh", "gelu"))
CHECKSUMS = "_checksums"  # the state dict entry: JSON {tensor name: CRC32 of its bytes}, written by save_checkpoint
METADATA = ("_config", "_quantization", CHECKSUMS)  # the JSON string entries of a checkpoint


def _fail(name, what, v):
    shown = json.dumps(v) if isinstance(v, (str, bool, type(None))) else repr(v)
    raise ValueError(f"{name} must be {what}, got {shown[:60]}{'...' if len(shown) > 60 else ''}")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def check_fields(args) -> None:
    """Every field of a ModelArgs dataclass as given (before its defaults are filled in): the type its annotation
    says (an int field takes no float or bool, a float field any finite number, Optional ones also None), sizes in
    [1, SIZE_LIMITS] (n_local_heads -1 = n_head, n_experts from 0), POSITIVE_FLOATS > 0 (norm_eps also < 1),
    CHOICES, layer lists of indices below n_layer."""
    for f in fields(args):
        v, t = getattr(args, f.name), f.type
        if v is None and type(None) in typing.get_args(t):
            continue
        t = next((a for a in typing.get_args(t) if a is not type(None)), t)
        ok = {int: _is_int, float: _is_number, bool: lambda x: isinstance(x, bool), str: lambda x: isinstance(x, str),
              list: lambda x: isinstance(x, list) and all(map(_is_int, x)), dict: lambda x: isinstance(x, dict)}[t]
        if not ok(v):
            _fail(f.name, {int: "an integer", float: "a finite number", list: "a list of integers"}.get(
                t, f"a {t.__name__}") + (" or null" if f.default is None else ""), v)
        if f.name in SIZE_LIMITS:
            lo = 0 if f.name == "n_experts" else -1 if f.name == "n_local_heads" and v == -1 else 1
            if not lo <= v <= SIZE_LIMITS[f.name]:
                _fail(f.name, f"in [1, {SIZE_LIMITS[f.name]}]", v)
        if f.name in POSITIVE_FLOATS and not (v > 0 and (f.name != "norm_eps" or v < 1)):
            _fail(f.name, "in (0, 1)" if f.name == "norm_eps" else "> 0", v)
        if f.name in CHOICES and v not in CHOICES[f.name]:
            _fail(f.name, f"one of {', '.join(CHOICES[f.name])}", v)
        if t is list and not all(0 <= i < args.n_layer for i in v):
            _fail(f.name, f"layer indices in [0, {args.n_layer})", v)
    if args.n_experts and args.n_experts_per_tok > args.n_experts:
        _fail("n_experts_per_tok", f"at most n_experts ({args.n_experts})", args.n_experts_per_tok)


ROPE_KEYS = {  # rope_type -> (required positive numbers, optional positive numbers)
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "linear": (("factor",), ()),
    "longrope": (("original_max_position_embeddings",), ("factor", "attention_factor")),
}


def check_rope_scaling(args) -> None:
    """rope_scaling (after the defaults: longrope's factor lists hold rotary_dim / 2 numbers): a known rope_type
    (absent = llama3) with every key model_configs.rope_frequencies reads, each a positive number."""
    s = args.rope_scaling
    if s is None:
        return
    kind = s.get("rope_type", "llama3")
    if kind not in ROPE_KEYS:
        _fail("rope_scaling.rope_type", f"one of {', '.join(ROPE_KEYS)}", kind)
    required, optional = ROPE_KEYS[kind]
    for k in required + optional:
        if k not in s and k in required:
            raise ValueError(f"rope_scaling ({kind}) lacks {k}")
        if s.get(k) is not None and not (_is_number(s[k]) and s[k] > 0):
            _fail(f"rope_scaling.{k}", "a positive number", s[k])
    if kind == "llama3" and s["low_freq_factor"] == s["high_freq_factor"]:
        raise ValueError("rope_scaling: low_freq_factor and high_freq_factor must differ")
    for k in ("short_factor", "long_factor") if kind == "longrope" else ():
        v = s.get(k)
        if not (isinstance(v, list) and len(v) == args.rotary_dim // 2 and all(_is_number(x) and x > 0 for x in v)):
            _fail(f"rope_scaling.{k}", f"a list of {args.rotary_dim // 2} positive numbers", v)


def crc32(t) -> int:
    """CRC32 of a tensor's bytes (zlib: ~2.5 GB/s here; a flipped bit anywhere changes it)."""
    return zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(dtype=_u8()).numpy())


def _u8():
    import torch  # lazy: model_configs imports this file, and ModelArgs alone needs no tensors
    return torch.uint8


def checksums(sd: dict) -> str:
    """The CHECKSUMS entry for a state dict's tensors (a tensor shared under two names is hashed once)."""
    seen, out = {}, {}
    for k, t in sd.items():
        if k not in METADATA:
            key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.device.type == "cpu" else None
            out[k] = seen[key] if key in seen else crc32(t)
            if key is not None:
                seen[key] = out[k]
    return json.dumps(out)


def check_state(sd: dict, path, each=None) -> None:
    """A loaded state dict, before anything is built from it: names are strings, values tensors (the METADATA entries
    JSON strings), every floating-point tensor finite (one aminmax per tensor: 0.06 s warm on the default model's
    538 MB) and, when the file carries CHECKSUMS (save_checkpoint writes them), every tensor's CRC32 as written
    (0.2 s there). Files written before checksums existed load without that check. each(key, tensor) is called on
    every tensor once it is checked, one at a time (checkpoint.load_model casts it there and gives its file pages back)."""
    import torch
    stored = None
    if CHECKSUMS in sd:
        try:
            stored = json.loads(sd[CHECKSUMS])
        except json.JSONDecodeError:
            pass
        if not isinstance(stored, dict) or set(stored) != set(sd) - set(METADATA):
            raise ValueError(f"checkpoint {path}: {CHECKSUMS} does not list exactly the file's tensors")
    for k, v in sd.items():
        if not isinstance(k, str):
            raise ValueError(f"checkpoint {path}: state dict key {k!r} is not a string")
        if k in METADATA:
            if not isinstance(v, str):
                raise ValueError(f"checkpoint {path}: {k} is not a JSON object string (got {type(v).__name__})")
            continue
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"checkpoint {path}: {k} is a {type(v).__name__}, not a tensor")
        if v.is_floating_point() and v.numel() and not all(map(math.isfinite, map(float, torch.aminmax(v)))):
            raise ValueError(f"checkpoint {path}: tensor {k} holds NaN or infinite values")
        if stored is not None and crc32(v) != stored[k]:
            raise ValueError(f"checkpoint {path}: tensor {k} is corrupt (its CRC32 differs from the one written)")
        if each is not None:
            each(k, v)


def check_sizes(sd: dict, args, path) -> None:
    """What a config claims against what the file holds, before the network is built (a config with n_layer 1000
    but two layers' tensors is refused here, not after building 1000 layers)."""
    layers = {int(k.split(".")[1]) for k in sd if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if layers != set(range(args.n_layer)):
        raise ValueError(f"checkpoint {path}: _config n_layer is {args.n_layer} but the file holds {len(layers)} layers")
    emb = sd.get("tok_embeddings.weight")
    if emb is not None and emb.dim() == 2 and emb.dtype.is_floating_point and tuple(emb.shape) != (
            args.vocab_size, args.dim):
        raise ValueError(f"checkpoint {path}: _config vocab_size x dim is {args.vocab_size} x {args.dim} but "
                         f"tok_embeddings.weight is {tuple(emb.shape)}")


def check_shapes(sd: dict, expected: dict, path) -> None:
    """Every tensor the network has (expected: its state dict on the meta device) has the shape it needs and is
    floating-point exactly where the network's is (an int32 embedding is refused, not cast)."""
    for k, v in sd.items():
        e = expected.get(k)
        if e is not None and (v.shape, v.dtype.is_floating_point) != (e.shape, e.dtype.is_floating_point):
            want = "floating-point" if e.dtype.is_floating_point else str(e.dtype).removeprefix("torch.")
            raise ValueError(f"checkpoint {path}: tensor {k} is {str(v.dtype).removeprefix('torch.')} "
                             f"{tuple(v.shape)}, its config and recipe say {want} {tuple(e.shape)}")


def json_object(value, key: str, path) -> dict:
    """A checkpoint's JSON field (_config, _quantization, config.json) as a dict, or one clear ValueError."""
    try:
        obj = json.loads(value) if isinstance(value, (str, bytes)) else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        obj = None
    if not isinstance(obj, dict):
        raise ValueError(f"checkpoint {path}: {key} is not a JSON object string (got {type(value).__name__})")
    return obj


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first non-empty line of an exception's message (or its type name), cut to `limit` characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    msg = lines[0] if lines else type(e).__name__
    return msg[:limit] + ("..." if len(msg) > limit else "")


def checked(build, path, key):
    """build() (ModelArgs from a config, a recipe's modules), its complaint as one ValueError naming file and key."""
    try:
        return build()
    except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(f"checkpoint {path}: {key}: {first_line(e)}") from None
