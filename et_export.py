# et_export.py: model.py's Transformer as an ExecuTorch .pte (XNNPACK delegate by default; portable, QNN, Core ML,
# MPS), for runner-et/ and generate.py --pte (pte_backend.py). The .pte's methods are export_pte's contract.
#
#   python et_export.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --output_path smollm2.pte \
#       [--quantize 8da4w --groupsize 32] [--max_seq_length 1024] [--backend xnnpack|portable|qnn|coreml|mps]
#
# Spellings of ExecuTorch's own docs work too: -d fp32|fp16|bf16 (= --dtype; XNNPACK has fp16 kernels, no bf16),
# --quant (= --quantize), -xnnpack / -coreml / --mps (= --backend), --out-path (= --output_path).
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Optional

from common import GROUPSIZES, ArgumentParser, at_least, atomic_path, cli, first_line, one_of, resolve_checkpoint
import torch
from torch import Tensor, nn

import et_passes
import qexport
import qops
from pte_backend import PTEBackend  # noqa: F401  (re-exported for older callers)

BACKENDS = ("xnnpack", "portable", "qnn", "coreml", "mps")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_MAX_SEQ_LENGTH = 1024


# ------------------------------------------------------------------------------------------------ export-time swaps
class _DirectCache(nn.Module):
    """KVCache for export (the kv_cache swap point): batch 1, shared positions [T]; writes into the cache's own
    buffers (no [:B] view), which ExecuTorch turns into an in-place index_put_ on the mutable buffer."""

    def __init__(self, cache):
        super().__init__()
        self.register_buffer("k_cache", cache.k_cache, persistent=False)
        self.register_buffer("v_cache", cache.v_cache, persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, batch_index: Optional[Tensor] = None):
        assert batch_index is None and input_pos.dim() == 1, "the .pte takes positions [T] and one sequence"
        self.k_cache.index_copy_(2, input_pos, k.contiguous())  # contiguous: no stride guards on the dynamic length
        self.v_cache.index_copy_(2, input_pos, v.contiguous())
        return self.k_cache, self.v_cache


class _RMSNorm4D(nn.Module):
    """model.RMSNorm with the mean taken over a 4-D view [1, N, 1, D] (dims 2, 3): the same arithmetic, but a mean
    XNNPACK accepts (it only averages the two innermost dims of a 4-D tensor), so norms stay inside the delegate.
    (Not model.py's own form: the extra views cost eager decode ~14 us per norm.)"""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        shape = xf.shape
        ms = xf.pow(2).reshape(1, -1, 1, shape[-1]).mean((2, 3), keepdim=True).reshape(*shape[:-1], 1)
        return self.weight * (xf * torch.rsqrt(ms + self.eps)).type_as(x)


class _RotaryLinear(nn.Module):
    """model.Rotary with rotate_half as a linear with a constant +-1 permutation weight (entries 0 / +-1: the product
    is exact): slices on the dynamic length do not lower to XNNPACK, a linear with a constant weight does. One
    instance serves every layer; its weight is a buffer, so export sees model state rather than a lifted constant."""

    def __init__(self, d: int, device=None, rotary_dim: Optional[int] = None):
        super().__init__()
        h = (rotary_dim or d) // 2
        r = torch.zeros(d, d)  # x @ r == rotate_half(x) == cat(-x[..., h:2h], x[..., :h]) (+ zeros past 2h: sin 0)
        r[torch.arange(h) + h, torch.arange(h)] = -1.0
        r[torch.arange(h), torch.arange(h) + h] = 1.0
        self.register_buffer("weight", r.t().contiguous().to(device), persistent=False)  # linear() multiplies by W^T

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x * cos + torch.nn.functional.linear(x, self.weight.to(x.dtype)) * sin


def _linear_kind(m) -> Optional[str]:
    """qops.py's QuantizedLinear -> "8da4w" | "int8" | "int4" (weight-only asymmetric: no ExecuTorch kernel)."""
    if not isinstance(m, qops.QuantizedLinear):
        return None
    if m.qweight.bits == 8:
        return "int8"
    return "8da4w" if m.act == "int8" and (m.qweight.symmetric or m.qweight.xnnpack) else "int4"


