// libFuzzer target over tokenizer.bin parsing and use (tests/test_libfuzzer.py builds and runs it when clang is there):
//   clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -I runner-common runner-common/fuzz/fuzz_tokenizer.cpp
// Each input is a whole tokenizer.bin. parse_tokenizer() must accept it or throw llm::Error; an accepted one must
// encode a fixed text of every kind the encoders handle (special tokens, contractions, digits, whitespace runs, invalid
// UTF-8) to ids inside the vocabulary, and decode / stream-decode / render chat without a sanitizer report.
#include <cstdint>
#include <string>
#include <vector>

#include "../tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string text =
      "<|im_start|>user\nHello wörld, I'm 42 \xF0\x9F\xA4\x96  \t\n\n x\xC3(\xFF <s></s> don't\r\n 123456<|im_end|>";
  try {
    const llm::Tokenizer tok = llm::parse_tokenizer(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
    std::vector<int> ids = llm::encode(tok, text);
    for (int id : ids)
      if (id < 0 || id >= tok.n_vocab) __builtin_trap();  // an id outside the vocabulary: a bug, make it a crash
    ids.push_back(tok.n_vocab + 5);  // ids past the tokenizer decode to nothing
    llm::decode(tok, ids);
    llm::StreamDecoder sd{&tok};
    for (int id : ids) llm::stream_put(sd, id);
    llm::stream_flush(sd);
    llm::render_chat(tok, {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}}, true);
  } catch (const llm::Error&) {
  }
  return 0;
}
