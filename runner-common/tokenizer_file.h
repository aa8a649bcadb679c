// Reading tokenizer.bin (header-only, C++17): the Tokenizer struct every other tokenizer header works on, and
// load_tokenizer(), which parses the file and validates every field before anything uses it.
//
// The format (runner-common/README.md, written by scripts/export_tokenizer_bin.py): llama2.c's token table (part A),
// then an optional extension of tagged sections found through a 16-byte footer. A plain llama2.c file (no footer) is
// read with llama2.c's conventions (SentencePiece, BOS 1, EOS 2, <unk> 0, dummy prefix, byte tokens found by their
// bytes). Validation: every count and length is checked against the bytes that remain, the footer offset against the
// file, every token id against the vocabulary, every enum and flag field against its range, code points against
// U+10FFFF; a known section appears at most once and is read to its last byte. Any failure is one llm::Error
// "<path>: <what>"; the encoders and decoders may then index every table without checks.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "utf8.h"

namespace llm {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum Kind { SENTENCEPIECE = 1, BPE = 2 };
enum TokenType { T_NORMAL = 0, T_SPECIAL = 1, T_BYTE = 2, T_UNKNOWN = 3, T_UNUSED = 4, T_USER = 5, T_HOLE = 6 };
constexpr uint8_t T_BYTELEVEL = 0x80;  // BPE: the vocab string is byte-level (whole-word lookups may hit it)
enum Flags {
  F_DIGITS_SPLIT = 1, F_NFC = 2, F_IGNORE_MERGES = 4, F_ADD_PREFIX_SPACE = 8, F_SP_ADD_DUMMY_PREFIX = 16,
  F_SP_REMOVE_EXTRA_WS = 32, F_SP_BYTE_FALLBACK = 64, F_SP_NOT_BPE = 128, F_SP_NOT_IDENTITY = 256,
  F_SP_PREFIX_FIRST = 512,  // legacy=False: the dummy prefix only at the start of the text, not before a space
  F_ALL = 1023
};
enum Pre { PRE_NONE = 0, PRE_GPT2 = 1, PRE_LLAMA3 = 2, PRE_QWEN2 = 3, PRE_O200K = 4, PRE_FALCON = 5 };
enum ChatKind {
  CHAT_NONE = 0, CHAT_CHATML = 1, CHAT_LLAMA2 = 2, CHAT_LLAMA3 = 3, CHAT_ZEPHYR = 4, CHAT_GEMMA = 5, CHAT_PHI3 = 6,
  CHAT_PHI4 = 7, CHAT_MISTRAL = 8, CHAT_SMOLLM3 = 9, CHAT_LAST = CHAT_SMOLLM3
};

inline const char* chat_kind_name(int k) {
  static const char* names[] = {"none",  "chatml", "llama2", "llama3",  "zephyr",
                                "gemma", "phi3",   "phi4",   "mistral", "smollm3"};
  return k >= 0 && k <= CHAT_LAST ? names[k] : "unknown";
}

struct Tokenizer {
  std::string path;
  // INFO / STOP / CHAT (defaults: a plain llama2.c file)
  int kind = SENTENCEPIECE;
  bool has_extension = false;
  int n_vocab = 0;
  int bos_id = 1, eos_id = 2, unk_id = 0;  // bos_id / unk_id -1: none
  bool add_bos = true;
  std::vector<int> stop_ids{2};
  int flags = 0, pre = PRE_NONE;
  int chat_kind = CHAT_LLAMA2;
  std::string default_system, default_system_no_think;  // chatml's default system prompt; SmolLM3's two defaults
  bool has_default_system = false;
  bool no_system = false;  // the template refuses a system message (Gemma 1/2, Mistral v0.1)
  // the tables (part A, TYPE, BYTE, SPEC, PIEC, UNKS, MERG, UNIL/UNIN/UNIS, PYSP, CASE)
  std::vector<std::string> pieces;  // token bytes (SentencePiece: the piece text, ' ' for '▁')
  std::vector<float> scores;
  std::vector<uint8_t> types;  // TokenType, | T_BYTELEVEL
  int byte_ids[256];           // SentencePiece: byte-fallback piece of each byte; BPE: the token of each byte; -1 none
  std::vector<std::pair<std::string, int>> specials;          // literal text -> id, longest first
  std::unordered_map<int, int> strip;                         // special id -> 1 lstrip | 2 rstrip (STRP)
  std::unordered_map<uint64_t, std::pair<int, int>> merges;   // merge_key(left, right) -> (rank, result)
  RangeTable L, N, S, pyspace;                                // \p{L}, \p{N}, \s, Python's str.isspace
  RangeTable U, W;  // o200k: [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] and [\p{Ll}\p{Lm}\p{Lo}\p{M}]
  RangeTable P;     // Falcon: \p{P} and ASCII punctuation (the Punctuation pre-tokenizer)
  std::array<std::vector<uint32_t>, 8> casefold;              // (?i:) matches of s t r e v m l d
  std::string unk_surface = " \xE2\x81\x87 ";
  // derived at load
  std::vector<int> byte_of;                          // token id -> byte value of a byte piece, else -1
  std::vector<std::vector<int>> specials_by_byte;    // first byte -> indices into specials
  std::unordered_map<std::string, int> piece_to_id;  // SP: pieces the encoder may produce; BPE: byte-level vocab
  std::vector<int> user_defined;                     // SP user-defined pieces (atomic in the encoder), longest first
  mutable std::unordered_map<std::string, std::vector<int>> bpe_cache;  // pre-token -> ids
  uint64_t fingerprint = 0;  // vocab_fingerprint() of part A: what a model exported with this vocabulary records
};

// The vocabulary's fingerprint (README: "Vocabulary fingerprint"): FNV-1a 64 over part A's token records without
// their scores, id 0 to n_vocab - 1: each token's length as uint32 little-endian, then its bytes.
struct VocabHash {
  uint64_t h = 0xcbf29ce484222325ull;
  void add(const char* p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ uint8_t(p[i])) * 0x100000001b3ull;
  }
  void token(const std::string& bytes) {
    const uint32_t n = uint32_t(bytes.size());
    const char le[4] = {char(n & 0xFF), char((n >> 8) & 0xFF), char((n >> 16) & 0xFF), char(n >> 24)};
    add(le, 4);
    add(bytes.data(), bytes.size());
  }
};

