// The generate loop, chat loop and main shared by runner-aoti/ and runner-et/ (the command line: options.h).
// A runner implements llm::Model (load, forward over a token chunk with the KV cache kept inside, metadata; for the
// decoding modes also prefill() and forward_masked()) and calls
//     return llm::run_main(argc, argv, "runner-aoti", [](const llm::Options& o) { return load(o); });
// Decoding modes (-M): kv (the prompt in one forward call, then one call per token), hybrid (the prompt through the
// fixed-length `prefill` program in chunks of its length, the last one padded, then one call per token) and
// lookahead (lookahead.h: n-gram guesses verified in one call of the `lookahead` program per step; lossless).
// Output matches generate.py: generate mode prints the prompt, the streamed continuation and a newline on stdout;
// chat mode reads user lines after a "> " prompt. Timings go to stderr.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "options.h"
#include "sampler.h"
#include "tokenizer.h"

namespace llm {

struct GenStats;
class Model;
inline std::vector<int> lookahead_generate(Model& model, const Tokenizer& tok, const std::vector<int64_t>& prompt,
                                    int start_pos, int max_new, int N, int W, int G,
                                    const std::function<void(int)>& on_token, GenStats* st);

struct ModelInfo {
  int vocab_size = 0;
  int max_seq_len = 0;
  int bos_id = -1;               // -1: unknown (the tokenizer.bin extension usually says)
  std::vector<int> eos_ids;      // empty: unknown
  int tokenizer_vocab_size = -1; // -1: unknown; used to warn about a tokenizer.bin that belongs to another model
  bool has_vocab_fingerprint = false;  // the artifact records its tokenizer's Tokenizer::fingerprint (README)
  uint64_t vocab_fingerprint = 0;
  std::string tokenizer_kind;    // "sentencepiece" | "bpe" | ""
  std::string description;       // one line for the log
  int prefill_len = 0;           // hybrid: the fixed length N of the loaded `prefill` program (0: not loaded)
  bool lookahead = false;        // lookahead: the `lookahead` program (tokens, positions, mask) is loaded
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelInfo& info() const = 0;
  // Process tokens[0..n) at positions pos..pos+n-1 in one call (the KV cache lives in the model) and return the
  // logits of the last position: info().vocab_size floats, valid until the next call.
  virtual const float* forward(const int64_t* tokens, int n, int64_t pos) = 0;
  // hybrid: exactly info().prefill_len tokens at positions[0..N) (the caller pads the last chunk); returns the logits
  // of every row, [N, vocab_size].
  virtual const float* prefill(const int64_t* /*tokens*/, const int64_t* /*positions*/) {
    throw Error("this model has no fixed-length prefill program");
  }
  // lookahead (speculative.py's contract): n tokens at positions[0..n); token k writes cache slot positions[0] + k and
  // attends as mask [n, max_seq_len] (additive: 0 or -inf) says; returns the logits of every row, [n, vocab_size].
  virtual const float* forward_masked(const int64_t* /*tokens*/, const int64_t* /*positions*/, const float* /*mask*/,
                                      int /*n*/) {
    throw Error("this model has no lookahead program");
  }
};

// The one line a runner throws when an artifact lacks the program a mode needs: names the export flag.
inline Error missing_program(const std::string& path, const std::string& program, const std::string& mode) {
  const std::string flag = mode == "hybrid" ? "--prefill_chunk N" : "--lookahead";
  return Error(path + " has no `" + program + "` program, which -M " + mode + " needs: export it with " + flag +
               " (et_export.py / aoti_export.py)");
}

// o.model_path, o.threads (-j, else the free cores; 0 only when $OMP_NUM_THREADS sets the count) and
// o.decoding (-M: which programs to load)
using ModelLoader = std::function<std::unique_ptr<Model>(const Options& o)>;

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline void write_out(const std::string& s) {
  if (!s.empty()) {
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
  }
}

inline double cpu_s() { return double(std::clock()) / CLOCKS_PER_SEC; }  // process CPU time, all threads

struct GenStats {
  int prompt_tokens = 0, steps = 0, new_tokens = 0;
  int decode_tokens = 0;  // tokens the decode forwards produced (kv, hybrid: = steps; lookahead: up to N per step)
  double ttft_s = 0, decode_s = 0, decode_cpu_s = 0;
};

// The tokens one generation keeps (every mode): a stop id ends it, max_new caps it, each kept token is streamed.
struct KeptTokens {
  const Tokenizer& tok;
  int max_new;
  const std::function<void(int)>& on_token;
  std::vector<int> out;
  bool done = max_new <= 0;

