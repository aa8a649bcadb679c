# pte_backend.py: an ExecuTorch .pte from et_export.py run from Python (ExecuTorch's runtime) as an engine.py backend,
# in every mode the runners have (kv, hybrid, lookahead); the methods it calls are et_export.export_pte's contract.
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from common import first_line, native_output_filtered


def _check_pte_file(path: Path):
    """Cheap structural check so a truncated or foreign file gives a one-line error instead of a runtime abort."""
    if not path.is_file():
        raise FileNotFoundError(f".pte not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
    if len(head) < 40 or head[4:6] != b"ET":
        raise ValueError(f"{path} is not an ExecuTorch program (.pte): no 'ET' flatbuffer identifier")
    if head[8:12] == b"eh00":
        program_size = int.from_bytes(head[16:24], "little")
        seg_base = int.from_bytes(head[24:32], "little")
        seg_size = int.from_bytes(head[32:40], "little") if int.from_bytes(head[12:16], "little") >= 32 else 0
        need = max(program_size, seg_base + seg_size if seg_base else 0)
        if size < need:
            raise ValueError(f"{path} is truncated: {size} bytes, the program says {need} (re-run et_export.py)")


def _needs_x86_kernels(path: Path) -> bool:
    """Whether the program calls llama_flat::q8a4w_mm (et_export.py --x86_kernels): its operator table names it, in
    the flatbuffer before the weights' segments (the extended header's program size)."""
    with open(path, "rb") as f:
        head = f.read(64)
        size = int.from_bytes(head[16:24], "little") if head[8:12] == b"eh00" else 64 << 20
        f.seek(0)
        return b"llama_flat::q8a4w_mm" in f.read(min(size, 64 << 20))


class _Method:
    def __init__(self, method):
        self.execute = method  # execute(inputs) -> outputs, as executorch.runtime's Method


class _Program:
    """executorch.runtime's Program over its extension module, _C: method_names, load_method(name).execute(inputs)."""

    def __init__(self, program):
        self._program, self._methods = program, {}
        self.method_names = {program.get_method_name(i) for i in range(program.num_methods())}

    def load_method(self, name):
        if name not in self._methods:
            self._methods[name] = _Method(self._program.load_method(name))
        return self._methods[name]


def load_program(path: Path):
    """executorch.runtime.Runtime.get().load_program(path), without that module's import: it imports the whole
    exporter (executorch.exir, which parses a YAML of every edge op: ~7 of a `generate.py --pte` run's 15 s) for one
    warning class. Its extension module is what it wraps; where that differs (another ExecuTorch), the runtime."""
    try:
        from executorch.extension.pybindings import _C
        return _Program(_C._load_program(str(path), enable_etdump=False, debug_buffer_size=0,
                                         program_verification=_C.Verification.InternalConsistency, data_path=None))
    except (ImportError, AttributeError, TypeError):  # (TypeError: another signature; a bad file: RuntimeError)
        from executorch.runtime import Runtime
        return Runtime.get().load_program(path)


# what each decoding mode loads from a .pte, and the export flag that writes it (the runners say the same)
MODE_METHODS = {"kv": ("forward", None), "hybrid": ("prefill", "--prefill_chunk N"),
                "lookahead": ("lookahead", "--lookahead")}


class PTEBackend:
    """generate.py backend over an ExecuTorch .pte, through ExecuTorch's Python runtime.
    forward(tokens [1, T], input_pos [T]) -> logits [1, T, V]; one sequence. mode (the runners' -M): "kv" runs
    `forward` (any prompt length in one call); "hybrid" runs prompts through `prefill` in chunks of its length
    (prefill_chunk; generate.py / eval.py pad the last one) and decodes with `decode`; "lookahead" runs everything
    through `lookahead` (causal masks) and offers forward_masked() (speculative.py's contract). In kv mode a program's
    `prompt` method (--fast_prefill) takes the calls that ask for one position's logits (engine.prefill's logits_at)."""

    max_batch_size = 1
    prefill_chunk = None
    logits_at = False  # True with a `prompt` method (kv mode)

    def __init__(self, path, method: str = "forward", mode: str = "kv"):
        path = Path(path)
        _check_pte_file(path)
        if _needs_x86_kernels(path):
            import fast_cpu_kernels
            try:
                fast_cpu_kernels.load_et_kernels()
            except RuntimeError as e:
                raise ValueError(f"{path} was exported with --x86_kernels: {e}") from None
        try:
            import executorch.kernels.quantized  # noqa: F401 - registers quantized_decomposed kernels (embeddings)
        except Exception:  # noqa: BLE001 - only quantized programs need them; loading says so if they do
            pass
        try:
            self.program = load_program(path)
            names = self.program.method_names
        except Exception as e:  # noqa: BLE001 - the runtime raises RuntimeError with multi-line details
            raise ValueError(f"cannot load {path}: not a valid ExecuTorch program, truncated or corrupt "
                             f"({type(e).__name__})") from None
        if mode not in MODE_METHODS:
            raise ValueError(f"unknown mode {mode!r}: kv, hybrid or lookahead")
        need, flag = MODE_METHODS[mode]
        if mode != "kv" and need not in names:
            raise ValueError(f"{path} has no `{need}` method, which {mode} mode needs: export it with et_export.py "
                             f"{flag}")
        method = need if mode != "kv" else method
        if method not in names:
            raise ValueError(f"{path} has no method {method!r} (methods: {', '.join(sorted(names))})")
        self.mode = mode
        self.path = path
        self.method_names = names
        self.constants = {}
        for name in sorted(names):
            if name.startswith(("get_", "use_", "enable_")):
                try:
                    vals = list(self.program.load_method(name).execute([]))
                except Exception as e:  # noqa: BLE001
                    raise ValueError(f"cannot run constant method {name} of {path} ({type(e).__name__})") from None
                vals = [v.item() if isinstance(v, Tensor) and v.numel() == 1 else v for v in vals]
                self.constants[name] = vals if name == "get_eos_ids" else vals[0]
        if "get_max_seq_len" not in self.constants:
            raise ValueError(f"{path} has no get_max_seq_len method: not exported by et_export.py")
        self.max_seq_length = int(self.constants["get_max_seq_len"])
        self.vocab_size = self.constants.get("get_vocab_size")
        self.method = self._load(method)
        self.has_masked = mode == "lookahead"
        self.prompt = self._load("prompt") if mode == "kv" and "prompt" in names else None
        self.logits_at = self.prompt is not None
        if mode == "hybrid":
            self.prefill_chunk = int(self.constants["get_prefill_chunk"])
            self.decode = self._load("decode" if "decode" in names else "forward")

    def _load(self, method):
        try:
            with native_output_filtered():  # the runtime's threadpool prints cpuinfo noise at the first load
                return self.program.load_method(method)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot load method {method!r} of {self.path}: {type(e).__name__}: "
                             f"{first_line(e)}") from None

    def forward_masked(self, tokens: Tensor, input_pos: Tensor, mask: Tensor) -> Tensor:
        """The `lookahead` method: speculative.py's lookahead contract."""
        if not self.has_masked:
            raise ValueError(f"{self.path}: forward_masked needs mode='lookahead'")
        return self.method.execute([tokens.to(torch.long).contiguous(), input_pos.to(torch.long).contiguous(),
                                    mask.to(torch.float32).contiguous()])[0]

    def forward(self, tokens: Tensor, input_pos: Tensor, logits_at: Optional[Tensor] = None) -> Tensor:
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"the .pte runs one sequence: tokens must be [1, T], got {list(tokens.shape)}")
        if input_pos.dim() == 2 and input_pos.shape[0] == 1:
            input_pos = input_pos[0]
        T = tokens.shape[1]
        if self.mode == "hybrid" and T == self.prefill_chunk:  # padding (-1) continues the positions (the runners too)
            input_pos = (input_pos[0] + torch.arange(T)).clamp(max=self.max_seq_length - 1)
        elif (input_pos < 0).any():
            raise ValueError("the .pte takes shared positions input_pos [T] (no padding)")
        if int(input_pos.max()) >= self.max_seq_length or T > self.max_seq_length:
            raise ValueError(f"position {int(input_pos[-1])} is beyond the .pte's max_seq_len {self.max_seq_length}")
        tokens, input_pos = tokens.to(torch.long).contiguous(), input_pos.to(torch.long).contiguous()
        if self.mode == "lookahead":
            return self.forward_masked(tokens, input_pos, _causal(input_pos, self.max_seq_length))
        if self.mode == "hybrid" and T != self.prefill_chunk:
            if T != 1:
                raise ValueError(f"hybrid mode takes chunks of {self.prefill_chunk} tokens or one token, got {T}")
            return self.decode.execute([tokens, input_pos])[0]
        if self.prompt is not None and logits_at is not None and T > 1:
            return self.prompt.execute([tokens, input_pos, logits_at.to(torch.long).reshape(1).contiguous()])[0]
        return self.method.execute([tokens, input_pos])[0]


def _causal(input_pos: Tensor, S: int) -> Tensor:
    from speculative import causal_mask
    return causal_mask(input_pos.cpu(), S)
