# Issue 18: every bad flag and bad file, in every script, is exit code 1 and exactly one `error: ...` line on stderr,
# no traceback, found before anything loads (so each row costs only the flag check or a refused file), with nothing
# new at the output path and no temporary litter; SIGTERM during an export leaves nothing behind.
#
# One table, one row per case (the and the ones already handled, so they stay handled). Most rows call the
# script's main(argv) in this process through common.cli, exactly what its `if __name__ == "__main__": cli(main)`
# does; the rows marked SUBPROCESS run the real command line. Rows that need a change in a file this test does not
# own are xfail(strict=True) with the change named: when it lands they pass, and strict makes the lead flip them.
# Rows for scripts that would do real work if their check were missing use a junk checkpoint (a file that exists but
# is no checkpoint), so a missing check fails fast on the junk instead of exporting for minutes.
import importlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "scripts"))

GEN = None  # "needs generate.py to build its parser with common.ArgumentParser"
ET = None  # "needs et_export.py to build its parser with common.ArgumentParser"
ONNX = None  # "needs export_onnx.py to build its parser with common.ArgumentParser"
AOTI = None  # "needs aoti_export.py to build its parser with common.ArgumentParser"
QUANT = None  # "needs quantize.py to build its parser with common.ArgumentParser"
BENCH = None  # "needs bench.py to build its parser with common.ArgumentParser"
CONV = None  # "needs scripts/convert_checkpoint.py to build its parser with common.ArgumentParser"
TOKBIN = None  # "needs scripts/export_tokenizer_bin.py to build its parser with common.ArgumentParser"
TOKPY = None  # "needs tokenizer.py to build its parser with common.ArgumentParser"
GGUFTOK = None  # "needs scripts/gguf_tokenizer.py to build its parser with common.ArgumentParser"
SERVER = None  # "needs server.py to build its parser with common.ArgumentParser"
CONFIG = None  # "needs checkpoint.py load_model to check that _config / _quantization are JSON object strings"
SUBPROCESS = "subprocess"

G = ["--prompt", "hi", "--max_new_tokens", "2", "--temperature", "0", "--quiet"]
QAIC = ["--output_dir", "{out}/qaic", "--prompt_len", "8", "--ctx_len", "32"]
PEER_T = ["time", "--gguf", "{random}", "--tokenizer_path", "{ckdir}"]

