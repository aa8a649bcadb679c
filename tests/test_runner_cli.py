# The C++ runners' command line (runner-common/options.h), without a model: every flag has llama2.c's letter and a
# long form (`--name value` and `--name=value`), the usage text lists both, and bad input is one `error: ...` line
# with exit status 1, checked before any file is opened (the paths given here do not exist). Both runners share the
# parser; runner-et builds in seconds, runner-aoti in about a minute the first time (cached in <runner>/build).
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import assert_clean_error  # noqa: E402
from test_aoti import build_runner, run  # noqa: E402
from test_tokenizer_bin import export_bin, make_bpe_dir  # noqa: E402

# letter -> long names (generate.py's where it has the flag)
LONG = {"t": ["temperature"], "p": ["top_p"], "k": ["top_k"], "s": ["seed"], "n": ["max_new_tokens", "steps"],
        "i": ["prompt"], "z": ["tokenizer", "tokenizer_path"], "m": ["mode"], "y": ["system", "system_prompt"],
        "e": ["encode_only"], "q": ["quiet"], "x": ["ignore_eos"], "j": ["threads"], "M": ["decoding"],
        "L": ["lookahead"], "h": ["help"]}

# (flag, value, what the error's parenthesis says)
BAD = [("-j", "100000", "in [1, 1024]"), ("-j", "0", "in [1, 1024]"), ("-j", "-3", "in [1, 1024]"),
       ("--threads", "100000", "in [1, 1024]"), ("--threads", "1e3", "in [1, 1024]"), ("-t", "abc", ">= 0"),
       ("--temperature", "-0.5", ">= 0"), ("-t", "1e999", ">= 0"), ("-n", "1e999", ">= 0"), ("-n", "-1", ">= 0"),
       ("--max_new_tokens", "2147483648", ">= 0"), ("--steps", " 5", ">= 0"), ("-k", "-2", ">= 0"),
       ("--top_k", "x", ">= 0"), ("-p", "1.5", "in (0, 1]"), ("--top_p", "0", "in (0, 1]"), ("-p", "nan", "in (0, 1]"),
       ("--seed", "-1", ">= 0"), ("-s", "18446744073709551616", ">= 0"), ("-s", "1e3", ">= 0"),
       ("-m", "poem", "unknown mode"), ("--mode", "poem", "unknown mode"), ("-M", "fast", "unknown decoding"),
       ("--decoding", "", "unknown decoding"), ("-L", "1,1,1", "NGRAM >= 2"), ("--lookahead", "5,1,2,3", "NGRAM >= 2"),
       ("--lookahead", "5,,2", "NGRAM >= 2")]


@pytest.fixture(scope="module")
def runners():
    pytest.importorskip("executorch", reason="the executorch package is not installed")
    return {"runner-et": build_runner(REPO / "runner-et", REPO / "runner-et" / "build" / "run", "runner-et"),
            "runner-aoti": build_runner()}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    bpe = make_bpe_dir(root / "bpe")
    return bpe, export_bin(bpe, root / "bpe.bin")


def test_no_arguments_is_an_error_line(runners):
    for name, runner in runners.items():
        r = run([runner])
        assert_clean_error(r, r"^error: no arguments: give a model file \(see -h\)$")
        assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "Example: " in r.stderr
        assert r.stdout == ""


@pytest.mark.parametrize("flag,value,want", BAD)
def test_bad_values_are_one_error_line(runners, tmp_path, flag, value, want):
    for spelling in [[flag, value]] + ([[f"{flag}={value}"]] if flag.startswith("--") else []):
        for runner in runners.values():
            r = run([runner, tmp_path / "missing.pte", "-z", tmp_path / "missing.bin", "-i", "hi", *spelling])
            assert r.returncode == 1 and r.stdout == "", r.stderr
            assert r.stderr.startswith(f"error: bad value for {flag}: {value} (") and r.stderr.count("\n") == 1
            assert want in r.stderr and r.stderr.endswith(")\n"), r.stderr


@pytest.mark.parametrize("args,msg", [
    (["--bogus"], "unknown option --bogus"), (["-w", "1"], "unknown option -w"), (["--temp", "1"], "unknown option"),
    (["--quiet=1"], "option --quiet takes no value"), (["-e=1"], "unknown option"), (["-t"], "option -t needs a value"),
    (["--top_p"], "option --top_p needs a value"), (["other.pte"], "unexpected argument other.pte"),
    (["-M", "lookahead", "--temperature", "0.5"], "greedy only")])
def test_bad_command_lines_are_one_error_line(runners, tmp_path, args, msg):
    for runner in runners.values():
        r = run([runner, tmp_path / "missing.pte", "-z", tmp_path / "missing.bin", *args])
        assert_clean_error(r, msg)
        assert r.stderr.count("\n") == 1 and r.stdout == ""


def test_valid_values_go_on_to_loading(runners, tmp_path):
    """The bounds themselves are accepted: the run gets as far as the (missing) tokenizer."""
    for runner in runners.values():
        for args in (["-j", "1024"], ["--threads=1"], ["-n", "0", "-t", "0", "-p", "1", "-k", "0", "-s", "0"],
                     ["--max_new_tokens", "2147483647", "--temperature=1e3", "--top_p", "1e-9", "--seed",
                      "18446744073709551615", "--mode=chat", "--decoding", "hybrid", "--lookahead=2,1,1"]):
            r = run([runner, tmp_path / "missing.pte", "-z", tmp_path / "missing.bin", *args])
            assert_clean_error(r, "cannot open tokenizer")


def test_usage_lists_both_forms(runners):
    for name, runner in runners.items():
        for h in ("-h", "--help"):
            r = run([runner, h])
            assert r.returncode == 0 and r.stderr == "", r.stderr
            for letter, names in LONG.items():
                assert f"-{letter}, " + ", ".join(f"--{n}" for n in names) in r.stdout, (letter, r.stdout)
            assert ("model.pt2" in r.stdout) == (name == "runner-aoti")


def test_long_forms_equal_the_letters(runners, tok):
    """-e (no model is loaded) prints the prompt's ids: the letters, the long forms with a space or '=', and the
    options before the model all encode the same prompt with the same tokenizer, as tokenizer.py does."""
    import tokenizer as T
    bpe, bin_path = tok
    prompt = "Once upon a time, 123 café -x"
    want = " ".join(map(str, T.load_tokenizer(bpe).encode(prompt))) + "\n"
    for runner in runners.values():
        for args in (["model.pte", "-e", "-z", bin_path, "-i", prompt],
                     ["model.pte", "--encode_only", "--tokenizer", bin_path, "--prompt", prompt],
                     ["model.pte", "--encode_only", f"--tokenizer_path={bin_path}", f"--prompt={prompt}"],
                     ["--prompt", prompt, "-z", bin_path, "model.pte", "-e", "-q", "-j", "2"],
                     ["-e", "-z", bin_path, "-i", prompt]):  # -e -z: no model needed
            r = run([runner, *args])
            assert r.returncode == 0 and r.stdout == want, (args, r.stderr)
