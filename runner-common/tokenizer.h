// tokenizer.bin reader, encoder and decoder for the C++ runners (header-only, C++17, no dependencies).
//
// Over 500 lines: an exact C++ reimplementation of tokenizer.py's SentencePiece and byte-level BPE encoders
// (pre-tokenizer regexes included) plus decoding and chat templates; llama2.c's 100-line encoder cannot match them.
//
// Reproduces tokenizer.py exactly: SentencePiece BPE models (merge by piece score, byte fallback, dummy prefix) and
// byte-level BPE (special-token split, optional digit split, the GPT-2 / Llama 3 / Qwen2 pre-tokenizer regexes
// written out by hand over exported Unicode class tables, merges by rank). decode() and StreamDecoder give the same
// text as tokenizer.py's decode() / stream(), U+FFFD replacements included. The file format is documented in
// runner-common/README.md and written by scripts/export_tokenizer_bin.py; a plain llama2.c tokenizer.bin (no
// extension) is read with llama2.c's conventions (BOS 1, EOS 2, byte tokens found by their bytes).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace llm {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ------------------------------------------------------------------------------------------------------ UTF-8
inline void append_utf8(std::string& out, uint32_t c) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

static const char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// One strictly valid UTF-8 sequence at s[0..n): its length (1-4) and code point, or 0 when invalid (overlong forms,
// surrogates, > U+10FFFF and truncated sequences are invalid).
inline int utf8_decode_strict(const unsigned char* s, size_t n, uint32_t* cp) {
  if (n == 0) return 0;
  unsigned c = s[0];
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  int len;
  uint32_t v, min;
  if ((c & 0xE0) == 0xC0) { len = 2; v = c & 0x1F; min = 0x80; }
  else if ((c & 0xF0) == 0xE0) { len = 3; v = c & 0x0F; min = 0x800; }
  else if ((c & 0xF8) == 0xF0) { len = 4; v = c & 0x07; min = 0x10000; }
  else return 0;
  if (n < size_t(len)) return 0;
  for (int k = 1; k < len; k++) {
    if ((s[k] & 0xC0) != 0x80) return 0;
    v = (v << 6) | (s[k] & 0x3F);
  }
  if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
  *cp = v;
  return len;
}

// CPython's bytes.decode("utf-8", errors="replace"): each maximal ill-formed subpart becomes one U+FFFD.
inline std::string python_utf8_replace(const std::string& in) {
  const unsigned char* s = reinterpret_cast<const unsigned char*>(in.data());
  const size_t n = in.size();
  std::string out;
  out.reserve(n);
  size_t i = 0;
  while (i < n) {
    unsigned c = s[i];
    if (c < 0x80) {
      out += char(c);
      i++;
      continue;
    }
    int need;
    unsigned lo = 0x80, hi = 0xBF;  // range of the first continuation byte
    if (c >= 0xC2 && c <= 0xDF) need = 1;
    else if (c == 0xE0) { need = 2; lo = 0xA0; }
    else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) need = 2;
    else if (c == 0xED) { need = 2; hi = 0x9F; }
    else if (c == 0xF0) { need = 3; lo = 0x90; }
    else if (c >= 0xF1 && c <= 0xF3) need = 3;
    else if (c == 0xF4) { need = 3; hi = 0x8F; }
    else {
      out += kReplacement;
      i++;
      continue;
    }
    size_t j = i + 1;
    bool ok = true;
    for (int k = 0; k < need; k++, j++) {
      if (j >= n) { ok = false; break; }
      unsigned b = s[j];
      if (b < (k == 0 ? lo : 0x80) || b > (k == 0 ? hi : 0xBF)) { ok = false; break; }
    }
    if (ok) {
      out.append(in, i, j - i);
    } else {
      out += kReplacement;
    }
    i = j;
  }
  return out;
}

// Code points of valid UTF-8 text.
inline std::vector<uint32_t> utf8_to_cps(const std::string& s) {
  std::vector<uint32_t> out;
  const unsigned char* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    uint32_t cp;
    int len = utf8_decode_strict(p + i, s.size() - i, &cp);
    if (len == 0) { cp = 0xFFFD; len = 1; }
    out.push_back(cp);
    i += len;
  }
  return out;
}

inline std::string cps_to_utf8(const std::vector<uint32_t>& cps, size_t begin = 0) {
  std::string out;
  for (size_t i = begin; i < cps.size(); i++) append_utf8(out, cps[i]);
  return out;
}

// Sorted inclusive code point ranges with an ASCII fast path.
struct RangeTable {
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
  bool ascii[128] = {};
  void finish() {
    std::sort(ranges.begin(), ranges.end());
    for (uint32_t c = 0; c < 128; c++) ascii[c] = slow(c);
  }
  bool slow(uint32_t c) const {
    auto it = std::upper_bound(ranges.begin(), ranges.end(), std::make_pair(c, UINT32_MAX));
    return it != ranges.begin() && (it - 1)->second >= c;
  }
  bool has(uint32_t c) const { return c < 128 ? ascii[c] : slow(c); }
};