def export_swaps(model, int8_dynamic: bool = True, x86_kernels: bool = False):
    """Assign export-friendly modules at model.py's swap points (and in place of qops.py's modules) while
    exporting; the originals are put back afterwards.
      * each KVCache -> _DirectCache over the same buffers (the cache write is reinplaced, not copied);
      * each RMSNorm -> _RMSNorm4D and each Rotary -> one shared _RotaryLinear, so both stay inside the XNNPACK
        delegate (same arithmetic);
      * qops.py's QuantizedEmbedding -> qexport.ETEmbedding (ExecuTorch's quantized embedding kernels);
      * QuantizedLinears with int8 activations (8da4w, 8da8w) -> qexport.XnnpackLinear (the pattern XNNPACK lowers);
        with int8_dynamic, int8 weight-only ones too: XNNPACK has no float x int8 weight-only GEMM, so the .pte
        quantizes activations per token too (qd8-f32-qc8w), which differs from eager int8 by that rounding only;
        without it portable kernels would dequantize every weight on every call. For the portable backend they stay
        weight-only. x86_kernels: 8da4w ones -> qexport.X86Linear (this repository's AVX2 kernel) where it takes them."""
    import model as model_py
    rope = _RotaryLinear(model.config.head_dim, model.norm.weight.device, model.config.rotary_dim)

    def replacement(m):
        if isinstance(m, model_py.KVCache):
            return _DirectCache(m)
        if isinstance(m, model_py.RMSNorm):
            return _RMSNorm4D(m)
        if isinstance(m, model_py.Rotary):
            return rope
        if isinstance(m, qops.QuantizedEmbedding):
            return qexport.ETEmbedding(m.qweight)
        if x86_kernels and qexport.X86Linear.takes(m):
            return qexport.X86Linear(m)
        if qexport.xnnpack_kind(m) and (m.act == "int8" or (int8_dynamic and _linear_kind(m) == "int8")):
            return qexport.XnnpackLinear(m)
        return None

    return qexport.swapped(model, replacement)


# ------------------------------------------------------------------------------------------------ export
def export_programs(model, prefill_chunk: Optional[int] = None, backend: str = "xnnpack",
                    lookahead: bool = False, fast_prefill: bool = False, x86_kernels: bool = False) -> dict:
    """torch.export the model (caches set up) as forward(tokens [1, T], input_pos [T]) -> logits [1, T, V]:
    {"forward": dynamic T} (+ "prefill": T = prefill_chunk, "decode": T = 1) (+ "lookahead": dynamic T with a mask,
    speculative.py's contract) (+ "prompt": T >= 2 and logits_at, the last position's logits only). All share one
    module, so the lowered program shares weights and (with share_mutable_buffers) the cache."""
    from torch.export import Dim, export
    S = model.max_seq_length
    progs = {}
    with torch.no_grad(), export_swaps(model, backend == "xnnpack", x86_kernels):
        seq = Dim("seq", min=1, max=S)
        T = min(4, S)
        ex = (torch.zeros(1, T, dtype=torch.long), torch.arange(T))
        progs["forward"] = export(model, ex, dynamic_shapes=({1: seq}, {0: seq}), strict=False)
        if prefill_chunk:
            if not 1 < prefill_chunk <= S:
                raise ValueError(f"--prefill_chunk must be in 2..{S}")
            ex = (torch.zeros(1, prefill_chunk, dtype=torch.long), torch.arange(prefill_chunk))
            progs["prefill"] = export(model, ex, strict=False)
            progs["decode"] = export(model, (torch.zeros(1, 1, dtype=torch.long), torch.tensor([0])), strict=False)
        if lookahead:
            import speculative
            speculative.check_step_contract(model.config)
            with speculative.step_caches(model):
                progs["lookahead"] = export(model, (torch.zeros(1, T, dtype=torch.long), torch.arange(T)),
                                            {"mask": speculative.causal_mask(range(T), S)},
                                            dynamic_shapes={"idx": {1: seq}, "input_pos": {0: seq}, "mask": {2: seq}},
                                            strict=False)
        if fast_prefill:
            plen = Dim("prompt_seq", min=2, max=S)
            ex = (torch.zeros(1, T, dtype=torch.long), torch.arange(T))  # (T = min(4, S) >= 2)
            progs["prompt"] = export(model, ex, {"logits_at": torch.tensor([T - 1])}, strict=False,
                                     dynamic_shapes={"idx": {1: plen}, "input_pos": {0: plen}, "logits_at": None})
    for name, ep in progs.items():
        et_passes.drop_unused_state(ep)
        if not et_passes.gqa_attention_pass(ep.graph_module):
            print(f"note: {name}: attention left to ATen's SDPA decomposition (pattern not recognised)", file=sys.stderr)
    return progs


