#!/usr/bin/env python
"""aoti_export.py: model.py's Transformer as an AOT Inductor package (.pt2) that runs without Python (runner-aoti/)
or from generate.py (--aoti_package), the KV cache inside the package; the package writer that stores the weights of
its models once; AOTIBackend, the package's Python runtime.

    python aoti_export.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --output_path smollm2.pt2
    python generate.py --aoti_package smollm2.pt2 --prompt "Once upon a time"

The package's "model" is forward(tokens int64[1, T], input_pos int64[T]) -> float32 logits[1, T, V], T dynamic in
[1, max_seq_length]; the cache buffers are constants the graph updates in place (state persists across calls of one
loaded package). Model facts travel as string metadata (package_metadata). export() lists the other models a package
may hold; package_shared() the shared-weights layout."""
import contextlib
import hashlib
import json
import mmap
import os
import sys
import time
import zipfile
from pathlib import Path
from typing import Optional

from common import (THREADS, ArgumentParser, at_least, atomic_path, check_device, checkpoint_file, cli, first_line,
                    write_atomic)
from native_files import check_free_space, native_tmpdir
import torch
import torch_internals as TI

try:  # the CPU accelerator: without it a package reads its whole cache, quantized weights folded into float ones
    import fast_cpu
    import fast_cpu_quant
    import qexport
except ImportError:
    fast_cpu = None

METADATA_VERSION = "1"
LOOKAHEAD_HINT = 12  # tokens of a typical lookahead step's call: the length its kernels are tuned for
PROMPT_HINT = 64  # tokens of a typical prompt: the length the "prompt" model's kernels are tuned for
SHARED_WEIGHTS = "data/weights/llama_flat"  # a multi-model package's constants: `index` + one record per tensor


# ----------------------------------------------------------------------------------------------------------- export
def package_metadata(model, tok, device: str, dtype: torch.dtype, checkpoint_path) -> dict:
    """Facts a runner needs, as the string -> string map that AOT Inductor stores in the package. With a tokenizer:
    its facts and vocab_fingerprint (uint64, decimal), the tokenizer.bin the runners take (runner-common/README.md)."""
    cfg = model.config
    meta = {
        "llm_export_version": METADATA_VERSION,
        "model_type": "llama-family-transformer",
        "vocab_size": str(cfg.vocab_size),
        "max_seq_len": str(model.max_seq_length), "max_batch_size": "1",
        "dtype": str(dtype).replace("torch.", ""),
        "device": device,
        "n_layer": str(cfg.n_layer),
        "dim": str(cfg.dim),
        "checkpoint": Path(checkpoint_path).name,
        "model_config": json.dumps({k: getattr(cfg, k) for k in cfg.__dataclass_fields__}),
    }
    if tok is not None:
        from et_export import vocab_fingerprint  # None for a tokenizer no tokenizer.bin holds
        fp = vocab_fingerprint(tok)
        meta.update({
            "tokenizer_kind": tok.kind,
            "tokenizer_vocab_size": str(tok.vocab_size),
            "bos_id": str(tok.bos_id if tok.bos_id is not None else -1),
            "eos_id": str(tok.eos_id),
            "eos_ids": ",".join(str(i) for i in sorted(tok.stop_ids)),
            "add_bos": "1" if tok.add_bos else "0",
            **({"vocab_fingerprint": str(fp % (1 << 64))} if fp is not None else {}),
        })
    return meta