  void put(int t) {
    if (done) return;
    if (is_stop(tok, t)) {
      done = true;
      return;
    }
    out.push_back(t);
    if (on_token) on_token(t);
    done = int(out.size()) >= max_new;
  }
};

// The timings of one generation: t0 before the prompt, t_first / c_first (wall / CPU) when the first token came.
inline void fill_stats(GenStats* st, int prompt_tokens, double t0, double t_first, double c_first, int steps,
                       int decode_tokens, int new_tokens) {
  if (!st) return;
  const double t_end = now_s(), c_end = cpu_s();
  st->decode_cpu_s = c_end - c_first;
  st->prompt_tokens = prompt_tokens;
  st->ttft_s = t_first - t0;
  st->decode_s = t_end - t_first;
  st->steps = steps;
  st->decode_tokens = decode_tokens;
  st->new_tokens = new_tokens;
}

// hybrid: the prompt at start_pos.. through the fixed-length prefill program, chunks of N tokens, the last one padded
// (token 0 at the positions after the prompt, clamped to the context: causally after it, overwritten by decode).
// Returns the logits of the prompt's last token.
inline const float* hybrid_prefill(Model& model, const std::vector<int64_t>& ids, int start_pos) {
  const ModelInfo& mi = model.info();
  const int N = mi.prefill_len;
  std::vector<int64_t> tok(N), pos(N);
  const float* last = nullptr;
  for (size_t s = 0; s < ids.size(); s += N) {
    const int n = int(std::min(ids.size() - s, size_t(N)));
    for (int i = 0; i < N; i++) {
      tok[i] = i < n ? ids[s + i] : 0;
      pos[i] = std::min<int64_t>(start_pos + int64_t(s) + i, mi.max_seq_len - 1);
    }
    last = model.prefill(tok.data(), pos.data()) + size_t(n - 1) * mi.vocab_size;
  }
  return last;
}

// generate.py's generate() for one sequence: prompt in one forward call at start_pos (hybrid: prefill chunks), then
// one call per token (lookahead: lookahead.h); stops at a stop id (not emitted) or after max_new tokens (clamped to
// the context). Returns the kept tokens.
inline std::vector<int> generate(Model& model, const Tokenizer& tok, Sampler& sampler, const std::vector<int>& prompt,
                                 int start_pos, int max_new, const std::function<void(int)>& on_token, GenStats* st,
                                 const Options& o) {
  const ModelInfo& mi = model.info();
  const int len = start_pos + int(prompt.size());
  if (prompt.empty()) throw Error("empty prompt (and the tokenizer adds no BOS): nothing to condition on");
  if (len >= mi.max_seq_len)
    throw Error("prompt of " + std::to_string(len) + " tokens does not fit the context of " +
                std::to_string(mi.max_seq_len) + " tokens");
  if (max_new <= 0 || max_new > mi.max_seq_len - len) max_new = mi.max_seq_len - len;
  std::vector<int64_t> ids(prompt.begin(), prompt.end());
  if (o.decoding == "lookahead")
    return lookahead_generate(model, tok, ids, start_pos, max_new, o.ngram, o.window, o.gcap, on_token, st);
  KeptTokens kept{tok, max_new, on_token};
  const double t0 = now_s();
  const float* logits = o.decoding == "hybrid" ? hybrid_prefill(model, ids, start_pos)
                                               : model.forward(ids.data(), int(ids.size()), start_pos);
  int next = sampler.sample(logits, mi.vocab_size);
  kept.put(next);
  const double t_first = now_s(), c_first = cpu_s();
  int steps = 0;
  for (int i = 0; !kept.done; i++) {  // at most max_new - 1 steps: kept.put ends at max_new tokens
    int64_t t = next;
    next = sampler.sample(model.forward(&t, 1, len + i), mi.vocab_size);
    kept.put(next);
    steps++;
  }
  fill_stats(st, int(prompt.size()), t0, t_first, c_first, steps, steps, int(kept.out.size()));
  return kept.out;
}

inline void report(const GenStats& st, int threads) {
  const double prefill = st.prompt_tokens / std::max(st.ttft_s, 1e-9);
  const double decode = st.steps ? st.decode_tokens / st.decode_s : 0.0;
  std::fprintf(stderr,
               "TTFT %.1f ms | prefill %.1f tok/s | decode %.2f tok/s (%d steps) | %d new tokens | "
               "%.2f tokens/forward | %d threads\n",
               st.ttft_s * 1000, prefill, decode, st.steps, st.new_tokens,
               st.steps ? double(st.decode_tokens) / st.steps : 0.0, threads);
  if (st.decode_tokens)  // CPU time per token: a figure that holds up on a machine shared with other work
    std::fprintf(stderr, "decode %.2f ms/token wall, %.2f ms/token CPU (all threads)\n",
                 1000 * st.decode_s / st.decode_tokens, 1000 * st.decode_cpu_s / st.decode_tokens);
  std::fprintf(stderr, "achieved tok/s: %f\n", decode);
  std::ifstream status("/proc/self/status");  // Linux: this process's peak resident memory (VmHWM, in kB)
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) std::fprintf(stderr, "peak memory %.0f MB\n", std::atof(line.c_str() + 6) / 1024);
}