def _backend_partitioners(backend: str, log=lambda *a: None) -> list:
    """Partitioners for a backend name; a clear error naming what to install when a vendor SDK is missing."""
    if backend == "portable":
        return []
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        class _XnnpackPartitioner(XnnpackPartitioner):
            """XnnpackPartitioner that, when XNNPACK takes every op it asks to keep whole (linear, torchao's quant
            ops) as it stands (float32, 8da4w), hands to_edge_transform_and_lower no per-node filter: with one, it
            retraces the whole program through run_decompositions twice more (about a quarter of the lowering time).
            The .pte is the same byte for byte. Otherwise (fp16: the rope's cast weight is not a constant) the filter
            stays. Says how many subgraphs go to XNNPACK (the long part)."""

            def ops_to_not_decompose(self, ep):
                ops, keep = super().ops_to_not_decompose(ep)
                kept = [n for n in ep.graph.nodes if n.op == "call_function" and n.target in ops]
                return ops, (None if all(keep(n) for n in kept) else keep)

            def partition(self, exported_program):
                result = super().partition(exported_program)
                log(f"preprocessing {len(result.partition_tags)} subgraphs for XNNPACK ...")
                return result
        return [_XnnpackPartitioner()]
    if backend == "qnn":
        root = os.environ.get("QNN_SDK_ROOT", "")
        if not root or not Path(root).is_dir():
            raise RuntimeError("--backend qnn needs the Qualcomm AI Engine Direct (QNN) SDK: install it from "
                               "https://www.qualcomm.com/developer/software/qualcomm-ai-engine-direct-sdk and set "
                               "QNN_SDK_ROOT to its directory (and LD_LIBRARY_PATH to $QNN_SDK_ROOT/lib/x86_64-linux-clang)")
        try:
            import executorch.backends.qualcomm.partition.qnn_partitioner  # noqa: F401
        except Exception as e:
            raise RuntimeError(f"--backend qnn: executorch's Qualcomm backend does not load ({type(e).__name__}: "
                               f"{first_line(e)}); build executorch with "
                               "-DEXECUTORCH_BUILD_QNN=ON against the QNN SDK in QNN_SDK_ROOT") from None
        raise NotImplementedError("--backend qnn: the QNN SDK is present, but this script does not set up QNN compile "
                                  "specs (SoC model, HTP options) yet; use --backend xnnpack")
    if backend == "coreml":
        if sys.platform != "darwin":
            raise RuntimeError("--backend coreml needs macOS (Core ML compiles and runs only on Apple platforms, with "
                               "coremltools installed); use --backend xnnpack here")
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner
        return [CoreMLPartitioner()]
    if backend == "mps":
        if sys.platform != "darwin":
            raise RuntimeError("--backend mps needs macOS with Xcode and an executorch build with "
                               "-DEXECUTORCH_BUILD_MPS=ON (the pip wheel has no MPS backend); use --backend xnnpack here")
        try:
            from executorch.backends.apple.mps.partition import MPSPartitioner
        except ImportError:
            raise RuntimeError("--backend mps: executorch.backends.apple.mps is missing; build executorch from "
                               "source with -DEXECUTORCH_BUILD_MPS=ON") from None
        from executorch.exir.backend.compile_spec_schema import CompileSpec
        return [MPSPartitioner([CompileSpec("use_fp16", bytes([False]))])]
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def lower(progs: dict, backend: str, constant_methods: dict, verbose: bool = False):
    """to_edge_transform_and_lower + to_executorch with mutable-buffer-preserving memory planning.
    Returns (ExecutorchProgramManager, op summary)."""
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass
    log = (lambda *a: print(*a, file=sys.stderr)) if verbose else (lambda *a: None)
    partitioners = _backend_partitioners(backend, log)
    log(f"lowering to {backend}: decompositions, partitioning{', preprocessing' if partitioners else ''} ...")
    trim = et_passes.xnnpack_trimmed_passes() if backend == "xnnpack" else contextlib.nullcontext()
    with _torch_internal_warnings_hidden(), trim:
        edge = to_edge_transform_and_lower(progs, transform_passes=[et_passes.inferred_view_dims],
                                           partitioner=partitioners, constant_methods=constant_methods,
                                           compile_config=EdgeCompileConfig(_check_ir_validity=False,
                                                                            _skip_dim_order=True))
    summary = et_passes.op_summary(edge)
    reinplace = et_passes.reinplace_is_safe(edge)
    config = ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=len(progs) > 1),
        sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
        emit_mutable_buffer_names=True,
        run_reinplace_pass=reinplace,
    )
    log("to_executorch: memory planning, emitting ...")
    with _torch_internal_warnings_hidden():
        et = edge.to_executorch(config)
    return et, summary