// ------------------------------------------------------------------------------------------------------ chat
struct Message {
  std::string role, content;
};

enum ChatKind { CHAT_NONE = 0, CHAT_CHATML = 1, CHAT_LLAMA2 = 2, CHAT_LLAMA3 = 3, CHAT_ZEPHYR = 4 };
inline const char* chat_kind_name(int k) {
  static const char* names[] = {"none", "chatml", "llama2", "llama3", "zephyr"};
  return k >= 0 && k <= 4 ? names[k] : "unknown";
}

// ------------------------------------------------------------------------------------------------------ tokenizer
class Tokenizer {
 public:
  enum Kind { SENTENCEPIECE = 1, BPE = 2 };
  enum Type : uint8_t { T_NORMAL = 0, T_SPECIAL = 1, T_BYTE = 2, T_UNKNOWN = 3, T_UNUSED = 4, T_USER = 5, T_HOLE = 6 };
  static constexpr uint8_t T_BYTELEVEL = 0x80;
  enum Flags {
    F_DIGITS_SPLIT = 1, F_NFC = 2, F_IGNORE_MERGES = 4, F_ADD_PREFIX_SPACE = 8, F_SP_ADD_DUMMY_PREFIX = 16,
    F_SP_REMOVE_EXTRA_WS = 32, F_SP_BYTE_FALLBACK = 64, F_SP_NOT_BPE = 128, F_SP_NOT_IDENTITY = 256
  };
  enum Pre { PRE_NONE = 0, PRE_GPT2 = 1, PRE_LLAMA3 = 2, PRE_QWEN2 = 3 };

  int kind = SENTENCEPIECE;
  bool has_extension = false;  // false: a plain llama2.c file, read with llama2.c's conventions
  int n_vocab = 0;
  int bos_id = 1, eos_id = 2, unk_id = 0;
  bool add_bos = true;
  std::vector<int> stop_ids{2};
  int flags = 0, pre = PRE_NONE;
  int chat_kind = CHAT_LLAMA2;
  std::string default_system;
  bool has_default_system = false;

  void load(const std::string& path) {
    path_ = path;
    std::ifstream f(path, std::ios::binary);
    if (!f) throw Error("cannot open tokenizer file " + path);
    std::stringstream ss;
    ss << f.rdbuf();
    data_ = ss.str();
    parse();
  }

  int type(int id) const { return id >= 0 && id < n_vocab ? (types_[id] & 0x7F) : T_HOLE; }
  const std::string& piece(int id) const { return pieces_[id]; }
  bool is_stop(int id) const { return std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end(); }

  // tokenizer.py's token_text(): the literal text of a special token (BPE: else the vocab piece); "" if none
  std::string token_text(int id) const {
    for (auto& s : specials_)
      if (s.second == id) return s.first;
    if (kind == BPE && id >= 0 && id < n_vocab) return pieces_[id];
    return "";
  }

  // Text -> ids, as tokenizer.py's encode(text, bos): special tokens written in the text become their ids; with
  // bos (-1: the tokenizer's add_bos) BOS is prepended unless the text already starts with it.
  std::vector<int> encode(const std::string& text, int bos = -1) const {
    std::vector<int> ids;
    size_t pos = 0, i = 0;
    while (i < text.size()) {
      int id = -1;
      size_t len = match_special(text, i, &id);
      if (len == 0) {
        i++;
        continue;
      }
      if (i > pos) encode_ordinary(text.substr(pos, i - pos), ids);
      ids.push_back(id);
      i += len;
      pos = i;
    }
    if (pos < text.size()) encode_ordinary(text.substr(pos), ids);
    bool want_bos = bos < 0 ? add_bos : bos != 0;
    if (want_bos && bos_id >= 0 && (ids.empty() || ids[0] != bos_id)) ids.insert(ids.begin(), bos_id);
    return ids;
  }

  // ids -> text exactly as tokenizer.py's decode() (valid UTF-8; invalid bytes replaced like Python does)
  std::string decode(const int* ids, size_t n) const {
    return kind == BPE ? decode_bpe(ids, n) : decode_sp(ids, n);
  }
  std::string decode(const std::vector<int>& ids) const { return decode(ids.data(), ids.size()); }

