// SentencePiece encoding for the C++ tokenizer (header-only, C++17): sentencepiece's BPE algorithm over the pieces
// of tokenizer.bin, as tokenizer.py's SentencePiece encoder gives them (llama2.c's encoder, made exact): '▁' in the
// input is a space; optional whitespace cleanup; dummy prefix; characters (user-defined pieces atomic); repeatedly
// merge the adjacent pair whose merged piece scores highest (leftmost on ties); a character without a piece becomes
// byte pieces (byte fallback) or one <unk> per run of them.
#pragma once

#include <queue>
#include <string>
#include <vector>

#include "tokenizer_file.h"

namespace llm {

// Ordinary text (no special tokens in it) -> ids appended to out; dummy: add the dummy prefix (tokenizer.h decides:
// the model's flag, and with F_SP_PREFIX_FIRST only for text at the start of the input).
inline void encode_sp(const Tokenizer& t, const std::string& input, std::vector<int>& out, bool dummy) {
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
  if (t.flags & F_SP_REMOVE_EXTRA_WS) {
    std::string s;
    for (char c : text)
      if (!(c == ' ' && (s.empty() || s.back() == ' '))) s += c;
    while (!s.empty() && s.back() == ' ') s.pop_back();
    text = s;
  }
  if (text.empty()) return;
  if (dummy) text = " " + text;

  // symbols: a doubly linked list over the text; a frozen symbol (user-defined piece) never merges
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
    for (int u : t.user_defined) {
      const std::string& s = t.pieces[u];
      if (text.compare(i, s.size(), s) == 0) {
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
    auto it = t.piece_to_id.find(text.substr(sym[l].start, sym[l].len + sym[r].len));
    if (it == t.piece_to_id.end() || token_type(t, it->second) != T_NORMAL) return;
    agenda.push({t.scores[it->second], l, r, sym[l].len + sym[r].len});
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
    auto it = t.piece_to_id.find(w);
    if (it != t.piece_to_id.end()) {
      out.push_back(it->second);
      prev_unk = false;
    } else if (t.flags & F_SP_BYTE_FALLBACK) {
      for (unsigned char c : w) {
        int id = t.byte_ids[c] >= 0 ? t.byte_ids[c] : t.unk_id;
        if (id >= 0) out.push_back(id);
      }
      prev_unk = false;
    } else {
      if (!prev_unk && t.unk_id >= 0) out.push_back(t.unk_id);  // consecutive unknown characters: one <unk>
      prev_unk = true;
    }
  }
}

}  // namespace llm
