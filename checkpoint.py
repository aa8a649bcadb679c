# checkpoint.py: reading and writing model.py's checkpoints safely. Loads with torch.load(weights_only=True, mmap=True)
# and trusts nothing before validation.py has checked it (config, sizes, names, shapes, finiteness, CRC32s); saves
# atomically (common.atomic_path) with every tensor's checksum. quantize.load_model wraps load_model for quantized files.
import contextlib
import ctypes
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch

from common import atomic_path, checkpoint_file
from model import ModelArgs, Transformer
from validation import CHECKSUMS, check_shapes, check_sizes, check_state, checked, checksums, json_object


def checkpoint_config(sd: dict, path) -> ModelArgs:
    """The ModelArgs of a checkpoint's state dict: its "_config" entry, else config.json beside it (older files), else
    its directory's name. One ValueError naming the file and the field where it is no valid config."""
    if "_config" in sd:
        cfg = json_object(sd["_config"], "_config", path)
        return checked(lambda: ModelArgs.from_dict(cfg), path, "_config")
    if (path.parent / "config.json").is_file():
        cfg = json_object((path.parent / "config.json").read_bytes(), "config.json", path)
        return checked(lambda: ModelArgs.from_dict(cfg), path, "config.json")
    return ModelArgs.from_name(path.parent.name)


@contextlib.contextmanager
def no_init():
    """torch.nn.init's functions as no-ops (as transformers' no_init_weights): a model built on the meta device has no
    values to initialize, and meta's normal_ imports Dynamo (1.5 s of every script's start that loads a model)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "ones_", "zeros_", "constant_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def page_releaser(sd: dict) -> Callable:
    """release(t): give back the resident pages of tensor t of sd, a state dict torch.load(mmap=True) has just mapped
    from its file (one private mapping) and that was only read since: what is read again comes back from the page
    cache (written pages would be lost: common.release_pages compares first). A no-op off Linux or off that mapping."""
    first = next((v for v in sd.values() if isinstance(v, torch.Tensor) and v.numel()), None)
    span = None
    if first is not None and sys.platform == "linux":
        for f in (line.split(maxsplit=5) for line in Path("/proc/self/maps").read_text().splitlines()):
            lo, hi = (int(a, 16) for a in f[0].split("-"))
            if lo <= first.data_ptr() < hi:
                span = (lo, hi) if len(f) == 6 and "p" in f[1] and f[5].startswith("/") else None
                break
    madvise = ctypes.CDLL("libc.so.6").madvise if span else None

    def release(t: torch.Tensor) -> None:
        s = t.untyped_storage()
        lo, hi = -(-s.data_ptr() // 4096) * 4096, (s.data_ptr() + s.nbytes()) // 4096 * 4096  # whole pages inside
        if span and span[0] <= lo < hi <= span[1]:
            madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED
    return release


def load_model(checkpoint_path, device="cpu", dtype: Optional[torch.dtype] = None,
               quantized: Optional[Callable] = None) -> Transformer:
    """Load a checkpoint written by scripts/convert_checkpoint.py or quantize.py, safely (weights_only, mmap).

    The file carries its own config under "_config" (a JSON string of ModelArgs) and, when quantized, its recipe
    under "_quantization" (JSON, applied by `quantized` before the weights are assigned: quantize.load_model passes
    quantize.apply_recipe, which checks it), so no flag and no filename parsing. Older files without "_config" fall
    back to config.json beside them, then to the directory's name. Nothing in the file is trusted before it is
    checked (validation.py): the config's fields, its sizes against the tensors, every tensor's name, type, shape,
    finiteness and checksum; any failure is one ValueError naming the file and the field or tensor."""
    path = checkpoint_file(checkpoint_path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ValueError(f"cannot read checkpoint {path}: not a valid PyTorch weights file ({type(e).__name__})") from None
    if not isinstance(sd, dict):
        raise ValueError(f"checkpoint {path} does not hold a state dict")
    quantized_file = "_quantization" in sd  # (a float file loaded as stored releases nothing: no /proc/self/maps read)
    release = page_releaser(sd) if quantized_file or dtype is not None else None

    def each(k, v):  # as each tensor is checked: cast in the state dict (the peak is the cast weights plus one tensor,
        cast = dtype is not None and v.is_floating_point() and v.dtype != dtype  # not both copies), its pages given
        if cast:                                        # back where cast, or where a quantized model's kernels will
            sd[k] = v.to(dtype)                         # make layouts of their own, one weight at a time (the checks
        if cast or quantized_file:                      # read every page)
            release(v)
    check_state(sd, path, each=each)
    sd.pop(CHECKSUMS, None)
    args = checkpoint_config(sd, path)
    sd.pop("_config", None)
    check_sizes(sd, args, path)
    recipe = sd.pop("_quantization", None)
    recipe = None if recipe is None else json_object(recipe, "_quantization", path)
    with torch.device("meta"), no_init():
        model = Transformer(args)
    if recipe:  # quantized(model, recipe) swaps in the quantized modules (quantize.load_model passes its own)
        if quantized is None:
            raise ValueError(f"checkpoint {path} is quantized ({recipe.get('mode')}): load it with quantize.load_model")
        model = checked(lambda: quantized(model, recipe), path, "_quantization")
    model.quantization = recipe or None
    if args.tie_embeddings:
        sd.pop("output.weight", None)
    check_shapes(sd, model.state_dict(), path)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not (args.tie_embeddings and k == "output.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    if dtype is not None:  # (already cast in the state dict above: nothing left to copy)
        model = model.to(dtype=dtype)  # casts floating-point tensors only; quantized integer weights stay as they are
    return model.to(device).eval().requires_grad_(False)


def checkpoint_state(model: Transformer, quantization: Optional[dict] = None) -> dict:
    """The dict that load_model() reads back: weights (tied output dropped) + config (+ quantization recipe)."""
    sd = {k: v for k, v in model.state_dict().items() if not (model.config.tie_embeddings and k == "output.weight")}
    sd["_config"] = json.dumps(asdict(model.config))
    if quantization:
        sd["_quantization"] = json.dumps(quantization)
    return sd


def save_checkpoint(sd: dict, path) -> None:
    """Write atomically (common.atomic_path), so no half-written checkpoint is left behind, with every tensor's CRC32
    (validation.checksums: load_model verifies them). What load_model would refuse is never written: a "_config"
    that is no valid ModelArgs, a NaN or infinite weight."""
    if "_config" in sd:
        checked(lambda: ModelArgs.from_dict(json_object(sd["_config"], "_config", path)), path, "_config")
    sd = {k: v for k, v in sd.items() if k != CHECKSUMS}
    check_state(sd, path)
    sd[CHECKSUMS] = checksums(sd)
    with atomic_path(path) as tmp:
        torch.save(sd, str(tmp))