  // The chat template rendering for messages (see scripts/export_tokenizer_bin.py render_chat)
  std::string render_chat(const std::vector<Message>& messages, bool add_generation_prompt = true) const {
    std::string out;
    const std::string bos = token_text(bos_id), eos = token_text(eos_id);
    switch (chat_kind) {
      case CHAT_CHATML:
        if (has_default_system && (messages.empty() || messages[0].role != "system"))
          out += "<|im_start|>system\n" + default_system + "<|im_end|>\n";
        for (auto& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
        if (add_generation_prompt) out += "<|im_start|>assistant\n";
        break;
      case CHAT_LLAMA2: {
        size_t first = 0;
        const std::string* system = nullptr;
        if (!messages.empty() && messages[0].role == "system") {
          system = &messages[0].content;
          first = 1;
        }
        for (size_t i = first; i < messages.size(); i++) {
          std::string content = messages[i].content;
          if (i == first && system) content = "<<SYS>>\n" + *system + "\n<</SYS>>\n\n" + content;
          if (messages[i].role == "user") out += bos + "[INST] " + strip(content) + " [/INST]";
          else if (messages[i].role == "assistant") out += " " + strip(content) + " " + eos;
        }
        break;
      }
      case CHAT_LLAMA3:
        for (size_t i = 0; i < messages.size(); i++)
          out += (i == 0 ? bos : std::string()) + "<|start_header_id|>" + messages[i].role +
                 "<|end_header_id|>\n\n" + strip(messages[i].content) + "<|eot_id|>";
        if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
        break;
      case CHAT_ZEPHYR:
        for (auto& m : messages) out += "<|" + m.role + "|>\n" + m.content + eos + "\n";
        if (add_generation_prompt) out += "<|assistant|>\n";
        break;
      default:
        throw Error("this tokenizer has no chat template the runner can render (tokenizer.bin chat kind " +
                    std::string(chat_kind_name(chat_kind)) + "); use generate mode");
    }
    return out;
  }

  // Python's str.strip()
  std::string strip(const std::string& s) const {
    std::vector<uint32_t> cps = utf8_to_cps(s);
    size_t a = 0, b = cps.size();
    while (a < b && pyspace_.has(cps[a])) a++;
    while (b > a && pyspace_.has(cps[b - 1])) b--;
    return cps_to_utf8(std::vector<uint32_t>(cps.begin() + a, cps.begin() + b));
  }

  std::string describe() const {
    std::string s = std::string(kind == BPE ? "byte-level BPE" : "SentencePiece") + ", " + std::to_string(n_vocab) +
                    " tokens, chat " + chat_kind_name(chat_kind);
    if (!has_extension) s += " (plain llama2.c file)";
    return s;
  }

 private:
  std::string path_, data_;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<uint8_t> types_;
  int byte_ids_[256];
  std::vector<int> byte_of_;  // token id -> byte value for byte tokens (SentencePiece), else -1
  std::vector<std::pair<std::string, int>> specials_;  // literal text -> id
  std::vector<std::vector<int>> specials_by_byte_;      // first byte -> indices into specials_, longest first
  std::unordered_map<std::string, int> piece_to_id_;   // SP: pieces the encoder may produce; BPE: byte-level vocab
  std::vector<int> user_defined_;                      // SP user-defined pieces (atomic in the encoder)
  std::unordered_map<uint64_t, std::pair<int, int>> merges_;  // (left, right) -> (rank, result)
  RangeTable L_, N_, S_, pyspace_;
  std::vector<std::vector<uint32_t>> casefold_;  // s t r e v m l d
  std::string unk_surface_ = " \xE2\x81\x87 ";
  mutable std::unordered_map<std::string, std::vector<int>> cache_;

  // ---------------------------------------------------------------------------------------------- parsing
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(path_ + ": " + what);
  }

  struct Reader {
    const std::string& d;
    size_t pos, end;
    const Tokenizer* t;
    const char* where;
    void need(size_t n) {
      if (n > end - pos) t->fail(std::string("truncated or corrupt ") + where);
    }
    uint32_t u32() {
      need(4);
      uint32_t v;
      std::memcpy(&v, d.data() + pos, 4);
      pos += 4;
      return v;
    }
    int32_t i32() { return int32_t(u32()); }
    float f32() {
      need(4);
      float v;
      std::memcpy(&v, d.data() + pos, 4);
      pos += 4;
      return v;
    }
    std::string bytes(size_t n) {
      need(n);
      std::string s = d.substr(pos, n);
      pos += n;
      return s;
    }
    std::string blob() { return bytes(u32()); }
  };