# (id, script, argv with {placeholders}, regex the one error line must match, xfail reason or None, SUBPROCESS or None)
ROWS = [
    # ---------------------------------------------------------------- generate.py: decoding flags (issue's list)
    ("generate-max_new_tokens--1", "generate.py", ["--checkpoint_path", "{ck}", "--prompt", "hi", "--max_new_tokens",
                                                   "-1"], r"--max_new_tokens must be >= 1, got -1", GEN, SUBPROCESS),
    ("generate-temperature--1", "generate.py", ["--checkpoint_path", "{ck}", *G, "--temperature", "-1"],
     r"--temperature must be >= 0", GEN, None),
    ("generate-temperature-nan", "generate.py", ["--checkpoint_path", "{ck}", *G, "--temperature", "nan"],
     r"--temperature must be", GEN, None),
    ("generate-top_p-2", "generate.py", ["--checkpoint_path", "{ck}", *G, "--top_p", "2"],
     r"--top_p must be in \(0, 1\], got 2$", GEN, None),
    ("generate-top_k--5", "generate.py", ["--checkpoint_path", "{ck}", *G, "--top_k", "-5"],
     r"--top_k must be >= 1, got -5", GEN, None),
    ("generate-prefill_chunk-0", "generate.py", ["--checkpoint_path", "{ck}", *G, "--prefill_chunk", "0"],
     r"--prefill_chunk must be >= 1", GEN, None),
    ("generate-full_batch_size-0", "generate.py", ["--checkpoint_path", "{ck}", *G, "--full_batch_size", "0"],
     r"--full_batch_size must be >= 1", GEN, None),
    ("generate-max_seq_length-0", "generate.py", ["--checkpoint_path", "{ck}", *G, "--max_seq_length", "0"],
     r"--max_seq_length must be >= 1", GEN, None),
    ("generate-num_samples-0", "generate.py", ["--checkpoint_path", "{ck}", *G, "--num_samples", "0"],
     r"--num_samples must be >= 1", GEN, None),
    ("generate-seed--3", "generate.py", ["--checkpoint_path", "{ck}", *G, "--seed", "-3"],
     r"--seed must be >= 0", GEN, None),
    ("generate-max_new_tokens-x", "generate.py", ["--checkpoint_path", "{ck}", *G, "--max_new_tokens", "x"],
     r"invalid int value: 'x'", GEN, None),
    ("generate-unknown-flag", "generate.py", ["--checkpoint_path", "{ck}", *G, "--bogus"],
     r"unrecognized arguments: --bogus", GEN, None),
    ("generate-onnx-random-bytes", "generate.py", ["--checkpoint_path", "{ck}", *G, "--onnx", "{random}"],
     r"is not an ONNX graph", GEN, None),
    ("generate-draft-missing", "generate.py", ["--checkpoint_path", "{ck}", *G, "--draft_checkpoint_path", "{missing}"],
     r"checkpoint not found", None, None),
    # generate.py: already handled (they stay so)
    ("generate-threads-0", "generate.py", ["--checkpoint_path", "{ck}", *G, "--threads", "0"],
     r"--threads must be in \[1, 1024\], got 0", None, None),
    ("generate-speculate_k-0", "generate.py", ["--checkpoint_path", "{ck}", *G, "--speculate_k", "0",
                                               "--draft_checkpoint_path", "{ck}"], r"speculate_k", None, None),
    ("generate-checkpoint-missing", "generate.py", ["--checkpoint_path", "{missing}", *G],
     r"^error: checkpoint not found: .*missing", None, SUBPROCESS),
    ("generate-checkpoint-missing-with-tokenizer", "generate.py", ["--checkpoint_path", "{missing}", *G,
                                                                   "--tokenizer_path", "{ckdir}"],
     r"checkpoint not found", None, None),
    ("generate-checkpoint-junk", "generate.py", ["--checkpoint_path", "{junk}", *G, "--tokenizer_path", "{ckdir}"],
     r"not a valid PyTorch", None, None),
    ("generate-config-int", "generate.py", ["--checkpoint_path", "{cfg_int}", *G], r"_config", CONFIG, None),
    ("generate-config-list", "generate.py", ["--checkpoint_path", "{cfg_list}", *G], r"_config", CONFIG, None),
    ("generate-config-not-json", "generate.py", ["--checkpoint_path", "{cfg_text}", *G], r"", None, None),
    ("generate-onnx-missing", "generate.py", ["--onnx", "{missing}", "--tokenizer_path", "{ckdir}", *G],
     r"ONNX graph not found", None, None),
    ("generate-aoti-missing", "generate.py", ["--aoti_package", "{missing}", "--tokenizer_path", "{ckdir}", *G],
     r"not found", None, None),
    ("generate-tokenizer-missing", "generate.py", ["--checkpoint_path", "{ck}", *G, "--tokenizer_path", "{missing}"],
     r"tokenizer path not found", None, None),
    ("generate-prompts_file-missing", "generate.py", ["--checkpoint_path", "{ck}", *G[2:], "--prompts_file", "{missing}"],
     r"prompts file not found", None, None),
    ("generate-device-tpu", "generate.py", ["--checkpoint_path", "{ck}", *G, "--device", "tpu"],
     r"invalid choice: 'tpu'", GEN, None),
    # ---------------------------------------------------------------- server.py (checked before it listens or loads)
    ("server-port-70000", "server.py", ["--checkpoint_path", "{ck}", "--port", "70000"], r"--port", None, None),
    ("server-threads-0", "server.py", ["--checkpoint_path", "{ck}", "--threads", "0"],
     r"--threads must be in \[1, 1024\], got 0", None, None),
    ("server-unknown-flag", "server.py", ["--checkpoint_path", "{ck}", "--port", "0", "--bogus"],
     r"unrecognized arguments", SERVER, None),
    ("server-max_seq_length-0", "server.py", ["--checkpoint_path", "{missing}", "--port", "0", "--max_seq_length", "0"],
     r"--max_seq_length must be >= 1", SERVER, None),
    # ---------------------------------------------------------------- eval.py
    ("eval-max_tokens-0", "eval.py", ["--checkpoint_path", "{ck}", "--text_file", "{text}", "--max_tokens", "0"],
     r"--max_tokens must be >= 2, got 0", None, SUBPROCESS),
    ("eval-max_tokens-1", "eval.py", ["--checkpoint_path", "{ck}", "--text_file", "{text}", "--max_tokens", "1"],
     r"--max_tokens must be", None, None),
    ("eval-stride-0", "eval.py", ["--checkpoint_path", "{ck}", "--text_file", "{text}", "--stride", "0"],
     r"--stride must be >= 1", None, None),
    ("eval-max_seq_length-1", "eval.py", ["--checkpoint_path", "{ck}", "--text_file", "{text}", "--max_seq_length",
                                          "1"], r"at least 2", None, None),
    ("eval-stride-over-window", "eval.py", ["--checkpoint_path", "{ck}", "--text_file", "{text}", "--max_seq_length",
                                            "64", "--stride", "65"], r"--stride must be between", None, None),
    ("eval-text-missing", "eval.py", ["--checkpoint_path", "{ck}", "--text_file", "{missing}"],
     r"text file not found", None, None),
    ("eval-checkpoint-missing", "eval.py", ["--checkpoint_path", "{missing}", "--text_file", "{text}"],
     r"checkpoint not found", None, None),
    ("eval-onnx-random-bytes", "eval.py", ["--onnx", "{random}", "--tokenizer_path", "{ckdir}", "--text_file",
                                           "{text}"], r"is not an ONNX graph", None, None),
    ("eval-unknown-flag", "eval.py", ["--checkpoint_path", "{ck}", "--text_file", "{text}", "--bogus"],
     r"unrecognized arguments", None, None),
    # ---------------------------------------------------------------- compile_qaic.py (no compiler here)
    ("qaic-onnx-random-bytes-dry-run", "compile_qaic.py", ["--onnx_path", "{random}", *QAIC, "--dry_run"],
     r"is not an ONNX graph", None, SUBPROCESS),
    ("qaic-onnx-random-bytes", "compile_qaic.py", ["--onnx_path", "{random}", *QAIC],
     r"is not an ONNX graph", None, None),
    ("qaic-onnx-empty-file", "compile_qaic.py", ["--onnx_path", "{empty}", *QAIC, "--dry_run"],
     r"is not an ONNX graph", None, None),
    ("qaic-onnx-missing", "compile_qaic.py", ["--onnx_path", "{missing}", *QAIC, "--dry_run"],
     r"ONNX graph not found", None, None),
    ("qaic-num_cores-0", "compile_qaic.py", ["--checkpoint_path", "{ck}", *QAIC, "--num_cores", "0", "--dry_run"],
     r"--num_cores must be in \[1, 16\], got 0", None, None),
    ("qaic-num_cores-17", "compile_qaic.py", ["--checkpoint_path", "{ck}", *QAIC, "--num_cores", "17", "--dry_run"],
     r"--num_cores must be", None, None),
    ("qaic-prompt_len-0", "compile_qaic.py", ["--checkpoint_path", "{ck}", "--output_dir", "{out}/q", "--prompt_len",
                                              "0", "--dry_run"], r"--prompt_len must be >= 1", None, None),
    ("qaic-ctx_len-0", "compile_qaic.py", ["--checkpoint_path", "{ck}", "--output_dir", "{out}/q", "--ctx_len", "0",
                                           "--dry_run"], r"--ctx_len must be >= 1", None, None),
    ("qaic-batch_size-0", "compile_qaic.py", ["--checkpoint_path", "{ck}", *QAIC, "--batch_size", "0", "--dry_run"],
     r"--batch_size must be >= 1", None, None),
    ("qaic-full_batch_size-0", "compile_qaic.py", ["--checkpoint_path", "{ck}", *QAIC, "--full_batch_size", "0",
                                                   "--dry_run"], r"--full_batch_size must be >= 1", None, None),
    ("qaic-mos--2", "compile_qaic.py", ["--checkpoint_path", "{ck}", *QAIC, "--mos", "-2", "--dry_run"],
     r"--mos must be", None, None),
    ("qaic-prompt-over-ctx", "compile_qaic.py", ["--checkpoint_path", "{ck}", "--output_dir", "{out}/q",
                                                 "--prompt_len", "64", "--ctx_len", "32", "--dry_run"],
     r"longer than --ctx_len", None, None),
    ("qaic-full_batch_size-with-batch", "compile_qaic.py", ["--checkpoint_path", "{ck}", *QAIC, "--full_batch_size",
                                                            "2", "--batch_size", "2", "--dry_run"],
     r"leave --batch_size at 1", None, None),
    ("qaic-checkpoint-missing", "compile_qaic.py", ["--checkpoint_path", "{missing}", *QAIC, "--dry_run"],
     r"checkpoint not found", None, None),
    ("qaic-output_dir-under-file", "compile_qaic.py", ["--checkpoint_path", "{ck}", "--output_dir", "{file}/q",
                                                       "--dry_run"], r"is a file", None, None),
    ("qaic-device_group-bad", "compile_qaic.py", ["--checkpoint_path", "{ck}", *QAIC, "--device_group", "0,x"],
     r"device ids", None, None),
    ("qaic-no-compiler", "compile_qaic.py", ["--checkpoint_path", "{ck}", *QAIC], r"qaic-exec", None, None),
    # ---------------------------------------------------------------- export_onnx.py
    ("onnx-ctx_len-0", "export_onnx.py", ["--checkpoint_path", "{junk}", "--output_dir", "{out}/o", "--ctx_len", "0"],
     r"--ctx_len must be >= 1", ONNX, None),
    ("onnx-max_ctx_len-0", "export_onnx.py", ["--checkpoint_path", "{junk}", "--output_dir", "{out}/o",
                                              "--max_ctx_len", "0"], r"--max_ctx_len must be >= 1", ONNX, None),
    ("onnx-opset-3", "export_onnx.py", ["--checkpoint_path", "{junk}", "--output_dir", "{out}/o", "--opset", "3"],
     r"--opset must be in", ONNX, None),
    ("onnx-atol-nan", "export_onnx.py", ["--checkpoint_path", "{junk}", "--output_dir", "{out}/o", "--atol", "nan"],
     r"--atol must be > 0", ONNX, None),
    ("onnx-output_dir-under-file", "export_onnx.py", ["--checkpoint_path", "{junk}", "--output_dir", "{file}/o"],
     r"is a file", ONNX, None),
    ("onnx-full_batch_size-0", "export_onnx.py", ["--checkpoint_path", "{junk}", "--output_dir", "{out}/o",
                                                  "--full_batch_size", "0"],
     r"full_batch_size must be >= 1", None, None),
    ("onnx-checkpoint-missing", "export_onnx.py", ["--checkpoint_path", "{missing}", "--output_dir", "{out}/o"],
     r"checkpoint not found", None, None),
    ("onnx-checkpoint-junk", "export_onnx.py", ["--checkpoint_path", "{junk}", "--output_dir", "{out}/o"],
     r"not a valid PyTorch", None, None),
    # ---------------------------------------------------------------- et_export.py
    ("et-prefill_chunk--4", "et_export.py", ["--checkpoint_path", "{junk}", "--output_path", "{out}/x.pte",
                                             "--prefill_chunk", "-4"],
     r"--prefill_chunk must be >= 1, got -4", ET, SUBPROCESS),
    ("et-output-folder-missing", "et_export.py", ["--checkpoint_path", "{junk}", "--output_path", "{out}/nodir/x.pte"],
     r"folder .*nodir does not exist", ET, None),
    ("et-output-is-folder", "et_export.py", ["--checkpoint_path", "{junk}", "--output_path", "{out}"],
     r"is a folder", ET, None),
    ("et-groupsize-48", "et_export.py", ["--checkpoint_path", "{junk}", "--output_path", "{out}/x.pte", "--quantize",
                                         "8da4w", "--groupsize", "48"],
     r"--groupsize must be one of 32, 64, 128, 256", ET, None),
    ("et-eos_ids-negative", "et_export.py", ["--checkpoint_path", "{junk}", "--output_path", "{out}/x.pte",
                                             "--eos_ids", "2", "-1"], r"--eos_ids must be >= 0", ET, None),
    ("et-max_seq_length-0", "et_export.py", ["--checkpoint_path", "{junk}", "--output_path", "{out}/x.pte",
                                             "--max_seq_length", "0"], r"max_seq_length", None, None),
    ("et-checkpoint-missing", "et_export.py", ["--checkpoint_path", "{missing}", "--output_path", "{out}/x.pte"],
     r"checkpoint not found", None, None),
    ("et-checkpoint-junk", "et_export.py", ["--checkpoint_path", "{junk}", "--output_path", "{out}/x.pte"],
     r"not a valid PyTorch", None, None),
    # ---------------------------------------------------------------- aoti_export.py
    ("aoti-max_seq_length-0", "aoti_export.py", ["--checkpoint_path", "{junk}", "--output_path", "{out}/x.pt2",
                                                 "--max_seq_length", "0"], r"max_seq_length", None, None),
    ("aoti-output-folder-missing", "aoti_export.py", ["--checkpoint_path", "{junk}", "--output_path",
                                                      "{out}/nodir/x.pt2"], r"nodir", None, None),
    ("aoti-checkpoint-missing", "aoti_export.py", ["--checkpoint_path", "{missing}", "--output_path", "{out}/x.pt2"],
     r"checkpoint not found", None, None),
    ("aoti-output-is-folder", "aoti_export.py", ["--checkpoint_path", "{junk}", "--output_path", "{out}"],
     r"is a folder", AOTI, None),
    ("aoti-unknown-flag", "aoti_export.py", ["--checkpoint_path", "{junk}", "--output_path", "{out}/x.pt2", "--bogus"],
     r"unrecognized arguments", AOTI, None),
    # ---------------------------------------------------------------- quantize.py
    ("quantize-groupsize-48", "quantize.py", ["--checkpoint_path", "{junk}", "--mode", "int4", "--groupsize", "48"],
     r"--groupsize must be", None, None),
    ("quantize-mode-int3", "quantize.py", ["--checkpoint_path", "{junk}", "--mode", "int3"],
     r"unknown mode", None, None),
    ("quantize-checkpoint-missing", "quantize.py", ["--checkpoint_path", "{missing}", "--mode", "int8"],
     r"checkpoint not found", None, None),
    ("quantize-calibration-missing", "quantize.py", ["--checkpoint_path", "{junk}", "--mode", "int4-gptq",
                                                     "--calibration_file", "{missing}"],
     r"calibration file not found", None, None),
    ("quantize-calibration_tokens-0", "quantize.py", ["--checkpoint_path", "{junk}", "--mode", "8da4w",
                                                      "--calibration_file", "{text}", "--calibration_tokens", "0"],
     r"--calibration_tokens must be >= 1", QUANT, None),
    ("quantize-damp--1", "quantize.py", ["--checkpoint_path", "{junk}", "--mode", "8da4w", "--calibration_file",
                                         "{text}", "--damp", "-1"], r"--damp must be >= 0", QUANT, None),
    ("quantize-output-folder-missing", "quantize.py", ["--checkpoint_path", "{junk}", "--mode", "int8", "--output",
                                                       "{out}/nodir/q.pth"],
     r"folder .*nodir does not exist", QUANT, None),
    # ---------------------------------------------------------------- bench.py (--rows x: a missing check stops there)
    ("bench-runs-0", "bench.py", ["--runs", "0", "--json", "{out}/b.json"], r"--runs must be >= 1", None, None),
    ("bench-rounds-0", "bench.py", ["--rounds", "0", "--json", "{out}/b.json"], r"--rounds must be >= 1", None, None),
    ("bench-json-folder-missing", "bench.py", ["--rows", "x", "--json", "{out}/nodir/b.json"],
     r"folder .*nodir does not exist", BENCH, None),
    ("bench-unknown-flag", "bench.py", ["--rows", "x", "--bogus"], r"unrecognized arguments", BENCH, None),
    # ---------------------------------------------------------------- scripts
    ("download-checkpoint_dir-under-file", "scripts/download.py", ["--checkpoint_dir", "{file}/x"],
     r"is a file, not a folder", None, None),
    ("download-unknown-flag", "scripts/download.py", ["--bogus"], r"unrecognized arguments", None, None),
    ("peer-threads-0", "scripts/llamacpp_peer.py", [*PEER_T, "--threads", "0"],
     r"--threads must be >= 1", None, None),
    ("peer-runs-0", "scripts/llamacpp_peer.py", [*PEER_T, "--runs", "0"], r"--runs must be >= 1", None, None),
    ("peer-n_ctx-0", "scripts/llamacpp_peer.py", [*PEER_T, "--n_ctx", "0"], r"--n_ctx must be >= 1", None, None),
    ("peer-max_new_tokens-0", "scripts/llamacpp_peer.py", [*PEER_T, "--max_new_tokens", "0"],
     r"--max_new_tokens must be >= 1", None, None),
    ("peer-gguf-missing", "scripts/llamacpp_peer.py", ["time", "--gguf", "{missing}"], r"GGUF not found", None, None),
    ("peer-checkpoint-missing", "scripts/llamacpp_peer.py", ["write", "--checkpoint_path", "{missing}"],
     r"checkpoint not found", None, None),
    ("peer-output-folder-missing", "scripts/llamacpp_peer.py", ["write", "--checkpoint_path", "{junk}", "--output",
                                                                "{out}/nodir/x.gguf"],
     r"folder .*nodir does not exist", None, None),
    ("peer-no-command", "scripts/llamacpp_peer.py", [], r"required: cmd", None, None),
    ("convert-unknown-flag", "scripts/convert_checkpoint.py", ["{ckdir}", "--bogus"],
     r"unrecognized arguments", CONV, None),
    ("tokenizer_bin-output-folder-missing", "scripts/export_tokenizer_bin.py", ["{ckdir}", "-o", "{out}/nodir/t.bin"],
     r"folder .*nodir does not exist", TOKBIN, None),
    ("gguf_tokenizer-unknown-flag", "scripts/gguf_tokenizer.py", ["{random}", "{out}/g", "--bogus"],
     r"unrecognized arguments", GGUFTOK, None),
    ("tokenizer-unknown-flag", "tokenizer.py", ["{ckdir}", "hi", "--bogus"], r"unrecognized arguments", TOKPY, None),
]