def export(checkpoint_path, output_path, max_seq_length: int = 1024, dtype: Optional[str] = None, device: str = "cpu",
           tokenizer_path=None, so: bool = False, log=print, prefill_chunk: Optional[int] = None,
           lookahead: bool = False, fast_prefill: bool = False) -> Path:
    """Export and write the package atomically (common.atomic_path). Returns its path. Float and quantize.py
    checkpoints export alike (quantized products on fast_cpu_quant's kernels, qexport.aoti_forms). Besides "model":
      * prefill_chunk N: "prefill", forward with a fixed T = N (the runners' hybrid mode; the last chunk is padded);
      * lookahead: "lookahead", forward(tokens [1, T], input_pos [T], mask [1, 1, T, S] float32), dynamic T:
        speculative.py's lookahead contract (engine.StepCache at the kv_cache swap point);
      * fast_prefill: "prompt", forward(tokens [1, T], input_pos [T], logits_at int64[1] = T - 1) -> [1, 1, V], the
        kv mode's prompts: tuned at PROMPT_HINT tokens with ATen among the GEMM choices ("model"'s C++ templates,
        tuned for decode, run many rows at ~40% of oneDNN's rate) and skipping the other positions' logits. A float
        model's "prompt" keeps oneDNN's packed weights in its own library (opaque tensors cannot be shared: about
        twice the package); a quantized one shares "model"'s records (int4's: fast_cpu_kernels' tiles, whose kernel
        every model calls through a C shim where it runs, runner-aoti builds it too; else ATen's int4 layout) and adds
        8da4w's, or int8's q as bfloat16 on a CPU with bfloat16 dot products (packed by oneDNN, in its own library);
        int4 and 8da4w without the kernels add "long_prompt" (from long_prompt_min = BF16_ROWS tokens: oneDNN's GEMM)."""
    from quantize import load_model
    from torch.export import Dim

    check_device(device)
    if max_seq_length < 2:
        raise ValueError(f"--max_seq_length must be at least 2 (got {max_seq_length})")
    output_path = Path(output_path)
    check_free_space(output_path, checkpoint_file(checkpoint_path))  # a full disk aborted the process
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(f"unknown dtype {dtype!r}")
    torch_dtype = getattr(torch, dtype) if dtype else None
    if so and (prefill_chunk or lookahead or fast_prefill):
        raise ValueError("--so writes one model: --prefill_chunk / --lookahead / --fast_prefill need a .pt2")
    if prefill_chunk is not None and not 2 <= prefill_chunk <= max_seq_length:
        raise ValueError(f"--prefill_chunk must be in 2..{max_seq_length} (the context), got {prefill_chunk}")

    model = load_model(checkpoint_path, device=device, dtype=torch_dtype)
    with torch.device(device):
        model.setup_caches(1, max_seq_length)
    if fast_cpu is not None:  # CPU: the layers read the filled cache slots only (fast_cpu.FilledSlots)
        fast_cpu_quant.compile_setup()
        fast_cpu.speed_up(model, export=True)
    S = model.max_seq_length
    if S < max_seq_length:
        log(f"note: max_seq_length capped at the model's block_size, {S}")
    run_dtype = model.norm.weight.dtype

    tok = None
    tok_path = Path(tokenizer_path) if tokenizer_path else checkpoint_file(checkpoint_path).parent
    try:
        from tokenizer import load_tokenizer
        tok = load_tokenizer(tok_path)
    except (FileNotFoundError, ValueError, ImportError) as e:
        log(f"warning: no tokenizer facts in the package metadata ({e})")
    if tok is not None and tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens but the model only {model.config.vocab_size}")

    meta = package_metadata(model, tok, device, run_dtype, checkpoint_path)
    if device == "cpu":  # Inductor's CPU kernels are specialised to this many OpenMP threads
        meta["threads"] = str(torch.get_num_threads())
    if model.quantization:
        meta["quantization"] = json.dumps(model.quantization)

    kv = model.layers[0].attention.kv_cache.k_cache
    meta["kv_cache_shape"] = ",".join(map(str, kv.shape))
    meta["cache_dtype"] = str(kv.dtype).replace("torch.", "")
    if prefill_chunk and prefill_chunk > S:
        raise ValueError(f"--prefill_chunk {prefill_chunk} is longer than the context, {S}")
    seq = Dim("seq", min=1, max=S)
    example = (torch.zeros(1, 2, dtype=torch.long, device=device), torch.arange(2, device=device))
    t0 = time.perf_counter()
    # prefer_deferred_runtime_asserts_over_guards: shape facts the symbolic solver cannot prove over the whole range
    # (e.g. a stride guard Eq(T*Min(16, 32*T), 16*T) from the grouped-query reshape, true for every T >= 1) become
    # runtime asserts in the package instead of failing the export with "Constraints violated"
    programs = {}  # model name -> (exported program, example args, example kwargs)
    forms = {}  # quantized weights' export forms (qexport.aoti_forms): the layouts every model of the package shares

    def quantized(rows: str):  # a quantized model's products on fast_cpu_quant's kernels, not float32 copies
        return qexport.aoti_forms(model, rows, forms) if model.quantization and fast_cpu else contextlib.nullcontext()

    with torch.no_grad(), quantized("words"):
        ep = torch.export.export(model, example, dynamic_shapes=({1: seq}, {0: seq}), strict=False,
                                 prefer_deferred_runtime_asserts_over_guards=True)
        programs["model"] = (ep, example, {})
        if prefill_chunk:
            ex = (torch.zeros(1, prefill_chunk, dtype=torch.long, device=device),
                  torch.arange(prefill_chunk, device=device))
            programs["prefill"] = (torch.export.export(model, ex, strict=False), ex, {})
        if lookahead:
            import speculative
            speculative.check_step_contract(model.config)
            # the example length is the size hint AOT Inductor tunes the GEMMs for: a typical step's call (the
            # default 6,1,1: 5 to 15 tokens) rather than 2, the decode graph's
            T = min(LOOKAHEAD_HINT, S)
            ex = (torch.zeros(1, T, dtype=torch.long, device=device), torch.arange(T, device=device))
            kw = {"mask": speculative.causal_mask(range(T), S).to(device=device, dtype=run_dtype)}
            with speculative.step_caches(model):
                programs["lookahead"] = (torch.export.export(
                    model, ex, kw, dynamic_shapes={"idx": {1: seq}, "input_pos": {0: seq}, "mask": {2: seq}},
                    strict=False, prefer_deferred_runtime_asserts_over_guards=True), ex, kw)
    bf16_copies = []  # weight-only int8's prompt copies (below)
    if fast_prefill:  # prompts of 2 tokens or more (the runners run a 1-token prompt through "model"); the
        T = min(PROMPT_HINT, S)  # weight-only products of many rows are ATen's packed kernels (fast_cpu_quant.py)
        ex = (torch.zeros(1, T, dtype=torch.long, device=device), torch.arange(T, device=device))
        kw = {"logits_at": torch.tensor([T - 1], device=device)}
        prompts = [("prompt", 2, "native")]  # (model, its shortest length, its quantized forms' export_rows)
        # int4 and 8da4w without fast_cpu_kernels' kernel, on a CPU with bfloat16 dot products: "long_prompt" (L tokens
        # or more) through oneDNN's bfloat16 GEMM; weight-only int8's "prompt" runs it at every length, on a bfloat16
        # copy of its integer weights (FastQuantizedLinear.add_export_copy; the blocks', not the output's)
        q, kernel = model.quantization, bool(forms) and all(f.int4_cpu[1] is None for f in forms.values() if f.int4_cpu)
        bf16_copies = [f.add_export_copy() for f in forms.values()
                       if f.qweight is not model.output.qweight and f.prompt_copy_bytes()]
        if q and fast_cpu and q.get("mode") in ("8da4w", "int4", "int4-gptq") and not kernel \
                and fast_cpu_quant.BF16_GEMM and S > fast_cpu_quant.BF16_ROWS:
            prompts.append(("long_prompt", fast_cpu_quant.BF16_ROWS, "bf16"))
            meta["long_prompt_min"] = str(fast_cpu_quant.BF16_ROWS)
        for name, low, rows in prompts:
            length = Dim(f"{name}_seq", min=low, max=S)
            with torch.no_grad(), quantized(rows):
                programs[name] = (torch.export.export(model, ex, kw, dynamic_shapes={
                    "idx": {1: length}, "input_pos": {0: length}, "logits_at": None},
                    strict=False, prefer_deferred_runtime_asserts_over_guards=True), ex, kw)
    meta["models"] = ",".join(programs)
    # Several models share their constants (package_shared); a quantized model alone on CPU takes that layout too (its
    # constants mapped, 64-byte aligned): weight-only int4 at the 1B shape decoded at 55 against 40 tok/s and peaked at
    # 796 against 1,483 MB than in AOT Inductor's own package (constants inside the library; runner-aoti, 2 threads)
    shared_layout = len(programs) > 1 or bool(model.quantization and device == "cpu" and fast_cpu is not None)
    if shared_layout:
        meta["shared_weights"] = SHARED_WEIGHTS
    if prefill_chunk:
        meta["prefill_chunk"] = str(prefill_chunk)
    log(f"exported {len(programs)} graph(s) ({', '.join(programs)}) in {time.perf_counter() - t0:.1f} s; "
        "compiling with AOT Inductor ...")

    configs = {"aot_inductor.metadata": meta}
    if device == "cpu" and fast_cpu is not None:  # (+ the C shims of fast_cpu_kernels' ops, where they run)
        configs.update({**fast_cpu.INDUCTOR_CPU, **getattr(fast_cpu_quant.fast_cpu_kernels, "aoti_shims", dict)()})
    # atomic_path's temporary path already has the final name (the package's archive folder is named after the file)
    t0 = time.perf_counter()
    with native_tmpdir(), atomic_path(output_path) as tmp:  # the compiler's temporaries: removed, even interrupted
        if so:
            # a plain shared library with the weights inside; AOT Inductor keeps no metadata in it, so the facts go
            # to a JSON file beside it (<output>.json), written first so that a .so never lacks one
            configs.update({"aot_inductor.output_path": str(tmp), "aot_inductor.package_constants_in_so": True})
            with torch.no_grad():
                path = TI.aot_compile(ep.module(), example, options=configs)
            write_atomic(so_metadata_path(output_path), json.dumps(meta, indent=1))
            os.replace(path, tmp)
        elif not shared_layout:
            with torch.no_grad():
                TI.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=configs)
        else:  # the shared-weights layout (package_shared): each model's constants come out as a blob (binary_blob),
            files = {}  # which package_shared splits, dedups and stores. GEMMs are Inductor's C++ templates only:
            # with ATen's among the candidates, freezing's oneDNN-packed weights (opaque tensors, which a loader
            # cannot map from a file) win some GEMMs of the many-row programs (prefill, lookahead)
            shared = {**configs, "aot_inductor.package": True, "aot_inductor.package_constants_in_so": False,
                      "aot_inductor.package_constants_on_disk_format": "binary_blob",
                      "max_autotune_gemm_backends": "CPP"}
            if model.quantization and not TI.cpu_has("avx512"):  # (Inductor's int4 template is AVX-512's: ATen's)
                shared.update({"max_autotune_gemm_backends": "CPP,ATEN", "cpp.weight_prepack": False})
            own = {**configs, "aot_inductor.package": True, "aot_inductor.package_constants_in_so": True}
            # a quantized model's "prompt": no float GEMMs on its weights, ATen's int8 / int4 kernels allowed, no
            # prepacking; except on int8's bfloat16 copies (oneDNN-packed, so in its own library, as a float model's)
            if model.quantization and not any(bf16_copies):
                own = {**shared, "max_autotune_gemm_backends": "CPP,ATEN", "cpp.weight_prepack": False}
            for name, (prog, ex, kw) in programs.items():
                log(f"  compiling {name} ...")
                with torch.no_grad():
                    files[name] = TI.aot_compile(prog.module(), ex, kw, options=own if "prompt" in name else shared)
            package_shared(tmp, files, log)
    log(f"compiled in {time.perf_counter() - t0:.1f} s -> {output_path} ({output_path.stat().st_size / 1e6:.1f} MB)")
    return output_path


