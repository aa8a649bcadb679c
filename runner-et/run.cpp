// runner-et: llama2.c-style text generation from an ExecuTorch program (.pte from et_export.py), XNNPACK delegate.
//   ./runner-et/build/run smollm2.pte -z tokenizer.bin -i "Once upon a time" -n 256
// This file only adapts executorch::extension::Module to llm::Model; the tokenizer, sampler and the generate / chat
// loops live in runner-common/ and are shared with runner-aoti. The .pte contract (et_export.py): method
// forward(tokens int64[1, T], input_pos int64[T]) -> float32 logits[1, T, V] with dynamic T and the KV cache in
// mutable buffers; constant methods get_max_seq_len, get_vocab_size, get_bos_id, get_eos_ids, use_kv_cache, ...
// (get_vocab_fingerprint, when present: the tokenizer.bin must have that fingerprint, runner-common/README.md)
// Decoding modes load other methods of the same program (sharing the cache): -M hybrid `prefill` (T fixed,
// get_prefill_chunk) and `decode` (T = 1; `forward` when absent), -M lookahead only `lookahead` (tokens, positions,
// mask float32[1, 1, T, S]). In kv mode a `prompt` method (et_export.py --fast_prefill: tokens, positions, logits_at
// int64[1] -> the last position's logits [1, 1, V]) takes every call of more than one token. Only the methods a
// mode uses are loaded (XNNPACK packs each method's weights: --fast_prefill's `prompt` costs a second copy).
#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/platform/runtime.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "pte_check.h"
#include "runner.h"

// The wheel ships the thread pool library but not its header (extension/threadpool/threadpool.h): the two calls
// used to size the pool, declared as that header declares them.
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

namespace {

using executorch::extension::Module;
using executorch::runtime::Error;
using executorch::runtime::EValue;

std::string err(Error e) {
  return std::string(executorch::runtime::to_string(e)) + " (0x" +
         [](unsigned v) { char b[16]; std::snprintf(b, sizeof b, "%x", v); return std::string(b); }(unsigned(e)) +
         ")";
}

// The .pte's header, checked against the file before the runtime sees it (pte_check.h); then load() has ExecuTorch
// verify the whole flatbuffer (Program::Verification::InternalConsistency).
void check_pte(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw llm::Error("cannot open ExecuTorch program " + path);
  const std::streamoff size = f.tellg();
  char head[64] = {};
  f.seekg(0);
  f.read(head, std::min<std::streamoff>(size, 64));
  check_pte_header(head, uint64_t(size), path);
}

class EtModel : public llm::Model {
 public:
  explicit EtModel(const std::string& path, const std::string& decoding) {
    check_pte(path);
    // share_memory_arenas: methods exported together (et_export.py's share_mutable_buffers) use one KV cache
    module_ = std::make_unique<Module>(path, Module::LoadMode::Mmap, nullptr, nullptr, nullptr, true);
    Error e = module_->load(executorch::runtime::Program::Verification::InternalConsistency);
    if (e == Error::InvalidProgram)
      throw llm::Error(path + ": corrupt or truncated ExecuTorch program (ExecuTorch's verification failed)");
    if (e != Error::Ok) throw llm::Error(path + ": cannot load ExecuTorch program: " + err(e));
    auto names = module_->method_names();
    if (!names.ok() || !names->count("forward"))
      throw llm::Error(path + ": the program has no forward method (not made by et_export.py?)");
    if (decoding == "hybrid") {
      if (!names->count("prefill") || !names->count("get_prefill_chunk"))
        throw llm::missing_program(path, "prefill", decoding);
      load(path, "prefill");
      decode_ = names->count("decode") ? "decode" : "forward";
      load(path, decode_);
      info_.prefill_len = int(constant(*names, "get_prefill_chunk", 0));
    } else if (decoding == "lookahead") {
      if (!names->count("lookahead")) throw llm::missing_program(path, "lookahead", decoding);
      load(path, "lookahead");
      info_.lookahead = true;
    } else {
      load(path, "forward");
      if (names->count("prompt")) {  // et_export.py --fast_prefill: prompts of 2+ tokens, the last logits only
        load(path, "prompt");
        prompt_ = true;
      }
    }
    info_.max_seq_len = int(constant(*names, "get_max_seq_len", 0));
    info_.vocab_size = int(constant(*names, "get_vocab_size", 0));
    info_.bos_id = int(constant(*names, "get_bos_id", -1));
    if (names->count("get_eos_ids")) {
      auto r = module_->execute("get_eos_ids");
      if (r.ok())
        for (auto& v : *r)
          if (v.isInt()) info_.eos_ids.push_back(int(v.toInt()));
    }
    if (names->count("get_vocab_fingerprint")) {  // runner-common/README.md: Vocabulary fingerprint
      info_.has_vocab_fingerprint = true;
      info_.vocab_fingerprint = uint64_t(constant(*names, "get_vocab_fingerprint", 0));
    }
    if (names->count("use_kv_cache") && !constant(*names, "use_kv_cache", 1))
      throw llm::Error(path + ": program without a KV cache (use_kv_cache is false); export it with et_export.py");
    if (info_.max_seq_len <= 0 || info_.vocab_size <= 0)
      throw llm::Error(path + ": get_max_seq_len/get_vocab_size missing (not made by et_export.py?)");
    info_.description = "ExecuTorch, vocab " + std::to_string(info_.vocab_size) + ", context " +
                        std::to_string(info_.max_seq_len);
    if (prompt_) info_.description += ", prompts through \"prompt\"";
    if (decoding == "kv") {  // warm up (as runner-aoti): a call of each method sets up its kernels before the first
      const int64_t w[2] = {0, 0};  // prompt is timed, and a program whose kernels fail on it fails here, before any
      forward(w, 1, 0);             // output (cache positions 0-1 are written again before they are read)
      if (prompt_) forward(w, 2, 0);
    }
  }

