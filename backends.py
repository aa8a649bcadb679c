# backends.py: the backend a command line names, for generate.py, server.py, eval.py and bench.py: model.py's network
# (eager or --compile, engine.TorchBackend), an AOT Inductor package, an ExecuTorch .pte, an ONNX graph on ONNX
# Runtime or a Cloud AI 100 QPC. Each exporter's backend class is imported only when its flag is given.
from pathlib import Path

import torch

import tp  # tensor parallelism under torchrun
from common import DEFAULT_CHECKPOINT, REPO, THREADS, ArgumentParser, at_least, available_memory, checkpoint_file
from checkpoint import checkpoint_config
from engine import TorchBackend
from quantize import load_model

RUNTIME_BYTES = 300 << 20  # Python and PyTorch's own libraries, before any tensor


def load_backend(args, device, dtype, max_batch_size, max_seq_length):
    """Pick the backend from the command line. Exported artifacts carry their own sizes and precision."""
    mode = getattr(args, "mode", None) or ("lookahead" if getattr(args, "lookahead", None) else "kv")
    if getattr(args, "aoti_package", None):
        from aoti_export import AOTIBackend
        return AOTIBackend(args.aoti_package, device=device, mode=mode)
    if getattr(args, "pte", None):
        from pte_backend import PTEBackend
        return PTEBackend(args.pte, mode=mode)
    if getattr(args, "onnx", None):
        from onnx_backends import OnnxBackend
        return OnnxBackend(args.onnx, max_batch_size=max_batch_size)
    if getattr(args, "qpc", None):
        from onnx_backends import QpcBackend
        return QpcBackend(args.qpc, device_group=args.device_group)
    if tp.get_world_size() > 1:  # under torchrun: this rank's shard of every attention / feed-forward matrix
        model = tp.load_model_tp(args.checkpoint_path, device=device, dtype=dtype)
    else:
        if device.type == "cpu":
            check_fits(args.checkpoint_path, dtype, max_batch_size, max_seq_length)
        model = load_model(args.checkpoint_path, device=device, dtype=dtype)
    return TorchBackend(model, max_batch_size, max_seq_length, compile=args.compile)


def memory_needed(checkpoint_path, dtype, max_batch_size: int, max_seq_length: int) -> tuple[int, int]:
    """(weights, KV cache) bytes that running a checkpoint takes at least: its floating-point tensors at dtype (the
    rest as stored), the cache of max_batch_size x max_seq_length positions. Reads the file's index, not its data."""
    path = checkpoint_file(checkpoint_path)
    sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    args = checkpoint_config(sd, path)
    size = lambda t: t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
    weights = sum(size(t) for t in sd.values() if isinstance(t, torch.Tensor))
    kv_dtype = dtype or next((t.dtype for t in sd.values() if isinstance(t, torch.Tensor) and t.is_floating_point()),
                             torch.float32)
    kv = 2 * args.n_layer * max_batch_size * args.n_local_heads * args.head_dim * max_seq_length * kv_dtype.itemsize
    return weights, kv


def check_fits(checkpoint_path, dtype, max_batch_size: int, max_seq_length: int) -> None:
    """Refuse, before loading, a model that cannot fit in the memory this machine has free (MemAvailable): one line
    with what it needs and what there is. A file that cannot be read is left for load_model to report."""
    free = available_memory()
    try:
        weights, kv = memory_needed(checkpoint_path or DEFAULT_CHECKPOINT, dtype, max_batch_size, max_seq_length)
    except Exception:  # noqa: BLE001 - load_model names what is wrong with the file
        return
    if free is not None and weights + kv + RUNTIME_BYTES > free:
        at = f" at {str(dtype).removeprefix('torch.')}" if dtype is not None else ""
        raise ValueError(f"{checkpoint_path or DEFAULT_CHECKPOINT} needs about {(weights + kv + RUNTIME_BYTES) / 1e9:.1f} GB"
                          f"{at} (weights {weights / 1e9:.1f} GB, KV cache {kv / 1e9:.1f} GB, PyTorch "
                          f"{RUNTIME_BYTES / 1e9:.1f} GB) and this machine has {free / 1e9:.1f} GB available: quantize "
                          "it (quantize.py) or shorten --max_seq_length")


def add_backend_args(p: ArgumentParser):
    """The flags that pick and size a backend (load_backend); server.py takes the same."""
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help=f"model.pth from scripts/convert_checkpoint.py or quantize.py (default: {DEFAULT_CHECKPOINT.relative_to(REPO)}, prepared on first use)")
    p.add_argument("--tokenizer_path", type=Path, default=None, help="default: the checkpoint's directory")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step and the prompts' blocks")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"])
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: the cores not busy with other work; README: Threads)", rule=THREADS)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max_seq_length", type=int, default=None,
                   help="KV cache length (default: prompt + new tokens; server.py: 2048)", rule=at_least(1))
    p.add_argument("--prefill_chunk", type=int, default=None, help="process prompts in fixed chunks of N tokens", rule=at_least(1))
    p.add_argument("--full_batch_size", type=int, default=None,
                   help="continuous batching with N cache slots (more prompts/requests than slots: slots are refilled)", rule=at_least(1))
    p.add_argument("--aoti_package", "--dso", type=Path,
                   help="run an AOT Inductor .pt2 (or a .so from aoti_export.py --so) from aoti_export.py")
    p.add_argument("--pte", type=Path, help="run an ExecuTorch .pte from et_export.py")
    p.add_argument("--onnx", type=Path, help="run an ONNX graph from export_onnx.py on ONNX Runtime")
    p.add_argument("--qpc", type=Path, help="run a Cloud AI 100 QPC from compile_qaic.py")
    p.add_argument("--device_group", default="0", help="Cloud AI 100 device ids for --qpc, e.g. 0,1")