  void parse() {
    const std::string& d = data_;
    if (d.size() < 4) fail("too small to be a tokenizer.bin");
    size_t part_a_end = d.size();
    size_t ext = 0;
    if (d.size() >= 4 + 16 && d.compare(d.size() - 8, 8, "LLTOKEND") == 0) {
      uint64_t off;
      std::memcpy(&off, d.data() + d.size() - 16, 8);
      if (off < 4 || off + 16 > d.size() - 16 || d.compare(off, 8, "LLTOKEXT") != 0)
        fail("corrupt tokenizer.bin extension (bad offset)");
      has_extension = true;
      ext = off;
      part_a_end = off;
    }
    Reader r{d, 0, part_a_end, this, "token table"};
    uint32_t max_len = r.u32();
    if (max_len == 0 || max_len > (1u << 16)) fail("not a tokenizer.bin (implausible max_token_length)");
    while (r.pos < r.end) {
      float score = r.f32();
      uint32_t len = r.u32();
      if (len > max_len) fail("truncated or corrupt token table (token longer than max_token_length)");
      pieces_.push_back(r.bytes(len));
      scores_.push_back(score);
    }
    n_vocab = int(pieces_.size());
    if (n_vocab < 3) fail("not a tokenizer.bin (fewer than 3 tokens)");
    types_.assign(n_vocab, T_NORMAL);
    std::fill(byte_ids_, byte_ids_ + 256, -1);
    if (has_extension) parse_extension(ext);
    else llama2c_defaults();
    build();
  }

  void llama2c_defaults() {
    kind = SENTENCEPIECE;
    bos_id = 1, eos_id = 2, unk_id = 0, add_bos = true, stop_ids = {2};
    flags = F_SP_ADD_DUMMY_PREFIX;
    chat_kind = CHAT_LLAMA2;
    types_[0] = T_UNKNOWN;
    types_[1] = types_[2] = T_SPECIAL;
    // byte tokens: 256 consecutive tokens whose bytes are llama2.c's rendering of bytes 0..255 (chr(b) in UTF-8)
    for (int o = 0; o + 256 <= n_vocab; o++) {
      bool ok = true;
      for (int b = 0; b < 256 && ok; b++) {
        std::string want;
        append_utf8(want, uint32_t(b));
        ok = pieces_[o + b] == want;
      }
      if (ok) {
        for (int b = 0; b < 256; b++) byte_ids_[b] = o + b, types_[o + b] = T_BYTE;
        flags |= F_SP_BYTE_FALLBACK;
        break;
      }
    }
    specials_ = {{pieces_[0], 0}, {"<s>", 1}, {"</s>", 2}};
    pyspace_.ranges = {{9, 13}, {28, 32}, {0x85, 0x85}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
                       {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}};
  }

  static void read_ranges(Reader& r, RangeTable& t) {
    uint32_t n = r.u32();
    r.need(size_t(n) * 8);
    for (uint32_t i = 0; i < n; i++) {
      uint32_t lo = r.u32(), hi = r.u32();
      t.ranges.emplace_back(lo, hi);
    }
  }

  void parse_extension(size_t off) {
    Reader h{data_, off + 8, data_.size() - 16, this, "tokenizer.bin extension"};
    uint32_t version = h.u32();
    if (version != 1) fail("unsupported tokenizer.bin extension version " + std::to_string(version));
    uint32_t n_sections = h.u32();
    bool info = false;
    std::vector<std::vector<int>> merges_flat;
    for (uint32_t s = 0; s < n_sections; s++) {
      std::string tag = h.bytes(4);
      uint32_t len = h.u32();
      h.need(len);
      std::string where = "tokenizer.bin section " + tag;
      Reader r{data_, h.pos, h.pos + len, this, where.c_str()};
      h.pos += len;
      if (tag == "INFO") {
        int nv = r.i32();
        if (nv != n_vocab) fail("token count in the extension does not match the token table");
        kind = r.i32();
        bos_id = r.i32(), eos_id = r.i32();
        add_bos = r.i32() != 0;
        chat_kind = r.i32();
        flags = r.i32();
        unk_id = r.i32();
        pre = r.i32();
        if (kind != SENTENCEPIECE && kind != BPE) fail("unknown tokenizer kind " + std::to_string(kind));
        info = true;
      } else if (tag == "STOP") {
        int n = r.i32();
        r.need(size_t(std::max(n, 0)) * 4);
        stop_ids.clear();
        for (int i = 0; i < n; i++) stop_ids.push_back(r.i32());
      } else if (tag == "TYPE") {
        if (len != uint32_t(n_vocab)) fail("token type table has the wrong size");
        std::memcpy(types_.data(), data_.data() + r.pos, n_vocab);
      } else if (tag == "BYTE") {
        for (int b = 0; b < 256; b++) byte_ids_[b] = r.i32();
      } else if (tag == "SPEC") {
        int n = r.i32();
        for (int i = 0; i < n; i++) {
          int id = r.i32();
          specials_.emplace_back(r.blob(), id);
        }
      } else if (tag == "CHAT") {
        chat_kind = r.i32();
        default_system = r.blob();
        has_default_system = r.i32() != 0;
      } else if (tag == "PYSP") {
        read_ranges(r, pyspace_);
      } else if (tag == "PIEC") {
        int n = r.i32();
        for (int i = 0; i < n; i++) {
          int id = r.i32();
          std::string p = r.blob();
          if (id < 0 || id >= n_vocab) fail("piece id out of range");
          pieces_[id] = p;
        }
      } else if (tag == "UNKS") {
        unk_surface_ = r.blob();
      } else if (tag == "MERG") {
        int n = r.i32();
        r.need(size_t(std::max(n, 0)) * 12);
        for (int rank = 0; rank < n; rank++) {
          int a = r.i32(), b = r.i32(), res = r.i32();
          if (a < 0) continue;
          // like a Python dict built in rank order: a repeated pair keeps its last rank
          merges_[key(a, b)] = {rank, res};
        }
      } else if (tag == "UNIL") {
        read_ranges(r, L_);
      } else if (tag == "UNIN") {
        read_ranges(r, N_);
      } else if (tag == "UNIS") {
        read_ranges(r, S_);
      } else if (tag == "CASE") {
        casefold_.clear();
        for (int k = 0; k < 8; k++) {
          int n = r.i32();
          std::vector<uint32_t> v;
          for (int i = 0; i < n; i++) v.push_back(r.u32());
          casefold_.push_back(v);
        }
      }  // unknown sections (PATT, future ones) are skipped
    }
    if (!info) fail("tokenizer.bin extension has no INFO section");
    if (kind == BPE && (L_.ranges.empty() || N_.ranges.empty() || S_.ranges.empty()))
      fail("byte-level BPE tokenizer.bin lacks its Unicode tables");
    if (kind == BPE && (pre == PRE_LLAMA3 || pre == PRE_QWEN2) && casefold_.size() != 8)
      fail("tokenizer.bin lacks the case-folding table its pre-tokenizer needs");
    if (bos_id >= n_vocab || eos_id < 0 || eos_id >= n_vocab) fail("BOS/EOS id out of range");
  }