// The tokenizer must fit the model's vocabulary (its ids index the embedding); a model with more ids than the
// tokenizer is fine (padded vocabularies; ids past the tokenizer decode to nothing, as in tokenizer.py). An artifact
// that records its tokenizer's fingerprint takes only that vocabulary (another one of the same size included).
inline void check_pairing(const Tokenizer& tok, const ModelInfo& mi) {
  if (mi.has_vocab_fingerprint && mi.vocab_fingerprint != tok.fingerprint)
    throw Error(tok.path + " is not the vocabulary the model was exported with (fingerprint " +
                std::to_string(tok.fingerprint) + ", the model's " + std::to_string(mi.vocab_fingerprint) +
                "): use the tokenizer.bin of its checkpoint");
  if (tok.n_vocab > mi.vocab_size)
    throw Error("the tokenizer has " + std::to_string(tok.n_vocab) + " tokens but the model's vocabulary is " +
                std::to_string(mi.vocab_size) + ": wrong tokenizer.bin for this model?");
  if (mi.tokenizer_vocab_size >= 0 && mi.tokenizer_vocab_size != tok.n_vocab)
    std::fprintf(stderr, "warning: the model was exported with a %d-token tokenizer, tokenizer.bin has %d\n",
                 mi.tokenizer_vocab_size, tok.n_vocab);
}

