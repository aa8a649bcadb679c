// runner-et's checks of a .pte's header against the file, before ExecuTorch sees it (header-only; the fuzz target
// fuzz_pte.cpp runs them too). A .pte is a flatbuffer with the file identifier "ET" + 2 digits at bytes 4..8 and, from
// et_export.py, an extended header "eh00" at 8..40 (header length, program size, segment base offset, segment data
// size): the program, the segments after it and the root table inside it must lie inside the file.
#pragma once

#include <cctype>
#include <cstdint>
#include <cstring>
#include <string>

#include "tokenizer_file.h"  // llm::Error

// head: the file's first 64 bytes (zeros past its end), size: the file's size. Throws llm::Error "<path>: ...".
inline void check_pte_header(const char* head, uint64_t size, const std::string& path) {
  if (size < 16 || head[4] != 'E' || head[5] != 'T' || !std::isdigit((unsigned char)head[6]) ||
      !std::isdigit((unsigned char)head[7]))
    throw llm::Error(path + ": not an ExecuTorch program (expected a .pte from et_export.py)");
  uint32_t root, header_len;
  std::memcpy(&root, head, 4);
  std::memcpy(&header_len, head + 12, 4);
  if (std::memcmp(head + 8, "eh00", 4) == 0 && size >= 40) {
    uint64_t program_size, segment_base, segment_size;
    std::memcpy(&program_size, head + 16, 8);
    std::memcpy(&segment_base, head + 24, 8);
    std::memcpy(&segment_size, head + 32, 8);
    if (header_len < 32 || header_len > 64 || program_size > size || segment_base > size ||
        segment_size > size)
      throw llm::Error(path + ": truncated or corrupt ExecuTorch program (its header says " +
                       std::to_string(program_size) + " program bytes, segments " + std::to_string(segment_size) +
                       " bytes at " + std::to_string(segment_base) + "; the file has " + std::to_string(size) + ")");
    if (segment_size && (segment_base < program_size || segment_base + segment_size > size))
      throw llm::Error(path + ": truncated ExecuTorch program (" + std::to_string(size) + " of " +
                       std::to_string(segment_base + segment_size) + " bytes)");
    if (root < 8 + header_len || root >= program_size)
      throw llm::Error(path + ": corrupt ExecuTorch program (its root table is outside the program)");
  } else if (root < 8 || root >= size) {
    throw llm::Error(path + ": corrupt ExecuTorch program (its root table is outside the file)");
  }
}