  static uint64_t key(int a, int b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

  void build() {
    L_.finish(), N_.finish(), S_.finish(), pyspace_.finish();
    for (auto& s : specials_)
      if (s.second < 0 || s.second >= n_vocab || s.first.empty()) fail("special token out of range");
    std::stable_sort(specials_.begin(), specials_.end(),
                     [](auto& a, auto& b) { return a.first.size() > b.first.size(); });
    specials_by_byte_.assign(256, {});
    for (size_t i = 0; i < specials_.size(); i++)
      specials_by_byte_[uint8_t(specials_[i].first[0])].push_back(int(i));
    byte_of_.assign(n_vocab, -1);
    for (int b = 0; b < 256; b++)
      if (byte_ids_[b] >= n_vocab) fail("byte token id out of range");
      else if (byte_ids_[b] >= 0 && type(byte_ids_[b]) == T_BYTE) byte_of_[byte_ids_[b]] = b;
    for (int i = 0; i < n_vocab; i++) {
      int t = type(i);
      if (kind == SENTENCEPIECE) {
        if (t == T_NORMAL || t == T_USER) piece_to_id_.emplace(pieces_[i], i);
        if (t == T_USER) user_defined_.push_back(i);
      } else if (types_[i] & T_BYTELEVEL) {
        piece_to_id_.emplace(pieces_[i], i);
      }
    }
    std::sort(user_defined_.begin(), user_defined_.end(),
              [&](int a, int b) { return pieces_[a].size() > pieces_[b].size(); });
  }

  // ---------------------------------------------------------------------------------------------- encoding
  size_t match_special(const std::string& text, size_t i, int* id) const {
    if (specials_.empty()) return 0;
    for (int k : specials_by_byte_[uint8_t(text[i])]) {
      const std::string& s = specials_[k].first;
      if (text.compare(i, s.size(), s) == 0) {
        *id = specials_[k].second;
        return s.size();
      }
    }
    return 0;
  }

  void encode_ordinary(const std::string& text, std::vector<int>& out) const {
    if (kind == BPE) encode_bpe(text, out);
    else encode_sp(text, out);
  }

  // ----- SentencePiece (BPE model): merge the adjacent pair whose merged piece scores highest, leftmost first
  void encode_sp(const std::string& input, std::vector<int>& out) const {
    // '▁' (U+2581) in the input is SentencePiece's escaped space; the token table stores spaces
    std::string text;
    for (size_t i = 0; i < input.size(); i++) {
      if (input.compare(i, 3, "\xE2\x96\x81") == 0) {
        text += ' ';
        i += 2;
      } else {
        text += input[i];
      }
    }
    if (flags & F_SP_REMOVE_EXTRA_WS) {
      std::string t;
      for (char c : text)
        if (!(c == ' ' && (t.empty() || t.back() == ' '))) t += c;
      while (!t.empty() && t.back() == ' ') t.pop_back();
      text = t;
    }
    if (text.empty()) return;
    if (flags & F_SP_ADD_DUMMY_PREFIX) text = " " + text;

    struct Sym {
      int prev, next;
      size_t start, len;
      bool freeze;
    };
    std::vector<Sym> sym;
    const unsigned char* p = reinterpret_cast<const unsigned char*>(text.data());
    for (size_t i = 0; i < text.size();) {
      size_t len = 0;
      bool freeze = false;
      for (int u : user_defined_) {
        const std::string& s = pieces_[u];
        if (!s.empty() && text.compare(i, s.size(), s) == 0) {
          len = s.size(), freeze = true;
          break;
        }
      }
      if (!len) {
        uint32_t cp;
        len = utf8_decode_strict(p + i, text.size() - i, &cp);
        if (!len) len = 1;
      }
      int idx = int(sym.size());
      sym.push_back({idx - 1, -1, i, len, freeze});
      if (idx > 0) sym[idx - 1].next = idx;
      i += len;
    }
    struct Pair {
      float score;
      int left, right;
      size_t size;
    };
    auto worse = [](const Pair& a, const Pair& b) {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    };
    std::priority_queue<Pair, std::vector<Pair>, decltype(worse)> agenda(worse);
    auto add = [&](int l, int r) {
      if (l < 0 || r < 0 || sym[l].freeze || sym[r].freeze) return;
      auto it = piece_to_id_.find(text.substr(sym[l].start, sym[l].len + sym[r].len));
      if (it == piece_to_id_.end() || type(it->second) != T_NORMAL) return;
      agenda.push({scores_[it->second], l, r, sym[l].len + sym[r].len});
    };
    for (size_t i = 1; i < sym.size(); i++) add(int(i) - 1, int(i));
    while (!agenda.empty()) {
      Pair top = agenda.top();
      agenda.pop();
      Sym &l = sym[top.left], &r = sym[top.right];
      if (l.len == 0 || r.len == 0 || l.len + r.len != top.size) continue;  // stale
      l.len += r.len;
      l.next = r.next;
      if (r.next >= 0) sym[r.next].prev = top.left;
      r.len = 0;
      add(l.prev, top.left);
      add(top.left, l.next);
    }
    bool prev_unk = false;
    for (int i = sym.empty() ? -1 : 0; i >= 0; i = sym[i].next) {
      std::string w = text.substr(sym[i].start, sym[i].len);
      auto it = piece_to_id_.find(w);
      if (it != piece_to_id_.end()) {
        out.push_back(it->second);
        prev_unk = false;
      } else if (flags & F_SP_BYTE_FALLBACK) {
        for (unsigned char c : w) {
          int id = byte_ids_[c] >= 0 ? byte_ids_[c] : unk_id;
          if (id >= 0) out.push_back(id);
        }
        prev_unk = false;
      } else {
        if (!prev_unk && unk_id >= 0) out.push_back(unk_id);  // consecutive unknown characters: one <unk>
        prev_unk = true;
      }
    }
  }

  // ----- byte-level BPE
  bool isL(uint32_t c) const { return L_.has(c); }
  bool isN(uint32_t c) const { return N_.has(c); }
  bool isS(uint32_t c) const { return S_.has(c); }
  bool isOther(uint32_t c) const { return !isS(c) && !isL(c) && !isN(c); }
  static bool isCRLF(uint32_t c) { return c == '\r' || c == '\n'; }
  bool fold_is(uint32_t c, int letter) const {  // letter index into "strevmld"
    for (uint32_t x : casefold_[letter])
      if (x == c) return true;
    return false;
  }

  // length (in code points) of a contraction at cps[i] == '\'', 0 if none
  size_t contraction(const std::vector<uint32_t>& c, size_t i, size_t b, bool ci) const {
    if (i + 1 >= b) return 0;
    auto is = [&](size_t k, char ch, int fold_idx) {
      if (k >= b) return false;
      return ci ? fold_is(c[k], fold_idx) : c[k] == uint32_t(ch);
    };
    // 's | 't | 're | 've | 'm | 'll | 'd   ("strevmld" indices: s0 t1 r2 e3 v4 m5 l6 d7)
    if (is(i + 1, 's', 0) || is(i + 1, 't', 1)) return 2;
    if (is(i + 1, 'r', 2) && is(i + 2, 'e', 3)) return 3;
    if (is(i + 1, 'v', 4) && is(i + 2, 'e', 3)) return 3;
    if (is(i + 1, 'm', 5)) return 2;
    if (is(i + 1, 'l', 6) && is(i + 2, 'l', 6)) return 3;
    if (is(i + 1, 'd', 7)) return 2;
    return 0;
  }

  // trailing whitespace alternatives shared by the patterns: \s+(?!\S) | \s+
  size_t whitespace_run(const std::vector<uint32_t>& c, size_t i, size_t b) const {
    size_t k = i;
    while (k < b && isS(c[k])) k++;
    if (k == i) return 1;  // cannot happen for a well-formed class table; make progress anyway
    if (k == b) return k - i;
    return k - i >= 2 ? k - i - 1 : 1;
  }

  // One pre-token starting at cps[i] (limit b): its length in code points.
  size_t pretoken(const std::vector<uint32_t>& c, size_t i, size_t b) const {
    const uint32_t x = c[i];
    if (pre == PRE_GPT2) {
      if (x == '\'') {
        size_t n = contraction(c, i, b, false);
        if (n) return n;
      }
      // ' ?\p{L}+' | ' ?\p{N}+' | ' ?[^\s\p{L}\p{N}]+'
      const bool sp = x == ' ' && i + 1 < b;
      for (int cls = 0; cls < 3; cls++) {
        auto in = [&](uint32_t ch) { return cls == 0 ? isL(ch) : cls == 1 ? isN(ch) : isOther(ch); };
        size_t j = sp && in(c[i + 1]) ? i + 1 : i;
        if (!in(c[j])) continue;
        size_t k = j;
        while (k < b && in(c[k])) k++;
        return k - i;
      }
      return whitespace_run(c, i, b);
    }
    // Llama 3 / Qwen2
    if (x == '\'') {
      size_t n = contraction(c, i, b, true);
      if (n) return n;
    }
    if (!isCRLF(x) && !isL(x) && !isN(x) && i + 1 < b && isL(c[i + 1])) {  // [^\r\n\p{L}\p{N}]?\p{L}+
      size_t k = i + 1;
      while (k < b && isL(c[k])) k++;
      return k - i;
    }
    if (isL(x)) {
      size_t k = i;
      while (k < b && isL(c[k])) k++;
      return k - i;
    }
    if (isN(x)) {  // \p{N}{1,3} (Qwen2: \p{N})
      size_t maxn = pre == PRE_QWEN2 ? 1 : 3, k = i;
      while (k < b && k - i < maxn && isN(c[k])) k++;
      return k - i;
    }
    size_t j = (x == ' ' && i + 1 < b && isOther(c[i + 1])) ? i + 1 : i;  //  ?[^\s\p{L}\p{N}]+[\r\n]*
    if (isOther(c[j])) {
      size_t k = j;
      while (k < b && isOther(c[k])) k++;
      while (k < b && isCRLF(c[k])) k++;
      return k - i;
    }
    // \s*[\r\n]+ : up to the last CR/LF of the whitespace run
    size_t k = i, last = SIZE_MAX;
    while (k < b && isS(c[k])) {
      if (isCRLF(c[k])) last = k;
      k++;
    }
    if (last != SIZE_MAX) return last + 1 - i;
    return whitespace_run(c, i, b);
  }

  void encode_bpe(const std::string& input, std::vector<int>& out) const {
    std::string text = input;
    if ((flags & F_ADD_PREFIX_SPACE) && (text.empty() || text[0] != ' ')) text = " " + text;
    // code points with their byte offsets (an invalid byte counts as one "other" character)
    std::vector<uint32_t> cps;
    std::vector<size_t> offs;
    const unsigned char* p = reinterpret_cast<const unsigned char*>(text.data());
    for (size_t i = 0; i < text.size();) {
      uint32_t cp;
      int len = utf8_decode_strict(p + i, text.size() - i, &cp);
      if (!len) cp = 0xFFFD, len = 1;
      cps.push_back(cp);
      offs.push_back(i);
      i += len;
    }
    offs.push_back(text.size());
    auto words = [&](size_t a, size_t b) {
      for (size_t i = a; i < b;) {
        size_t n = pretoken(cps, i, b);
        bpe_word(text.substr(offs[i], offs[i + n] - offs[i]), out);
        i += n;
      }
    };
    if (flags & F_DIGITS_SPLIT) {  // every \p{N} character is its own chunk
      size_t start = 0;
      for (size_t i = 0; i < cps.size(); i++) {
        if (isN(cps[i])) {
          if (i > start) words(start, i);
          words(i, i + 1);
          start = i + 1;
        }
      }
      if (start < cps.size()) words(start, cps.size());
    } else {
      words(0, cps.size());
    }
  }

  void bpe_word(const std::string& word, std::vector<int>& out) const {
    auto hit = cache_.find(word);
    if (hit != cache_.end()) {
      out.insert(out.end(), hit->second.begin(), hit->second.end());
      return;
    }
    std::vector<int> parts;
    bool whole = false;
    if (flags & F_IGNORE_MERGES) {
      auto it = piece_to_id_.find(word);
      if (it != piece_to_id_.end()) parts = {it->second}, whole = true;
    }
    if (!whole) {
      for (unsigned char c : word) parts.push_back(byte_ids_[c] >= 0 ? byte_ids_[c] : -1000 - int(c));
      while (parts.size() > 1) {  // merge the lowest-rank adjacent pair everywhere, until no pair has a merge
        int best = INT_MAX, l = 0, r = 0, res = 0;
        for (size_t j = 0; j + 1 < parts.size(); j++) {
          if (parts[j] < 0 || parts[j + 1] < 0) continue;
          auto it = merges_.find(key(parts[j], parts[j + 1]));
          if (it != merges_.end() && it->second.first < best)
            best = it->second.first, l = parts[j], r = parts[j + 1], res = it->second.second;
        }
        if (best == INT_MAX) break;
        std::vector<int> merged;
        merged.reserve(parts.size());
        for (size_t j = 0; j < parts.size();) {
          if (parts[j] == l && j + 1 < parts.size() && parts[j + 1] == r) {
            merged.push_back(res);
            j += 2;
          } else {
            merged.push_back(parts[j++]);
          }
        }
        parts.swap(merged);
      }
    }
    std::vector<int> ids;
    for (int id : parts) {
      if (id >= 0) ids.push_back(id);
      else if (unk_id >= 0) ids.push_back(unk_id);  // a byte missing from the vocab: <unk>, or dropped
    }
    if (cache_.size() > 100000) cache_.clear();
    cache_[word] = ids;
    out.insert(out.end(), ids.begin(), ids.end());
  }

  // ---------------------------------------------------------------------------------------------- decoding
  std::string decode_bpe(const int* ids, size_t n) const {
    std::string bytes;
    for (size_t i = 0; i < n; i++)
      if (ids[i] >= 0 && ids[i] < n_vocab) bytes += pieces_[ids[i]];
    return python_utf8_replace(bytes);
  }

  // sentencepiece's byte pieces: each valid UTF-8 character as is, each invalid byte as U+FFFD
  static void sp_bytes(const std::string& run, std::string& out) {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(run.data());
    for (size_t i = 0; i < run.size();) {
      uint32_t cp;
      int len = utf8_decode_strict(p + i, run.size() - i, &cp);
      if (len) {
        out.append(run, i, len);
        i += len;
      } else {
        out += kReplacement;
        i++;
      }
    }
  }

  // sentencepiece's Decode(): control pieces vanish, <unk> shows its surface, byte pieces join into characters,
  // and the first piece loses its leading space (the dummy prefix).
  std::string decode_sp(const int* ids, size_t n) const {
    std::string text, run;
    bool is_bos_ws = true, bos_ws_seen = false;
    const bool strip_first = flags & (F_SP_ADD_DUMMY_PREFIX | F_SP_REMOVE_EXTRA_WS);
    for (size_t i = 0; i < n; i++) {
      int id = ids[i];
      if (id < 0 || id >= n_vocab) continue;  // tokenizer.py drops ids outside the vocabulary
      int t = type(id);
      if (t == T_BYTE && byte_of_[id] >= 0) {
        run += char(byte_of_[id]);
        continue;
      }
      sp_bytes(run, text);
      run.clear();
      if (bos_ws_seen || !text.empty()) is_bos_ws = false;
      if (t == T_SPECIAL) {
        bos_ws_seen = false;
      } else if (t == T_UNKNOWN) {
        text += unk_surface_;
        bos_ws_seen = false;
      } else {
        std::string p = pieces_[id];
        bool has = false;
        if (is_bos_ws && strip_first && !p.empty() && p[0] == ' ') {
          p.erase(0, 1);
          has = !(flags & F_SP_REMOVE_EXTRA_WS);
        }
        text += p;
        bos_ws_seen = has;
      }
    }
    sp_bytes(run, text);
    return text;
  }
};

// tokenizer.py's StreamDecoder: put(id) returns the newly completed text, holding text back while it ends in an
// incomplete character (U+FFFD); flush() returns the rest.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  std::string put(int id) {
    ids_.push_back(id);
    return emit(false);
  }
  std::string flush() { return emit(true); }
  void reset() { ids_.clear(), prefix_ = read_ = 0; }

 private:
  const Tokenizer& tok_;
  std::vector<int> ids_;
  size_t prefix_ = 0, read_ = 0;

  std::string emit(bool final) {
    std::vector<uint32_t> done = utf8_to_cps(tok_.decode(ids_.data() + prefix_, read_ - prefix_));
    std::vector<uint32_t> text = utf8_to_cps(tok_.decode(ids_.data() + prefix_, ids_.size() - prefix_));
    if (text.size() > done.size() && (final || text.back() != 0xFFFD)) {
      prefix_ = read_;
      read_ = ids_.size();
      return cps_to_utf8(text, done.size());
    }
    return "";
  }
};

}  // namespace llm