inline int token_type(const Tokenizer& t, int id) { return id >= 0 && id < t.n_vocab ? (t.types[id] & 0x7F) : T_HOLE; }
inline uint64_t merge_key(int a, int b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

// A little-endian reader over d[pos, end) that checks every read against the bytes left.
struct Reader {
  const std::string& d;
  size_t pos, end;
  std::string path, where;

  [[noreturn]] void fail(const std::string& what) const { throw Error(path + ": " + what); }
  void need(size_t n) const {
    if (n > end - pos) fail("truncated or corrupt " + where);
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
    uint32_t u = u32();
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
  std::string bytes(size_t n) {
    need(n);
    pos += n;
    return d.substr(pos - n, n);
  }
  std::string blob() { return bytes(u32()); }
  // a count of items of at least item_size bytes each
  uint32_t count(size_t item_size) {
    uint32_t n = u32();
    if (size_t(n) * item_size > end - pos) fail(where + ": count " + std::to_string(n) + " exceeds the bytes left");
    return n;
  }
  // an int32 in [lo, hi]
  int in_range(int lo, int hi, const char* what) {
    int32_t v = i32();
    if (v < lo || v > hi)
      fail(where + ": " + what + " " + std::to_string(v) + " out of range [" + std::to_string(lo) + ", " +
           std::to_string(hi) + "]");
    return v;
  }
  int id(const Tokenizer& t, const char* what, bool none_ok = false) {
    return in_range(none_ok ? -1 : 0, t.n_vocab - 1, what);
  }
  uint32_t code_point() {
    uint32_t c = u32();
    if (c > 0x10FFFF) fail(where + ": code point " + std::to_string(c) + " beyond U+10FFFF");
    return c;
  }
};

// Inclusive code-point ranges, ascending and disjoint.
inline void read_ranges(Reader& r, RangeTable& t) {
  uint32_t n = r.count(8);
  for (uint32_t i = 0; i < n; i++) {
    uint32_t lo = r.code_point(), hi = r.code_point();
    if (lo > hi || (!t.ranges.empty() && lo <= t.ranges.back().second))
      r.fail(r.where + ": code-point ranges not ascending and disjoint");
    t.ranges.emplace_back(lo, hi);
  }
}

inline void llama2c_defaults(Tokenizer& t) {
  t.kind = SENTENCEPIECE;
  t.bos_id = 1, t.eos_id = 2, t.unk_id = 0, t.add_bos = true, t.stop_ids = {2};
  t.flags = F_SP_ADD_DUMMY_PREFIX;
  t.chat_kind = CHAT_LLAMA2;
  t.types[0] = T_UNKNOWN;
  t.types[1] = t.types[2] = T_SPECIAL;
  // byte tokens: 256 consecutive tokens whose bytes are llama2.c's rendering of bytes 0..255 (chr(b) in UTF-8)
  for (int o = 0; o + 256 <= t.n_vocab; o++) {
    bool ok = true;
    for (int b = 0; b < 256 && ok; b++) {
      std::string want;
      append_utf8(want, uint32_t(b));
      ok = t.pieces[o + b] == want;
    }
    if (ok) {
      for (int b = 0; b < 256; b++) t.byte_ids[b] = o + b, t.types[o + b] = T_BYTE;
      t.flags |= F_SP_BYTE_FALLBACK;
      break;
    }
  }
  t.specials = {{t.pieces[0], 0}, {"<s>", 1}, {"</s>", 2}};
  if (t.pieces[0].empty()) t.specials.erase(t.specials.begin());
  t.pyspace.ranges = {{9, 13}, {28, 32}, {0x85, 0x85}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
                      {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}};
}

// One section of the extension; r spans exactly its payload.
inline void read_section(Tokenizer& t, const std::string& tag, Reader& r, bool* info) {
  if (tag == "INFO") {
    if (r.i32() != t.n_vocab) r.fail("token count in the extension does not match the token table");
    t.kind = r.in_range(SENTENCEPIECE, BPE, "tokenizer kind");
    t.bos_id = r.id(t, "BOS id", true);
    t.eos_id = r.id(t, "EOS id");
    t.add_bos = r.in_range(0, 1, "add_bos");
    t.chat_kind = r.in_range(CHAT_NONE, CHAT_LAST, "chat kind");
    t.flags = r.in_range(0, F_ALL, "flags");
    t.unk_id = r.id(t, "unk id", true);
    t.pre = r.in_range(PRE_NONE, PRE_FALCON, "pre-tokenizer");
    r.in_range(0, 0, "reserved field");
    *info = true;
  } else if (tag == "STOP") {
    t.stop_ids.assign(r.count(4), 0);
    for (int& id : t.stop_ids) id = r.id(t, "stop id");
  } else if (tag == "TYPE") {
    if (r.end - r.pos != size_t(t.n_vocab)) r.fail(r.where + ": not one byte per token");
    for (uint8_t& ty : t.types) {
      ty = uint8_t(r.d[r.pos++]);
      if ((ty & 0x7F) > T_HOLE) r.fail(r.where + ": token type " + std::to_string(ty) + " out of range");
    }
  } else if (tag == "BYTE") {
    for (int b = 0; b < 256; b++) t.byte_ids[b] = r.id(t, "byte token id", true);
  } else if (tag == "SPEC") {
    uint32_t n = r.count(8);
    for (uint32_t i = 0; i < n; i++) {
      int id = r.id(t, "special token id");
      t.specials.emplace_back(r.blob(), id);
      if (t.specials.back().first.empty()) r.fail(r.where + ": special token with empty text");
    }
  } else if (tag == "STRP") {
    uint32_t n = r.count(8);
    for (uint32_t i = 0; i < n; i++) {
      int id = r.id(t, "lstrip/rstrip token id");
      t.strip[id] = r.in_range(0, 3, "lstrip/rstrip flags");
    }
  } else if (tag == "CHAT") {
    t.chat_kind = r.in_range(CHAT_NONE, CHAT_LAST, "chat kind");
    t.default_system = r.blob();
    t.has_default_system = r.in_range(0, 1, "has-default-system flag");
    if (r.pos < r.end) t.no_system = r.in_range(0, 1, "no-system flag");  // absent in older files
    if (r.pos < r.end) t.default_system_no_think = r.blob();
  } else if (tag == "PYSP") {
    read_ranges(r, t.pyspace);
  } else if (tag == "PIEC") {
    uint32_t n = r.count(8);
    for (uint32_t i = 0; i < n; i++) {
      int id = r.id(t, "piece id");
      t.pieces[id] = r.blob();
    }
  } else if (tag == "UNKS") {
    t.unk_surface = r.blob();
  } else if (tag == "MERG") {
    uint32_t n = r.count(12);
    for (uint32_t rank = 0; rank < n; rank++) {
      int a = r.i32(), b = r.i32(), res = r.i32();
      if (a == -1 && b == -1 && res == -1) continue;  // a merge whose tokens are missing: never applies
      for (int v : {a, b, res})
        if (v < 0 || v >= t.n_vocab) r.fail(r.where + ": merge id " + std::to_string(v) + " out of range");
      t.merges[merge_key(a, b)] = {int(rank), res};  // like a Python dict built in rank order: last rank wins
    }
  } else if (tag == "UNIL") {
    read_ranges(r, t.L);
  } else if (tag == "UNIN") {
    read_ranges(r, t.N);
  } else if (tag == "UNIS") {
    read_ranges(r, t.S);
  } else if (tag == "UNIP") {
    read_ranges(r, t.P);
  } else if (tag == "UNIU") {
    read_ranges(r, t.U);
  } else if (tag == "UNIW") {
    read_ranges(r, t.W);
  } else if (tag == "CASE") {
    for (auto& letter : t.casefold) {
      letter.assign(r.count(4), 0);
      for (uint32_t& c : letter) c = r.code_point();
    }
  } else {
    return;  // unknown sections (PATT, future ones) are skipped
  }
  if (r.pos != r.end) r.fail(r.where + ": " + std::to_string(r.end - r.pos) + " bytes past its contents");
}

inline void read_extension(Tokenizer& t, const std::string& d, size_t off) {
  Reader h{d, off + 8, d.size() - 16, t.path, "tokenizer.bin extension"};
  uint32_t version = h.u32();
  if (version != 1) h.fail("unsupported tokenizer.bin extension version " + std::to_string(version));
  uint32_t n_sections = h.count(8);
  bool info = false;
  std::set<std::string> seen;
  for (uint32_t s = 0; s < n_sections; s++) {
    std::string tag = h.bytes(4), name;
    for (unsigned char c : tag) name += c > 0x20 && c < 0x7F ? char(c) : '?';
    uint32_t len = h.u32();
    h.need(len);
    Reader r{d, h.pos, h.pos + len, t.path, "tokenizer.bin section " + name};
    h.pos += len;
    static const std::set<std::string> known{"INFO", "STOP", "TYPE", "BYTE", "SPEC", "CHAT", "PYSP", "PIEC",
                                             "UNKS", "MERG", "UNIL", "UNIN", "UNIS", "UNIU", "UNIW", "UNIP", "STRP",
                                             "CASE"};
    if (known.count(tag) && !seen.insert(tag).second) r.fail("tokenizer.bin has two " + name + " sections");
    read_section(t, tag, r, &info);
  }
  if (h.pos != h.end) h.fail("corrupt tokenizer.bin extension (bytes after its last section)");
  if (!info) h.fail("tokenizer.bin extension has no INFO section");
  if (t.kind == BPE && (t.L.ranges.empty() || t.N.ranges.empty() || t.S.ranges.empty()))
    h.fail("byte-level BPE tokenizer.bin lacks its Unicode tables");
  if (t.kind == BPE && t.pre == PRE_NONE) h.fail("byte-level BPE tokenizer.bin without a pre-tokenizer");
  if (t.kind == SENTENCEPIECE && t.pre != PRE_NONE) h.fail("SentencePiece tokenizer.bin with a BPE pre-tokenizer");
  if (t.kind == BPE && t.pre != PRE_GPT2 && t.pre != PRE_FALCON && !seen.count("CASE"))
    h.fail("tokenizer.bin lacks the case-folding table its pre-tokenizer needs");
  if (t.kind == BPE && t.pre == PRE_O200K && (t.U.ranges.empty() || t.W.ranges.empty()))
    h.fail("tokenizer.bin lacks the letter-case tables its o200k pre-tokenizer needs");
  if (t.kind == BPE && t.pre == PRE_FALCON && t.P.ranges.empty())
    h.fail("tokenizer.bin lacks the punctuation table its Falcon pre-tokenizer needs");
}

// The lookup tables the encoders use.
inline void derive_tables(Tokenizer& t) {
  t.L.finish(), t.N.finish(), t.S.finish(), t.U.finish(), t.W.finish(), t.P.finish(), t.pyspace.finish();
  std::stable_sort(t.specials.begin(), t.specials.end(),
                   [](auto& a, auto& b) { return a.first.size() > b.first.size(); });
  t.specials_by_byte.assign(256, {});
  for (size_t i = 0; i < t.specials.size(); i++)
    t.specials_by_byte[uint8_t(t.specials[i].first[0])].push_back(int(i));
  t.byte_of.assign(t.n_vocab, -1);
  for (int b = 0; b < 256; b++)
    if (t.byte_ids[b] >= 0 && token_type(t, t.byte_ids[b]) == T_BYTE) t.byte_of[t.byte_ids[b]] = b;
  for (int i = 0; i < t.n_vocab; i++) {
    int ty = token_type(t, i);
    if (t.kind == SENTENCEPIECE) {
      if (ty == T_NORMAL || ty == T_USER) t.piece_to_id.emplace(t.pieces[i], i);
      if (ty == T_USER && !t.pieces[i].empty()) t.user_defined.push_back(i);
    } else if (t.types[i] & T_BYTELEVEL) {
      t.piece_to_id.emplace(t.pieces[i], i);
    }
  }
  std::sort(t.user_defined.begin(), t.user_defined.end(),
            [&](int a, int b) { return t.pieces[a].size() > t.pieces[b].size(); });
}

// A tokenizer.bin's bytes d -> the Tokenizer; path names it in errors (the fuzz target runner-common/fuzz/ calls this).
inline Tokenizer parse_tokenizer(const std::string& d, const std::string& path) {
  Tokenizer t;
  t.path = path;
  if (d.size() < 4) throw Error(path + ": too small to be a tokenizer.bin");
  size_t part_a_end = d.size(), ext = 0;
  if (d.size() >= 4 + 16 && d.compare(d.size() - 8, 8, "LLTOKEND") == 0) {
    uint64_t off;
    std::memcpy(&off, d.data() + d.size() - 16, 8);
    // part A (at least its header), then the extension's 16-byte header, then the footer
    if (d.size() < 4 + 16 + 16 || off < 4 || off > d.size() - 32 || d.compare(off, 8, "LLTOKEXT") != 0)
      throw Error(path + ": corrupt tokenizer.bin extension (bad offset)");
    t.has_extension = true;
    ext = part_a_end = size_t(off);
  }
  Reader r{d, 0, part_a_end, path, "token table"};
  VocabHash fingerprint;
  uint32_t max_len = r.u32();
  if (max_len == 0 || max_len > (1u << 16)) r.fail("not a tokenizer.bin (implausible max_token_length)");
  while (r.pos < r.end) {
    float score = r.f32();
    uint32_t len = r.u32();
    if (len > max_len) r.fail("truncated or corrupt token table (token longer than max_token_length)");
    if (std::isnan(score)) r.fail("corrupt token table (a score is not a number)");
    t.pieces.push_back(r.bytes(len));
    t.scores.push_back(score);
    fingerprint.token(t.pieces.back());
  }
  t.fingerprint = fingerprint.h;
  t.n_vocab = int(t.pieces.size());
  if (t.n_vocab < 3) r.fail("not a tokenizer.bin (fewer than 3 tokens)");
  t.types.assign(t.n_vocab, T_NORMAL);
  std::fill(t.byte_ids, t.byte_ids + 256, -1);
  if (t.has_extension) read_extension(t, d, ext);
  else llama2c_defaults(t);
  derive_tables(t);
  return t;
}

inline Tokenizer load_tokenizer(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error("cannot open tokenizer file " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_tokenizer(ss.str(), path);
}

}  // namespace llm