@contextlib.contextmanager
def _torch_internal_warnings_hidden():
    """Lowering makes torch warn about its own internals (buffer mutation, its deprecated LeafSpec, once per deep
    copy): noise between the progress lines that no user can act on."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Mutation on a buffer")
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning)
        yield


def _tokenizer(tokenizer_path):
    """The checkpoint's tokenizer.py Tokenizer (bos / eos ids, the vocabulary fingerprint), or None (with a note)."""
    try:
        from tokenizer import load_tokenizer
        return load_tokenizer(tokenizer_path)
    except Exception as e:  # noqa: BLE001 - a missing tokenizer only costs the defaults below and the fingerprint
        print(f"note: no tokenizer at {tokenizer_path} ({type(e).__name__}): the .pte records no vocabulary "
              "fingerprint", file=sys.stderr)
        return None


def vocab_fingerprint(tok) -> Optional[int]:
    """runner-common/README.md's vocabulary fingerprint of tok's tokenizer.bin (scripts/export_tokenizer_bin.py
    builds the bytes and hashes them), as the int64 get_vocab_fingerprint returns; None for no tokenizer or one that
    tokenizer.bin cannot hold (no C++ runner runs it). aoti_export.py records it too."""
    scripts = str(Path(__file__).resolve().parent / "scripts")
    if tok is None:
        return None
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import export_tokenizer_bin as E
    try:
        fp = E.vocab_fingerprint(E.build(tok, with_chat=False))
    except E.ExportError:
        return None
    return fp - (1 << 64) if fp >= 1 << 63 else fp


def _token_ids(tok, bos_id, eos_ids):
    """bos / eos ids for the constant methods: explicit flags, else the tokenizer beside the checkpoint."""
    if bos_id is not None and eos_ids:
        return bos_id, list(eos_ids)
    if tok is not None:
        tb = getattr(tok, "bos_id", None)
        te = sorted({i for i in [getattr(tok, "eos_id", None), *getattr(tok, "stop_ids", ())] if i is not None})
    else:
        tb, te = None, []
    bos = bos_id if bos_id is not None else (tb if tb is not None else 1)
    eos = list(eos_ids) if eos_ids else (te or [2])
    if tok is None and (bos_id is None or not eos_ids):
        print(f"using bos {bos}, eos {eos} (pass --bos_id / --eos_ids to override)", file=sys.stderr)
    return bos, eos


