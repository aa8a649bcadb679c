// runner-aoti: llama2.c-style text generation from an AOT Inductor package (.pt2 from aoti_export.py).
//   ./runner-aoti/build/run smollm2.pt2 -z tokenizer.bin -i "Once upon a time" -n 256 -t 0.8 -p 0.9 -s 42
// This file only adapts torch::inductor::AOTIModelPackageLoader to llm::Model; the tokenizer, sampler and the
// generate / chat loops live in runner-common/ and are shared with runner-et.
// Decoding modes load other models of the same package (aoti_export.py --prefill_chunk / --lookahead; its metadata
// lists them in `models`): -M hybrid "prefill" (T fixed) + "model", -M lookahead "lookahead" alone (tokens,
// positions, mask [1, 1, T, S]). The models of such a package hold no constants (aoti_export.py's package_shared): its
// records under the metadata's `shared_weights` folder hold each distinct weight once and that folder's `index` says
// which constant of which model each one is; they are mapped from the package file here (copy-on-write, no copy) and
// handed, with one KV cache allocated here (shape: metadata kv_cache_shape), to every loaded model with
// update_constant_buffer(..., user_managed = true) under the constants' internal names (FQN, '.' -> '_').
// In kv mode a package's "prompt" model (aoti_export.py --fast_prefill: forward(tokens, positions, logits_at [1]) ->
// the last position's logits, GEMMs tuned for prompts, its weights inside its own library) takes every call of more
// than one token; it gets only the shared KV cache. Its "long_prompt" model (an int4 / 8da4w package made on a CPU
// with bfloat16 dot products but without fast_cpu_kernels' kernel: oneDNN's bfloat16 GEMM) takes those of
// long_prompt_min tokens or more.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner_cpu.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runner.h"

