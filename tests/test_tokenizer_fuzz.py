# Fuzzing the C++ tokenizer's tokenizer.bin reader (runner-common/tokenizer_file.h) and its encoders and decoders:
# runner-common/tok_tool.cpp built with -fsanitize=address,undefined runs a seeded mutation campaign over real
# tokenizer.bin files (scripts/export_tokenizer_bin.py on the tiny SentencePiece and byte-level BPE fixtures of
# test_tokenizer_bin.py, and llama2.c's plain format): truncations, byte flips, huge length / count / offset fields,
# out-of-range ids and enum values, dropped / repeated sections, with random prompts, id sequences and chats.
# Every run must end in success (exit 0, nothing on stderr, encoded ids inside the file's vocabulary) or one
# "error: ..." line with exit 1; any sanitizer report, crash or hang is a failure.
#   python -m pytest -q tests/test_tokenizer_fuzz.py            # ~900 runs, well under a minute once built
#   TOK_FUZZ_LONG=1 python -m pytest -q tests/test_tokenizer_fuzz.py, or
#   python tests/test_tokenizer_fuzz.py --long [--seed N] [--runs N]   # longer local campaign
# Skips (with the reason) without g++ or where g++ cannot build and run a sanitized program.
# Also here: the runners' numeric flags are range-checked before anything loads (runner-common/options.h).
import argparse
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
COMMON = REPO / "runner-common"
TOOL = COMMON / "build" / "tok_tool_asan"
SAN_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
SAN_ENV = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=86",
               UBSAN_OPTIONS="halt_on_error=1:exitcode=87:print_stacktrace=1")
RUNS, LONG_RUNS = 900, 20000


class Unavailable(Exception):
    """The toolchain cannot build the sanitized tool (a skip, not a failure)."""