  const llm::ModelInfo& info() const override { return info_; }

  const float* forward(const int64_t* tokens, int n, int64_t pos) override {
    pos_.resize(n);
    for (int i = 0; i < n; i++) pos_[i] = pos + i;
    const auto& logits = prompt_ && n > 1 ? run("prompt", tokens, pos_.data(), nullptr, n, n - 1)
                                          : run(decode_, tokens, pos_.data(), nullptr, n);
    // the last position's row: [1, T, V] or [1, 1, V] (a program that returns only the last position)
    return logits.const_data_ptr<float>() + size_t(logits.size(1) - 1) * info_.vocab_size;
  }

  const float* prefill(const int64_t* tokens, const int64_t* positions) override {
    return run("prefill", tokens, positions, nullptr, info_.prefill_len).const_data_ptr<float>();
  }

  const float* forward_masked(const int64_t* tokens, const int64_t* positions, const float* mask, int n) override {
    const auto& logits = run("lookahead", tokens, positions, mask, n);
    if (logits.size(1) != n) throw llm::Error("lookahead returned logits for " + std::to_string(logits.size(1)) +
                                              " of " + std::to_string(n) + " tokens");
    return logits.const_data_ptr<float>();
  }

 private:
  std::unique_ptr<Module> module_;
  llm::ModelInfo info_;
  std::vector<int64_t> tokens_, pos_;
  std::vector<float> mask_;
  std::string decode_ = "forward";  // the method of single-token steps (hybrid: `decode` when the program has it)
  bool prompt_ = false;             // kv mode with a `prompt` method
  int64_t logits_at_ = 0;
  std::vector<executorch::runtime::EValue> result_;

  void load(const std::string& path, const std::string& method) {
    Error e = module_->load_method(method);
    if (e != Error::Ok)
      throw llm::Error(path + ": cannot load method " + method + ": " + err(e) +
                       " (a kernel or delegate missing from this build?)");
  }