inline int chat_loop(Model& model, Tokenizer& tok, Sampler& sampler, const Options& o) {
  const ModelInfo& mi = model.info();
  std::vector<Message> messages;
  if (!o.system_prompt.empty()) messages.push_back({"system", o.system_prompt});
  render_chat(tok, messages, true);  // fails early, with a clear message: no template, or it takes no system message
  std::vector<int> cached;
  std::fprintf(stderr, "chat with the model (%d tokens of context); empty line or Ctrl-D to quit\n", mi.max_seq_len);
  bool first = true;
  while (true) {
    std::string user;
    if (first && o.has_prompt) {
      user = o.prompt;
    } else {
      write_out("> ");
      if (!std::getline(std::cin, user)) {
        write_out("\n");  // the prompt's line ends (as generate.py --chat)
        break;
      }
      if (!isatty(0)) write_out(user + "\n");  // piped input: echoed, so the transcript reads like a terminal's
    }
    first = false;
    if (user.find_first_not_of(" \t\r\n") == std::string::npos) break;
    messages.push_back({"user", user});
    std::vector<int> ids = encode(tok, render_chat(tok, messages, true), 0);
    size_t common = 0;
    while (common < std::min(cached.size(), ids.size() - 1) && cached[common] == ids[common]) common++;
    if (int(ids.size()) + 1 >= mi.max_seq_len) {
      std::fprintf(stderr, "[context full: starting a new conversation]\n");
      messages = {messages.back()};
      cached.clear();
      common = 0;
      ids = encode(tok, render_chat(tok, messages, true), 0);
      if (int(ids.size()) + 1 >= mi.max_seq_len)
        throw Error("message of " + std::to_string(ids.size()) + " tokens does not fit the context of " +
                    std::to_string(mi.max_seq_len));
    }
    StreamDecoder dec{&tok};
    GenStats st;
    std::vector<int> rest(ids.begin() + common, ids.end());
    std::vector<int> out = generate(model, tok, sampler, rest, int(common), o.steps,
                                    [&](int t) { write_out(stream_put(dec, t)); }, &st, o);
    write_out(stream_flush(dec) + "\n");
    // the cache now holds the prompt and every reply token except the last sampled one
    cached = ids;
    if (!out.empty()) cached.insert(cached.end(), out.begin(), out.end() - 1);
    messages.push_back({"assistant", decode(tok, out)});
    if (!o.quiet)
      std::fprintf(stderr, "[%d tokens, %.1f tok/s]\n", st.new_tokens, st.steps ? st.decode_tokens / st.decode_s : 0.0);
  }
  return 0;
}

// What the run is doing ("loading x.pte"), in a page shared with the supervising parent (supervise()).
inline char* g_doing = nullptr;
constexpr size_t DOING_SIZE = 4096;
inline void doing(const std::string& what) {
  if (g_doing) std::snprintf(g_doing, DOING_SIZE, "%s", what.c_str());
}

inline const char* crash_signal(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGSYS: return "SIGSYS";
    default: return nullptr;  // not a crash (SIGINT, SIGTERM, SIGPIPE, SIGKILL, ...)
  }
}

inline pid_t g_child = 0;

// Crash isolation. The runtimes verify a program's structure when they load it (ExecuTorch's InternalConsistency,
// the zip checks of runner-aoti), but not all a corrupt or foreign file can hold: an operator index past the
// table segfaults in ExecuTorch's Method::init, a constant that makes a kernel's ET_CHECK fail aborts, a broken
// library inside a package crashes dlopen. So the run happens in a child process: returns -1 there (go on and run)
// and, in the parent, the child's exit status; a child that dies by a crash signal becomes one line "error: <what it
// was doing>: crashed (SIGSEGV): a corrupt or incompatible file?" and status 1. SIGINT / SIGTERM / SIGHUP / SIGQUIT
// sent to the parent are passed on, and a child ended by a signal that is not a crash ends the parent by the same
// signal (`run ... | head` still ends by SIGPIPE). Without fork() the run happens in-process.
inline int supervise() {
  void* page = mmap(nullptr, DOING_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) return -1;
  g_doing = static_cast<char*>(page);
  doing("starting");
  std::fflush(nullptr);
  const pid_t parent = getpid(), pid = fork();
  if (pid == 0) {  // the child: ends with the parent (a parent killed by SIGKILL leaves no orphan running)
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    return -1;
  }
  if (pid < 0) return -1;  // no child: run here
  g_child = pid;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) signal(sig, [](int s) { kill(g_child, s); });
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return 1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  const int sig = WTERMSIG(status);
  if (const char* name = crash_signal(sig)) {
    g_doing[DOING_SIZE - 1] = '\0';
    std::fprintf(stderr, "error: %s: crashed (%s): a corrupt or incompatible file?\n", g_doing, name);
    return 1;
  }
  signal(sig, SIG_DFL);
  raise(sig);
  return 128 + sig;
}

