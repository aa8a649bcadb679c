// The C++ tokenizer of the runners (header-only, C++17, no dependencies): tokenizer.bin in, tokenizer.py's ids and
// text out, exactly. One file per question:
//   utf8.h            UTF-8 helpers, CPython's "replace" decoding, code-point range tables
//   tokenizer_file.h  the Tokenizer struct; load_tokenizer() reads tokenizer.bin and validates every field
//   encode_sp.h       SentencePiece encoding (merge by piece score, byte fallback, dummy prefix)
//   encode_bpe.h      byte-level BPE encoding (GPT-2 / Llama 3 / Qwen2 pre-tokenizers, merges by rank)
//   decode.h          decode() and the StreamDecoder
//   chat.h            chat template rendering
// This file: encode() (special tokens, then the kind's encoder, then BOS) and the small queries the runners use.
// The format is documented in runner-common/README.md and written by scripts/export_tokenizer_bin.py.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "chat.h"
#include "decode.h"
#include "encode_bpe.h"
#include "encode_sp.h"
#include "tokenizer_file.h"

namespace llm {

// The longest special token written at text[i]: its length (0 if none) and id.
inline size_t match_special(const Tokenizer& t, const std::string& text, size_t i, int* id) {
  if (t.specials.empty()) return 0;
  for (int k : t.specials_by_byte[uint8_t(text[i])]) {
    const std::string& s = t.specials[k].first;
    if (text.compare(i, s.size(), s) == 0) {
      *id = t.specials[k].second;
      return s.size();
    }
  }
  return 0;
}

// Unicode White_Space at s[i]: its length in bytes, 0 if none (what an added token's lstrip / rstrip takes in)
inline size_t white_space_at(const std::string& s, size_t i) {
  uint32_t c;
  int n = utf8_decode_strict(reinterpret_cast<const unsigned char*>(s.data()) + i, s.size() - i, &c);
  bool ws = (c >= 9 && c <= 13) || c == ' ' || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
            c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
  return n && ws ? size_t(n) : 0;
}

// text[a, b) without special tokens -> ids; SentencePiece's dummy prefix as tokenizer.py puts it
inline void encode_ordinary(const Tokenizer& t, const std::string& text, size_t a, size_t b, std::vector<int>& out) {
  if (b <= a) return;
  if (t.kind == BPE) return encode_bpe(t, text.substr(a, b - a), out);
  bool dummy = t.flags & F_SP_ADD_DUMMY_PREFIX;
  if (t.flags & F_SP_PREFIX_FIRST) dummy = dummy && a == 0 && text[0] != ' ' && text.compare(0, 3, "\xE2\x96\x81") != 0;
  encode_sp(t, text.substr(a, b - a), out, dummy);
}

// Text -> ids, as tokenizer.py's encode(text, bos): special tokens written in the text become their ids (one with
// lstrip / rstrip takes in the whitespace before / after it); with bos (-1: the tokenizer's add_bos) BOS is prepended
// unless the text already starts with it.
inline std::vector<int> encode(const Tokenizer& t, const std::string& text, int bos = -1) {
  std::vector<int> ids;
  size_t pos = 0, i = 0;
  while (i < text.size()) {
    int id = -1;
    size_t len = match_special(t, text, i, &id);
    if (len == 0) {
      i++;
      continue;
    }
    auto fl = t.strip.find(id);
    const int strip = fl == t.strip.end() ? 0 : fl->second;
    size_t end = i;  // lstrip: the whitespace just before it is the token's
    if (strip & 1) {
      std::vector<size_t> starts;  // code point starts in [pos, i)
      for (size_t k = pos; k < i;) {
        starts.push_back(k);
        uint32_t c;
        int n = utf8_decode_strict(reinterpret_cast<const unsigned char*>(text.data()) + k, i - k, &c);
        k += n ? n : 1;
      }
      while (!starts.empty() && white_space_at(text, starts.back()) == end - starts.back()) end = starts.back(), starts.pop_back();
    }
    encode_ordinary(t, text, pos, end, ids);
    ids.push_back(id);
    i += len;
    if (strip & 2)
      while (i < text.size() && white_space_at(text, i)) i += white_space_at(text, i);
    pos = i;
  }
  encode_ordinary(t, text, pos, text.size(), ids);
  bool want_bos = bos < 0 ? t.add_bos : bos != 0;
  if (want_bos && t.bos_id >= 0 && (ids.empty() || ids[0] != t.bos_id)) ids.insert(ids.begin(), t.bos_id);
  return ids;
}

inline bool is_stop(const Tokenizer& t, int id) {
  return std::find(t.stop_ids.begin(), t.stop_ids.end(), id) != t.stop_ids.end();
}

inline std::string describe(const Tokenizer& t) {
  std::string s = std::string(t.kind == BPE ? "byte-level BPE" : "SentencePiece") + ", " +
                  std::to_string(t.n_vocab) + " tokens, chat " + chat_kind_name(t.chat_kind);
  if (!t.has_extension) s += " (plain llama2.c file)";
  return s;
}

}  // namespace llm
