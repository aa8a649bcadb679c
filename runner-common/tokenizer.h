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

inline void encode_ordinary(const Tokenizer& t, const std::string& text, std::vector<int>& out) {
  if (t.kind == BPE) encode_bpe(t, text, out);
  else encode_sp(t, text, out);
}

// Text -> ids, as tokenizer.py's encode(text, bos): special tokens written in the text become their ids; with bos
// (-1: the tokenizer's add_bos) BOS is prepended unless the text already starts with it.
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
    if (i > pos) encode_ordinary(t, text.substr(pos, i - pos), ids);
    ids.push_back(id);
    i += len;
    pos = i;
  }
  if (pos < text.size()) encode_ordinary(t, text.substr(pos), ids);
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
