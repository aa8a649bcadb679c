// The runners' command line (header-only, C++17): Options, the flag table FLAGS, usage(), parse_args(). Every flag
// has llama2.c's letter and descriptive long forms (generate.py's names where it has one): "-t 0.8", "--temperature
// 0.8" and "--temperature=0.8" are the same. Each flag's rule (type, range) is declared in its row of FLAGS; every
// value is parsed and checked there, before any file is opened. A bad one is an llm::Error ("bad value for -n: -5
// (want a whole number >= 0)", naming the flag as it was given), which run_main prints as one "error: ..." line.
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
#include <initializer_list>
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

// The most threads -j takes. Each thread is an OS thread of XNNPACK's pool (runner-et) or libtorch's OpenMP pool
// (runner-aoti); asking for 100000 made pthreadpool fail half-way and runner-et die with SIGSEGV. 1024 is above the
// hardware threads of any single machine today (2 x 192 cores x 2 SMT = 768) and a fixed bound, so a command line
// means the same on every machine; more threads than cores only slow a run down, but do no harm.
constexpr unsigned long long MAX_THREADS = 1024;

// A flag's value as given, with the checks a flag's rule uses; each throws "bad value for <flag>: <value> (<want>)".
struct Arg {
  std::string flag, v;  // the flag as it was spelled (-t, --temperature), its value

  Error bad(const std::string& want) const { return Error("bad value for " + flag + ": " + v + " (" + want + ")"); }
  static std::string num(double x) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", x);
    return b;
  }
  // a finite number in [lo, hi] ((lo, hi] when open); the whole value must be the number ("0.8x", " 1" are not)
  double real(double lo, double hi, bool open = false) const {
    const std::string want = "want a number " + (std::isinf(hi) ? (open ? "> " : ">= ") + num(lo)
                                                                : (open ? "in (" : "in [") + num(lo) + ", " + num(hi) + "]");
    char* end = nullptr;
    const double x = v.empty() || std::isspace((unsigned char)v[0]) ? NAN : std::strtod(v.c_str(), &end);
    if (!std::isfinite(x) || *end || !std::isfinite(float(x)) || x < lo || (open && x == lo) || x > hi)
      throw bad(want);
    return x;
  }
  // a whole number in [lo, hi]: decimal digits only (no sign, no exponent, no spaces)
  unsigned long long whole(unsigned long long lo, unsigned long long hi) const {
    const std::string want = "want a whole number " + (hi == ULLONG_MAX || hi == INT_MAX ? ">= " + std::to_string(lo)
                                                       : "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) throw bad(want);
    errno = 0;
    const unsigned long long x = std::strtoull(v.c_str(), nullptr, 10);
    if (errno == ERANGE || x < lo || x > hi) throw bad(want);
    return x;
  }
  // one of the choices; the message names what is unknown ("unknown mode poem")
  std::string choice(const char* what, std::initializer_list<const char*> choices) const {
    std::string list;
    for (const char* c : choices) {
      if (v == c) return v;
      list += (list.empty() ? "" : ", ") + std::string(c);
    }
    throw bad("unknown " + std::string(what) + "; want " + list);
  }
  // NGRAM,WINDOW,GCAP: three whole numbers, each at least its minimum
  void triple(int out[3], std::initializer_list<int> mins) const {
    const std::string want = "want NGRAM,WINDOW,GCAP: NGRAM >= 2, WINDOW >= 1, GCAP >= 1, e.g. 6,1,1";
    size_t a = 0, k = 0;
    for (int lo : mins) {
      const size_t b = v.find(',', a);
      const std::string part = v.substr(a, b == std::string::npos ? std::string::npos : b - a);
      if (part.empty() || part.size() > 6 || part.find_first_not_of("0123456789") != std::string::npos ||
          std::atoi(part.c_str()) < lo || (b == std::string::npos) != (k == 2))
        throw bad(want);
      out[k++] = std::atoi(part.c_str());
      a = b + 1;
    }
  }
};

// One flag: llama2.c's letter, its long names ('|'-separated, the first one is the usage text's), the value's name
// (nullptr: a switch), the help line, and the rule: set() checks the value (the Arg call's arguments are the range)
// and stores it.
struct Flag {
  char letter;
  const char* names;
  const char* value;
  const char* help;
  void (*set)(Options&, const Arg&);
};