namespace {

// "4,1,8,64" -> {4, 1, 8, 64} (metadata shapes, the weights index's shapes and strides; "" -> {})
std::vector<int64_t> csv_ints(const std::string& v) {
  std::vector<int64_t> out;
  std::stringstream s(v);
  for (std::string x; std::getline(s, x, ',');) out.push_back(std::stoll(x));
  return out;
}

// The first line of an exception message, printable ASCII only (a dlopen error on a corrupt library quotes binary
// garbage), at most 300 characters.
std::string first_line(const std::string& s) {
  size_t a = s.find_first_not_of(" \n\t");
  if (a == std::string::npos) return "unknown error";
  std::string line = s.substr(a, s.find('\n', a) - a), out;
  for (unsigned char c : line) out += (c >= 0x20 && c < 0x7F) ? char(c) : '?';
  return out.size() > 300 ? out.substr(0, 300) + "..." : out;
}

// CRC-32 (zip's: reflected polynomial 0xEDB88320) of n bytes.
uint32_t crc32(const unsigned char* p, size_t n) {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; i++) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// A .pt2 is a zip archive (PyTorch's writer: entries stored, not compressed). Before libtorch sees it: the local
// header and the end-of-central-directory record must be there, every entry's data must lie inside the file, and
// the entries libtorch unpacks and loads (under data/aotinductor/: the models' libraries, their metadata and
// sources) must match their CRC-32, so that a changed byte in a library is an error here rather than a crash in
// dlopen. The weight records (data/weights/, data/constants/) are only bounds-checked: reading them all would cost
// seconds for a large model, and a changed weight byte changes numbers, not control flow.
void check_zip(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0) {
    if (fd >= 0) close(fd);
    throw llm::Error("cannot open AOT Inductor package " + path);
  }
  const size_t size = size_t(st.st_size);
  void* m = size ? mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
  close(fd);
  const auto* d = static_cast<const unsigned char*>(m);
  struct Unmap {
    void* m;
    size_t n;
    ~Unmap() { if (m != MAP_FAILED) munmap(m, n); }
  } unmap{m, size};
  if (m == MAP_FAILED || size < 22 || std::memcmp(d, "PK\x03\x04", 4) != 0)
    throw llm::Error(path + ": not an AOT Inductor package (expected a .pt2 zip archive from aoti_export.py)");
  auto u16 = [&](size_t o) { return uint32_t(d[o]) | uint32_t(d[o + 1]) << 8; };
  auto u32 = [&](size_t o) { return u16(o) | u16(o + 2) << 16; };
  auto corrupt = [&](const std::string& what) { return llm::Error(path + ": corrupt AOT Inductor package (" + what + ")"); };
  size_t eocd = size - 22;
  while (eocd > 0 && eocd + 65536 + 22 > size && std::memcmp(d + eocd, "PK\x05\x06", 4) != 0) eocd--;
  if (std::memcmp(d + eocd, "PK\x05\x06", 4) != 0)
    throw llm::Error(path + ": truncated or corrupt AOT Inductor package (no zip directory at the end)");
  uint64_t n = u16(eocd + 10), dir = u32(eocd + 16);
  if (eocd >= 20 && std::memcmp(d + eocd - 20, "PK\x06\x07", 4) == 0) {  // zip64: the directory's real place
    uint64_t z64;
    std::memcpy(&z64, d + eocd - 12, 8);
    if (z64 + 56 > size || std::memcmp(d + z64, "PK\x06\x06", 4) != 0) throw corrupt("zip64 directory");
    std::memcpy(&n, d + z64 + 32, 8);
    std::memcpy(&dir, d + z64 + 48, 8);
  }
  for (uint64_t i = 0, p = dir; i < n; i++) {
    if (p > size || size - p < 46 || std::memcmp(d + p, "PK\x01\x02", 4) != 0) throw corrupt("zip directory");
    const uint32_t crc = u32(p + 16), name_len = u16(p + 28), extra_len = u16(p + 30), comment_len = u16(p + 32);
    uint64_t csize = u32(p + 20), local = u32(p + 42);
    if (p + 46 + name_len + extra_len > size) throw corrupt("zip directory");
    const std::string name(reinterpret_cast<const char*>(d + p + 46), name_len);
    for (size_t e = p + 46 + name_len; e + 4 <= p + 46 + name_len + extra_len;) {  // zip64 sizes / offset
      const uint32_t id = u16(e), len = u16(e + 2);
      if (id == 1) {
        size_t f = e + 4;
        if (u32(p + 24) == 0xFFFFFFFFu) f += 8;  // the uncompressed size
        if (u32(p + 20) == 0xFFFFFFFFu && f + 8 <= e + 4 + len) std::memcpy(&csize, d + f, 8), f += 8;
        if (u32(p + 42) == 0xFFFFFFFFu && f + 8 <= e + 4 + len) std::memcpy(&local, d + f, 8);
      }
      e += 4 + len;
    }
    if (local > size || size - local < 30 || std::memcmp(d + local, "PK\x03\x04", 4) != 0)
      throw corrupt("entry " + name.substr(0, 200) + ": no local header");
    const uint64_t data = local + 30 + u16(local + 26) + u16(local + 28);
    if (data > size || csize > size - data) throw corrupt("entry " + name.substr(0, 200) + " past the end of the file");
    if (name.find("/data/aotinductor/") != std::string::npos && u16(p + 10) == 0 && crc32(d + data, csize) != crc)
      throw corrupt("entry " + name.substr(0, 200) + ": CRC-32 mismatch");
    p += 46 + name_len + extra_len + comment_len;
  }
}

