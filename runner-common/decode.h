// Decoding for the C++ tokenizer (header-only, C++17): ids -> text exactly as tokenizer.py's decode(), and its
// StreamDecoder, so streamed output equals generate.py's byte for byte (U+FFFD replacements included).
// Byte-level BPE concatenates token bytes and decodes them like Python's bytes.decode("utf-8", "replace");
// SentencePiece follows sentencepiece's Decode (control tokens vanish, the first piece loses its dummy-prefix space,
// byte pieces join into characters with one U+FFFD per invalid byte). Ids outside the vocabulary are dropped.
#pragma once

#include <string>
#include <vector>

#include "tokenizer_file.h"

namespace llm {

inline std::string decode_bpe(const Tokenizer& t, const int* ids, size_t n) {
  std::string bytes;
  for (size_t i = 0; i < n; i++)
    if (ids[i] >= 0 && ids[i] < t.n_vocab) bytes += t.pieces[ids[i]];
  return python_utf8_replace(bytes);
}

// sentencepiece's byte pieces: each valid UTF-8 character as is, each invalid byte as U+FFFD
inline void sp_bytes(const std::string& run, std::string& out) {
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
inline std::string decode_sp(const Tokenizer& t, const int* ids, size_t n) {
  std::string text, run;
  bool is_bos_ws = true, bos_ws_seen = false;
  const bool strip_first = t.flags & (F_SP_ADD_DUMMY_PREFIX | F_SP_REMOVE_EXTRA_WS);
  for (size_t i = 0; i < n; i++) {
    int id = ids[i];
    if (id < 0 || id >= t.n_vocab) continue;  // tokenizer.py drops ids outside the vocabulary
    int ty = token_type(t, id);
    if (ty == T_HOLE) continue;  // an unused id between added tokens
    if (ty == T_BYTE && t.byte_of[id] >= 0) {
      run += char(t.byte_of[id]);
      continue;
    }
    sp_bytes(run, text);
    run.clear();
    if (bos_ws_seen || !text.empty()) is_bos_ws = false;
    if (ty == T_SPECIAL) {
      bos_ws_seen = false;
    } else if (ty == T_UNKNOWN) {
      text += t.unk_surface;
      bos_ws_seen = false;
    } else {
      std::string p = t.pieces[id];
      bool has = false;
      if (is_bos_ws && strip_first && !p.empty() && p[0] == ' ') {
        p.erase(0, 1);
        has = !(t.flags & F_SP_REMOVE_EXTRA_WS);
      }
      text += p;
      bos_ws_seen = has;
    }
  }
  sp_bytes(run, text);
  return text;
}

// ids -> text exactly as tokenizer.py's decode() (valid UTF-8; invalid bytes replaced like Python does)
inline std::string decode(const Tokenizer& t, const int* ids, size_t n) {
  return t.kind == BPE ? decode_bpe(t, ids, n) : decode_sp(t, ids, n);
}
inline std::string decode(const Tokenizer& t, const std::vector<int>& ids) { return decode(t, ids.data(), ids.size()); }

// tokenizer.py's StreamDecoder: stream_put(id) returns the newly completed text, holding text back while it ends in
// an incomplete character (U+FFFD); stream_flush() returns the rest.
struct StreamDecoder {
  const Tokenizer* tok;
  std::vector<int> ids = {};
  size_t prefix = 0, read = 0;
};

inline std::string stream_emit(StreamDecoder& s, bool final) {
  std::vector<uint32_t> done = utf8_to_cps(decode(*s.tok, s.ids.data() + s.prefix, s.read - s.prefix));
  std::vector<uint32_t> text = utf8_to_cps(decode(*s.tok, s.ids.data() + s.prefix, s.ids.size() - s.prefix));
  if (text.size() > done.size() && (final || text.back() != 0xFFFD)) {
    s.prefix = s.read;
    s.read = s.ids.size();
    return cps_to_utf8(text, done.size());
  }
  return "";
}
inline std::string stream_put(StreamDecoder& s, int id) {
  s.ids.push_back(id);
  return stream_emit(s, false);
}
inline std::string stream_flush(StreamDecoder& s) { return stream_emit(s, true); }

}  // namespace llm
