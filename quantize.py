# Weight quantization for model.py's Transformer, gpt-fast style: one scheme per mode, applied by swapping nn.Linear /
# nn.Embedding modules for quantized ones that hold plain integer tensors. GPTQ lives in gptq.py.
#
#     python quantize.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --mode int8
#     python quantize.py --checkpoint_path ... --mode int4 --groupsize 32     (or --mode 8da4w --groupsize 32)
#     python quantize.py --checkpoint_path ... --mode int4-gptq --groupsize 64 --calibration_file some.txt
#
# Modes (weights of every nn.Linear; activations stay float unless said otherwise):
#   int8       weight-only, symmetric, one scale per output channel          w = q * s,            q in [-127, 127]
#   int4       weight-only, asymmetric, groups of G along in_features        w = q * s + z,        q in [0, 15]
#   8da4w      int4 groupwise weights (scales on the bfloat16 grid) x int8 dynamic per-token asymmetric activations, for
#              ExecuTorch/XNNPACK: x @ w.T = xq @ ((q - 8) s).T + group_sums(x) @ (z + 8 s).T, i.e. XNNPACK's qb4w GEMM
#              (zero point 8 only) on the int8 activations xq plus a small float GEMM of the float activations' group
#              sums (K/G inputs). Symmetric weights (z = 0, ExecuTorch's own 8da4w; still loaded) measured +21%
#              perplexity on SmolLM2-135M, whose weights come from an asymmetric 4-bit GGUF; these +1.7%.
#   8da8w      int8 weights as int8's x int8 dynamic per-token asymmetric activations (as 8da4w's): the int8 x int8
#              product llama.cpp's Q8_0 runs. Prompts (more than one row) go through one integer GEMM (torch._int_mm,
#              VNNI) in eager, compiled and package prefill (README's prefill table: 2.3-2.7x llama.cpp Q8_0).
#   int4-gptq  int4 storage and kernels, weights chosen by GPTQ on calibration text (8da4w with --calibration_file too)
#
# Embeddings (--embedding int8 | int4 | none, default int8, one scale per row): a tied output projection (SmolLM2,
# Llama 3.2, Qwen) reads the very same quantized table (one copy in memory and in the file); in 8da4w mode it also
# quantizes its activations, so the XNNPACK delegate takes it. int8 by default because that table is the most
# sensitive matrix of a small model: on SmolLM2-135M int4 g32 alone costs ~6% perplexity, int8 ~0.05%, for ~10 MB.
# --embedding int4 (groups of --groupsize, symmetric in 8da4w mode) gives the smallest file. A tied table is always
# rounded to nearest; an untied output projection gets GPTQ like the other linears.
#
# Storage: plain int8 / uint8 / float tensors (torch.load(weights_only=True)). int4 is packed two per byte: in each
# group of G, byte j holds element j (high nibble) and j + G/2 (low). Scales, zeros and the other float tensors are
# float32 whatever the source's dtype: a float32 run (the CPU default) maps them from the file, where a bfloat16 file's
# would be cast copies kept beside the kernels' own layouts (1.7 GB for an 8B int4 g32 model).
# The file stores its recipe; load_model() below has checkpoint.load_model() call apply_recipe() on a meta-device model,
# then assign the weights.
#
# Kernels (eager, packed CPU, bfloat16 GEMM, compiled decode, export forms): qops.py, beside the layouts they read.
import sys
import time
from pathlib import Path
from typing import Optional

from common import GROUPSIZES, ArgumentParser, at_least, check_device, checkpoint_file, cli, default_checkpoint, one_of
import torch
import torch.nn as nn

from checkpoint import checkpoint_state, save_checkpoint
from checkpoint import load_model as load_float_or_hooked
from qops import (SHRINKS, SYM_EXTRA, QuantizedEmbedding, QuantizedLinear, QuantizedWeight,  # noqa: F401
                  _int4_round, group_params, quantize_tensor, quantize_weight)

MODES = ("int8", "int4", "8da4w", "8da8w", "int4-gptq")
EIGHT_BIT = ("int8", "8da8w")  # modes without a group size
EMBEDDINGS = ("int8", "int4", "none")
FORMAT_VERSION = 1

# ----------------------------------------------------------------------------------------------------------- schemes
def _scheme(bits: int, groupsize: Optional[int] = None, symmetric: bool = False, xnnpack: bool = False) -> dict:
    """xnnpack (4-bit, 8da4w): scales on the bfloat16 grid and export operands in XNNPACK's qb4w pattern."""
    d = {"bits": bits, "groupsize": groupsize if bits == 4 else None, "symmetric": bool(symmetric or bits == 8)}
    if xnnpack and bits == 4:
        d["xnnpack"] = True
    return d


