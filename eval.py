# Perplexity of a text file with a sliding window, for any checkpoint (float or quantized) and, through engine.py's
# backend protocol, for exported artifacts (--pte, --aoti_package, --onnx) whose forward returns every position.
#
#     python eval.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model_int4.g32.pth --text_file some.txt
#     python eval.py --checkpoint_path ... --text_file some.txt --max_seq_length 512 --stride 256
#
# Windows (the Hugging Face "perplexity of fixed-length models" recipe): a window of max_seq_length tokens starts
# every `stride` tokens; each window scores only the tokens that no earlier window scored, with everything before them
# in the window as context, so with stride < max_seq_length every token but the first is scored exactly once. With
# stride = max_seq_length (disjoint windows) the first token of each window has no context and is not scored, as in
# the HF recipe. Each window is a fresh sequence at positions 0.. (the KV cache is simply overwritten).
#
# --mode runs the programs of the runners' decoding modes (the three-phase check of ExecuTorch's LLM example: the
# float checkpoint, the quantized one, the exported program, each in every mode, must give the same perplexity):
#     kv         forward, each window in one call
#     hybrid     the fixed-length prefill program (an artifact exported with --prefill_chunk N; for a checkpoint,
#                --prefill_chunk N), chunks of N, the last one padded
#     lookahead  the lookahead contract (speculative.py's forward_masked) with causal masks: model.py through
#                StepCache, or the `lookahead` program of an artifact exported with --lookahead
import math
import sys
import time
from pathlib import Path
from typing import Optional

from common import THREADS, ArgumentParser, at_least, check_device, cli, resolve_checkpoint, set_threads
import torch

from backends import load_backend


def check_windows(max_seq_length: int, stride: Optional[int], n_tokens: Optional[int] = None) -> None:
    """The one check of the window settings (main() runs it on the flags before anything loads)."""
    if max_seq_length < 2:
        raise ValueError(f"--max_seq_length must be at least 2, got {max_seq_length}")
    if stride is not None and not 1 <= stride <= max_seq_length:
        raise ValueError(f"--stride must be between 1 and --max_seq_length ({max_seq_length}), got {stride}")
    if n_tokens is not None and n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to measure perplexity, got {n_tokens}")


def sliding_windows(n_tokens: int, max_seq_length: int, stride: int) -> list:
    """[(begin, end, n_scored)]: the window is tokens[begin:end]; its last n_scored positions are scored, i.e. tokens
    end - n_scored .. end - 1 are predicted (token 0 never is: nothing precedes it)."""
    check_windows(max_seq_length, stride, n_tokens)
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_seq_length, n_tokens)
        n_scored = end - max(prev_end, begin + 1)  # the window's first token has no prediction
        if n_scored > 0:
            out.append((begin, end, n_scored))
        prev_end = end
        if end == n_tokens:
            break
    return out


def window_logits(backend, tokens: list, device, mode: str = "kv") -> torch.Tensor:
    """All-position logits [T, V] of one sequence through a backend (positions 0..T-1). Fixed-shape backends
    (prefill_chunk N) get chunks of exactly N tokens, the last one padded with position -1. mode "lookahead": one
    forward_masked call with a causal mask."""
    T = len(tokens)
    chunk = getattr(backend, "prefill_chunk", None)
    ids = torch.tensor(tokens, dtype=torch.long)
    if mode == "lookahead":
        from speculative import causal_mask
        logits = backend.forward_masked(ids.view(1, T).to(device), torch.arange(T, device=device),
                                        causal_mask(range(T), backend.max_seq_length).to(device))
        _check_all_positions(logits, T)
        return logits[0]
    if not chunk:
        logits = backend.forward(ids.view(1, T).to(device), torch.arange(T, device=device))
        _check_all_positions(logits, T)
        return logits[0]
    outs = []
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        tok = torch.zeros(1, chunk, dtype=torch.long)
        pos = torch.full((1, chunk), -1, dtype=torch.long)
        tok[0, :e - s], pos[0, :e - s] = ids[s:e], torch.arange(s, e)
        logits = backend.forward(tok.to(device), pos.to(device))
        _check_all_positions(logits, chunk)
        outs.append(logits[0, :e - s])
    return torch.cat(outs, 0)


def _check_all_positions(logits: torch.Tensor, T: int):
    if logits.dim() != 3 or logits.shape[1] != T:
        raise ValueError(f"this backend returns logits of shape {tuple(logits.shape)} for {T} tokens (only the last "
                         f"position): perplexity needs the logits of every position; export a graph that returns all "
                         f"of them, or evaluate the checkpoint")


