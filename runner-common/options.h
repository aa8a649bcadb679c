// The runners' llama2.c-style command line (header-only, C++17): Options, usage(), parse_args(). Every flag value
// is parsed and range-checked here, before any file is opened; a bad one is an llm::Error ("bad value for -n: -5
// (...)"), which run_main prints as one "error: ..." line.
#pragma once

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <string>
#include <thread>

#include "tokenizer_file.h"

namespace llm {

struct Options {
  std::string model_path, tokenizer_path, prompt, system_prompt, mode = "generate";
  std::string decoding = "kv";           // -M kv|hybrid|lookahead
  int ngram = 6, window = 1, gcap = 1;   // -L NGRAM,WINDOW,GCAP (lookahead; generate.py --lookahead's spelling)
  bool has_prompt = false, encode_only = false, quiet = false, ignore_stop = false;
  float temperature = 1.0f, top_p = 0.9f;
  int top_k = 0, steps = 256, threads = 0;  // threads 0 after parse_args: $OMP_NUM_THREADS sets the count
  unsigned long long seed = 0;
};

inline void usage(const char* name, const char* artifact) {
  std::fprintf(stderr,
               "Usage:   %s <model> [options]\n"
               "Example: %s %s -z tokenizer.bin -i \"Once upon a time\" -n 256 -t 0.8 -p 0.9 -s 42\n"
               "Options:\n"
               "  -t <float>  temperature in [0,inf), default 1.0 (0 = greedy, the same tokens as generate.py)\n"
               "  -p <float>  top-p (nucleus) in (0,1], default 0.9 (1 = off)\n"
               "  -k <int>    top-k >= 0, default 0 (off)\n"
               "  -s <int>    random seed >= 0, default (and 0): time(NULL)\n"
               "  -n <int>    new tokens to generate (per chat turn), default 256; 0 = up to the context length\n"
               "  -i <string> prompt (generate mode) / first user message (chat mode)\n"
               "  -z <string> tokenizer.bin, default: tokenizer.bin beside the model, else ./tokenizer.bin\n"
               "  -m <string> mode: generate|chat, default: generate\n"
               "  -y <string> system prompt (chat mode)\n"
               "  -e          encode only: print the prompt's token ids and exit (no model is loaded)\n"
               "  -q          quiet: no timings on stderr\n"
               "  -x          ignore stop tokens: always generate -n tokens (benchmarks)\n"
               "  -j <int>    CPU threads >= 1 (default: $OMP_NUM_THREADS, else the cores not busy with other work)\n"
               "  -M <string> decoding: kv (default) | hybrid (prompt through the fixed-length prefill program, needs\n"
               "              an export with --prefill_chunk N) | lookahead (n-gram guesses verified in one call per\n"
               "              step, greedy: -t 0; needs an export with --lookahead)\n"
               "  -L <n,w,g>  lookahead NGRAM,WINDOW,GCAP (n-gram size >= 2, window >= 1, n-grams verified >= 1),\n"
               "              default 6,1,1\n",
               name, name, artifact);
}

// The numeric flags -t -p -k -s -n -j: the whole value must be a number in the flag's range.
inline void set_number(Options& o, char flag, const std::string& v) {
  auto bad = [&](const char* want) {
    return Error("bad value for -" + std::string(1, flag) + ": " + v + " (" + want + ")");
  };
  char* end = nullptr;
  errno = 0;
  if (flag == 't' || flag == 'p') {
    double x = NAN;
    if (!v.empty() && !std::isspace((unsigned char)v[0])) {
      x = std::strtod(v.c_str(), &end);
      if (*end) x = NAN;  // "0.8x" is not a number either
    }
    if (!std::isfinite(x) || !std::isfinite(float(x))) throw bad("want a finite number");
    if (flag == 't' && x < 0) throw bad("temperature must be >= 0");
    if (flag == 'p' && !(x > 0 && x <= 1)) throw bad("top-p must be in (0, 1]");
    (flag == 't' ? o.temperature : o.top_p) = float(x);
    return;
  }
  if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) throw bad("want a whole number >= 0");
  const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
  if (errno == ERANGE) throw bad("too large");
  if (flag == 's') {
    o.seed = x;
    return;
  }
  if (x > (unsigned long long)INT_MAX) throw bad("too large");
  if (flag == 'j' && x < 1) throw bad("want at least 1 thread");
  (flag == 'k' ? o.top_k : flag == 'j' ? o.threads : o.steps) = int(x);
}