def export_pte(model, output_path, max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH, backend: str = "xnnpack",
               bos_id: int = 1, eos_ids=(2,), prefill_chunk: Optional[int] = None, verbose: bool = True,
               lookahead: bool = False, fast_prefill: bool = False, vocab_fingerprint: Optional[int] = None,
               x86_kernels: bool = False) -> dict:
    """Lower a model.py Transformer (float, or quantized by quantize.py: model.quantization names the recipe) to a
    .pte at output_path, written atomically. Returns info: size, method names, op summary, times. The .pte contract
    (generate.py, eval.py and the C++ runner rely on it):
      * `forward(tokens: int64[1, T], input_pos: int64[T]) -> float32 logits[1, T, V]`, T dynamic in [1, max_seq_len];
        the KV cache is a set of mutable buffers: state persists across calls of one loaded program and starts zeroed
        (harmless: the attention mask comes from the positions);
      * constant methods named as ExecuTorch's own LLM runner reads them: get_max_seq_len, get_max_context_len,
        get_vocab_size, get_bos_id, get_eos_ids, use_kv_cache, enable_dynamic_shape (+ get_n_layers,
        get_max_batch_size, use_sdpa_with_kv_cache=False); get_vocab_fingerprint (int64) when vocab_fingerprint is
        given: the tokenizer.bin the runners then take (runner-common/README.md); main() passes the checkpoint's
        tokenizer's, and no fingerprint when the checkpoint has no tokenizer (the runners check the size only);
      * standard ATen / quantized_decomposed ops and the XNNPACK delegate only, no llama:: custom ops, so a standalone
        C++ runner loads it; an operator without an ExecuTorch kernel is refused at export, by name; x86_kernels:
        8da4w linears as llama_flat::q8a4w_mm, whose kernel runner-et and pte_backend.py register (AVX2 CPUs);
      * prefill_chunk N (the hybrid mode's AR-N program): `prefill` (tokens [1, N], fixed; runners pad the last chunk
        with positions after the prompt) and `decode` (tokens [1, 1]), sharing weights and cache; get_prefill_chunk;
      * fast_prefill: `prompt(tokens, input_pos, logits_at int64[1] = T - 1) -> [1, 1, V]`, T in [2, max_seq_len], the
        last position's logits only (forward's every-position logits cost SmolLM2 ~4 ms of a 15-token prompt);
        XNNPACK packs each loaded method's weights, so a runner that loads it holds them twice;
      * lookahead: `lookahead(tokens, input_pos, mask float32[1, 1, T, S]) -> [1, T, V]`, T dynamic: speculative.py's
        lookahead contract (engine.StepCache at the kv_cache swap point); with a causal mask also the prompt and
        plain decode, so a runner in lookahead mode loads only this method.
    The export-time swaps (export_swaps) and graph passes (et_passes.py) keep every piece inside the delegate."""
    log = (lambda *a: print(*a, file=sys.stderr)) if verbose else (lambda *a: None)
    output_path = Path(output_path)
    _backend_partitioners(backend)  # fail fast, before the slow export, on a backend that cannot work here
    if x86_kernels:
        import fast_cpu_kernels
        fast_cpu_kernels.load_et_kernels()  # (its kernel registered: _ops_without_kernel asks the runtime)
        if not any(qexport.X86Linear.takes(m) for m in model.modules()):
            raise ValueError("--x86_kernels: the model has no 8da4w linears the x86 kernel takes (4-bit groups of 32k, "
                             "16k channels, scales on the bfloat16 grid: what --quantize 8da4w makes)")
    if any(_linear_kind(m) == "int4" for m in model.modules()):
        raise ValueError("int4 / int4-gptq weights (asymmetric, weight-only) have no ExecuTorch kernel; quantize with "
                         "--quantize 8da4w (or int8) for ExecuTorch")
    if backend == "xnnpack" and qexport.scales_not_bf16(model):
        log("note: XNNPACK stores 4-bit group scales as bfloat16; this model's scales are not bf16 values, so the .pte's "
            "logits differ slightly from the eager quantized model's")
    t0 = time.perf_counter()
    model.eval().requires_grad_(False)
    model.setup_caches(1, max_seq_length)  # capped at block_size
    S = model.max_seq_length
    if lookahead and model.norm.weight.dtype != torch.float32:
        raise ValueError("--lookahead programs take a float32 mask: export them with -d fp32")
    methods = (["forward"] + ["prefill", "decode"] * bool(prefill_chunk) + ["lookahead"] * lookahead
               + ["prompt"] * fast_prefill)
    log(f"exporting {', '.join(methods)} with torch.export ...")
    progs = export_programs(model, prefill_chunk, backend, lookahead, fast_prefill, x86_kernels)
    t1 = time.perf_counter()
    cfg = model.config
    constant_methods = {
        "get_max_seq_len": S, "get_max_context_len": S, "get_vocab_size": cfg.vocab_size,
        "get_bos_id": int(bos_id), "get_eos_ids": [int(e) for e in eos_ids],
        "use_kv_cache": True, "enable_dynamic_shape": True, "use_sdpa_with_kv_cache": False,
        "get_n_layers": cfg.n_layer, "get_max_batch_size": 1,
    }
    if prefill_chunk:
        constant_methods["get_prefill_chunk"] = int(prefill_chunk)
    if vocab_fingerprint is not None:
        constant_methods["get_vocab_fingerprint"] = int(vocab_fingerprint)
    et, summary = lower(progs, backend, constant_methods, verbose)
    t2 = time.perf_counter()
    missing = _ops_without_kernel(et)
    if missing:  # e.g. an op some family's block needs and nothing lowers: refuse here, not at load time
        raise ValueError(f"{cfg.family or 'this model'}: the {backend} .pte needs operator(s) {', '.join(missing)} that "
                         f"ExecuTorch has no kernel for, so it could not run; nothing was written")
    log(f"writing {output_path} ...")
    with atomic_path(output_path) as tmp, open(tmp, "wb") as f:
        et.write_to_file(f)
    size = output_path.stat().st_size
    log(f"exported in {t1 - t0:.1f} s, lowered to {backend} in {t2 - t1:.1f} s")
    for name, s in summary.items():
        top = ", ".join(f"{k} {v}" for k, v in list(s["portable"].items())[:8])
        log(f"  {name}: {s['delegated_ops']} ops in {s['delegate_calls']} {backend} delegate call(s), "
            f"{s['portable_ops']} portable ops ({top})")
    quantization = getattr(model, "quantization", None)
    log(f"wrote {output_path} ({size / 2**20:.1f} MiB; max_seq_len {S}, vocab {cfg.vocab_size}"
        f"{', quantized ' + quantization.get('mode', '') if quantization else ''})")
    return dict(path=str(output_path), size=size, methods=list(progs), summary=summary,
                export_s=t1 - t0, lower_s=t2 - t1)