@torch.no_grad()
def perplexity(backend, ids: list, max_seq_length: int, stride: Optional[int] = None, device="cpu",
               progress: bool = False, mode: str = "kv") -> dict:
    """Sliding-window perplexity of token ids. Returns ppl, nll (mean, nats), tokens (scored), processed, seconds,
    tok_s (processed tokens per second) and windows: [(begin, end, n_scored, nll_sum)]."""
    device = torch.device(device)
    max_seq_length = min(max_seq_length, backend.max_seq_length)
    stride = stride or max(1, max_seq_length // 2)
    wins = sliding_windows(len(ids), max_seq_length, stride)
    total, scored, processed, per_window = 0.0, 0, 0, []
    t0 = time.perf_counter()
    for i, (b, e, k) in enumerate(wins):
        logits = window_logits(backend, ids[b:e], device, mode).float()
        logp = torch.log_softmax(logits[-k - 1:-1], dim=-1)          # predictions for tokens e-k .. e-1
        target = torch.tensor(ids[e - k:e], device=logp.device)
        nll = -logp.gather(-1, target[:, None]).double().sum().item()
        per_window.append((b, e, k, nll))
        total, scored, processed = total + nll, scored + k, processed + (e - b)
        if progress:
            print(f"\rwindow {i + 1}/{len(wins)}: ppl so far {math.exp(total / scored):.4f}", end="", file=sys.stderr,
                  flush=True)
    if progress:
        print(file=sys.stderr)
    dt = time.perf_counter() - t0
    return dict(ppl=math.exp(total / scored), nll=total / scored, tokens=scored, processed=processed, seconds=dt,
                tok_s=processed / dt if dt > 0 else float("inf"), windows=per_window)


def parse_args(argv=None):
    p = ArgumentParser(description="Sliding-window perplexity of a text file.")
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help="model.pth (float or quantized); default: the default model")
    p.add_argument("--text_file", type=Path, required=True, help="UTF-8 text to score")
    p.add_argument("--tokenizer_path", type=Path, default=None, help="default: the checkpoint's directory")
    p.add_argument("--max_seq_length", type=int, default=512, help="window length in tokens (default 512)", rule=at_least(1))
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: half a window)", rule=at_least(1))
    p.add_argument("--max_tokens", type=int, default=None, help="score only the first N tokens of the text (N >= 2)", rule=at_least(2))
    p.add_argument("--bos", choices=["auto", "yes", "no"], default="auto",
                   help="prepend BOS (auto: the tokenizer's default)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"])
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the cores not busy with other work)", rule=THREADS)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--compile", action="store_true", help="torch.compile the blocks (dynamic length)")
    p.add_argument("--mode", default="kv", choices=["kv", "hybrid", "lookahead"],
                   help="the program of a runner decoding mode (-M): forward, the fixed-length prefill, lookahead")
    p.add_argument("--prefill_chunk", type=int, default=None,
                   help="--mode hybrid on a checkpoint: the chunk length (an artifact carries its own)", rule=at_least(1))
    p.add_argument("--aoti_package", type=Path, help="an AOT Inductor .pt2 from aoti_export.py")
    p.add_argument("--pte", type=Path, help="an ExecuTorch .pte from et_export.py")
    p.add_argument("--onnx", type=Path, help="an ONNX graph from export_onnx.py")
    p.add_argument("--qpc", type=Path, help="a Cloud AI 100 QPC from compile_qaic.py")
    p.add_argument("--device_group", default="0")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)  # flag values and paths checked here (common.ArgumentParser)
    if not args.text_file.is_file():
        raise ValueError(f"--text_file {args.text_file} is not a file")
    check_device(args.device)
    set_threads(args.threads, log=lambda m: print(m, file=sys.stderr))
    check_windows(args.max_seq_length, args.stride)
    if args.mode == "hybrid" and not (args.pte or args.aoti_package or args.prefill_chunk):
        raise ValueError("--mode hybrid: give --prefill_chunk N (or a .pte / .pt2 exported with --prefill_chunk N)")
    if args.mode != "kv" and (args.onnx or args.qpc):
        raise ValueError(f"--mode {args.mode} runs checkpoints, .pte and .pt2 programs (ONNX / QPC: --mode kv)")
    exported = args.aoti_package or args.pte or args.onnx or args.qpc
    resolve_checkpoint(args)
    from tokenizer import load_tokenizer
    tok = load_tokenizer(args.tokenizer_path)
    text = args.text_file.read_text(encoding="utf-8")
    ids = tok.encode(text, bos=None if args.bos == "auto" else args.bos == "yes")
    if args.max_tokens is not None:
        ids = ids[:args.max_tokens]
    check_windows(args.max_seq_length, args.stride, len(ids))
    device = torch.device(args.device)
    t0 = time.perf_counter()
    backend = load_backend(args, device, getattr(torch, args.dtype), 1, args.max_seq_length)
    if args.mode == "hybrid" and not (args.pte or args.aoti_package):
        backend.prefill_chunk = args.prefill_chunk
    load_s = time.perf_counter() - t0
    if backend.max_seq_length < args.max_seq_length:
        print(f"note: the backend holds {backend.max_seq_length} tokens: windows of {backend.max_seq_length}",
              file=sys.stderr)
    r = perplexity(backend, ids, args.max_seq_length, args.stride, device, progress=not args.quiet, mode=args.mode)
    what = exported or args.checkpoint_path
    window = min(args.max_seq_length, backend.max_seq_length)
    what = f"{what}{'' if args.mode == 'kv' else ' (' + args.mode + ')'}"
    print(f"{what}: perplexity {r['ppl']:.4f} (nll {r['nll']:.5f}) over {r['tokens']} tokens | window {window}, "
          f"stride {args.stride or max(1, window // 2)}, {len(r['windows'])} windows | {r['processed']} tokens in "
          f"{r['seconds']:.1f} s = {r['tok_s']:.1f} tok/s (load {load_s:.1f} s)")
    return r


if __name__ == "__main__":
    cli(main)