# ----------------------------------------------------------------------------------------------------------- recipes
def _set_module(root: nn.Module, name: str, new: nn.Module):
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, new)


def _note(notes: list, msg: str, log=True):
    notes.append(msg)
    if log:
        print(f"note: {msg}", file=sys.stderr)


def check_args(mode: str, groupsize: Optional[int], embedding: Optional[str] = None, calibrated: bool = False):
    """The checks of quantize_model's arguments that need no model (the CLI runs them before loading anything)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode not in EIGHT_BIT and groupsize not in GROUPSIZES:
        raise ValueError(f"--groupsize must be one of {', '.join(map(str, GROUPSIZES))} for {mode}, got {groupsize}")
    if embedding is not None and embedding not in EMBEDDINGS:
        raise ValueError(f"--embedding must be one of {', '.join(EMBEDDINGS)}, got {embedding!r}")
    if mode == "int4-gptq" and not calibrated:
        raise ValueError("--mode int4-gptq needs --calibration_file (quantize_model: calibration_ids), a text to "
                         "calibrate GPTQ on")


def make_recipe(model: nn.Module, mode: str, groupsize: Optional[int] = 32, embedding: Optional[str] = None,
                log: bool = True) -> dict:
    """Decide what gets quantized how, for arguments that passed check_args (no weights touched)."""
    four_bit = mode not in EIGHT_BIT
    G = groupsize if four_bit else None
    linear = _scheme(4, G, xnnpack=(mode == "8da4w")) if four_bit else _scheme(8)
    act = "int8" if mode in ("8da4w", "8da8w") else None
    embedding = embedding or "int8"  # see the header: the table is also the output projection of tied models
    notes, skip = [], []
    emb = getattr(model, "tok_embeddings", None)
    emb_scheme = None
    if embedding != "none" and isinstance(emb, nn.Embedding):
        emb_scheme = _scheme(8) if embedding == "int8" else _scheme(4, groupsize or 32, symmetric=act is not None)
        if emb_scheme["bits"] == 4 and emb.embedding_dim % emb_scheme["groupsize"]:
            _note(notes, f"embedding dim {emb.embedding_dim} is not a multiple of {emb_scheme['groupsize']}: "
                         f"embedding quantized to int8 instead", log)
            emb_scheme = _scheme(8)
    tied = bool(getattr(getattr(model, "config", None), "tie_embeddings", False)) and isinstance(emb, nn.Embedding)
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or (tied and name == "output"):
            continue
        if four_bit and m.in_features % G:
            if mode == "8da4w":
                skip.append(name)
                _note(notes, f"{name}: in_features {m.in_features} is not a multiple of {G}: kept float", log)
            else:
                raise ValueError(f"--groupsize {G} does not divide in_features {m.in_features} of {name}; "
                                 f"try a smaller group size")
    return {"format": FORMAT_VERSION, "mode": mode, "groupsize": G, "linear": linear, "act": act,
            "embedding": emb_scheme, "tied_output": tied,
            "output_act": act if (tied and emb_scheme) else None,  # 8da4w: dynamic int8 activations, int8/int4 table
            "skip": skip, "notes": notes}


def _targets(model: nn.Module, recipe: dict) -> list:
    skip = set(recipe["skip"])
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in skip
            and not (recipe["tied_output"] and n == "output")]


RECIPE_KEYS = ("format", "mode", "groupsize", "linear", "act", "embedding", "tied_output", "output_act", "skip")


def _check_scheme(scheme, key: str) -> None:
    if not isinstance(scheme, dict) or scheme.get("bits") not in (4, 8):
        raise ValueError(f"{key} must be a scheme with bits 4 or 8, got {scheme!r:.80}")
    G = scheme.get("groupsize")
    if (G not in GROUPSIZES) if scheme["bits"] == 4 else G is not None:
        raise ValueError(f"{key}.groupsize must be {'one of ' + str(GROUPSIZES) if scheme['bits'] == 4 else 'null'} "
                         f"for {scheme['bits']} bits, got {G!r}")
    if not isinstance(scheme.get("symmetric"), bool) or not isinstance(scheme.get("xnnpack", False), bool):
        raise ValueError(f"{key}.symmetric (and xnnpack) must be true or false, got {scheme!r:.80}")


def check_recipe(recipe) -> dict:
    """A quantization recipe (what make_recipe writes, what a checkpoint's "_quantization" claims) before anything is
    built from it or written: format FORMAT_VERSION, every key of RECIPE_KEYS with its type and range (a group size in
    GROUPSIZES, never 0). One ValueError naming the key. Returns the recipe."""
    if not isinstance(recipe, dict) or recipe.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported quantization recipe (format "
                         f"{recipe.get('format') if isinstance(recipe, dict) else recipe!r}); this quantize.py reads "
                         f"format {FORMAT_VERSION}")
    missing = [k for k in RECIPE_KEYS if k not in recipe]
    if missing:
        raise ValueError(f"the recipe lacks {', '.join(missing)}")
    if recipe["mode"] not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {recipe['mode']!r:.40}")
    _check_scheme(recipe["linear"], "linear")
    if recipe["groupsize"] != recipe["linear"]["groupsize"]:
        raise ValueError(f"groupsize {recipe['groupsize']!r:.20} differs from linear.groupsize")
    if recipe["embedding"] is not None:
        _check_scheme(recipe["embedding"], "embedding")
    for k in ("act", "output_act"):
        if recipe[k] not in (None, "int8"):
            raise ValueError(f"{k} must be null or \"int8\", got {recipe[k]!r:.40}")
    if not isinstance(recipe["tied_output"], bool):
        raise ValueError(f"tied_output must be true or false, got {recipe['tied_output']!r:.20}")
    if not (isinstance(recipe["skip"], list) and all(isinstance(n, str) for n in recipe["skip"])):
        raise ValueError(f"skip must be a list of module names, got {recipe['skip']!r:.60}")
    return recipe


def apply_recipe(model: nn.Module, recipe: dict) -> nn.Module:
    """Swap modules for the quantized ones a checkpoint's recipe names (shapes only: typically on the meta device,
    before load_state_dict(assign=True) brings the stored tensors). The recipe is checked first (check_recipe), and
    its group sizes against the model's matrices."""
    check_recipe(recipe)
    ref = model.norm.weight
    dtype, device = ref.dtype, ref.device
    for name in _targets(model, recipe):
        lin = model.get_submodule(name)
        if lin.in_features % (recipe["linear"]["groupsize"] or 1):
            raise ValueError(f"linear.groupsize {recipe['linear']['groupsize']} does not divide in_features "
                             f"{lin.in_features} of {name}")
        qw = QuantizedWeight(lin.out_features, lin.in_features, recipe["linear"], dtype, device)
        bias = torch.empty(lin.out_features, dtype=dtype, device=device) if lin.bias is not None else None
        _set_module(model, name, QuantizedLinear(qw, bias, recipe["act"]))
    if recipe["embedding"]:
        emb = model.tok_embeddings
        if emb.embedding_dim % (recipe["embedding"]["groupsize"] or 1):
            raise ValueError(f"embedding.groupsize {recipe['embedding']['groupsize']} does not divide the embedding "
                             f"dim {emb.embedding_dim}")
        qw = QuantizedWeight(emb.num_embeddings, emb.embedding_dim, recipe["embedding"], dtype, device)
        model.tok_embeddings = QuantizedEmbedding(qw)
        if recipe["tied_output"]:
            model.output = QuantizedLinear(qw, None, recipe["output_act"])
    return model


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, groupsize: int = 32, calibration_ids=None, embedding=None, *,
                   act_order: bool = False, damp: float = 0.1, calibration_seq_length: int = 512,
                   log: bool = True) -> dict:
    """Quantize a float model in place; returns the recipe to store with checkpoint_state(model, quantization=...).

    mode: int8 | int4 | 8da4w | 8da8w | int4-gptq (needs calibration_ids: token ids, 1-D or [n, seq_len]).
    embedding: None (the mode's default), "int8", "int4" or "none"."""
    check_args(mode, groupsize, embedding, calibration_ids is not None)
    if any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules()):
        raise ValueError("the model is already quantized; start from a float checkpoint")
    recipe = make_recipe(model, mode, groupsize, embedding, log=log)
    gptq = mode == "int4-gptq" or (mode == "8da4w" and calibration_ids is not None)
    emb_qw = None
    if recipe["embedding"]:  # first: GPTQ calibrates the layers on the embedding the model will really use
        emb = model.tok_embeddings
        emb_qw = quantize_weight(emb.weight, recipe["embedding"])
        model.tok_embeddings = QuantizedEmbedding(emb_qw)
        if recipe["tied_output"]:
            model.output = QuantizedLinear(emb_qw, None, recipe["output_act"])
    targets = _targets(model, recipe)
    if gptq:
        import gptq as GPTQ  # only GPTQ modes need it
        calib = GPTQ.calibration_batches(calibration_ids, min(calibration_seq_length, model.config.block_size))
        GPTQ.gptq_model(model, recipe, targets, calib, act_order=act_order, damp=damp, log=log)
    for name in targets:
        lin = model.get_submodule(name)
        if isinstance(lin, nn.Linear):
            qw = quantize_weight(lin.weight, recipe["linear"])
            _set_module(model, name, QuantizedLinear(qw, lin.bias, recipe["act"]))
    if gptq:
        recipe["gptq"] = {"act_order": act_order, "damp": damp, "calibration_tokens": int(calib.numel())}
    return check_recipe(recipe)


