// UTF-8 helpers for the C++ tokenizer (header-only, C++17): encoding a code point, strict decoding, CPython's
// bytes.decode("utf-8", "replace"), and the sorted code-point range tables the pre-tokenizer classes use.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace llm {

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

}  // namespace llm
