# Tensor parallelism for model.py's Transformer with torch.distributed, gpt-fast style: one process per device,
# every process holds 1/world of each attention and feed-forward matrix, two all-reduces per layer.
#
#     torchrun --standalone --nproc_per_node=2 generate.py --checkpoint_path checkpoints/NAME/model.pth --prompt "..."
#
# What is sharded (Megatron-style, no change to model.py):
#   attention.wqkv  column-parallel: rank r keeps the rows of its n_head/world query heads AND of its n_kv/world KV
#                   heads (q, k and v split separately, re-concatenated as [q_r; k_r; v_r]); biases with them.
#                   Query head h reads KV head h // (n_head/n_kv), so contiguous blocks of heads keep every GQA
#                   group on one rank (needs n_kv % world == 0).
#   attention.wo    row-parallel (input features = the rank's heads), output all-reduced (sum).
#   feed_forward.w1, w3  column-parallel (the rank's slice of the intermediate features); w2 row-parallel + all-reduce.
#   q_norm / k_norm (Qwen3) act per head with one shared weight: replicated. The per-rank KV cache holds n_kv/world
#   heads: apply_tp gives the model a per-rank copy of its config (n_head, n_local_heads, intermediate_size divided),
#   and Transformer.setup_caches reads n_local_heads from it.
#   Replicated: token embedding, output projection, norms, rotary tables. Every rank computes the full logits, so all
#   ranks sample the same token from the same seed (sampling in generate.py is on the CPU with a seeded generator).
#
# Quantized checkpoints (quantize.py) are sharded AFTER quantization, as stored: one file serves every world size and
# the sharded model computes what the unsharded quantized model computes (up to float summation order):
#   int8 (one scale per output channel): column-parallel keeps whole output rows with their scales; row-parallel splits
#        the input features, and each output row's scale multiplies every partial sum alike, so the all-reduced sum is
#        the same. (Quantizing each shard instead would give row-parallel shards their own scales: a different model
#        for every world size.)
#   int4 / int4-gptq (groups of G along in_features, packed within a group): column-parallel is exact; row-parallel
#        cuts at group boundaries, so the rank's input features (n_head*head_dim/world for wo,
#        intermediate_size/world for w2) must be a multiple of G.
#   8da4w (dynamic per-token int8 activations): the activation range is taken over the whole token row, so for the
#        row-parallel layers the per-token min/max is all-reduced (max) first, then each rank quantizes its slice
#        with the global parameters: the same numbers as one device.
#
# Collectives: torch.distributed._functional_collectives.all_reduce in forward hooks (what gpt-fast does): eager mode
# and torch.compile(fullgraph=True) both trace it. NCCL on CUDA, Gloo on CPU.
import contextlib
import dataclasses
import functools
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from common import check_device

__all__ = ["maybe_init_dist", "apply_tp", "load_model_tp", "is_rank0", "rank0_print", "rank0_only_output",
           "rank0_first", "get_rank", "get_world_size", "tp_launched"]


# ----------------------------------------------------------------------------------------------------------- process group
def tp_launched() -> bool:
    """True when this process was started by torchrun (or torch.distributed.run) with more than one process."""
    try:
        return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) and int(os.environ["WORLD_SIZE"]) > 1
    except ValueError:
        return False


