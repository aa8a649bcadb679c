# generate.py: text generation from the command line on every backend (gpt-fast's generate.py): one batch of
# prompts, continuous batching (--full_batch_size), speculative / lookahead decoding, and multi-turn chat. The loop
# itself (sampling, backends, prefill, generate, the continuous-batching Engine) is engine.py's, shared with
# server.py, eval.py, speculative.py and bench.py.
# Deliberate lazy plugin import: make_decode_mode() imports speculative.py.
import sys
from pathlib import Path

from common import ArgumentParser, at_least, check_device, cli, peak_memory_mb, resolve_checkpoint, set_threads
import torch

import tp  # tensor parallelism under torchrun
from backends import add_backend_args, load_backend
from engine import Sampling, TorchBackend, check_vocab, generate, generate_continuous, weight_bytes
from quantize import load_model


def parse_args(argv=None):
    p = ArgumentParser(description="Generate text with a LLaMA-family model on any backend.")
    add_backend_args(p)
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default="Hello, my name is", help="several prompts separated by '|' run as one batch")
    prompts.add_argument("--prompts_file", type=Path, help="one prompt per line, run as one batch")
    p.add_argument("--chat", action="store_true", help="multi-turn chat with the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--num_samples", type=int, default=1, rule=at_least(1))
    p.add_argument("--max_new_tokens", type=int, default=200, rule=at_least(1))
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy", rule=at_least(0))
    p.add_argument("--top_k", type=int, default=200, rule=at_least(1))
    p.add_argument("--top_p", type=float, default=None, rule=("in (0, 1]", lambda v: 0 < v <= 1))
    p.add_argument("--seed", type=int, default=1234, rule=at_least(0))
    p.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="speculative decoding with this draft model (e.g. a quantize.py version of the target)")
    p.add_argument("--speculate_k", type=int, default=5, help="draft tokens per speculative step", rule=at_least(1))
    p.add_argument("--lookahead", default=None, metavar="NGRAM,WINDOW,GCAP", help="lookahead decoding (greedy)")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    p.add_argument("--ignore_eos", action="store_true", help="never stop at EOS: always --max_new_tokens (benchmarks)")
    return p.parse_args(argv)


def make_decode_mode(args, n_prompts: int):
    """Speculative (--draft_checkpoint_path) or lookahead (--lookahead) decoding from speculative.py, or None.
    Checks the flags. Returns fn(backend, draft, ids, run) -> (outputs, stats) that also prints the acceptance
    statistics; run: the keyword arguments of engine.generate (sampling, stop_ids, on_token, prefill_chunk)."""
    if not (args.draft_checkpoint_path or args.lookahead):
        return None
    import speculative as S  # lazy plugin import (speculative.py imports engine.py, not this file)
    if args.draft_checkpoint_path and args.lookahead:
        raise ValueError("choose one of --draft_checkpoint_path (speculative) and --lookahead")
    if n_prompts != 1 or args.full_batch_size:
        raise ValueError("speculative and lookahead decoding take one prompt (batch 1)")
    S.check_speculate_k(args.speculate_k)  # also sizes the cache below, whichever mode
    spec = S.parse_lookahead_spec(args.lookahead, args.temperature) if args.lookahead else None

    def run(backend, draft, ids, kw):
        kw = {k: v for k, v in kw.items() if k != "prefill_chunk"}
        device = torch.device(args.device)
        if spec:
            out, st = S.lookahead_generate(backend, ids[0], args.max_new_tokens, device, *spec,
                                           stop_ids=kw["stop_ids"], on_token=kw["on_token"])
        else:
            out, st = S.speculative_generate(backend, draft, ids[0], args.max_new_tokens, device, args.speculate_k,
                                             **kw)
        if not args.quiet:
            print(S.format_stats(st), file=sys.stderr)
        return [out], st
    return run


def read_prompts(args) -> list[str]:
    if args.prompts_file:
        if not args.prompts_file.is_file():
            raise FileNotFoundError(f"prompts file not found: {args.prompts_file}")
        prompts = [l for l in args.prompts_file.read_text().splitlines() if l.strip()]
        if not prompts:
            raise ValueError(f"prompts file {args.prompts_file} has no prompts")
        return prompts
    return args.prompt.split("|")


