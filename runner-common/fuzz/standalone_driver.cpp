// A stand-in for libFuzzer's driver, for compilers without it (tests/test_libfuzzer.py uses it when clang++ is
// missing): link it with a fuzz target (LLVMFuzzerTestOneInput), preferably under the sanitizers,
//   g++ -std=c++17 -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined -I runner-common
//       runner-common/fuzz/fuzz_tokenizer.cpp runner-common/fuzz/standalone_driver.cpp -o fuzz_tokenizer
//   ./fuzz_tokenizer -max_total_time=5 -max_len=100000 -seed=1 corpus/      (files and folders of seed inputs)
// It runs the target over every seed input as it is, then over mutations of them (bit flips, random and boundary
// bytes, 32-bit fields set to small / huge values, truncations, insertions, deletions and copied chunks at random
// offsets, a few at a time, sometimes on top of the previous mutant) until -max_total_time seconds or -runs inputs.
// No coverage feedback: a random walk around the seeds, deterministic for a -seed. A finding ends the process: a
// crash by a signal, a sanitizer's report (its non-zero exit), or an input that runs past -timeout seconds
// (SIGALRM); the input is written to <-artifact_prefix>crash-<run> first where that is possible. The last lines are
// libFuzzer's stat::number_of_executed_units line. libFuzzer's other flags (-rss_limit_mb=...) are accepted and
// ignored.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" void __sanitizer_set_death_callback(void (*)(void)) __attribute__((weak));

namespace {

const std::string* g_input = nullptr;  // the input being run, for the crash artifact
char g_artifact[4096] = "";            // where it goes (set before each run: no formatting in a signal handler)

void write_artifact() {
  if (!g_input || !g_artifact[0]) return;
  const int fd = open(g_artifact, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  for (size_t at = 0; at < g_input->size();) {
    const ssize_t n = write(fd, g_input->data() + at, g_input->size() - at);
    if (n <= 0) break;
    at += size_t(n);
  }
  close(fd);
  const char msg[] = "standalone fuzz driver: the input that failed is in ";
  (void)!write(2, msg, sizeof msg - 1);
  (void)!write(2, g_artifact, strlen(g_artifact));
  (void)!write(2, "\n", 1);
}

void on_signal(int sig) {  // save the input, then die by the same signal (the exit status tells which)
  write_artifact();
  signal(sig, SIG_DFL);
  raise(sig);
}

void mutate_once(std::string& s, std::mt19937_64& rng, size_t max_len) {
  auto pick = [&](size_t n) { return n ? size_t(rng() % n) : 0; };
  static const uint8_t edge[] = {0x00, 0x01, 0x7F, 0x80, 0xFF, 0xFE};
  static const uint32_t edge32[] = {0, 1, 2, 0x7FFFFFFF, 0x80000000u, 0xFFFFFFFFu, 0xFFFF, 0x10000};
  switch (rng() % 8) {
    case 0:  // flip a bit
      if (!s.empty()) s[pick(s.size())] ^= char(1u << (rng() % 8));
      break;
    case 1:  // a random byte
      if (!s.empty()) s[pick(s.size())] = char(rng());
      break;
    case 2:  // a boundary byte
      if (!s.empty()) s[pick(s.size())] = char(edge[rng() % sizeof edge]);
      break;
    case 3:  // a 32-bit field (lengths, counts, offsets) set to a boundary value or a small one
      if (s.size() >= 4) {
        const uint32_t v = rng() % 2 ? edge32[rng() % (sizeof edge32 / 4)] : uint32_t(rng() % 300);
        std::memcpy(&s[pick(s.size() - 3)], &v, 4);
      }
      break;
    case 4:  // truncate
      s.resize(pick(s.size() + 1));
      break;
    case 5: {  // insert random bytes
      std::string bytes(1 + rng() % 16, '\0');
      for (char& c : bytes) c = char(rng());
      s.insert(pick(s.size() + 1), bytes);
      break;
    }
    case 6:  // delete a range
      if (!s.empty()) {
        const size_t at = pick(s.size());
        s.erase(at, 1 + pick(std::min<size_t>(64, s.size() - at)));
      }
      break;
    default:  // copy a chunk of the input over another place
      if (s.size() >= 2) {
        const size_t from = pick(s.size()), n = 1 + pick(std::min<size_t>(64, s.size() - from));
        const std::string chunk = s.substr(from, n);
        s.replace(pick(s.size()), chunk.size(), chunk);
      }
  }
  if (s.size() > max_len) s.resize(max_len);
}

bool flag(const char* arg, const char* name, long long* out) {
  const size_t n = strlen(name);
  if (strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  *out = std::atoll(arg + n + 1);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  long long seconds = 5, runs = -1, seed = 1, max_len = 1 << 20, timeout = 10;
  std::string prefix = "./";
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; i++) {
    const char* a = argv[i];
    if (flag(a, "-max_total_time", &seconds) || flag(a, "-runs", &runs) || flag(a, "-seed", &seed) ||
        flag(a, "-max_len", &max_len) || flag(a, "-timeout", &timeout))
      continue;
    if (strncmp(a, "-artifact_prefix=", 17) == 0) {
      prefix = a + 17;
    } else if (a[0] == '-') {  // another libFuzzer flag: ignored
    } else if (std::filesystem::is_directory(a)) {
      for (const auto& e : std::filesystem::directory_iterator(a))
        if (e.is_regular_file()) inputs.push_back(e.path().string());
    } else {
      inputs.push_back(a);
    }
  }
  std::vector<std::string> seeds;
  for (const auto& path : inputs) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
      std::fprintf(stderr, "error: cannot read %s\n", path.c_str());
      return 1;
    }
    seeds.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    if (seeds.back().size() > size_t(max_len)) seeds.back().resize(size_t(max_len));
  }
  if (seeds.empty()) seeds.emplace_back();
  for (int sig : {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL, SIGALRM}) signal(sig, on_signal);
  if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(write_artifact);
  std::fprintf(stderr, "standalone fuzz driver: %zu seed input(s), -seed=%lld, %lld s, max_len %lld\n",
               seeds.size(), seed, seconds, max_len);
  std::mt19937_64 rng{uint64_t(seed)};
  const auto start = std::chrono::steady_clock::now(), end = start + std::chrono::seconds(seconds);
  std::string input;
  long long n = 0;
  for (; runs < 0 || n < runs; n++) {
    if (size_t(n) < seeds.size()) {
      input = seeds[size_t(n)];  // each seed as it is first
    } else {
      if (std::chrono::steady_clock::now() >= end) break;
      if (rng() % 4 != 0 || input.empty()) input = seeds[rng() % seeds.size()];  // else: on top of the last mutant
      for (int k = 1 + int(rng() % 4); k > 0; k--) mutate_once(input, rng, size_t(max_len));
    }
    std::snprintf(g_artifact, sizeof g_artifact, "%scrash-%lld", prefix.c_str(), n);
    g_input = &input;
    // a heap block of exactly the input's size (as libFuzzer passes it): a read past the end is a sanitizer report
    std::unique_ptr<uint8_t[]> data(new uint8_t[input.size() + !input.size()]);
    std::memcpy(data.get(), input.data(), input.size());
    alarm(unsigned(timeout > 0 ? timeout : 0));
    LLVMFuzzerTestOneInput(data.get(), input.size());
    alarm(0);
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "Done %lld runs in %.1f s, no finding\nstat::number_of_executed_units: %lld\n", n, took, n);
  return 0;
}
