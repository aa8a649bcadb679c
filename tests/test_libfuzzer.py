# libFuzzer campaigns (clang -fsanitize=fuzzer,address,undefined) over the C++ runners' input verification, a bounded
# time each (FUZZ_SECONDS, default 20): runner-common/fuzz/fuzz_tokenizer.cpp (tokenizer.bin parsing, then encode /
# decode / chat on what was accepted; seeds: SentencePiece, byte-level BPE and plain llama2.c files exported here) and
# runner-et/fuzz_pte.cpp (the .pte header checks and ExecuTorch's InternalConsistency verification; seed: a .pte
# exported here). A sanitizer report, a crash, a leak, a timeout or an out-of-memory fails the test. Without clang++
# (Debian: apt-get install clang), or with FUZZ_STANDALONE=1, the same targets are built with g++ (under
# -fsanitize=address,undefined where g++ has the sanitizers) and runner-common/fuzz/standalone_driver.cpp, which runs
# them over random mutations of the same seeds (no coverage feedback) for FUZZ_SECONDS, default 5. FUZZ_SEED=N
# repeats a campaign's mutations. The fuzzers are cached in runner-common/build/.
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_tokenizer_bin import export_bin, make_bpe_dir, make_sp_dir  # noqa: E402

BUILD = REPO / "runner-common" / "build"
STANDALONE = os.environ.get("FUZZ_STANDALONE") == "1" or shutil.which("clang++") is None
SECONDS = int(os.environ.get("FUZZ_SECONDS", "5" if STANDALONE else "20"))
SEED = int(os.environ.get("FUZZ_SEED", random.randrange(1, 1 << 31)))
FLAGS = ["-std=c++17", "-g", "-O1", "-fno-sanitize-recover=undefined"]
SANITIZERS = ["-fsanitize=address,undefined"]
DRIVER = REPO / "runner-common" / "fuzz" / "standalone_driver.cpp"


def build(src: Path, out: Path, *extra) -> Path:
    """src -> out with clang++ and libFuzzer, or (STANDALONE) with g++ and DRIVER, out then named <out>-standalone;
    again when a source in its folder or runner-common is newer than out."""
    if STANDALONE:
        cxx = shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            pytest.skip("no C++ compiler (clang++ or g++): cannot build the fuzzers")
        out, srcs, flags = out.with_name(out.name + "-standalone"), [src, DRIVER], FLAGS + SANITIZERS
    else:
        cxx, srcs, flags = shutil.which("clang++"), [src], FLAGS + ["-fsanitize=fuzzer,address,undefined"]
    deps = [*srcs, *src.parent.glob("*.h"), *(REPO / "runner-common").glob("*.h")]
    if out.exists() and out.stat().st_mtime > max(s.stat().st_mtime for s in deps):
        return out
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [cxx, "-I", str(REPO / "runner-common"), "-o", str(tmp), *map(str, srcs), *extra]
    r = subprocess.run([cmd[0], *flags, *cmd[1:]], capture_output=True, text=True)
    if r.returncode != 0 and STANDALONE:  # a g++ without libasan / libubsan: the driver alone still finds crashes
        plain = subprocess.run([cmd[0], *FLAGS[:3], *cmd[1:]], capture_output=True, text=True)
        if plain.returncode == 0:
            print(f"note: {cxx} cannot build with {SANITIZERS[0]}; {out.name} runs without sanitizers")
        r = plain if plain.returncode == 0 else r
    assert r.returncode == 0, r.stderr[-3000:]
    os.replace(tmp, out)
    return out


def campaign(fuzzer: Path, corpus: Path, max_len: int):
    """Run the fuzzer for SECONDS over a copy of corpus (new inputs land there); a finding is a non-zero exit (a
    signal included)."""
    crashes = corpus.parent / "findings"
    crashes.mkdir(exist_ok=True)
    r = subprocess.run([str(fuzzer), f"-max_total_time={SECONDS}", f"-max_len={max_len}", "-rss_limit_mb=2048",
                        "-timeout=10", f"-seed={SEED}", f"-artifact_prefix={crashes}/", "-print_final_stats=1",
                        str(corpus)], capture_output=True, text=True, errors="replace", timeout=SECONDS + 120)
    assert r.returncode == 0, f"{fuzzer.name}: exit {r.returncode} (FUZZ_SEED={SEED}):\n{r.stderr[-4000:]}"
    runs = next(line for line in r.stderr.splitlines() if line.startswith("stat::number_of_executed_units"))
    assert int(runs.split(":")[-1]) > 100, r.stderr[-2000:]  # it ran
    print(f"{fuzzer.name}: {runs.split(':')[-1].strip()} runs in {SECONDS} s, no finding")


def test_fuzz_tokenizer_bin(tmp_path):
    fuzzer = build(REPO / "runner-common" / "fuzz" / "fuzz_tokenizer.cpp", BUILD / "fuzz_tokenizer")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    sp, bpe = make_sp_dir(tmp_path / "sp"), make_bpe_dir(tmp_path / "bpe")
    export_bin(sp, corpus / "sp.bin")
    export_bin(sp, corpus / "llama2c.bin", "--llama2c")
    export_bin(bpe, corpus / "bpe.bin")
    campaign(fuzzer, corpus, max(f.stat().st_size for f in corpus.iterdir()) * 2)


def test_fuzz_pte_verification(tmp_path):
    pytest.importorskip("executorch", reason="the executorch package is not installed")
    import executorch
    from test_aoti import tiny_checkpoint
    et = Path(list(executorch.__path__)[0])
    fuzzer = build(REPO / "runner-et" / "fuzz_pte.cpp", BUILD / "fuzz_pte", "-DC10_USING_CUSTOM_GENERATED_MACROS",
                   "-DET_EVENT_TRACER_ENABLED", "-I", str(et / "include"),
                   "-I", str(et / "include/executorch/runtime/core/portable_type/c10"), f"-L{et / 'lib'}",
                   "-lexecutorch", f"-Wl,-rpath,{et / 'lib'}")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    ckpt = tiny_checkpoint(make_bpe_dir(tmp_path / "bpe", vocab_size=300) / "model.pth")
    r = subprocess.run([sys.executable, str(REPO / "et_export.py"), "--checkpoint_path", str(ckpt), "--output_path",
                        str(corpus / "tiny.pte"), "--max_seq_length", "16"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    campaign(fuzzer, corpus, (corpus / "tiny.pte").stat().st_size + 1024)