def main(argv=None) -> list[dict]:
    """Runs generate.py; returns each timed run's stats (bench.py reads them)."""
    args = parse_args(argv)
    check_device(args.device)
    set_threads(args.threads, log=lambda m: print(m, file=sys.stderr))  # common.py says how the default is chosen
    prompts = None if args.chat else read_prompts(args)
    decode_mode = None if args.chat else make_decode_mode(args, len(prompts))  # checks its flags before loading
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rank = tp.maybe_init_dist(device)  # None unless launched by torchrun with several processes
    if rank is not None:
        if args.aoti_package or args.pte or args.onnx or args.qpc:
            raise ValueError("torchrun (tensor parallelism) runs model.py checkpoints, not exported artifacts")
        if args.chat:
            raise ValueError("--chat is not supported under torchrun (tensor parallelism)")
        tp.rank0_only_output()  # rank 0 prints the text; other ranks' stderr is tagged "[rank N]"
        args.quiet = args.quiet or rank != 0
    with tp.rank0_first():  # rank 0 prepares the default checkpoint, if needed, before the others look
        resolve_checkpoint(args)
    from tokenizer import load_tokenizer
    tok = load_tokenizer(args.tokenizer_path)
    torch.manual_seed(args.seed)
    if args.chat:
        return chat(args, tok, device, dtype)

    ids = [tok.encode(p) for p in prompts]
    if any(len(x) == 0 for x in ids):
        raise ValueError("empty prompt (and the tokenizer adds no BOS): nothing to condition on")
    max_seq = args.max_seq_length or max(len(x) for x in ids) + args.max_new_tokens
    if decode_mode is not None:
        max_seq += args.speculate_k + 1  # a verification step may write past the last kept token
    backend = load_backend(args, device, dtype, args.full_batch_size or len(ids), max_seq)
    check_vocab(tok, backend)
    draft = (TorchBackend(load_model(args.draft_checkpoint_path, device=device, dtype=dtype), 1, max_seq,
                          compile=args.compile) if args.draft_checkpoint_path else None)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    stream = len(ids) == 1 and not args.full_batch_size
    runs = ([-1] if args.compile else []) + list(range(args.num_samples))
    if args.compile:
        log("compiling with Inductor (a warm-up run; minutes the first time, cached for later runs) ...")
    results = []
    for i in runs:
        gen = torch.Generator().manual_seed(args.seed + max(i, 0))
        decoder = tok.stream() if stream and i >= 0 else None
        if decoder is not None:
            print(prompts[0], end="", flush=True)
        on_token = (lambda b, t: print(decoder.put(t), end="", flush=True)) if decoder else None
        kw = dict(sampling=Sampling(args.temperature, args.top_k, args.top_p, gen),
                  stop_ids=() if args.ignore_eos else tok.stop_ids, on_token=on_token, prefill_chunk=args.prefill_chunk)
        if args.full_batch_size:
            out, st = generate_continuous(backend, ids, args.max_new_tokens, device, args.full_batch_size, **kw)
        elif decode_mode is not None:
            out, st = decode_mode(backend, draft, ids, kw)
        else:
            out, st = generate(backend, ids, args.max_new_tokens, device, **kw)
        if i < 0:
            log(f"compiled and warmed up in {st['ttft_s'] + st['decode_s']:.1f} s")
            continue
        if decoder is not None:
            print(decoder.flush(), flush=True)
        else:
            for p, o in zip(prompts, out):
                print(p + tok.decode(o) + "\n" + "-" * 40, flush=True)
        report(log, st, backend, device)
        results.append(st)
    if isinstance(backend, TorchBackend) and not args.compile and device.type == "cpu":
        log("hint: --compile decodes several times faster on CPU")
    return results


def report(log, st, backend, device):
    steps, model = st["decode_steps"], getattr(backend, "model", None)
    log(f"TTFT {st['ttft_s'] * 1000:.1f} ms | prefill {st['prefill_tok_s']:.1f} tok/s | "
        f"decode {st['decode_tok_s']:.2f} tok/s ({steps} steps) | {st['new_tokens']} new tokens | "
        f"{torch.get_num_threads()} threads")
    bandwidth = ""
    if model is not None and st["decode_s"] > 0 and steps:
        gb = weight_bytes(model) / 1e9
        bandwidth = f"weights {gb:.3f} GB | achieved bandwidth {gb * steps / st['decode_s']:.2f} GB/s | "
    log(f"{bandwidth}peak memory {peak_memory_mb(device):.0f} MB")


def chat(args, tok, device, dtype):
    """Multi-turn chat. The conversation is re-rendered with the chat template every turn; the tokens that are already
    in the KV cache (the common prefix) are not processed again."""
    max_seq = args.max_seq_length or 2048
    backend = load_backend(args, device, dtype, 1, max_seq)
    check_vocab(tok, backend)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    cached: list[int] = []
    gen = torch.Generator().manual_seed(args.seed)
    print(f"chat with the model ({backend.max_seq_length} tokens of context); empty line or Ctrl-D to quit",
          file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            print()  # the prompt's line ends
            break
        if not sys.stdin.isatty():  # piped input: echo it, so the transcript reads like a terminal session
            print(user)
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), bos=False)
        common = 0
        while common < min(len(cached), len(ids) - 1) and cached[common] == ids[common]:
            common += 1
        if len(ids) + 1 >= backend.max_seq_length:
            print("[context full: starting a new conversation]", file=sys.stderr)
            messages, cached, common = messages[-1:], [], 0
            ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), bos=False)
            if len(ids) + 1 >= backend.max_seq_length:
                raise ValueError(f"message of {len(ids)} tokens does not fit the context of {backend.max_seq_length}")
        decoder = tok.stream()
        out, st = generate(backend, [ids[common:]], args.max_new_tokens, device,
                           sampling=Sampling(args.temperature, args.top_k, args.top_p, gen), stop_ids=tok.stop_ids,
                           on_token=lambda b, t: print(decoder.put(t), end="", flush=True), start_pos=common)
        print(decoder.flush(), flush=True)
        # the cache now holds the prompt and every reply token except the last sampled one
        cached = ids + out[0][:-1] if out[0] else ids
        messages.append({"role": "assistant", "content": tok.decode(out[0])})
        if not args.quiet:
            print(f"[{st['new_tokens']} tokens, {st['decode_tok_s']:.1f} tok/s]", file=sys.stderr)


if __name__ == "__main__":
    cli(main)
