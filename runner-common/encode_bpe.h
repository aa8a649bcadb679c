// Byte-level BPE encoding for the C++ tokenizer (header-only, C++17), as tokenizer.py's BPE encoder: optional digit
// split, then the GPT-2 / Llama 3 (= cl100k) / Qwen2 / o200k (Phi-4-mini) pre-tokenizer regex written out by hand as
// its alternatives in order (Falcon: punctuation runs first, then GPT-2's regex, then digit runs in 3-digit groups)
// (contractions, letters, numbers, other symbols, whitespace with the \s+(?!\S) look-ahead) over tokenizer.bin's
// Unicode class tables; each pre-token's bytes start as single-byte tokens and merge by rank as `tokenizers` does
// (merge_word: O(n log n)) until no pair applies (ignore_merges: a pre-token that is itself a token stays whole).
#pragma once

#include <cstdint>
#include <functional>
#include <queue>
#include <string>
#include <vector>

#include "tokenizer_file.h"

namespace llm {

// ------------------------------------------------------------------------------------------------- pre-tokenizer
inline bool is_other(const Tokenizer& t, uint32_t c) { return !t.S.has(c) && !t.L.has(c) && !t.N.has(c); }
inline bool is_crlf(uint32_t c) { return c == '\r' || c == '\n'; }

// length (in code points) of a contraction at c[i] == '\'', 0 if none; case-insensitive (Llama 3 / Qwen2) through
// the CASE table, whose eight lists are s t r e v m l d
inline size_t contraction(const Tokenizer& t, const std::vector<uint32_t>& c, size_t i, size_t b, bool ci) {
  if (i + 1 >= b) return 0;
  auto is = [&](size_t k, char ch, int fold_idx) {
    if (k >= b) return false;
    if (!ci) return c[k] == uint32_t(ch);
    for (uint32_t x : t.casefold[fold_idx])
      if (x == c[k]) return true;
    return false;
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
inline size_t whitespace_run(const Tokenizer& t, const std::vector<uint32_t>& c, size_t i, size_t b) {
  size_t k = i;
  while (k < b && t.S.has(c[k])) k++;
  if (k == i) return 1;  // not whitespace: cannot happen when called; make progress anyway
  if (k == b) return k - i;
  return k - i >= 2 ? k - i - 1 : 1;
}

// o200k's two word alternatives at c[i], in order, with the regex's backtracking:
//   [^\r\n\p{L}\p{N}]?[U]*[W]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?  |  [^\r\n\p{L}\p{N}]?[U]+[W]*(?i:...)?
// (U = \p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}, W = \p{Ll}\p{Lm}\p{Lo}\p{M}): the match's length, 0 if neither matches.
inline size_t o200k_word(const Tokenizer& t, const std::vector<uint32_t>& c, size_t i, size_t b) {
  auto run = [&](const RangeTable& cls, size_t k) {
    while (k < b && cls.has(c[k])) k++;
    return k;
  };
  auto tail = [&](size_t k) { return k < b && c[k] == '\'' ? k + contraction(t, c, k, b, true) : k; };
  const bool prefix = !is_crlf(c[i]) && !t.L.has(c[i]) && !t.N.has(c[i]) && i + 1 < b;
  for (int alt = 0; alt < 2; alt++) {
    for (int p = prefix ? 1 : 0; p >= 0; p--) {  // the optional first character: taken first
      size_t j = i + p, k = run(t.U, j);
      if (alt == 0) {  // U* then W+: the longest U run that a W character follows
        for (size_t u = k + 1; u-- > j;)
          if (u < b && t.W.has(c[u])) return tail(run(t.W, u)) - i;
      } else if (k > j) {  // U+ then W*
        return tail(run(t.W, k)) - i;
      }
    }
  }
  return 0;
}

// One pre-token starting at c[i] (limit b): its length in code points (at least 1).
inline size_t pretoken(const Tokenizer& t, const std::vector<uint32_t>& c, size_t i, size_t b) {
  const uint32_t x = c[i];
  auto L = [&](uint32_t ch) { return t.L.has(ch); };
  auto N = [&](uint32_t ch) { return t.N.has(ch); };
  if (t.pre == PRE_O200K) {
    if (size_t n = o200k_word(t, c, i, b)) return n;
    if (N(x)) {  // \p{N}{1,3}
      size_t k = i;
      while (k < b && k - i < 3 && N(c[k])) k++;
      return k - i;
    }
    size_t j = (x == ' ' && i + 1 < b && is_other(t, c[i + 1])) ? i + 1 : i;  //  ?[^\s\p{L}\p{N}]+[\r\n/]*
    if (is_other(t, c[j])) {
      size_t k = j;
      while (k < b && is_other(t, c[k])) k++;
      while (k < b && (is_crlf(c[k]) || c[k] == '/')) k++;
      return k - i;
    }
  }
  if (t.pre == PRE_GPT2 || t.pre == PRE_FALCON) {
    if (x == '\'') {
      size_t n = contraction(t, c, i, b, false);
      if (n) return n;
    }
    // ' ?\p{L}+' | ' ?\p{N}+' | ' ?[^\s\p{L}\p{N}]+'
    const bool sp = x == ' ' && i + 1 < b;
    for (int cls = 0; cls < 3; cls++) {
      auto in = [&](uint32_t ch) { return cls == 0 ? L(ch) : cls == 1 ? N(ch) : is_other(t, ch); };
      size_t j = sp && in(c[i + 1]) ? i + 1 : i;
      if (!in(c[j])) continue;
      size_t k = j;
      while (k < b && in(c[k])) k++;
      return k - i;
    }
    return whitespace_run(t, c, i, b);
  }
  if (t.pre != PRE_O200K) {  // Llama 3 / Qwen2 (o200k shares the whitespace alternatives below)
    if (x == '\'') {
      size_t n = contraction(t, c, i, b, true);
      if (n) return n;
    }
    if (!is_crlf(x) && !L(x) && !N(x) && i + 1 < b && L(c[i + 1])) {  // [^\r\n\p{L}\p{N}]?\p{L}+
      size_t k = i + 1;
      while (k < b && L(c[k])) k++;
      return k - i;
    }
    if (L(x)) {
      size_t k = i;
      while (k < b && L(c[k])) k++;
      return k - i;
    }
    if (N(x)) {  // \p{N}{1,3} (Qwen2: \p{N})
      size_t maxn = t.pre == PRE_QWEN2 ? 1 : 3, k = i;
      while (k < b && k - i < maxn && N(c[k])) k++;
      return k - i;
    }
    size_t j = (x == ' ' && i + 1 < b && is_other(t, c[i + 1])) ? i + 1 : i;  //  ?[^\s\p{L}\p{N}]+[\r\n]*
    if (is_other(t, c[j])) {
      size_t k = j;
      while (k < b && is_other(t, c[k])) k++;
      while (k < b && is_crlf(c[k])) k++;
      return k - i;
    }
  }
  // \s*[\r\n]+ : up to the last CR/LF of the whitespace run
  size_t k = i, last = SIZE_MAX;
  while (k < b && t.S.has(c[k])) {
    if (is_crlf(c[k])) last = k;
    k++;
  }
  if (last != SIZE_MAX) return last + 1 - i;
  return whitespace_run(t, c, i, b);
}

// ------------------------------------------------------------------------------------------------- merges
// One pre-token's bytes, each a single-byte token (-1000 - byte where the vocabulary lacks it: never merges), merged
// as `tokenizers`' Word::merge_all does it: a min-heap of (rank, position) over adjacent pairs, a doubly linked list
// of symbols, and lazy invalidation (an entry whose pair has changed since it was pushed is skipped when popped).
// The lowest-rank pair merges first, the leftmost of equal ranks first; a merge pushes the pairs it forms with its
// neighbours. O(n log n) for a word of n bytes (the quadratic "merge the best pair everywhere, rescan" loop took
// seconds on a 200k-byte word); the same merges as that loop for merge lists where a merge's result ranks after it.
inline std::vector<int> merge_word(const Tokenizer& t, const std::string& word) {
  struct Sym {
    int id, prev, next;  // prev / next: neighbouring live symbols, -1 none
  };
  struct Entry {
    int rank, pos, result;
    bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const int n = int(word.size());
  std::vector<Sym> sym(n);
  for (int i = 0; i < n; i++) {
    const int b = uint8_t(word[i]);
    sym[i] = {t.byte_ids[b] >= 0 ? t.byte_ids[b] : -1000 - b, i - 1, i + 1 < n ? i + 1 : -1};
  }
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  auto push = [&](int pos) {  // the pair (pos, its next) if it has a merge
    const int r = sym[pos].next;
    if (r < 0 || sym[pos].id < 0 || sym[r].id < 0) return;
    auto it = t.merges.find(merge_key(sym[pos].id, sym[r].id));
    if (it != t.merges.end()) heap.push({it->second.first, pos, it->second.second});
  };
  for (int i = 0; i + 1 < n; i++) push(i);
  std::vector<bool> gone(n, false);
  while (!heap.empty()) {
    const Entry e = heap.top();
    heap.pop();
    const int r = sym[e.pos].next;
    if (gone[e.pos] || r < 0) continue;
    auto it = t.merges.find(merge_key(sym[e.pos].id, sym[r].id));
    if (it == t.merges.end() || it->second.second != e.result) continue;  // stale: the pair has changed
    sym[e.pos].id = e.result;  // merge r into pos
    gone[r] = true;
    sym[e.pos].next = sym[r].next;
    if (sym[r].next >= 0) sym[sym[r].next].prev = e.pos;
    if (sym[e.pos].prev >= 0) push(sym[e.pos].prev);
    push(e.pos);
  }
  std::vector<int> parts;
  for (int i = 0; i >= 0 && n > 0; i = sym[i].next) parts.push_back(sym[i].id);
  return parts;
}

// One pre-token's bytes -> ids appended to out (memoized).
inline void bpe_word(const Tokenizer& t, const std::string& word, std::vector<int>& out) {
  auto hit = t.bpe_cache.find(word);
  if (hit != t.bpe_cache.end()) {
    out.insert(out.end(), hit->second.begin(), hit->second.end());
    return;
  }
  std::vector<int> parts;
  bool whole = false;
  if (t.flags & F_IGNORE_MERGES) {
    auto it = t.piece_to_id.find(word);
    if (it != t.piece_to_id.end()) parts = {it->second}, whole = true;
  }
  if (!whole) parts = merge_word(t, word);
  std::vector<int> ids;
  for (int id : parts) {
    if (id >= 0) ids.push_back(id);
    else if (t.unk_id >= 0) ids.push_back(t.unk_id);  // a byte missing from the vocab: <unk>, or dropped
  }
  if (t.bpe_cache.size() > 100000) t.bpe_cache.clear();
  t.bpe_cache[word] = ids;
  out.insert(out.end(), ids.begin(), ids.end());
}

// GPT-2's byte -> printable character map (tokenizer.py's bytes_to_unicode): what a byte-level string is made of
inline uint32_t byte_char(unsigned b) {
  auto printable = [](unsigned x) { return (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE; };
  if (printable(b)) return b;
  uint32_t n = 0;
  for (unsigned x = 0; x < b; x++) n += !printable(x);
  return 256 + n;
}

// Falcon's steps after ByteLevel, on one pre-token's bytes: Digits (runs of bytes whose byte-level character is
// \p{N}: 0-9 and the bytes shown as ² ³ ¹ ¼ ½ ¾) apart from the rest, then each [0-9][0-9][0-9] on its own.
inline void falcon_digits(const Tokenizer& t, const std::string& w, std::vector<int>& out) {
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  size_t a = 0;
  while (a < w.size()) {
    const bool num = t.N.has(byte_char(uint8_t(w[a])));
    size_t b = a;
    while (b < w.size() && t.N.has(byte_char(uint8_t(w[b]))) == num) b++;
    size_t start = a;
    for (size_t i = a; num && i + 3 <= b;) {
      if (digit(w[i]) && digit(w[i + 1]) && digit(w[i + 2])) {
        if (i > start) bpe_word(t, w.substr(start, i - start), out);
        bpe_word(t, w.substr(i, 3), out);
        start = i += 3;
      } else {
        i++;
      }
    }
    if (b > start) bpe_word(t, w.substr(start, b - start), out);
    a = b;
  }
}

// Ordinary text (no special tokens in it) -> ids appended to out.
inline void encode_bpe(const Tokenizer& t, const std::string& input, std::vector<int>& out) {
  std::string text = input;
  if ((t.flags & F_ADD_PREFIX_SPACE) && (text.empty() || text[0] != ' ')) text = " " + text;
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
      size_t n = pretoken(t, cps, i, b);
      if (t.pre == PRE_FALCON) falcon_digits(t, text.substr(offs[i], offs[i + n] - offs[i]), out);
      else bpe_word(t, text.substr(offs[i], offs[i + n] - offs[i]), out);
      i += n;
    }
  };
  if (t.pre == PRE_FALCON) {  // Punctuation(Contiguous): runs of punctuation apart from the rest
    for (size_t a = 0; a < cps.size();) {
      size_t b = a;
      while (b < cps.size() && t.P.has(cps[b]) == t.P.has(cps[a])) b++;
      words(a, b);
      a = b;
    }
  } else if (t.flags & F_DIGITS_SPLIT) {  // every \p{N} character is its own chunk
    size_t start = 0;
    for (size_t i = 0; i < cps.size(); i++) {
      if (t.N.has(cps[i])) {
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

}  // namespace llm