# ----------------------------------------------------------------------------------------------------------- CLI
def output_path(checkpoint: Path, mode: str, groupsize: Optional[int]) -> Path:
    """model.pth -> model_int8.pth, model_int4.g32.pth, model_8da4w.g32.pth, model_int4-gptq.g128.pth"""
    suffix = f".g{groupsize}" if mode not in EIGHT_BIT else ""
    return checkpoint.with_name(f"{checkpoint.stem}_{mode}{suffix}.pth")


def _file_bytes(model) -> int:
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def parse_args(argv=None):
    p = ArgumentParser(description="Quantize a model.py checkpoint (writes model_<mode>[.g<G>].pth beside it).")
    p.add_argument("--checkpoint_path", type=Path, default=None, help="float checkpoint (default: the default model)")
    p.add_argument("--mode", required=True, help=f"one of {', '.join(MODES)}")
    p.add_argument("--groupsize", type=int, default=32, help=f"int4 modes: one of {GROUPSIZES} (default 32)", rule=one_of(GROUPSIZES))
    p.add_argument("--embedding", default=None,
                   help="int8 | int4 | none (default int8; a tied output projection shares the quantized table)")
    p.add_argument("--calibration_file", type=Path,
                   help="int4-gptq (required) and 8da4w (optional): text to calibrate GPTQ on")
    p.add_argument("--calibration_tokens", type=int, default=16384, help="GPTQ: at most this many tokens", rule=at_least(1))
    p.add_argument("--calibration_seq_length", type=int, default=512, help="GPTQ: tokens per sequence", rule=at_least(1))
    p.add_argument("--act_order", action="store_true", help="GPTQ: quantize columns by decreasing Hessian diagonal")
    p.add_argument("--damp", type=float, default=0.1, help="GPTQ: Hessian dampening (fraction of mean diagonal)", rule=at_least(0))
    p.add_argument("--tokenizer_path", type=Path, default=None, help="GPTQ: default the checkpoint's directory")
    p.add_argument("--output", type=Path, default=None, help="default: beside the input, model_<mode>[.g<G>].pth",
                   suffix=(".pth",))
    p.add_argument("--device", default="cpu", help="where to run GPTQ (cpu, cuda)")
    args = p.parse_args(argv)
    check_args(args.mode, args.groupsize, args.embedding, args.calibration_file is not None)
    if args.calibration_file is not None:
        if args.mode not in ("int4-gptq", "8da4w"):
            raise ValueError(f"--calibration_file is for --mode int4-gptq or 8da4w (GPTQ), not {args.mode}")
        if not args.calibration_file.is_file():
            raise FileNotFoundError(f"calibration file not found: {args.calibration_file}")
    check_device(args.device)
    return args