def _ops_without_kernel(et) -> list:
    """Operators the program calls outside any delegate that this ExecuTorch runtime (portable + optimized + quantized
    kernels, what runner-et links) has no kernel for. Empty when the runtime cannot be imported to ask."""
    try:
        from executorch.extension.pybindings import portable_lib
        import executorch.kernels.quantized  # noqa: F401 - registers the quantized_decomposed kernels
        kernels = set(portable_lib._get_operator_names())
    except Exception:  # noqa: BLE001
        return []
    needed = {f"{op.name}.{op.overload}" if op.overload else op.name
              for plan in et.executorch_program.execution_plan for op in plan.operators}
    return sorted(n for n in needed if n not in kernels and n.split(".")[0] not in kernels)


# ------------------------------------------------------------------------------------------------ CLI
def parse_args(argv=None):
    p = ArgumentParser(description="Export a LLaMA-family checkpoint to an ExecuTorch .pte.")
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help="model.pth from scripts/convert_checkpoint.py or quantize.py "
                        "(default: checkpoints/SmolLM2-135M-Instruct/model.pth)")
    p.add_argument("--output_path", "--out-path", type=Path, required=True, help="the .pte to write", suffix=(".pte",))
    p.add_argument("--quantize", "--quant", default=None,
                   help="quantize a float checkpoint first with quantize.py (int8, 8da4w, ...)")
    p.add_argument("-d", "--dtype", default="fp32", choices=sorted(DTYPES),
                   help="precision of a float checkpoint's program (XNNPACK: fp32, fp16)")
    p.add_argument("--groupsize", type=int, default=32, help="group size for --quantize", rule=one_of(GROUPSIZES))
    p.add_argument("--max_seq_length", type=int, default=DEFAULT_MAX_SEQ_LENGTH,
                   help="KV cache length = longest prompt + generation (capped at the model's block_size)", rule=at_least(1))
    p.add_argument("--backend", default="xnnpack", choices=BACKENDS, help="portable = no delegate (debugging)")
    for b in ("xnnpack", "coreml", "mps"):  # ExecuTorch's docs spell the backend as a switch
        p.add_argument(f"-{b}", f"--{b}", dest="backend", action="store_const", const=b, help=f"= --backend {b}")
    p.add_argument("--prefill_chunk", type=int, default=None,
                   help="hybrid mode: also add fixed-length `prefill` (N tokens) and `decode` (1 token) methods", rule=at_least(1))
    p.add_argument("--lookahead", action="store_true",
                   help="lookahead mode: also add the `lookahead` method (tokens, positions, attention mask)")
    p.add_argument("--fast_prefill", action="store_true",
                   help="also add the `prompt` method (the last position's logits: faster prompts, a second copy of "
                        "the packed weights in a runner's memory)")
    p.add_argument("--x86_kernels", action="store_true",
                   help="8da4w linears through this repository's AVX2 kernel, not XNNPACK's (x86: runner-et, --pte)")
    p.add_argument("--tokenizer_path", type=Path, default=None, help="bos/eos ids, vocabulary fingerprint (default: checkpoint directory)")
    p.add_argument("--bos_id", type=int, default=None, rule=at_least(0))
    p.add_argument("--eos_ids", type=int, nargs="+", default=None, rule=at_least(0))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from quantize import load_model
    if args.max_seq_length < 2:
        raise ValueError("--max_seq_length must be at least 2")
    if args.x86_kernels:
        if args.backend not in ("xnnpack", "portable"):
            raise ValueError(f"--x86_kernels runs on a CPU: --backend xnnpack or portable, not {args.backend}")
        import fast_cpu_kernels
        fast_cpu_kernels.load_et_kernels()  # (no AVX2 or no compiler: one line, before loading)
    _backend_partitioners(args.backend)  # a missing vendor SDK is reported before the checkpoint is even read
    dtype = DTYPES[args.dtype]
    if dtype != torch.float32:
        if args.quantize:
            raise ValueError(f"-d {args.dtype}: quantized programs are exported from float32 (-d fp32)")
        if args.lookahead:
            raise ValueError(f"-d {args.dtype}: --lookahead programs take a float32 mask (-d fp32)")
        if dtype == torch.bfloat16 and args.backend == "xnnpack":
            raise ValueError("-d bf16: XNNPACK has no bfloat16 kernels; use -d fp16 (or --backend portable)")
    resolve_checkpoint(args)
    model = load_model(args.checkpoint_path, dtype=dtype)
    if model.quantization and dtype != torch.float32:
        raise ValueError(f"-d {args.dtype}: {args.checkpoint_path} is quantized; export it with -d fp32")
    if args.quantize:
        if model.quantization:
            raise ValueError(f"{args.checkpoint_path} is already quantized; export it without --quantize")
        import quantize
        print(f"quantizing to {args.quantize} ...", file=sys.stderr)
        model.quantization = quantize.quantize_model(model, args.quantize, groupsize=args.groupsize)
        model.requires_grad_(False)
    tok = _tokenizer(args.tokenizer_path)
    bos, eos = _token_ids(tok, args.bos_id, args.eos_ids)
    beyond = [i for i in (bos, *eos) if not 0 <= i < model.config.vocab_size]
    if beyond:  # a runner would index past the logits with them
        raise ValueError(f"token id {beyond[0]} (--bos_id / --eos_ids or the tokenizer's) is beyond the vocabulary of "
                         f"{args.checkpoint_path} ({model.config.vocab_size} tokens)")
    export_pte(model, args.output_path, args.max_seq_length, args.backend, bos, eos, args.prefill_chunk,
               lookahead=args.lookahead, fast_prefill=args.fast_prefill, vocab_fingerprint=vocab_fingerprint(tok),
               x86_kernels=args.x86_kernels)


if __name__ == "__main__":
    cli(main)
