# torch_internals.py: every use of PyTorch's private APIs in one place (Inductor's and Dynamo's settings, AOT
# Inductor's package internals, the C++ wrapper source it generates), written against torch 2.13. Importing this file
# checks the version once; a torch upgrade that moves one of these names breaks here and nowhere else.
import contextlib
import re
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch.export._tree_utils import reorder_kwargs

TESTED = "2.13"
if not torch.__version__.startswith(TESTED + "."):
    raise ImportError(f"torch_internals.py uses private APIs of torch {TESTED}; this is torch {torch.__version__} "
                      f"(pip install torch=={TESTED}.0, or check the names in torch_internals.py)")

_COMPILER = ("dynamo_config", "aot_compile", "aoti_compile_and_package", "statically_known_true", "PT2ArchiveWriter")
inductor_config = None  # Inductor's config module once compiler() has run (freezing() reads it while Dynamo traces)


def compiler() -> None:
    """Imports Dynamo's, Inductor's and torch.export's modules and binds the names in _COMPILER here (idempotent).
    Not at import: they are half of a script's start (~1.5 of 3 s), which eager generation, the servers and every
    error line would pay for nothing. Code that compiles or exports calls it first (fast_cpu_quant.compile_setup);
    reading one of the names (TI.aot_compile) calls it too."""
    global dynamo_config, inductor_config, aot_compile, aoti_compile_and_package, statically_known_true
    global PT2ArchiveWriter
    if inductor_config is not None:
        return
    import torch._dynamo
    import torch._inductor.config
    from torch.fx.experimental.symbolic_shapes import statically_known_true  # (fast_cpu_quant)
    from torch.export.pt2_archive._package import PT2ArchiveWriter  # (aoti_export.package_shared)
    dynamo_config = torch._dynamo.config
    aot_compile = torch._inductor.aot_compile
    aoti_compile_and_package = torch._inductor.aoti_compile_and_package
    inductor_config = torch._inductor.config  # (last: the sign that every name is bound)


def __getattr__(name):  # (PEP 562: a name of _COMPILER read before compiler() ran)
    if name in _COMPILER:
        compiler()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PyTorchFileReader = torch._C.PyTorchFileReader


def set_inductor(settings: dict) -> None:
    """Assign Inductor settings (dotted names reach sub-configs: "cpp.enable_floating_point_contract_flag")."""
    compiler()
    for name, value in settings.items():
        cfg, *path, last = [inductor_config, *name.split(".")]
        for part in path:
            cfg = getattr(cfg, part)
        setattr(cfg, last, value)


def freezing() -> bool:
    """Whether the graph being compiled takes its weights as constants (Inductor's freezing; never where compiler()
    has not run: a torch.compile of another backend than fast_cpu.configure_inductor's, tp.py's tests)."""
    return inductor_config is not None and bool(inductor_config.freezing)


def no_freezing():
    """A context in which torch.compile traces and compiles with the weights as graph inputs."""
    compiler()
    return inductor_config.patch(freezing=False)


def mark_static(t):
    """Marks a plain tensor attribute's sizes static for torch.compile (returns it). Only compiled code reads the mark:
    before compiler() has run (eager generation) it is left off."""
    if inductor_config is not None:
        torch._dynamo.mark_static(t)
    return t


def dont_constant_fold(*ops: str) -> None:
    """Keeps Inductor's freezing from folding these ATen ops ("name.overload", e.g. nibble shifts) into constants;
    each op is added once, however often it is called (fast_cpu.configure_inductor runs for every compiled model)."""
    with contextlib.suppress(ImportError, AttributeError):
        from torch._inductor import constant_folding
        for name, overload in (op.split(".") for op in ops):
            op = getattr(getattr(torch.ops.aten, name), overload)
            if op not in constant_folding._dont_constant_fold:
                constant_folding.add_dont_constant_fold(op)


def force_stride_order():
    """Inductor's prim that materializes its input in a buffer of its own (None where it is missing)."""
    try:
        import torch._inductor.inductor_prims  # noqa: F401  (registers the prim)
        return torch.ops.prims.inductor_force_stride_order
    except (ImportError, AttributeError):
        return None


class _PackagedModel:
    """torch._inductor.package.load_package(path, model) without importing Inductor and Dynamo (~2 s of a script's
    start): what its AOTICompiledModel does, over the same loader (.loader), called as the exported program."""

    def __init__(self, path: str, model: str):
        self.loader = torch._C._aoti.AOTIModelPackageLoader(path, model, False, 1, -1)
        spec = self.loader.get_call_spec()
        self._in, self._out = pytree.treespec_loads(spec[0]), pytree.treespec_loads(spec[1])

    def __call__(self, *args, **kwargs):
        flat = pytree.tree_flatten((args, reorder_kwargs(kwargs, self._in)))[0]
        out = self.loader.boxed_run([x for x in flat if isinstance(x, torch.Tensor)])
        return pytree.tree_unflatten(out, self._out)

    def get_metadata(self) -> dict:
        return self.loader.get_metadata()


def load_package(path: str, model: str):
    return _PackagedModel(path, model)


def package_metadata(path: str, model: str) -> dict:
    return torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(path, model)


def container_runner(path: str, device: str):
    """The runner of a plain AOT Inductor .so (what a package's loader wraps)."""
    cls = torch._C._aoti.AOTIModelContainerRunnerCuda if device == "cuda" else torch._C._aoti.AOTIModelContainerRunnerCpu
    return cls(path, 1)


def constant_table(wrapper_cpp) -> list[dict]:
    """A compiled model's constants in the order of its weights blob, from the wrapper source AOT Inductor generates
    (its constants_info_[i] lines: name, dtype, storage offset, data_size (64-byte aligned), shape, stride)."""
    rows: dict[int, dict] = {}
    for i, field, value in re.findall(r"constants_info_\[(\d+)\]\.(\w+) = (.*);", Path(wrapper_cpp).read_text()):
        rows.setdefault(int(i), {})[field] = value
    table = []
    for i in sorted(rows):
        r = rows[i]
        if r.get("from_folded") != "false" or "layout_strided" not in r.get("layout", ""):
            raise RuntimeError(f"{wrapper_cpp}: constant {r.get('name')} is folded or not strided (unsupported)")
        dims = lambda v: [int(x) for x in v.strip("{}").split(",") if x.strip()]
        table.append(dict(name=r["name"].strip('"'), dtype=re.search(r"dtype_(\w+)", r["dtype"])[1],
                          offset=int(r["offset"]), nbytes=int(r["data_size"]), shape=dims(r["shape"]),
                          stride=dims(r["stride"])))
    return table


def onednn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 products on this CPU (AVX512-BW/VL/DQ or AVX-NE-CONVERT): its packed bfloat16
    weights fail to build elsewhere (an AVX2 machine)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_has(feature: str) -> bool:
    """Whether this CPU has an instruction set torch checks for: avx2, avx512_bf16, amx_tile
    (torch.cpu._is_*_supported)."""
    return bool(getattr(torch.cpu, f"_is_{feature}_supported", lambda: False)())