def maybe_init_dist(device=None) -> Optional[int]:
    """Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK in the environment, WORLD_SIZE > 1) join the process group and
    return this process's rank; otherwise return None (a plain single-process run).

    device: what the run computes on ("cpu", "cuda", a torch.device or None = CUDA when available). CUDA: NCCL, and
    each process takes the GPU of its LOCAL_RANK (torch.cuda.set_device, so "cuda" below means that GPU); CPU: Gloo.
    Calling it again returns the rank of the group already joined."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if not tp_launched():
        return None
    if not dist.is_available():
        raise RuntimeError("launched by torchrun but this PyTorch build has no torch.distributed")
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        check_device("cuda")
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise ValueError(f"local rank {local_rank} has no GPU: this node has {n}; "
                             f"use --nproc_per_node {n} or fewer")
        torch.cuda.set_device(local_rank)
        backend, kw = "nccl", {"device_id": torch.device("cuda", local_rank)}  # binds the GPU, eager NCCL init
    elif device.type == "cpu":
        if not dist.is_gloo_available():
            raise RuntimeError("tensor parallelism on the CPU needs the Gloo backend, which this PyTorch lacks")
        backend, kw = "gloo", {}
    else:
        raise ValueError(f"tensor parallelism runs on cuda (NCCL) or cpu (Gloo), not {device.type}")
    dist.init_process_group(backend=backend, rank=rank, world_size=world, **kw)
    import atexit
    atexit.register(_destroy)
    return rank


def _destroy():
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort at interpreter exit
            pass


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_rank0() -> bool:
    return get_rank() == 0


def rank0_print(*args, **kwargs):
    if is_rank0():
        print(*args, **kwargs)


class _Prefixed:
    """A text stream that prefixes every line with a tag (for the stderr of ranks other than 0)."""

    def __init__(self, stream, tag: str):
        self._stream, self._tag, self._line = stream, tag, ""

    def write(self, s: str) -> int:
        """Whole lines only, each in one write (print's text and its newline come in two calls; another rank's line
        written in between ran into this one, unbuffered under torchrun); flush() writes a partial line."""
        lines = (self._line + s).splitlines(keepends=True)
        self._line = lines.pop() if lines and not lines[-1].endswith("\n") else ""
        if lines:
            self._stream.write("".join(self._tag + line for line in lines))
        return len(s)

    def flush(self):
        if self._line:
            self._stream.write(self._tag + self._line)
            self._line = ""
        self._stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def rank0_only_output():
    """On ranks other than 0: stdout goes to /dev/null (only rank 0 prints the text), stderr lines get a
    "[rank N] " prefix (warnings and errors of every rank stay visible, and rank 0's `error: ...` line is the only one
    that starts with "error:"). No-op on rank 0 and outside torchrun."""
    r = get_rank()
    if r != 0 and not isinstance(sys.stderr, _Prefixed):
        sys.stdout = open(os.devnull, "w")
        sys.stderr = _Prefixed(sys.stderr, f"[rank {r}] ")


@contextlib.contextmanager
def rank0_first():
    """Rank 0 runs the block first (e.g. preparing the default checkpoint), the other ranks after it is done."""
    multi = get_world_size() > 1
    if multi and get_rank() != 0:
        dist.barrier()
    yield
    if multi and get_rank() == 0:
        dist.barrier()


# ----------------------------------------------------------------------------------------------------------- sharding
def _linear_parts(m: nn.Module) -> str:
    """"float" for nn.Linear, "quant" for qops.py's QuantizedLinear; raises for anything else."""
    if isinstance(m, nn.Linear):
        return "float"
    from qops import QuantizedLinear  # lazy: generate.py imports tp.py, and float models never need qops.py
    if isinstance(m, QuantizedLinear):
        return "quant"
    raise ValueError(f"tensor parallelism cannot shard a {type(m).__name__} (only nn.Linear and qops.py's "
                     f"QuantizedLinear)")


def _take(t: Optional[Tensor], dim: int, index: Tensor) -> Optional[Tensor]:
    """A fresh contiguous copy of t's slice (so the full tensor, often an mmap of the checkpoint, can be freed)."""
    if t is None:
        return None
    return t.index_select(dim, index.to(t.device)).clone()