inline const Flag FLAGS[] = {
    {'t', "temperature", "<float>", "temperature >= 0, default 1.0 (0 = greedy: generate.py's tokens)",
     [](Options& o, const Arg& a) { o.temperature = float(a.real(0, INFINITY)); }},
    {'p', "top_p", "<float>", "top-p (nucleus) in (0, 1], default 0.9 (1 = off)",
     [](Options& o, const Arg& a) { o.top_p = float(a.real(0, 1, true)); }},
    {'k', "top_k", "<int>", "top-k >= 0, default 0 (off)",
     [](Options& o, const Arg& a) { o.top_k = int(a.whole(0, INT_MAX)); }},
    {'s', "seed", "<int>", "random seed >= 0, default (and 0): time(NULL)",
     [](Options& o, const Arg& a) { o.seed = a.whole(0, ULLONG_MAX); }},
    {'n', "max_new_tokens|steps", "<int>", "new tokens (per chat turn) >= 0, default 256; 0 = up to the context",
     [](Options& o, const Arg& a) { o.steps = int(a.whole(0, INT_MAX)); }},
    {'i', "prompt", "<string>", "prompt (generate mode) / first user message (chat mode)",
     [](Options& o, const Arg& a) { o.prompt = a.v, o.has_prompt = true; }},
    {'z', "tokenizer|tokenizer_path", "<path>", "tokenizer.bin, default: beside the model, else ./tokenizer.bin",
     [](Options& o, const Arg& a) { o.tokenizer_path = a.v; }},
    {'m', "mode", "<string>", "generate|chat, default: generate",
     [](Options& o, const Arg& a) { o.mode = a.choice("mode", {"generate", "chat"}); }},
    {'y', "system|system_prompt", "<string>", "system prompt (chat mode)",
     [](Options& o, const Arg& a) { o.system_prompt = a.v; }},
    {'e', "encode_only", nullptr, "print the prompt's token ids and exit (no model is loaded)",
     [](Options& o, const Arg&) { o.encode_only = true; }},
    {'q', "quiet", nullptr, "quiet: no timings on stderr", [](Options& o, const Arg&) { o.quiet = true; }},
    {'x', "ignore_eos", nullptr, "ignore stop tokens: always generate -n tokens (benchmarks)",
     [](Options& o, const Arg&) { o.ignore_stop = true; }},
    {'j', "threads", "<int>",
     "CPU threads in [1, 1024] (default: $OMP_NUM_THREADS, else the cores not\nbusy with other work)",
     [](Options& o, const Arg& a) { o.threads = int(a.whole(1, MAX_THREADS)); }},
    {'M', "decoding", "<string>",
     "kv (default) | hybrid (the prompt through the fixed-length prefill\nprogram: export with --prefill_chunk N) | "
     "lookahead (n-gram guesses\nverified in one call per step, greedy: -t 0; export with --lookahead)",
     [](Options& o, const Arg& a) { o.decoding = a.choice("decoding", {"kv", "hybrid", "lookahead"}); }},
    {'L', "lookahead", "<n,w,g>", "lookahead NGRAM,WINDOW,GCAP (n-gram size >= 2, window >= 1,\n"
     "n-grams verified >= 1), default 6,1,1",
     [](Options& o, const Arg& a) {
       int v[3];
       a.triple(v, {2, 1, 1});
       o.ngram = v[0], o.window = v[1], o.gcap = v[2];
     }},
    {'h', "help", nullptr, "this text", nullptr},
};

// "Usage:" and "Example:" lines; full: the flags too, each as "-t, --temperature <float>"
// (artifact: the example model file, model.pte / model.pt2)
inline void usage(std::FILE* out, const char* name, const char* artifact, bool full) {
  std::fprintf(out,
               "Usage:   %s <model> [options]\n"
               "Example: %s %s -z tokenizer.bin -i \"Once upon a time\" -n 256 -t 0.8 -p 0.9 -s 42\n",
               name, name, artifact);
  if (!full) return;
  std::fprintf(out, "Options (--name value and --name=value both work):\n");
  for (const Flag& f : FLAGS) {
    std::string forms = std::string("-") + f.letter, names = f.names;
    for (size_t a = 0; a <= names.size();) {
      const size_t b = std::min(names.find('|', a), names.size());
      forms += ", --" + names.substr(a, b - a);
      a = b + 1;
    }
    if (f.value) forms += std::string(" ") + f.value;
    std::string help = f.help;
    for (size_t nl = help.find('\n'); nl != std::string::npos; nl = help.find('\n', nl + 1))
      help.insert(nl + 1, std::string(36, ' '));
    if (forms.size() > 33) forms += "\n" + std::string(35, ' ');  // the help on a line of its own
    std::fprintf(out, "  %-33s %s\n", forms.c_str(), help.c_str());
  }
}

// The row of "-t" or "--temperature" / "--steps" (the part before '='), nullptr if none.
inline const Flag* find_flag(const std::string& a) {
  for (const Flag& f : FLAGS) {
    if (a.size() == 2 && a[0] == '-' && a[1] == f.letter) return &f;
    if (a.size() < 3 || a.compare(0, 2, "--") != 0) continue;
    const std::string names = std::string("|") + f.names + "|";
    if (names.find("|" + a.substr(2) + "|") != std::string::npos) return &f;
  }
  return nullptr;
}

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

// argv: "<model> [options]" (the model may also come after the options); -h / --help print the usage and exit 0.
// Without a model: the short usage and an Error (the model may be left out with -e and -z: no model is loaded).
inline Options parse_args(int argc, char** argv, const char* artifact) {
  Options o;
  bool model = false;
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    if (a.size() < 2 || a[0] != '-') {
      if (model) throw Error("unexpected argument " + a + ": the model is " + o.model_path + " (see -h)");
      o.model_path = a, model = true;
      continue;
    }
    const size_t eq = a.compare(0, 2, "--") == 0 ? a.find('=') : std::string::npos;
    const std::string name = a.substr(0, eq);
    const Flag* f = find_flag(name);
    if (!f) throw Error("unknown option " + name + " (see -h)");
    if (!f->set) {
      usage(stdout, argv[0], artifact, true);
      std::exit(0);
    }
    Arg v{name, ""};
    if (!f->value && eq != std::string::npos) throw Error("option " + name + " takes no value");
    if (eq != std::string::npos) v.v = a.substr(eq + 1);
    else if (f->value && i + 1 >= argc) throw Error("option " + name + " needs a value");
    else if (f->value) v.v = argv[++i];
    f->set(o, v);
  }
  if (!model && !(o.encode_only && !o.tokenizer_path.empty())) {
    usage(stderr, argc ? argv[0] : "run", artifact, false);
    throw Error(argc > 1 ? "no model file given (see -h)" : "no arguments: give a model file (see -h)");
  }
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