  // method(tokens [1, n], positions [n] (, mask [1, 1, n, S]) (, logits_at [1])) -> logits float32 [1, n or 1, V]
  const executorch::aten::Tensor& run(const std::string& method, const int64_t* tokens, const int64_t* positions,
                                      const float* mask, int n, int64_t logits_at = -1) {
    tokens_.assign(tokens, tokens + n);
    if (positions != pos_.data()) pos_.assign(positions, positions + n);
    auto t = executorch::extension::from_blob(tokens_.data(), {1, n}, executorch::aten::ScalarType::Long);
    auto p = executorch::extension::from_blob(pos_.data(), {n}, executorch::aten::ScalarType::Long);
    std::vector<EValue> in{*t, *p};
    executorch::extension::TensorPtr m;
    if (mask) {
      mask_.assign(mask, mask + size_t(n) * info_.max_seq_len);
      m = executorch::extension::from_blob(mask_.data(), {1, 1, n, info_.max_seq_len},
                                           executorch::aten::ScalarType::Float);
      in.push_back(*m);
    }
    executorch::extension::TensorPtr at;
    if (logits_at >= 0) {
      logits_at_ = logits_at;
      at = executorch::extension::from_blob(&logits_at_, {1}, executorch::aten::ScalarType::Long);
      in.push_back(*at);
    }
    auto r = module_->execute(method, in);
    if (!r.ok()) throw llm::Error(method + " failed: " + err(r.error()));
    if (r->empty() || !(*r)[0].isTensor()) throw llm::Error(method + " returned no logits tensor");
    result_ = std::move(*r);
    const auto& logits = result_[0].toTensor();
    if (logits.scalar_type() != executorch::aten::ScalarType::Float || logits.dim() != 3 ||
        logits.size(2) != info_.vocab_size || logits.size(1) < 1)
      throw llm::Error(method + " returned logits of an unexpected shape or dtype (want float32 [1, T, vocab])");
    return logits;
  }

  int64_t constant(const std::unordered_set<std::string>& names, const std::string& name, int64_t dflt) {
    if (!names.count(name)) return dflt;
    auto r = module_->execute(name);
    if (!r.ok() || r->empty()) return dflt;
    const EValue& v = (*r)[0];
    if (v.isInt()) return v.toInt();
    if (v.isBool()) return v.toBool();
    return dflt;
  }
};

// ExecuTorch's log: errors (and everything with RUNNER_ET_VERBOSE=1) on stderr; its info chatter (cpuinfo probing,
// thread pool setup) would otherwise interleave with the runner's own messages.
void log_message(et_timestamp_t, et_pal_log_level_t level, const char* file, const char*, size_t line,
                 const char* msg, size_t len) {
  static const bool verbose = std::getenv("RUNNER_ET_VERBOSE") != nullptr;
  if (!verbose && level != kError && level != kFatal) return;
  const char* base = std::strrchr(file, '/');
  std::fprintf(stderr, "executorch %c %s:%zu] %.*s\n", char(level), base ? base + 1 : file, line, int(len), msg);
}

}  // namespace

int main(int argc, char** argv) {
  executorch::runtime::register_pal(executorch::runtime::PalImpl::create(log_message, __FILE__));
  executorch::runtime::runtime_init();
  return llm::run_main(argc, argv, "runner-et", [](const llm::Options& o) {
    const int threads = o.threads;
    // -j, else OMP_NUM_THREADS, sizes XNNPACK's thread pool (as both size libtorch's OpenMP pool in runner-aoti)
    const char* env = std::getenv("OMP_NUM_THREADS");
    int n = threads > 0 ? threads : env ? std::atoi(env) : 0;
    auto* pool = executorch::extension::threadpool::get_threadpool();
    if (n > 0 && pool) pool->_unsafe_reset_threadpool(uint32_t(n));
    return std::make_unique<EtModel>(o.model_path, o.decoding);
  });
}