def _shard_rows(m: nn.Module, rows: Tensor):
    """Keep output features `rows` of a linear layer (column parallelism): weights, scales, zeros and bias alike."""
    if _linear_parts(m) == "float":
        m.weight = nn.Parameter(_take(m.weight.data, 0, rows), requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(_take(m.bias.data, 0, rows), requires_grad=False)
        m.out_features = len(rows)
        return
    qw = m.qweight
    qw.qdata = _take(qw.qdata, 0, rows)
    qw.scales = _take(qw.scales, 0, rows)
    if qw.zeros is not None:
        qw.zeros = _take(qw.zeros, 0, rows)
    if m.bias is not None:
        m.bias = nn.Parameter(_take(m.bias.data, 0, rows), requires_grad=False)
    qw.out_features = m.out_features = len(rows)


def _shard_cols(m: nn.Module, start: int, end: int, rank: int):
    """Keep input features [start, end) of a linear layer (row parallelism). A bias is added once, on rank 0."""
    n = end - start
    if _linear_parts(m) == "float":
        m.weight = nn.Parameter(m.weight.data[:, start:end].clone(), requires_grad=False)
        m.in_features = n
    else:
        qw = m.qweight
        if qw.bits == 8:   # per output channel: scales untouched
            qw.qdata = qw.qdata[:, start:end].clone()
        else:              # groups of G along the input, two values per byte inside a group
            G = qw.groupsize
            qw.qdata = qw.qdata[:, start // 2:end // 2].clone()
            qw.scales = qw.scales[:, start // G:end // G].clone()
            if qw.zeros is not None:
                qw.zeros = qw.zeros[:, start // G:end // G].clone()
        qw.in_features = m.in_features = n
    if m.bias is not None and rank != 0:
        m.bias = None


def _all_reduce_hook(group):
    from torch.distributed import _functional_collectives as funcol

    def hook(module, inputs, output):
        return funcol.all_reduce(output, "sum", group)
    return hook


def _global_act_quant(group):
    """The activation quantizer of a row-parallel QuantizedLinear with dynamic per-token int8 activations (8da4w, its
    act_quant): qops.fake_quant_per_token_int8 on the rank's slice with the range of the WHOLE token row (min/max
    all-reduced), as one device would."""
    from torch.distributed import _functional_collectives as funcol
    from qops import fake_quant_per_token_int8

    def row_range(lo, hi):
        m = funcol.all_reduce(torch.cat((hi, -lo), dim=-1), "max", group)
        return -m[..., 1:], m[..., :1]
    return functools.partial(fake_quant_per_token_int8, row_range=row_range)


def _check_quant_cols(m: nn.Module, name: str, per_rank: int, world: int):
    if _linear_parts(m) == "quant" and m.qweight.bits == 4 and per_rank % m.qweight.groupsize:
        raise ValueError(f"cannot shard {name} over {world} ranks: its {per_rank * world} int4 input features split "
                         f"into {per_rank} per rank, not a multiple of the group size {m.qweight.groupsize} "
                         f"(quantize with a smaller --groupsize or use fewer ranks)")


def check_tp(model: nn.Module, world_size: int):
    """Raise ValueError (before anything is modified) when the model cannot be split over world_size ranks."""
    c = model.config
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    if getattr(model, "tp_world_size", 1) != 1:
        raise ValueError("model is already sharded for tensor parallelism")
    for what, n in (("query heads (n_head)", c.n_head), ("KV heads (n_local_heads)", c.n_local_heads),
                    ("intermediate_size", c.intermediate_size)):
        if n % world_size:
            raise ValueError(f"cannot shard the model over {world_size} ranks: its {n} {what} do not divide by "
                             f"{world_size}; use a world size that divides n_head={c.n_head}, "
                             f"n_local_heads={c.n_local_heads} and intermediate_size={c.intermediate_size}")
    blocks = (c.n_experts or not c.mlp_gated or c.mlp_bias or c.attn_out_bias or c.alibi or c.parallel_attn
              or c.learned_pos)
    if world_size > 1 and blocks:
        raise ValueError(f"tensor parallelism does not shard this model's blocks yet ({c.family or 'this family'}: "
                         "mixture of experts, plain MLP, biases on row-parallel linears, ALiBi slopes, parallel "
                         "attention or learned positions); run it on one rank")
    for i, layer in enumerate(model.layers):
        a, f = layer.attention, layer.feed_forward
        for name, m in ((f"layers.{i}.attention.wqkv", a.wqkv), (f"layers.{i}.attention.wo", a.wo),
                        (f"layers.{i}.feed_forward.w1", f.w1), (f"layers.{i}.feed_forward.w3", f.w3),
                        (f"layers.{i}.feed_forward.w2", f.w2)):
            _linear_parts(m)
        _check_quant_cols(a.wo, f"layers.{i}.attention.wo", a.n_head * a.head_dim // world_size, world_size)
        _check_quant_cols(f.w2, f"layers.{i}.feed_forward.w2", c.intermediate_size // world_size, world_size)


def apply_tp(model: nn.Module, rank: Optional[int] = None, world_size: Optional[int] = None, group=None) -> nn.Module:
    """Shard model.py's Transformer in place for tensor parallelism; returns it.

    rank / world_size default to the joined process group's (maybe_init_dist). Call after load_model and before
    setup_caches (TorchBackend calls that); then move it to the device: sharding on the CPU first keeps only 1/world
    of the layers on each GPU. With world_size 1 nothing changes. Raises ValueError, with the model untouched, when
    n_head, n_local_heads or intermediate_size do not divide by the world size (or an int4 row-parallel shard would
    cut a quantization group)."""
    if rank is None:
        rank = get_rank()
    if world_size is None:
        world_size = get_world_size()
    check_tp(model, world_size)
    if world_size == 1:
        return model
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("apply_tp needs the process group: call tp.maybe_init_dist() first (under torchrun)")
    if group is None:
        group = dist.group.WORLD
    W, r = world_size, rank
    c = model.config
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        D, nh, nkv = a.head_dim, a.n_head, a.n_kv
        qh, kvh = nh // W, nkv // W
        q_rows = torch.arange(r * qh * D, (r + 1) * qh * D)
        kv_rows = torch.arange(r * kvh * D, (r + 1) * kvh * D)
        rows = torch.cat((q_rows, nh * D + kv_rows, (nh + nkv) * D + kv_rows))
        _shard_rows(a.wqkv, rows)
        _shard_cols(a.wo, r * qh * D, (r + 1) * qh * D, r)
        a.n_head, a.n_kv = qh, kvh
        I = f.w1.out_features
        ffn_rows = torch.arange(r * I // W, (r + 1) * I // W)
        _shard_rows(f.w1, ffn_rows)
        _shard_rows(f.w3, ffn_rows)
        _shard_cols(f.w2, r * I // W, (r + 1) * I // W, r)
        for m in (a.wo, f.w2):
            if getattr(m, "act", None) == "int8":       # 8da4w: activation range over the whole row
                m.act_quant = _global_act_quant(group)
            m.register_forward_hook(_all_reduce_hook(group))
    # setup_caches sizes the KV cache from config.n_local_heads: a per-rank copy of the config (model.py untouched)
    model.tp_full_config = c
    model.config = dataclasses.replace(c, n_head=c.n_head // W, n_local_heads=c.n_local_heads // W,
                                       intermediate_size=c.intermediate_size // W, head_dim=c.head_dim)
    model.tp_rank, model.tp_world_size = r, W
    if model.max_seq_length > 0:  # caches made before sharding hold every head: remake them per rank
        model.setup_caches(model.max_batch_size, model.max_seq_length)
    return model


def load_model_tp(checkpoint_path, device="cpu", dtype: Optional[torch.dtype] = None) -> nn.Module:
    """checkpoint.load_model + apply_tp for this rank: the checkpoint is memory-mapped on the CPU, this rank's slices are
    copied out, and only they (plus the replicated embedding, output and norms) move to the device and dtype, so no
    device ever holds the whole model. Integer (quantized) tensors keep their dtype, as in load_model."""
    from quantize import load_model
    model = apply_tp(load_model(checkpoint_path, device="cpu"))
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model.to(device)
