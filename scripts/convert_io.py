"""What every reader of scripts/convert_checkpoint.py shares, and its writer: ConvertError, Source (a checkpoint as
read: config, tensor loaders, tokenizer writer), safe .pth loading, the check that a tensor is what its format
claims (floating-point, finite), and publish(): every output file staged, checked, then moved into place, so a
failed conversion leaves the previous one whole (llama.cpp's and safetensors' rule: never leave less than before).
"""
import dataclasses
import json
import os
import pickle
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import TOKENIZER_FILES, temp_dir  # noqa: E402
from checkpoint import save_checkpoint  # noqa: E402
from model import ModelArgs  # noqa: E402


class ConvertError(Exception):
    pass


@dataclasses.dataclass
class Source:
    args: ModelArgs
    names: dict            # canonical -> source name template
    tensors: dict          # source name -> zero-argument loader returning a torch tensor
    dtype: torch.dtype     # float dtype of the source weights
    permute: bool          # Q/K stored in the adjacent-pair rotary layout
    tied: object = None    # True/False from a config; None = tied when output is absent or equals the embedding
    tokenizer: object = None  # callable(out_dir) writing the tokenizer files
    ignore: tuple = ()     # source tensors that are not needed (e.g. rotary tables)
    norm_offset: float = 0.0  # added to every RMSNorm weight (Gemma's x * (1 + w))


def torch_load(path: Path):
    try:
        try:
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # legacy (non-zip) files cannot be memory-mapped
                raise
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if found:
            raise ConvertError(f"{path} holds non-tensor Python objects ({found.group(1)}) that cannot be loaded "
                               f"safely (weights_only=True); re-save it with only tensors and plain containers") from None
        raise ConvertError(f"cannot read {path}: not a valid PyTorch file (unpickling failed)") from None
    except Exception as e:
        raise ConvertError(f"cannot read {path}: not a valid PyTorch file ({type(e).__name__}: {_oneline(e)})") from None


def _oneline(e, n=200):
    s = " ".join(str(e).split())
    return s[:n] + ("..." if len(s) > n else "")


def _require(d: dict, keys, where):
    missing = [k for k in keys if k not in d]
    if missing:
        raise ConvertError(f"{where} lacks {', '.join(missing)}")


def checked_weight(name: str, t) -> torch.Tensor:
    """A source tensor as its format claims a weight is: a floating-point tensor of finite values. An integer tensor
    is refused, never cast (an int32 embedding once made the whole checkpoint int32)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        kind = str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else type(t).__name__
        raise ConvertError(f"tensor {name} is {kind}: weights must be floating-point")
    if t.numel() and not all(map(lambda x: torch.isfinite(x).item(), torch.aminmax(t))):
        raise ConvertError(f"tensor {name} holds NaN or infinite values")
    return t


def publish(out: Path, sd: dict, config: dict, tokenizer=None) -> list:
    """Write model.pth, config.json and the tokenizer files (tokenizer(dir) writes them) into a folder beside `out`,
    check them (the tokenizer files are parsed: tokenizer.load_tokenizer), then move each onto out/; when this
    conversion has a tokenizer, the tokenizer files of a previous one that it lacks are removed. Any failure before the moves leaves out/
    as it was. Returns the names published."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with temp_dir(out.parent, f".{out.name}.", ".tmp") as stage:
        save_checkpoint(sd, stage / "model.pth")
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer:
            tokenizer(stage)
        names = sorted(p.name for p in stage.iterdir())
        tokenizer_written = bool(set(names) & {"tokenizer.json", "tokenizer.model", "tokenizer.tiktoken"})
        if tokenizer_written:
            from tokenizer import load_tokenizer
            try:
                load_tokenizer(stage)
            except Exception as e:
                raise ConvertError(f"the source's tokenizer files do not load ({_oneline(e)}); nothing was written")
        out.mkdir(exist_ok=True)
        for name in names:
            os.chmod(stage / name, 0o644)
            os.replace(stage / name, out / name)
        for stale in set(TOKENIZER_FILES) - set(names) if tokenizer_written else ():  # they would shadow the new
            (out / stale).unlink(missing_ok=True)
    return names