def package_shared(path, files: dict, log=print) -> None:
    """The shared-weights layout: each model is compiled without its constants (package_constants_in_so=False) and
    the package holds every distinct constant once (matched by content: AOT Inductor names prepacked weights
    constantN in the order it makes them), as a 64-byte aligned, uncompressed record under SHARED_WEIGHTS listed by
    its `index` (model, internal name, record, dtype, storage offset, shape, stride per line). A loader maps the file
    and hands each model tensors over those records with update_constant_buffer(..., user_managed=True), plus one KV
    cache it allocates (kv_cache_shape in the metadata; the cache is not in the index). Metadata `models` lists the
    models, `shared_weights` the folder (shared_constants(), runner-aoti/run.cpp). Writes each model's files from
    aot_compile (binary_blob: the constants in a separate <wrapper>_weights.blob), the blobs split into their
    constants, every distinct one (by content) a record, and the index. KV cache buffers are left out (the loader
    allocates one cache for all models). A model compiled with its constants inside its library has no index lines."""
    records: dict[bytes, str] = {}  # content hash -> record name
    index, stored, total = [], 0, 0
    with TI.PT2ArchiveWriter(str(path)) as archive:
        for model, model_files in files.items():
            blob = next((f for f in model_files if isinstance(f, str) and f.endswith("_weights.blob")), None)
            wrapper = next(f for f in model_files if isinstance(f, str) and f.endswith(".wrapper.cpp"))
            for f in model_files:
                if isinstance(f, str) and f != blob:
                    archive.write_file(f"data/aotinductor/{model}/{os.path.basename(f)}", f)
            if blob is None:
                continue
            table = TI.constant_table(wrapper)
            with open(blob, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if sum(c["nbytes"] for c in table) != len(data):
                    raise RuntimeError(f"{blob}: {len(data)} bytes, its constants table says "
                                       f"{sum(c['nbytes'] for c in table)}")
                at = 0
                for c in table:
                    chunk, at = data[at:at + c["nbytes"]], at + c["nbytes"]
                    if "_kv_cache_" in c["name"]:  # the loader's (the FQN's ".kv_cache." with '.' -> '_')
                        continue
                    total += len(chunk)
                    key = hashlib.sha256(chunk).digest()
                    if key not in records:
                        records[key] = f"{SHARED_WEIGHTS}/{len(records)}"
                        archive.write_bytes(records[key], chunk)
                        stored += len(chunk)
                    index.append("\t".join([model, c["name"], records[key], c["dtype"], str(c["offset"]),
                                            ",".join(map(str, c["shape"])), ",".join(map(str, c["stride"]))]))
        archive.write_string(f"{SHARED_WEIGHTS}/index", "\n".join(index) + "\n")
    log(f"  constants of {len(files)} models: {total / 1e6:.1f} MB, {stored / 1e6:.1f} MB stored "
        f"({len(records)} distinct tensors)")


def shared_constants(path, models) -> dict:
    """{model: {internal name: tensor}} for the models of a package written by package_shared: tensors over the
    package file's records (mapped copy-on-write: shared by every model, nothing copied)."""
    reader = TI.PyTorchFileReader(str(path))
    index = reader.get_record(f"{SHARED_WEIGHTS}/index").decode()
    with open(path, "rb") as fh:
        data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    out: dict = {m: {} for m in models}
    whole: dict = {}
    for line in index.splitlines():
        model, name, record, dtype, offset, shape, stride = line.split("\t")
        if model not in out:
            continue
        if record not in whole:
            whole[record] = torch.frombuffer(data, dtype=torch.uint8, count=reader.get_record_size(record),
                                             offset=reader.get_record_offset(record))
        dims = lambda v: [int(x) for x in v.split(",") if x]
        out[model][name] = whole[record].view(getattr(torch, dtype)).as_strided(dims(shape), dims(stride),
                                                                              int(offset))
    return out


def so_metadata_path(so_path) -> Path:
    """Where --so puts the metadata of a plain shared library: beside it, <name>.so.json."""
    return Path(so_path).with_name(Path(so_path).name + ".json")


# ----------------------------------------------------------------------------------------------------------- backend
class _SoRunner:
    """A plain .so from --so, through the container runner (what aoti_load_package wraps for a .pt2)."""

    def __init__(self, path: Path, meta: dict):
        self.runner = TI.container_runner(str(path), meta.get("device", "cpu"))
        self.meta = meta

    def get_metadata(self):
        return self.meta

    def __call__(self, *args):
        return self.runner.run(list(args))


MODE_MODELS = {"kv": ("model", None), "hybrid": ("prefill", "--prefill_chunk N"),
               "lookahead": ("lookahead", "--lookahead")}


class AOTIBackend:
    """generate.py backend over an AOT Inductor package: forward(tokens[1, T], input_pos[T]) -> logits[1, T, V].
    mode (the runners' -M): "kv" runs "model"; "hybrid" runs prompts through "prefill" in chunks of its length
    (prefill_chunk; the last one padded) and decodes with "model"; "lookahead" runs everything through "lookahead"
    (causal masks) and offers forward_masked() (speculative.py's contract). In kv mode a package's "prompt" model
    (--fast_prefill) takes the calls that ask for one position's logits (logits_at, engine.prefill's prompts), its
    "long_prompt" model those of long_prompt_min tokens or more."""

    max_batch_size = 1
    has_masked = logits_at = False  # logits_at, engine.py's flag: True when "prompt" is loaded
    prompt_runner = long_prompt_runner = long_prompt_min = prefill_chunk = None

    def __init__(self, path, device="cpu", mode: str = "kv"):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"AOT Inductor package not found: {path}")
        if mode not in MODE_MODELS:
            raise ValueError(f"unknown mode {mode!r}: kv, hybrid or lookahead")
        self.mode = mode
        if path.suffix == ".so":
            if mode != "kv":
                raise ValueError(f"{path}: a plain .so holds one model; {mode} mode needs a .pt2 exported with "
                                 f"aoti_export.py {MODE_MODELS[mode][1]}")
            self._load_so(path, device)
            return
        if not zipfile.is_zipfile(path):
            raise ValueError(f"{path}: not an AOT Inductor package (not a .pt2 zip archive; truncated or wrong file?)")
        with native_tmpdir(compiles=False):  # no extracted aotinductor_* folders left, whether the load fails or not
            try:
                meta = TI.package_metadata(str(path), "model")
                models = (meta or {}).get("models", "model").split(",")
                need, flag = MODE_MODELS[mode]
                if need not in models:
                    raise LookupError(f"{path} has no `{need}` model, which {mode} mode needs: export it with "
                                      f"aoti_export.py {flag}")
                names = {"kv": ["model"] + [m for m in ("prompt", "long_prompt") if m in models],
                         "hybrid": ["prefill", "model"], "lookahead": ["lookahead"]}[mode]
                loaded = [TI.load_package(str(path), n) for n in names]
                self.runner = loaded[-1] if mode == "hybrid" else loaded[0]
                meta = self.runner.get_metadata()
            except LookupError as e:
                raise ValueError(str(e)) from None
            except Exception as e:
                raise ValueError(f"{path}: cannot load AOT Inductor package ({first_line(e)})") from None
        self._set_metadata(path, meta, device)
        if len(loaded) > 1 or meta.get("shared_weights"):
            self._share_constants(path, names, loaded, meta)
        if mode == "hybrid":
            self.prefill_runner, self.prefill_chunk = loaded[0], int(meta["prefill_chunk"])
        if "prompt" in names:
            self.prompt_runner, self.logits_at = loaded[names.index("prompt")], True
        if "long_prompt" in names:
            low = meta.get("long_prompt_min", "")
            if not (low.isdigit() and 2 <= int(low) <= self.max_seq_length):
                raise ValueError(f"{path}: bad package metadata (long_prompt_min {low!r})")
            self.long_prompt_runner, self.long_prompt_min = loaded[names.index("long_prompt")], int(low)
        self.has_masked = mode == "lookahead"

    def _share_constants(self, path, names, loaded, meta):
        """The models of a package get one KV cache (our tensors) and, where the package stores them once
        (shared_weights), the weights: given to each model as user-managed constants (no copy)."""
        shape = [int(x) for x in meta["kv_cache_shape"].split(",")]
        dtype = getattr(torch, meta.get("cache_dtype", "float32"))
        kv = [n for n in loaded[0].loader.get_constant_fqns() if ".kv_cache." in n]
        self.cache = {n.replace(".", "_"): torch.zeros(shape, dtype=dtype, device=self.device) for n in kv}
        weights = shared_constants(path, names) if meta.get("shared_weights") else {}
        for name, m in zip(names, loaded):
            consts = {**weights.get(name, {}), **self.cache}
            # all of them where the package stores the model's weights; else ("prompt": its own) the cache only
            m.loader.update_constant_buffer(consts, False, bool(weights.get(name)), True)
        self.constants = weights  # the tensors stay alive as long as the models

    def _load_so(self, path: Path, device):
        side = so_metadata_path(path)
        try:
            meta = json.loads(side.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: its metadata file {side.name} (written by aoti_export.py --so) is missing")
        except (OSError, ValueError) as e:
            raise ValueError(f"{side}: unreadable metadata ({type(e).__name__})") from None
        try:
            self.runner = _SoRunner(path, meta)
        except Exception as e:
            raise ValueError(f"{path}: cannot load AOT Inductor library ({first_line(e)})") from None
        self._set_metadata(path, meta, device)

    def _set_metadata(self, path, meta, device):
        if "max_seq_len" not in meta:
            raise ValueError(f"{path}: not made by aoti_export.py (no max_seq_len in the package metadata)")
        self.metadata = dict(meta)
        self.device = torch.device(meta.get("device", "cpu"))
        want = torch.device(device) if device is not None else self.device
        if want.type != self.device.type:
            raise ValueError(f"{path} was compiled for {self.device.type}: run it with --device {self.device.type} "
                             f"(or export again with --device {want.type})")
        self.max_seq_length = int(meta["max_seq_len"])
        self.vocab_size = int(meta["vocab_size"])

    def forward(self, tokens, input_pos, logits_at=None):
        if tokens.shape[0] != 1:
            raise ValueError("an AOT Inductor package from aoti_export.py runs one sequence at a time (batch 1)")
        if input_pos.dim() != 1:
            input_pos = input_pos[0]
        T = tokens.shape[1]
        if self.mode == "lookahead":
            from speculative import causal_mask
            return self.forward_masked(tokens, input_pos, causal_mask(input_pos.cpu(), self.max_seq_length))
        runner, kw = self.runner, {}
        if self.prompt_runner is not None and logits_at is not None and T > 1:
            if int(logits_at.reshape(-1)[0]) != T - 1:
                raise ValueError("the package's prompt model gives the last position's logits only")
            long = self.long_prompt_runner is not None and T >= self.long_prompt_min
            runner = self.long_prompt_runner if long else self.prompt_runner
            kw = {"logits_at": logits_at.reshape(1).to(self.device)}
        elif self.mode == "hybrid" and T > 1:
            if T != self.prefill_chunk:
                raise ValueError(f"hybrid mode takes chunks of {self.prefill_chunk} tokens or one token, got {T}")
            # padding (-1) continues the positions (the runners do the same)
            input_pos = (input_pos[0] + torch.arange(T, device=input_pos.device)).clamp(max=self.max_seq_length - 1)
            runner = self.prefill_runner
        with torch.inference_mode():
            out = runner(tokens.to(self.device), input_pos.to(self.device), **kw)
        return out[0] if isinstance(out, (list, tuple)) else out

    def forward_masked(self, tokens, input_pos, mask):
        """The "lookahead" model: speculative.py's lookahead contract."""
        if not self.has_masked:
            raise ValueError("forward_masked needs mode='lookahead'")
        with torch.inference_mode():
            out = self.runner(tokens.to(self.device), input_pos.to(self.device),
                              mask=mask.to(self.device, getattr(torch, self.metadata.get("dtype", "float32"))))
        return out[0] if isinstance(out, (list, tuple)) else out


# ----------------------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = ArgumentParser(description="Export a checkpoint to an AOT Inductor package (.pt2).")
    p.add_argument("--checkpoint_path", type=Path, required=True, help="model.pth (float or quantize.py output)")
    p.add_argument("--output_path", "--out-path", type=Path, required=True, suffix=(".pt2", ".so"),
                   help="the .pt2 to write (or a .so: --so, implied by the name)")
    p.add_argument("--tokenizer_path", type=Path, default=None, help="default: the checkpoint's directory")
    p.add_argument("--max_seq_length", type=int, default=1024, help="KV cache length = longest prompt + reply", rule=at_least(1))
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--so", action="store_true", help="write a plain shared library (weights inside) instead of a .pt2")
    p.add_argument("--prefill_chunk", type=int, default=None,
                   help="hybrid mode: add the model \"prefill\" (a fixed length of N tokens)", rule=at_least(1))
    p.add_argument("--lookahead", action="store_true", help="lookahead mode: add the model \"lookahead\" (tokens, positions, mask)")
    p.add_argument("--fast_prefill", action="store_true", help="add the model \"prompt\" (ATen GEMMs, last logits; weights twice)")
    p.add_argument("--threads", type=int, default=None, rule=THREADS, help="CPU threads the package's kernels are "
                   "compiled for (default: torch's); run it with as many")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    so = args.so or args.output_path.suffix == ".so"  # the source docs' `--out-path X.so`
    export(args.checkpoint_path, args.output_path, args.max_seq_length, args.dtype, args.device,
           args.tokenizer_path, so, log=lambda *a: print(*a, file=sys.stderr), prefill_chunk=args.prefill_chunk,
           lookahead=args.lookahead, fast_prefill=args.fast_prefill)


if __name__ == "__main__":
    cli(main)
