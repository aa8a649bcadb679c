#!/usr/bin/env python
"""A checkpoint of a published shape (model_configs.transformer_configs) with seeded random weights and the default
model's tokenizer, for measuring speed and memory at sizes no model hub is needed for (they do not depend on the
weights' values). The vocabulary is the default model's (SmolLM2's 49152 tokens), so every tokenizer-facing stage
works; the rest of the shape is the named model's.

    python scripts/random_checkpoint.py Llama-3.2-1B checkpoints/Llama-3.2-1B-random [--dtype bfloat16] [--seed 0]

Weights are N(0, 0.02) (norms 1), as model.py's Transformer holds them; writes model.pth + the tokenizer files.
"""
import shutil
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from common import TOKENIZER_FILES, ArgumentParser, cli, default_checkpoint  # noqa: E402
from checkpoint import checkpoint_state, save_checkpoint  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from model_configs import transformer_configs  # noqa: E402


def random_checkpoint(name: str, out_dir: Path, dtype=torch.float32, seed: int = 0, log=print) -> Path:
    """Write out_dir/model.pth (and the default model's tokenizer files) unless it is there. Returns its path."""
    out = Path(out_dir) / "model.pth"
    if out.is_file():
        return out
    source = default_checkpoint().parent
    vocab = ModelArgs.from_name("SmolLM2-135M").vocab_size
    args = replace(ModelArgs.from_name(name), vocab_size=vocab, tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(args)
    n = sum(p.numel() for p in model.parameters())  # (tied: the table once)
    log(f"writing {out}: {name}'s shape, {n / 1e9:.2f} B parameters of {dtype}, seed {seed} ...")
    torch.manual_seed(seed)
    model = model.to(dtype).to_empty(device="cpu")  # (in dtype from the start: an 8B in bfloat16 is 15 GB, not 30)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.fill_(1.0) if pname.endswith("norm.weight") else p.normal_(0, 0.02)
    model.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        if (source / f).is_file():
            shutil.copyfile(source / f, out.parent / f)
    save_checkpoint(checkpoint_state(model), out)
    return out


def main(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", choices=sorted(transformer_configs), metavar="NAME", help="a named config, e.g. Llama-3.2-1B")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    random_checkpoint(a.name, a.out_dir, getattr(torch, a.dtype), a.seed)


if __name__ == "__main__":
    cli(main)