inline int run_main_inner(int argc, char** argv, const char* name, const ModelLoader& load) {
  Options o = parse_args(argc, argv, std::string(name) == "runner-aoti" ? "model.pt2" : "model.pte");
  doing("reading " + o.tokenizer_path);
  Tokenizer tok = load_tokenizer(o.tokenizer_path);
  if (o.encode_only) {
    std::vector<int> ids = encode(tok, o.prompt);
    for (size_t i = 0; i < ids.size(); i++) std::printf(i ? " %d" : "%d", ids[i]);
    std::printf("\n");
    return 0;
  }
  const double t0 = now_s();
  doing("loading " + o.model_path);
  std::unique_ptr<Model> model = load(o);
  doing("running " + o.model_path);
  const ModelInfo& mi = model->info();
  check_pairing(tok, mi);
  if (!o.quiet)
    std::fprintf(stderr, "%s: loaded %s in %.2f s (%s); tokenizer: %s\n", name, o.model_path.c_str(), now_s() - t0,
                 mi.description.c_str(), describe(tok).c_str());
  if (!tok.has_extension) {  // a plain llama2.c tokenizer.bin: the model's metadata knows better than the defaults
    if (mi.bos_id >= 0) tok.bos_id = mi.bos_id;
    if (!mi.eos_ids.empty()) tok.stop_ids = mi.eos_ids, tok.eos_id = mi.eos_ids[0];
  }
  if (o.ignore_stop) tok.stop_ids.clear();
  Sampler sampler(o.temperature, o.top_p, o.top_k, o.seed);
  if (o.mode == "chat") return chat_loop(*model, tok, sampler, o);

  std::vector<int> ids = encode(tok, o.prompt);
  if (ids.empty()) throw Error("empty prompt (and the tokenizer adds no BOS): nothing to condition on");
  if (int(ids.size()) >= mi.max_seq_len)
    throw Error("prompt of " + std::to_string(ids.size()) + " tokens does not fit the context of " +
                std::to_string(mi.max_seq_len) + " tokens");
  StreamDecoder dec{&tok};
  GenStats st;
  write_out(o.prompt);
  generate(*model, tok, sampler, ids, 0, o.steps, [&](int t) { write_out(stream_put(dec, t)); }, &st, o);
  write_out(stream_flush(dec) + "\n");
  const char* env = std::getenv("OMP_NUM_THREADS");  // o.threads is 0 only when $OMP_NUM_THREADS set the count
  if (!o.quiet) report(st, o.threads > 0 ? o.threads : std::max(1, env ? std::atoi(env) : 1));
  return 0;
}

// Parses the command line, loads tokenizer and model, runs (in a child process: supervise()); any error becomes
// "error: ..." on stderr and exit 1.
inline int run_main(int argc, char** argv, const char* name, const ModelLoader& load) {
  const int supervised = supervise();
  if (supervised >= 0) return supervised;
  try {
    return run_main_inner(argc, argv, name, load);
  } catch (const std::bad_alloc&) {  // e.g. a corrupt size field in a model file
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s: out of memory\n", g_doing ? g_doing : "running");
    return 1;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", msg.substr(0, msg.find('\n')).c_str());
    return 1;
  } catch (...) {  // not a std::exception: still one line, never std::terminate's abort
    std::fflush(stdout);
    std::fprintf(stderr, "error: unexpected failure (an exception of unknown type)\n");
    return 1;
  }
}

}  // namespace llm

#include "lookahead.h"