def _params():
    return [pytest.param(row[1:], id=row[0], marks=[pytest.mark.xfail(strict=True, reason=row[4])] if row[4] else [])
            for row in ROWS]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_checkpoint):
    """The inputs rows point at: the tiny checkpoint, a junk checkpoint, random bytes, checkpoints whose _config is
    not a JSON object, a text, an existing plain file."""
    d, _ = tiny_checkpoint
    root = tmp_path_factory.mktemp("errors")
    rng = random.Random(18)
    (root / "random.bin").write_bytes(bytes(rng.randrange(256) for _ in range(4096)))
    (root / "empty.onnx").write_bytes(b"")
    (root / "junk.pth").write_bytes(b"this is no checkpoint\n" * 50)
    (root / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    (root / "plain_file").write_text("x")
    sd = torch.load(d / "model.pth", map_location="cpu", weights_only=True)
    for name, config in (("cfg_int", 5), ("cfg_list", json.dumps([1, 2])), ("cfg_text", "{not json")):
        c = root / name
        c.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(d / f, c / f)
        torch.save(dict(sd, _config=config), c / "model.pth")
    return dict(ck=d / "model.pth", ckdir=d, junk=root / "junk.pth", random=root / "random.bin",
                empty=root / "empty.onnx", text=root / "text.txt", file=root / "plain_file",
                cfg_int=root / "cfg_int" / "model.pth", cfg_list=root / "cfg_list" / "model.pth",
                cfg_text=root / "cfg_text" / "model.pth", root=root)


def _tree(root: Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _litter(root: Path) -> list:
    return [str(p) for p in root.rglob("*") if p.name.startswith(".export-tmp-") or p.name.endswith(".tmp")]


def _run_in_process(script: str, argv: list, capfd):
    """script's main(argv) under common.cli, as its __main__ runs it; returns (exit code, stderr)."""
    from common import cli
    mod = importlib.import_module(Path(script).stem)
    handler, threads = signal.getsignal(signal.SIGTERM), torch.get_num_threads()
    old_argv = sys.argv
    sys.argv = [script, *argv]  # bench.main() reads sys.argv itself
    try:
        with pytest.raises(SystemExit) as e:
            cli(lambda: mod.main() if script == "bench.py" else mod.main(argv))
    finally:
        sys.argv = old_argv
        signal.signal(signal.SIGTERM, handler)
        torch.set_num_threads(threads)
    return e.value.code, capfd.readouterr().err


@pytest.mark.parametrize("row", _params())
def test_bad_input_is_one_error_line(row, files, tmp_path, capfd, one_thread):
    script, argv, pattern, _, how = row
    out = tmp_path / "out"
    out.mkdir()
    subs = dict(files, out=out, missing=tmp_path / "missing.pth")
    argv = [a.format(**{k: str(v) for k, v in subs.items()}) for a in argv]
    before, shared = _tree(tmp_path), _tree(files["root"])
    if how == SUBPROCESS:
        r = run_cli(script, *argv, timeout=300)
        code, err = r.returncode, r.stderr
    else:
        code, err = _run_in_process(script, argv, capfd)
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 1 and "Traceback" not in err and len(errors) == 1, (code, err[-3000:])
    assert re.search(pattern, errors[0]), errors[0]
    assert _tree(tmp_path) == before and _tree(files["root"]) == shared  # nothing written, no temp litter
    assert not _litter(tmp_path) and not _litter(files["root"])


# ------------------------------------------------------------------------------------------------- SIGTERM
def test_sigterm_in_atomic_write_leaves_nothing(tmp_path):
    """The mechanism: cli() turns SIGTERM into SystemExit, so an atomic_path block in progress removes its temporary
    folder, and the final path is never created (exit code 143 = 128 + SIGTERM)."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from common import atomic_path, cli\n"
            "def main():\n"
            "    with atomic_path(sys.argv[2]) as tmp:\n"
            "        tmp.write_bytes(b'half'); print('writing', flush=True); time.sleep(60)\n"
            "cli(main)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(REPO), str(tmp_path / "x.pte")], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "writing"
    assert _litter(tmp_path)  # the temporary folder is there while the block runs
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 143
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("moment", ["made", "removing"])
def test_signal_at_the_temporary_folders_edges_leaves_nothing(tmp_path, monkeypatch, moment):
    """A signal's exception (KeyboardInterrupt here; cli's SystemExit alike) that lands the instant atomic_path's
    temporary folder has been made ("made": os.mkdir has returned), or while it is being removed after the block
    ("removing": the first rmtree is cut short), still leaves nothing behind, and the exception goes on. The full
    suite once saw aoti_export.py leave its folder when test_sigterm_during_exports_leaves_nothing signalled as soon
    as the folder appeared (mkdtemp had made it; the try that removes it had not begun)."""
    import common
    real_mkdir, real_rmtree, calls = os.mkdir, shutil.rmtree, []

    def mkdir(path, *a, **k):
        real_mkdir(path, *a, **k)
        if moment == "made" and Path(path).parent == tmp_path:
            raise KeyboardInterrupt

    def rmtree(path, *a, **k):
        calls.append(path)
        if moment == "removing" and len(calls) == 1:
            raise KeyboardInterrupt
        real_rmtree(path, *a, **k)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        with common.atomic_path(tmp_path / "m.pt2") as tmp:
            tmp.write_bytes(b"half")
            raise ValueError("the block failed")
    assert list(tmp_path.iterdir()) == []


def _start(args, marker: str):
    """Popen a script (stdout and stderr merged); a thread collects lines and sets an event at `marker`."""
    p = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    seen, lines = threading.Event(), []

    def pump():
        for ln in p.stdout:
            lines.append(ln)
            if marker in ln:
                seen.set()
        seen.set()  # ended without the marker: the test reports it
    threading.Thread(target=pump, daemon=True).start()
    return p, seen, lines


def test_sigterm_during_exports_leaves_nothing(tiny_checkpoint, tmp_path):
    """SIGTERM in the middle of the three exports (ONNX: while the graph is exported into its .export-tmp- folder;
    AOT Inductor: while compiling into atomic_path's temporary folder; ExecuTorch: while exporting, after its "using
    bos" line, which a folder without a tokenizer as --tokenizer_path brings out): each exits with
    143 and leaves no output file, no .export-tmp-*, no *.tmp file or folder. The three run at once."""
    d, _ = tiny_checkpoint
    jobs = {
        "onnx": (["export_onnx.py", "--checkpoint_path", d / "model.pth", "--output_dir", tmp_path / "onnx",
                  "--ctx_len", "32"], "exporting", tmp_path / "onnx"),
        "aoti": (["aoti_export.py", "--checkpoint_path", d / "model.pth", "--output_path", tmp_path / "aoti" / "m.pt2",
                  "--max_seq_length", "64"], "compiling with AOT Inductor", tmp_path / "aoti"),
        "et": (["et_export.py", "--checkpoint_path", d / "model.pth", "--output_path", tmp_path / "et" / "m.pte",
                "--max_seq_length", "64", "--tokenizer_path", tmp_path / "et"], "using bos", tmp_path / "et"),
    }
    for _, _, folder in jobs.values():
        folder.mkdir(exist_ok=True)
    running = {k: _start(args, marker) for k, (args, marker, _) in jobs.items()}
    for k, (p, seen, lines) in running.items():
        assert seen.wait(timeout=240) and p.poll() is None, (k, "".join(lines)[-3000:])
        if k == "et":
            time.sleep(1.0)  # into the export proper
        else:  # ONNX and AOTI: signal as soon as their temporary folder exists, so the cleanup below is real
            deadline = time.time() + 120
            while not _litter(jobs[k][2]) and p.poll() is None and time.time() < deadline:
                time.sleep(0.01)
            assert _litter(jobs[k][2]) and p.poll() is None, (k, list(jobs[k][2].iterdir()))
        p.send_signal(signal.SIGTERM)
    for k, (p, seen, lines) in running.items():
        rc = p.wait(timeout=120)
        folder = jobs[k][2]
        assert rc == 143, (k, rc, "".join(lines)[-3000:])
        assert "Traceback" not in "".join(lines), (k, "".join(lines)[-3000:])
        assert not _litter(folder), (k, _litter(folder))
        assert not [f for f in folder.iterdir() if f.suffix in (".onnx", ".pt2", ".pte")], (k, list(folder.iterdir()))


def test_known_third_party_noise_is_dropped_and_other_lines_stay():
    """torchao's failed loads of CUDA / other-Python kernels and torch's register_constant() deprecation are not
    printed once common.py is imported (every script imports it first); other torchao warnings still are."""
    code = ("import logging, common, torchao, executorch.exir\n"
            "logging.getLogger('torchao').warning('a real torchao warning')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Failed to load" not in r.stderr and "register_constant()" not in r.stderr, r.stderr[-2000:]
    assert "a real torchao warning" in r.stderr


def test_native_noise_is_dropped_and_other_native_lines_stay():
    """Lines C++ code writes to file descriptor 2 inside common.native_output_filtered come back, except ExecuTorch's
    cpuinfo noise."""
    code = ("import os, sys, common\n"
            "with common.native_output_filtered():\n"
            "    os.write(2, b'[cpuinfo_utils.cpp:87] Failed to open midr file /sys/x\\na native warning\\n')\n"
            "    print('a python line', file=sys.stderr)\n"
            "print('after', file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "midr" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-3:] == ["a native warning", "a python line", "after"], r.stderr


def test_default_threads_leave_out_the_cores_other_work_keeps_busy(monkeypatch):
    """No --threads and no $OMP_NUM_THREADS: torch's count less the busy cores (at least 1), said in one line; an
    explicit count wins. The busy-core count itself is read from /proc/stat."""
    import torch
    import common
    before = torch.get_num_threads()
    lines = []
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(common.os, "cpu_count", lambda: 4)
        torch.set_num_threads(4)
        monkeypatch.setattr(common, "busy_cores", lambda: 2.6)
        assert common.set_threads(None, log=lines.append) == 1
        assert lines == ["3 of 4 cores are busy with other work: 1 thread (--threads N to choose)"]
        torch.set_num_threads(4)
        monkeypatch.setattr(common, "busy_cores", lambda: 0.3)
        assert common.set_threads(None, log=lines.append) == 4 and len(lines) == 1
        assert common.set_threads(3, log=lines.append) == 3 and len(lines) == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        monkeypatch.setattr(common, "busy_cores", lambda: 4.0)
        assert common.set_threads(None, log=lines.append) == 2 and len(lines) == 1
    finally:
        torch.set_num_threads(before)
    monkeypatch.undo()
    assert 0.0 <= common.busy_cores(0.05) <= (__import__("os").cpu_count() or 1) + 0.01