def load_model(checkpoint_path, device="cpu", dtype=None):
    """checkpoint.load_model for any checkpoint: a quantized one gets its recipe's modules (apply_recipe)."""
    return load_float_or_hooked(checkpoint_path, device, dtype, quantized=apply_recipe)


def main(argv=None):
    args = parse_args(argv)
    ck = checkpoint_file(args.checkpoint_path or default_checkpoint())
    t0 = time.perf_counter()
    model = load_model(ck, device=args.device)
    before = _file_bytes(model)
    calib = None
    if args.calibration_file is not None:
        from tokenizer import load_tokenizer
        tok = load_tokenizer(args.tokenizer_path or ck.parent)
        calib = tok.encode(args.calibration_file.read_text(encoding="utf-8", errors="replace"))[:args.calibration_tokens]
        if len(calib) < 16:
            raise ValueError(f"calibration file {args.calibration_file} has only {len(calib)} tokens")
        print(f"calibrating on {len(calib)} tokens of {args.calibration_file}", file=sys.stderr)
    recipe = quantize_model(model, args.mode, args.groupsize, calibration_ids=calib, embedding=args.embedding,
                            act_order=args.act_order, damp=args.damp,
                            calibration_seq_length=args.calibration_seq_length)
    out = args.output or output_path(ck, args.mode, recipe["groupsize"])
    save_checkpoint(checkpoint_state(model.to("cpu").float(), quantization=recipe), out)  # (float32: see Storage)
    after = _file_bytes(model)
    print(f"{args.mode}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB of weights in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    print(out)


if __name__ == "__main__":
    cli(main)