// -L NGRAM,WINDOW,GCAP: three whole numbers, NGRAM >= 2, WINDOW >= 1, GCAP >= 1.
inline void set_lookahead(Options& o, const std::string& v) {
  int vals[3], k = 0;
  size_t a = 0;
  while (k < 3) {
    size_t b = v.find(',', a);
    std::string part = v.substr(a, b == std::string::npos ? std::string::npos : b - a);
    if (part.empty() || part.size() > 6 || part.find_first_not_of("0123456789") != std::string::npos) break;
    vals[k++] = std::atoi(part.c_str());
    if (b == std::string::npos) break;
    a = b + 1;
  }
  const bool three = k == 3 && std::count(v.begin(), v.end(), ',') == 2;
  if (!three || vals[0] < 2 || vals[1] < 1 || vals[2] < 1)
    throw Error("bad value for -L: " + v + " (want NGRAM,WINDOW,GCAP: NGRAM >= 2, WINDOW >= 1, GCAP >= 1, e.g. 6,1,1)");
  o.ngram = vals[0], o.window = vals[1], o.gcap = vals[2];
}

// artifact: the example model file in the usage text (model.pte / model.pt2)
// The default thread count (generate.py's too, common.set_threads): the cores less those other processes keep busy
// now (/proc/stat sampled 0.3 s apart), at least 1. OpenMP / XNNPACK threads wait at every kernel's end for the
// slowest one, so a thread on a core someone else holds stalls them all (README: Threads).
inline int free_cores(bool quiet) {
  const int n = std::max(1u, std::thread::hardware_concurrency());
  auto sample = [](long long& total, long long& idle) {
    std::ifstream f("/proc/stat");
    std::string cpu;
    long long v[8] = {0};
    f >> cpu;
    for (long long& x : v) f >> x;
    total = 0;
    for (long long x : v) total += x;
    idle = v[3] + v[4];  // idle + iowait
    return bool(f);
  };
  long long t0, i0, t1, i1;
  if (!sample(t0, i0)) return n;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  if (!sample(t1, i1) || t1 <= t0) return n;
  const int busy = int(std::lround(n * (1.0 - double(i1 - i0) / double(t1 - t0))));
  const int free = std::max(1, n - busy);
  if (free < n && !quiet)
    std::fprintf(stderr, "%d of %d cores are busy with other work: %d thread%s (-j N to choose)\n", busy, n, free,
                 free > 1 ? "s" : "");
  return free;
}

inline Options parse_args(int argc, char** argv, const char* artifact) {
  Options o;
  if (argc < 2 || argv[1][0] == '-') {
    if (argc >= 2 && (std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help")) {
      usage(argv[0], artifact);
      std::exit(0);
    }
    usage(argv[0], artifact);
    std::exit(1);
  }
  o.model_path = argv[1];
  for (int i = 2; i < argc; i++) {
    std::string a = argv[i];
    if (a.size() != 2 || a[0] != '-') throw Error("unknown argument " + a + " (see -h)");
    char f = a[1];
    if (f == 'e') { o.encode_only = true; continue; }
    if (f == 'q') { o.quiet = true; continue; }
    if (f == 'x') { o.ignore_stop = true; continue; }
    if (f == 'h') { usage(argv[0], artifact); std::exit(0); }
    if (std::string("tpksnjizmyML").find(f) == std::string::npos) throw Error("unknown option " + a + " (see -h)");
    if (i + 1 >= argc) throw Error("option " + a + " needs a value");
    std::string v = argv[++i];
    switch (f) {
      case 'i': o.prompt = v, o.has_prompt = true; break;
      case 'z': o.tokenizer_path = v; break;
      case 'm': o.mode = v; break;
      case 'y': o.system_prompt = v; break;
      case 'M': o.decoding = v; break;
      case 'L': set_lookahead(o, v); break;
      default: set_number(o, f, v);
    }
  }
  if (o.mode != "generate" && o.mode != "chat") throw Error("unknown mode " + o.mode + " (generate or chat)");
  if (o.decoding != "kv" && o.decoding != "hybrid" && o.decoding != "lookahead")
    throw Error("bad value for -M: " + o.decoding + " (kv, hybrid or lookahead)");
  if (o.decoding == "lookahead" && o.temperature > 0) throw Error("lookahead decoding is greedy only: use -t 0");
  if (o.seed == 0) o.seed = (unsigned long long)std::time(nullptr);
  if (o.threads == 0 && !std::getenv("OMP_NUM_THREADS") && !o.encode_only) o.threads = free_cores(o.quiet);
  if (o.tokenizer_path.empty()) {
    std::string dir = o.model_path.substr(0, o.model_path.find_last_of('/') + 1);
    std::string beside = dir + "tokenizer.bin";
    std::ifstream f(beside);
    o.tokenizer_path = f.good() ? beside : "tokenizer.bin";
  }
  return o;
}

}  // namespace llm