// The metadata file aoti_export.py --so writes beside a plain .so: a flat JSON object of strings.
std::unordered_map<std::string, std::string> read_flat_json(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw llm::Error("cannot open " + path + " (the metadata aoti_export.py --so writes beside the .so)");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string d = ss.str();
  std::unordered_map<std::string, std::string> out;
  size_t i = 0;
  auto bad = [&]() -> llm::Error { return llm::Error(path + ": not a flat JSON object of strings"); };
  auto skip = [&] { while (i < d.size() && std::isspace((unsigned char)d[i])) i++; };
  auto str = [&]() {
    skip();
    if (i >= d.size() || d[i] != '"') throw bad();
    std::string s;
    for (i++; i < d.size() && d[i] != '"'; i++) {
      if (d[i] == '\\' && i + 1 < d.size()) {
        char e = d[++i];
        if (e == 'n') s += '\n';
        else if (e == 't') s += '\t';
        else if (e == 'u' && i + 4 < d.size()) {  // \uXXXX (BMP only; the values are ASCII in practice)
          const std::string hex = d.substr(i + 1, 4);
          if (hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) throw bad();
          llm::append_utf8(s, uint32_t(std::stoul(hex, nullptr, 16)));
          i += 4;
        } else s += e;
      } else {
        s += d[i];
      }
    }
    if (i >= d.size()) throw bad();
    i++;
    return s;
  };
  skip();
  if (i >= d.size() || d[i] != '{') throw bad();
  i++;
  skip();
  if (i < d.size() && d[i] == '}') return out;
  while (true) {
    std::string k = str();
    skip();
    if (i >= d.size() || d[i] != ':') throw bad();
    i++;
    out[k] = str();
    skip();
    if (i < d.size() && d[i] == ',') { i++; continue; }
    if (i < d.size() && d[i] == '}') break;
    throw bad();
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

int meta_int(const std::unordered_map<std::string, std::string>& m, const std::string& k, int dflt) {
  auto it = m.find(k);
  if (it == m.end() || it->second.empty()) return dflt;
  try {
    return std::stoi(it->second);
  } catch (const std::exception&) {
    throw llm::Error("bad package metadata " + k + "=" + it->second);
  }
}

class AotiModel : public llm::Model {
 public:
  explicit AotiModel(const std::string& path, const std::string& decoding) {
    if (ends_with(path, ".so")) {
      if (decoding != "kv") throw llm::missing_program(path, decoding == "hybrid" ? "prefill" : "lookahead", decoding);
      load_so(path);
      return;
    }
    check_zip(path);
    std::unordered_map<std::string, std::string> meta;
    try {
      meta = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(path, "model");
    } catch (const std::exception& e) {
      throw llm::Error(path + ": cannot load AOT Inductor package: " + first_line(e.what()));
    }
    const std::string models = "," + (meta.count("models") ? meta["models"] : std::string("model")) + ",";
    const std::string need = decoding == "hybrid" ? "prefill" : decoding == "lookahead" ? "lookahead" : "model";
    if (models.find("," + need + ",") == std::string::npos) throw llm::missing_program(path, need, decoding);
    // the loader unpacks into a fresh directory under $TMPDIR and leaves it behind when loading fails: give it a
    // private parent that is removed on failure
    const char* old_tmp = std::getenv("TMPDIR");
    std::string saved = old_tmp ? old_tmp : "";
    std::string tmpl = (old_tmp && *old_tmp ? saved : std::string("/tmp")) + "/runner-aoti.XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    const char* priv = mkdtemp(buf.data());
    if (priv) setenv("TMPDIR", priv, 1);
    auto restore = [&] {
      if (old_tmp) setenv("TMPDIR", saved.c_str(), 1);
      else unsetenv("TMPDIR");
    };
    const bool prompt = decoding == "kv" && models.find(",prompt,") != std::string::npos;
    const bool long_prompt = decoding == "kv" && models.find(",long_prompt,") != std::string::npos;
    try {
      if (decoding == "hybrid") prefill_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path, "prefill");
      if (prompt) prompt_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path, "prompt");
      if (long_prompt) long_prompt_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path, "long_prompt");
      loader_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path, decoding == "lookahead" ? "lookahead"
                                                                                                       : "model");
    } catch (const std::exception& e) {
      restore();
      if (priv) std::filesystem::remove_all(priv);
      throw llm::Error(path + ": cannot load AOT Inductor package: " + first_line(e.what()));
    }
    restore();
    if (priv) private_tmp_ = priv;
    set_metadata(path, loader_->get_metadata());
    if (decoding == "hybrid") info_.prefill_len = meta_int(meta, "prefill_chunk", 0);
    if (long_prompt_) long_prompt_min_ = meta_int(meta, "long_prompt_min", 0);
    if (long_prompt_ && (long_prompt_min_ < 2 || long_prompt_min_ > info_.max_seq_len))
      throw llm::Error(path + ": bad package metadata (long_prompt_min)");
    if (prompt_) info_.description += ", prompts through \"prompt\"";
    if (long_prompt_) info_.description += ", from " + std::to_string(long_prompt_min_) + " tokens \"long_prompt\"";
    if (decoding == "hybrid" || meta.count("shared_weights"))
      share_constants(path, decoding == "lookahead" ? "lookahead" : "model", meta);
    info_.lookahead = decoding == "lookahead";
    dtype_ = meta.count("dtype") && meta["dtype"] == "bfloat16" ? at::kBFloat16
             : meta.count("dtype") && meta["dtype"] == "float16" ? at::kHalf : at::kFloat;
    if (decoding == "kv") {  // warm up, as llama.cpp's CLI does: a call of each model pages in its weights and sets
      const int64_t w[2] = {0, 0};  // up its kernels before the first prompt is timed (cache positions 0-1 are
      forward(w, 1, 0);             // written again before they are read)
      if (prompt_) forward(w, 2, 0);
      if (long_prompt_) {
        const std::vector<int64_t> lw(size_t(long_prompt_min_), 0);
        forward(lw.data(), int(long_prompt_min_), 0);
      }
    }
  }

  // The loaded models' constants: one KV cache (tensors of ours) and, in a package that stores them once
  // (shared_weights), the weights mapped from the package; given to each model as user-managed (no copy).
  void share_constants(const std::string& path, const std::string& main,
                       std::unordered_map<std::string, std::string>& meta) {
    const std::vector<int64_t> shape = csv_ints(meta["kv_cache_shape"]);
    const std::string cd = meta.count("cache_dtype") ? meta["cache_dtype"] : "float32";
    const auto dtype = cd == "bfloat16" ? at::kBFloat16 : cd == "float16" ? at::kHalf : at::kFloat;
    for (const auto& fqn : loader_->get_constant_fqns()) {
      if (fqn.find(".kv_cache.") == std::string::npos) continue;
      std::string name = fqn;
      std::replace(name.begin(), name.end(), '.', '_');
      cache_[name] = at::zeros(shape, at::TensorOptions().dtype(dtype).device(device_));
    }
    if (cache_.empty() || shape.size() != 4) throw llm::Error("package metadata lacks the KV cache (kv_cache_shape)");
    const bool shared = meta.count("shared_weights") > 0;
    if (shared) map_weights(path, meta["shared_weights"]);
    std::vector<std::pair<std::string, torch::inductor::AOTIModelPackageLoader*>> models{{main, loader_.get()}};
    if (prefill_) models.push_back({"prefill", prefill_.get()});
    if (prompt_) models.push_back({"prompt", prompt_.get()});
    if (long_prompt_) models.push_back({"long_prompt", long_prompt_.get()});
    for (auto& [name, loader] : models) {
      const bool stored = shared && weights_.count(name);  // else its weights are its own: give it the cache only
      auto consts = stored ? weights_[name] : std::unordered_map<std::string, at::Tensor>{};
      consts.insert(cache_.begin(), cache_.end());
      try {
        loader->update_constant_buffer(consts, false, stored, true);  // stored: every constant must be given
      } catch (const std::exception& e) {
        throw llm::Error(path + ": cannot give model " + name + " its constants: " + first_line(e.what()));
      }
    }
  }

  // weights_[model][internal name]: tensors over the package's records (the file mapped copy-on-write), as
  // listed by <dir>/index: model, name, record, dtype, storage offset, shape, stride (tab-separated)
  void map_weights(const std::string& path, const std::string& dir) {
    std::string index;
    std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
    try {
      reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
      auto rec = reader->getRecord(dir + "/index");
      index.assign(static_cast<const char*>(std::get<0>(rec).get()), std::get<1>(rec));
    } catch (const std::exception& e) {
      throw llm::Error(path + ": cannot read its weights index: " + first_line(e.what()));
    }
    const int fd = open(path.c_str(), O_RDONLY);
    struct stat st {};
    if (fd < 0 || fstat(fd, &st) != 0) throw llm::Error("cannot open " + path);
    void* p = mmap(nullptr, size_t(st.st_size), PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) throw llm::Error("cannot map " + path);
    map_ = static_cast<char*>(p), map_size_ = size_t(st.st_size);
    std::unordered_map<std::string, at::Tensor> records;
    std::stringstream lines(index);
    for (std::string line; std::getline(lines, line);) {
      std::vector<std::string> f;
      std::stringstream fs(line);
      for (std::string x; std::getline(fs, x, '\t');) f.push_back(x);
      if (f.size() == 6) f.push_back("");  // a 0-dim constant: no strides
      if (f.size() != 7) throw llm::Error(path + ": bad weights index line: " + line.substr(0, 200));
      const at::ScalarType dt = f[3] == "float32" ? at::kFloat : f[3] == "bfloat16" ? at::kBFloat16
                                : f[3] == "float16" ? at::kHalf : f[3] == "int8" ? at::kChar
                                : f[3] == "uint8" ? at::kByte : f[3] == "int32" ? at::kInt
                                : f[3] == "int64" ? at::kLong : at::kBool;
      if (f[3] != "bool" && dt == at::kBool) throw llm::Error(path + ": unknown dtype in its weights: " + f[3]);
      auto it = records.find(f[2]);
      if (it == records.end()) {
        const size_t off = reader->getRecordOffset(f[2]), n = reader->getRecordSize(f[2]);
        if (off + n > map_size_) throw llm::Error(path + ": weights record " + f[2] + " past the end of the file");
        it = records.emplace(f[2], at::from_blob(map_ + off, {int64_t(n)}, at::kByte)).first;
      }
      at::Tensor t = it->second.view(dt).as_strided(csv_ints(f[5]), csv_ints(f[6]), std::stoll(f[4]));
      weights_[f[0]][f[1]] = device_.is_cpu() ? t : t.to(device_);
    }
  }

  void load_so(const std::string& path) {
    auto meta = read_flat_json(path + ".json");
    if (meta.count("device") && meta["device"] != "cpu")
      throw llm::Error(path + ": a " + meta["device"] + " library; this runner loads CPU .so files (use a .pt2)");
    try {
      so_runner_ = std::make_unique<torch::inductor::AOTIModelContainerRunnerCpu>(path);
    } catch (const std::exception& e) {
      throw llm::Error(path + ": cannot load AOT Inductor library: " + first_line(e.what()));
    }
    set_metadata(path, meta);
  }

  void set_metadata(const std::string& path, std::unordered_map<std::string, std::string> meta) {
    if (!meta.count("max_seq_len") || !meta.count("vocab_size"))
      throw llm::Error(path + ": package metadata lacks max_seq_len/vocab_size (not made by aoti_export.py?)");
    info_.vocab_size = meta_int(meta, "vocab_size", 0);
    info_.max_seq_len = meta_int(meta, "max_seq_len", 0);
    info_.bos_id = meta_int(meta, "bos_id", -1);
    info_.tokenizer_vocab_size = meta_int(meta, "tokenizer_vocab_size", -1);
    info_.tokenizer_kind = meta.count("tokenizer_kind") ? meta["tokenizer_kind"] : "";
    if (meta.count("vocab_fingerprint")) {  // runner-common/README.md: Vocabulary fingerprint (decimal, int64 or uint64)
      const std::string& v = meta["vocab_fingerprint"];
      const bool neg = !v.empty() && v[0] == '-';
      errno = 0;
      char* end = nullptr;
      const uint64_t x = neg ? uint64_t(std::strtoll(v.c_str(), &end, 10)) : std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || !std::isdigit((unsigned char)v[neg]) || *end || errno == ERANGE)
        throw llm::Error(path + ": bad package metadata vocab_fingerprint=" + v.substr(0, 40));
      info_.has_vocab_fingerprint = true;
      info_.vocab_fingerprint = x;
    }
    if (meta.count("eos_ids")) {
      std::stringstream ss(meta["eos_ids"]);
      std::string item;
      while (std::getline(ss, item, ','))
        if (!item.empty()) info_.eos_ids.push_back(meta_int({{"eos_ids", item}}, "eos_ids", -1));
    }
    std::string dev = meta.count("device") ? meta["device"] : "cpu";
    if (dev == "cuda") device_ = c10::Device(c10::DeviceType::CUDA, 0);
    if (info_.vocab_size <= 0 || info_.max_seq_len <= 0) throw llm::Error(path + ": bad package metadata");
    info_.description = "AOT Inductor, " + dev + ", " + (meta.count("dtype") ? meta["dtype"] : "?") + ", vocab " +
                        std::to_string(info_.vocab_size) + ", context " + std::to_string(info_.max_seq_len) +
                        (meta.count("quantization") ? ", quantized" : "");
  }

  ~AotiModel() override {
    loader_.reset();  // removes its unpacked files
    prefill_.reset();
    prompt_.reset();
    long_prompt_.reset();
    weights_.clear();
    if (map_) munmap(map_, map_size_);
    if (!private_tmp_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(private_tmp_, ec);
    }
  }

  const llm::ModelInfo& info() const override { return info_; }

  const float* forward(const int64_t* tokens, int n, int64_t pos) override {
    c10::InferenceMode guard;
    at::Tensor t = at::empty({1, n}, at::kLong), p = at::empty({n}, at::kLong);
    std::memcpy(t.data_ptr<int64_t>(), tokens, sizeof(int64_t) * n);
    int64_t* pp = p.data_ptr<int64_t>();
    for (int i = 0; i < n; i++) pp[i] = pos + i;
    if (!device_.is_cpu()) t = t.to(device_), p = p.to(device_);
    const int64_t at = n - 1;  // the prompt models' logits_at
    auto* prompt = long_prompt_ && n >= long_prompt_min_ ? long_prompt_.get() : n > 1 ? prompt_.get() : nullptr;
    at::Tensor logits = prompt ? run(prompt, {t, p, tensor(&at, {1})}) : run(loader_.get(), {t, p});
    // logits [1, T, V]: keep the last position, as float32 on the CPU
    last_ = logits.select(0, 0).select(0, logits.size(1) - 1).to(c10::Device(c10::DeviceType::CPU), at::kFloat)
                .contiguous();
    return last_.data_ptr<float>();
  }

  const float* prefill(const int64_t* tokens, const int64_t* positions) override {
    const int n = info_.prefill_len;
    return all_rows(run(prefill_.get(), {tensor(tokens, {1, n}), tensor(positions, {n})}));
  }

  const float* forward_masked(const int64_t* tokens, const int64_t* positions, const float* mask, int n) override {
    c10::InferenceMode guard;
    at::Tensor m = at::empty({1, 1, n, info_.max_seq_len}, at::kFloat);
    std::memcpy(m.data_ptr<float>(), mask, sizeof(float) * size_t(n) * info_.max_seq_len);
    at::Tensor logits = run(loader_.get(), {tensor(tokens, {1, n}), tensor(positions, {n}), m.to(device_, dtype_)});
    if (logits.size(1) != n) throw llm::Error("lookahead returned logits for fewer positions than tokens");
    return all_rows(logits);
  }

 private:
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_, prefill_, prompt_, long_prompt_;
  int64_t long_prompt_min_ = 0;
  std::unordered_map<std::string, at::Tensor> cache_;
  std::unordered_map<std::string, std::unordered_map<std::string, at::Tensor>> weights_;  // model -> name -> tensor
  char* map_ = nullptr;  // the package file, mapped (shared_weights)
  size_t map_size_ = 0;
  at::ScalarType dtype_ = at::kFloat;

  at::Tensor tensor(const int64_t* data, std::vector<int64_t> shape) {
    at::Tensor t = at::empty(shape, at::kLong);
    std::memcpy(t.data_ptr<int64_t>(), data, sizeof(int64_t) * t.numel());
    return device_.is_cpu() ? t : t.to(device_);
  }

  at::Tensor run(torch::inductor::AOTIModelPackageLoader* loader, const std::vector<at::Tensor>& in) {
    c10::InferenceMode guard;
    std::vector<at::Tensor> out;
    try {
      out = loader ? loader->run(in) : so_runner_->run(in);
    } catch (const std::exception& e) {
      throw llm::Error("forward failed: " + first_line(e.what()));
    }
    if (out.empty() || out[0].dim() != 3 || out[0].size(0) != 1 || out[0].size(1) < 1 ||
        out[0].size(2) != info_.vocab_size)
      throw llm::Error("forward returned logits of an unexpected shape (want [1, T, vocab_size of the metadata])");
    return out[0];
  }

  const float* all_rows(const at::Tensor& logits) {
    last_ = logits.select(0, 0).to(c10::Device(c10::DeviceType::CPU), at::kFloat).contiguous();
    return last_.data_ptr<float>();
  }
  std::unique_ptr<torch::inductor::AOTIModelContainerRunnerCpu> so_runner_;
  llm::ModelInfo info_;
  c10::Device device_{c10::DeviceType::CPU};
  at::Tensor last_;
  std::string private_tmp_;
};

}  // namespace

int main(int argc, char** argv) {
  return llm::run_main(argc, argv, "runner-aoti", [](const llm::Options& o) {
    if (o.threads > 0) at::set_num_threads(o.threads);  // libtorch's OpenMP pool (Inductor's kernels)
    return std::make_unique<AotiModel>(o.model_path, o.decoding);
  });
}