def build_tool() -> Path:
    """tok_tool with ASan + UBSan, rebuilt when any runner-common source is newer than the binary."""
    if shutil.which("g++") is None:
        raise Unavailable("g++ is not installed: cannot build the sanitized C++ tokenizer")
    srcs = [COMMON / "tok_tool.cpp", *COMMON.glob("*.h")]
    if TOOL.exists() and TOOL.stat().st_mtime > max(s.stat().st_mtime for s in srcs):
        return TOOL
    TOOL.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:  # does this g++ (and its runtime) support the sanitizers at all?
        probe = Path(d) / "probe.cpp"
        probe.write_text("#include <vector>\nint main() { std::vector<int> v(3); return v[1]; }\n")
        r = subprocess.run(["g++", *SAN_FLAGS, "-o", str(probe.with_suffix("")), str(probe)], capture_output=True,
                           text=True)
        if r.returncode != 0 or subprocess.run([str(probe.with_suffix(""))], env=SAN_ENV).returncode != 0:
            raise Unavailable("g++ cannot build or run programs with -fsanitize=address,undefined here: "
                              + (r.stderr.strip().splitlines() or ["the probe did not run"])[-1][:200])
    tmp = TOOL.with_name(f"tok_tool_asan.{os.getpid()}.tmp")
    r = subprocess.run(["g++", "-std=c++17", "-O1", "-g", *SAN_FLAGS, "-o", str(tmp), str(srcs[0])],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    os.replace(tmp, TOOL)
    return TOOL


def make_bins(root: Path) -> dict:
    """Real tokenizer.bin files from the fixtures test_tokenizer_bin.py uses (exported in parallel)."""
    from test_family_tokenizers import make_family
    from test_tokenizer_bin import make_bpe_dir, make_sp_dir
    dirs = {"sp": make_sp_dir(root / "sp"), "smollm": make_bpe_dir(root / "smollm", "smollm"),
            "llama3": make_bpe_dir(root / "llama3", "llama3"),  # and the sections the model families add:
            "phi3": make_family("phi3", root / "phi3"),  # added tokens past the model, STRP, the legacy=false flag
            "phi4": make_family("phi4", root / "phi4"),  # o200k: UNIU / UNIW
            "falcon": make_family("falcon", root / "falcon")}  # UNIP
    procs = {k: subprocess.Popen([sys.executable, str(REPO / "scripts" / "export_tokenizer_bin.py"), str(d), "-o",
                                  str(root / f"{k}.bin")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for k, d in dirs.items()}
    for k, p in procs.items():
        err = p.communicate()[1]
        assert p.returncode == 0, f"export of the {k} fixture failed: {err.decode()[-2000:]}"
    bins = {k: (root / f"{k}.bin").read_bytes() for k in dirs}
    bins["plain"] = bins["sp"][:struct.unpack_from("<Q", bins["sp"], len(bins["sp"]) - 16)[0]]  # llama2.c's part
    return bins


# ------------------------------------------------------------------------------------------------ file layout
def extension_offset(d: bytes):
    """The extension's offset when the footer is present and sane, else None (a plain llama2.c file)."""
    if len(d) >= 36 and d[-8:] == b"LLTOKEND":
        off = struct.unpack_from("<Q", d, len(d) - 16)[0]
        if 4 <= off <= len(d) - 32 and d[off:off + 8] == b"LLTOKEXT":
            return off
    return None


def count_tokens(d: bytes):
    """Part A's token count, or None where part A does not parse (the C++ reader must then refuse the file)."""
    end = extension_offset(d) or len(d)
    if len(d) < 4:
        return None
    max_len, pos, n = struct.unpack_from("<I", d, 0)[0], 4, 0
    while pos < end:
        if pos + 8 > end:
            return None
        ln = struct.unpack_from("<I", d, pos + 4)[0]
        if ln > max_len or pos + 8 + ln > end:
            return None
        pos, n = pos + 8 + ln, n + 1
    return n


def fields(d: bytes) -> dict:
    """Offsets of the integer fields of a valid tokenizer.bin, by kind: {"length": [...], "id": [...], ...}."""
    f = {k: [] for k in ("token length", "length", "count", "id", "enum", "codepoint", "score", "type", "offset")}
    f["token length"].append(0)  # max_token_length
    off = extension_offset(d)
    pos, end = 4, off or len(d)
    while pos < end:
        f["score"].append(pos)
        f["token length"].append(pos + 4)
        pos += 8 + struct.unpack_from("<I", d, pos + 4)[0]
    if off is None:
        return f
    f["offset"].append(len(d) - 16)
    f["enum"].append(off + 8)  # version
    f["count"].append(off + 12)  # n_sections
    pos = off + 16
    u32 = lambda p: struct.unpack_from("<I", d, p)[0]  # noqa: E731
    for _ in range(u32(off + 12)):
        tag, n = d[pos:pos + 4], u32(pos + 4)
        f["length"].append(pos + 4)
        p, pos = pos + 8, pos + 8 + n
        if tag == b"INFO":
            f["count"].append(p)
            f["enum"] += [p + 4, p + 16, p + 20, p + 24, p + 32, p + 36]
            f["id"] += [p + 8, p + 12, p + 28]
        elif tag in (b"STOP", b"BYTE"):
            k = 0 if tag == b"BYTE" else 4
            if k:
                f["count"].append(p)
            f["id"] += list(range(p + k, pos, 4))
        elif tag == b"TYPE":
            f["type"] += list(range(p, pos))
        elif tag in (b"SPEC", b"PIEC"):
            f["count"].append(p)
            q = p + 4
            for _ in range(u32(p)):
                f["id"].append(q)
                f["length"].append(q + 4)
                q += 8 + u32(q + 4)
        elif tag == b"CHAT":
            f["enum"] += [p, p + 8 + u32(p + 4), p + 12 + u32(p + 4)]  # kind, has-default, no-system
            f["length"] += [p + 4, p + 16 + u32(p + 4)]  # the two blobs
        elif tag == b"STRP":
            f["count"].append(p)
            f["id"] += list(range(p + 4, pos, 8))
            f["enum"] += list(range(p + 8, pos, 8))
        elif tag in (b"PYSP", b"UNIL", b"UNIN", b"UNIS", b"UNIU", b"UNIW", b"UNIP"):
            f["count"].append(p)
            f["codepoint"] += list(range(p + 4, pos, 4))
        elif tag in (b"UNKS", b"PATT"):
            f["length"].append(p)
        elif tag == b"MERG":
            f["count"].append(p)
            f["id"] += list(range(p + 4, pos, 4))
        elif tag == b"CASE":
            q = p
            for _ in range(8):
                f["count"].append(q)
                f["codepoint"] += list(range(q + 4, q + 4 + 4 * u32(q), 4))
                q += 4 + 4 * u32(q)
    return f


def sections(d: bytes):
    """(part A, [(tag, payload)]) of a file with an extension."""
    off = extension_offset(d)
    n, pos, out = struct.unpack_from("<I", d, off + 12)[0], off + 16, []
    for _ in range(n):
        ln = struct.unpack_from("<I", d, pos + 4)[0]
        out.append((d[pos:pos + 4], d[pos + 8:pos + 8 + ln]))
        pos += 8 + ln
    return d[:off], out


def assemble(part_a: bytes, secs) -> bytes:
    ext = b"LLTOKEXT" + struct.pack("<II", 1, len(secs)) + b"".join(t + struct.pack("<I", len(p)) + p for t, p in secs)
    return part_a + ext + struct.pack("<Q", len(part_a)) + b"LLTOKEND"


def set_info(d: bytes, index: int, value: int) -> bytes:
    """The file with INFO field `index` (0 n_vocab, 1 kind, ..., 8 pre-tokenizer) set to value."""
    part_a, secs = sections(d)
    secs = [(t, p[:4 * index] + struct.pack("<i", value) + p[4 * index + 4:] if t == b"INFO" else p)
            for t, p in secs]
    return assemble(part_a, secs)


# ------------------------------------------------------------------------------------------------ mutations
def interesting(rng, kind: str, orig: int, n_vocab: int, size: int) -> int:
    if rng.random() < 0.5:  # a plausible value: the file may stay valid and reach the encoders with it
        if kind == "id":
            return rng.randrange(-1, n_vocab) & 0xFFFFFFFF
        if kind == "enum":
            return rng.choice([rng.randrange(-1, 6), rng.randrange(512)]) & 0xFFFFFFFF
        if kind == "codepoint":
            return rng.choice([rng.randrange(0x110000), rng.randrange(0x80), max(orig - 1, 0), orig + 1])
    return rng.choice([0, 1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 0x7F, 0x80, 0xFFFF, 0x10000, 0x10FFFF, 0x110000,
                       0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE, n_vocab - 1, n_vocab, n_vocab + 1, size,
                       size // 2, orig + 1, orig - 1, orig * 2, orig + 0x10000, rng.randrange(1 << 32)]) & 0xFFFFFFFF


def mutate(rng, base: bytes, n_vocab: int):
    """One mutated file and a short description."""
    d, what = bytearray(base), []
    f = fields(base)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.choice(["field"] * 10 + ["truncate", "truncate", "flip", "bytes", "section", "section", "offset",
                                          "insert"])
        if op == "field":
            kind = rng.choice([k for k in f if f[k] and k != "offset"])
            p = rng.choice(f[kind])
            if p + 4 > len(d):
                continue
            if kind == "type":
                d[p] = rng.choice([7, 8, 0x7F, 0x86, 0xFF, rng.randrange(7), rng.randrange(7) | 0x80])
            elif kind == "score":
                d[p:p + 4] = struct.pack("<f", rng.choice([float("nan"), float("inf"), -float("inf"), 1e38, -0.0]))
            else:
                orig = struct.unpack_from("<I", d, p)[0]
                d[p:p + 4] = struct.pack("<I", interesting(rng, kind, orig, n_vocab, len(d)))
            what.append(f"{kind}@{p}")
        elif op == "truncate":
            cuts = [p + k for k in range(-2, 6) for ps in f.values() for p in ps[:50]] + [rng.randrange(len(d) + 1)]
            cut = min(max(rng.choice(cuts), 0), len(d))
            del d[cut:]
            what.append(f"truncate@{cut}")
        elif op == "flip":
            for _ in range(rng.randint(1, 8)):
                if d:
                    p = rng.randrange(len(d))
                    d[p] ^= 1 << rng.randrange(8)
            what.append("flip")
        elif op == "bytes" and d:
            p = rng.randrange(len(d))
            d[p:p + 4] = bytes(rng.randrange(256) for _ in range(4))
            what.append(f"bytes@{p}")
        elif op == "insert":
            p = rng.randrange(len(d) + 1)
            d[p:p] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            what.append(f"insert@{p}")
        elif op == "offset" and f["offset"] and len(d) >= 16:
            v = rng.choice([0, 3, 4, len(d) - 32, len(d) - 31, len(d) - 16, len(d), 1 << 63, (1 << 64) - 1,
                            (1 << 64) - 16, (1 << 64) - 32, rng.randrange(1 << 64)])
            d[len(d) - 16:len(d) - 8] = struct.pack("<Q", v)
            what.append(f"footer offset {v}")
        elif op == "section" and extension_offset(bytes(d)) is not None:
            try:
                part_a, secs = sections(bytes(d))
            except struct.error:
                continue
            if not secs:
                continue
            i = rng.randrange(len(secs))
            how = rng.choice(["drop", "repeat", "swap", "unknown"])
            if how == "drop":
                secs.pop(i)
            elif how == "repeat":
                secs.insert(i, secs[i])
            elif how == "swap":
                j = rng.randrange(len(secs))
                secs[i], secs[j] = secs[j], secs[i]
            else:
                secs.insert(i, (bytes(rng.randrange(256) for _ in range(4)), bytes(rng.randrange(256)
                                                                                 for _ in range(rng.randrange(40)))))
            d = bytearray(assemble(part_a, secs))
            what.append(f"section {how} {secs[min(i, len(secs) - 1)][0]!r}" if secs else f"section {how}")
    return bytes(d), ", ".join(what) or "none"


WORDS = ("don't I'm it's WE'LL they'RE you've she'd 'S 'ſ ' '' hello world the café naïve 日本語 中文 🤖 👍🏽 "
         "<|im_start|> <|im_end|> <|endoftext|> <s> </s> <unk> [INST] ▁x ▁▁ 1234567 3.14 ١٢٣ ½ Ⅻ def f(x): "
         "return \t \n \r\n   \u00a0 \u2028 \u3000 \x0b \x85").split(" ")


def prompt(rng) -> bytes:
    parts = []
    for _ in range(rng.randint(0, 20)):
        r = rng.random()
        if r < 0.75:
            parts.append(rng.choice(WORDS).encode() + rng.choice([b" ", b"", b"  ", b"\n", b"'"]))
        elif r < 0.9:
            parts.append(bytes(rng.randrange(1, 256) for _ in range(rng.randint(1, 6))))  # invalid UTF-8 too
        else:
            parts.append(chr(rng.randrange(0x20, 0x10FFFF) if rng.random() < 0.5 else rng.randrange(0x80, 0x800))
                         .encode("utf-8", "surrogatepass"))
    return b"".join(parts).replace(b"\0", b"")


def tool_input(rng, mode: str, n_vocab: int) -> bytes:
    if mode == "encode":
        return b"\0".join(prompt(rng) for _ in range(rng.randint(1, 6)))
    if mode == "decode":
        pick = lambda: rng.choice([rng.randrange(max(n_vocab, 1)), rng.randrange(-5, n_vocab + 20),  # noqa: E731
                                   -(1 << 31), (1 << 31) - 1])
        return "".join(" ".join(str(pick()) for _ in range(rng.randint(0, 30))) + "\n"
                       for _ in range(rng.randint(1, 5))).encode()
    msgs = [(rng.choice([b"system", b"user", b"assistant", b"tool"]), prompt(rng)) for _ in range(rng.randint(0, 4))]
    return b"\x1e".join(r + b"\x1f" + c.replace(b"\x1e", b"").replace(b"\x1f", b"") for r, c in msgs)


def check(tool: Path, path: Path, data: bytes, mode: str, stdin: bytes, must_fail=False):
    """None when the run ended in success (unless must_fail) or one clean error line, else what went wrong."""
    try:
        r = subprocess.run([str(tool), mode, str(path)], input=stdin, capture_output=True, env=SAN_ENV, timeout=60)
    except subprocess.TimeoutExpired:
        return "hang (no exit within 60 s)"
    err = r.stderr.decode("utf-8", "replace")
    if "Sanitizer" in err or "runtime error" in err:
        return f"sanitizer report (exit {r.returncode}):\n{err[-4000:]}"
    if r.returncode == 0:
        if must_fail:
            return f"accepted a broken file (stdout {r.stdout[:200]!r})"
        if err:
            return f"exit 0 with stderr: {err[-500:]!r}"
        n = count_tokens(data)
        if mode == "encode":
            ids = [int(x) for x in r.stdout.split()]
            if n is None or any(i < 0 or i >= n for i in ids):
                return f"encode emitted ids outside the vocabulary of {n}: {sorted(set(ids))[-5:]}"
        return None
    lines = err.splitlines()
    if r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and err.endswith("\n"):
        # a file's problem names the file (a raw library exception text would not)
        return None if str(path) in lines[0] or mode == "chat" else f"error line without the file name: {err!r}"
    return f"exit {r.returncode}, stderr not one 'error: ' line: {err[-1000:]!r}"


def regressions(bins: dict):
    """The crashes and silent acceptances issue 18 names, always in the campaign, each a file that must be refused:
    (name, file, mode, stdin)."""
    sm, l3 = bins["smollm"], bins["llama3"]
    n = count_tokens(sm)
    part_a, secs = sections(sm)
    merg = [(t, p[:4] + b"".join(p[k:k + 8] + struct.pack("<i", 0x7FFFFFFF) for k in range(4, len(p), 12))
             if t == b"MERG" else p) for t, p in secs]  # every merge's result
    no_case = sections(l3)
    no_case = assemble(no_case[0], [s for s in no_case[1] if s[0] != b"CASE"])
    out = [(f"BPE pre-tokenizer {v} without a case table", set_info(sm, 8, v), "encode", b"don't I'M")
           for v in (0, 2, 3, 4, 5, -1, 0x7FFFFFFF)]
    out += [("llama3 file without its CASE section", no_case, "encode", b"don't"),
            ("merge result 0x7fffffff", assemble(part_a, merg), "encode", b"the the the hello world"),
            ("unk_id out of range", set_info(sm, 7, n + 5), "encode", b"\xff\xfe hello"),
            ("unknown chat kind", set_info(sm, 5, 10), "chat", b"user\x1fhi"),  # (9 = smollm3, the last)
            ("footer offset near 2^64", sm[:-16] + struct.pack("<Q", (1 << 64) - 8) + b"LLTOKEND", "info", b""),
            ("footer offset 2^64-1", sm[:-16] + struct.pack("<Q", (1 << 64) - 1) + b"LLTOKEND", "info", b"")]
    return out


def campaign(tool: Path, bins: dict, runs: int, seed: int, workdir: Path, workers=None) -> list:
    """Run the regression cases and `runs` seeded mutations; return the failures (descriptions)."""
    rng = random.Random(seed)
    cases = [(name, data, mode, stdin, True) for name, data, mode, stdin in regressions(bins)]
    names = sorted(bins)
    for i in range(runs):
        kind = names[i % len(names)]
        data, what = mutate(rng, bins[kind], count_tokens(bins[kind]))
        if i % 10 == 0:  # the valid files too, with random inputs
            data, what = bins[kind], "unmutated"
        mode = rng.choice(["encode"] * 6 + ["decode"] * 2 + ["chat", "info"])
        cases.append((f"#{i} {kind}: {what}", data, mode, tool_input(rng, mode, count_tokens(bins[kind]) or 0),
                      False))

    def one(i_case):
        i, (name, data, mode, stdin, must_fail) = i_case
        path = workdir / f"case{i}.bin"
        path.write_bytes(data)
        problem = check(tool, path, data, mode, stdin, must_fail)
        if problem is None:
            path.unlink()
            return None
        (workdir / f"case{i}.stdin").write_bytes(stdin)
        return f"{name} [{mode}; file {path}, stdin {path.with_suffix('.stdin')}]: {problem}"

    with ThreadPoolExecutor(workers or min(4, os.cpu_count() or 1)) as ex:
        return [p for p in ex.map(one, enumerate(cases)) if p]


def test_tokenizer_fuzz(tmp_path):
    import pytest
    try:
        tool = build_tool()
    except Unavailable as e:
        pytest.skip(str(e))
    bins = make_bins(tmp_path)
    long = os.environ.get("TOK_FUZZ_LONG", "") not in ("", "0")
    seed = int(os.environ.get("TOK_FUZZ_SEED", "0"))
    work = tmp_path / "cases"
    work.mkdir()
    failures = campaign(tool, bins, LONG_RUNS if long else RUNS, seed, work)
    assert not failures, f"{len(failures)} failing runs; first ones:\n" + "\n\n".join(failures[:5])


def test_runner_flags_are_checked_before_loading(tmp_path):
    """runner-common/options.h: a bad numeric flag is one error line before the model or tokenizer is opened (the
    paths given do not exist). Uses the runners test_aoti.py / test_runner_et.py build; skips when neither is built."""
    import pytest
    runners = [p for p in (REPO / "runner-aoti" / "build" / "run", REPO / "runner-et" / "build" / "run") if p.exists()]
    if not runners:
        pytest.skip("no runner is built (tests/test_aoti.py and tests/test_runner_et.py build them)")
    bad = [("-n", "-5"), ("-t", "-1"), ("-p", "2"), ("-p", "0"), ("-k", "-1"), ("-s", "-1"), ("-t", "nan"),
           ("-t", "inf"), ("-n", "1.5"), ("-n", "99999999999"), ("-k", "3x"), ("-t", "")]
    for runner in runners:
        for flag, value in bad:
            r = subprocess.run([str(runner), str(tmp_path / "missing.pte"), "-z", str(tmp_path / "missing.bin"), flag,
                                value, "-i", "hi"], capture_output=True, text=True)
            assert r.returncode == 1 and r.stdout == "", (runner, flag, value, r.stderr)
            assert r.stderr.startswith(f"error: bad value for {flag}: ") and r.stderr.count("\n") == 1, r.stderr
        r = subprocess.run([str(runner), str(tmp_path / "missing.pte"), "-z", str(tmp_path / "missing.bin"), "-n", "0",
                            "-t", "0", "-p", "1", "-k", "0", "-s", "0"], capture_output=True, text=True)
        assert r.returncode == 1 and "cannot open tokenizer" in r.stderr  # valid values: on to loading


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="fuzz the C++ tokenizer (see the top of this file)")
    ap.add_argument("--long", action="store_true", help=f"{LONG_RUNS} runs instead of {RUNS}")
    ap.add_argument("--runs", type=int, help="number of mutated runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=Path, default=COMMON / "build" / "fuzz-failures",
                    help="where failing cases are kept (default: runner-common/build/fuzz-failures)")
    a = ap.parse_args()
    try:
        tool = build_tool()
    except Unavailable as e:
        sys.exit(f"skipped: {e}")
    with tempfile.TemporaryDirectory() as tmp:
        bins = make_bins(Path(tmp))
    a.keep.mkdir(parents=True, exist_ok=True)
    runs = a.runs or (LONG_RUNS if a.long else RUNS)
    failures = campaign(tool, bins, runs, a.seed, a.keep)
    print("\n\n".join(failures[:20]))
    print(f"{runs} mutated runs (seed {a.seed}): {len(failures)} failures"
          + (f"; cases in {a.keep}" if failures else ""))
    sys.exit(1 if failures else 0)
