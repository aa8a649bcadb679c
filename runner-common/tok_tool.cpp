// Tokenizer checks without a model (tests/test_tokenizer_bin.py builds it with a plain g++ call):
//   tok_tool encode TOKENIZER.bin [BOS]   stdin: texts separated by \0        stdout: one line of ids per text
//   tok_tool decode TOKENIZER.bin         stdin: one line of ids per sequence stdout: per line, hex of decode()
//                                                                                and hex of the streamed text
//   tok_tool chat TOKENIZER.bin           stdin: messages "role\x1fcontent" separated by \x1e
//                                                                        stdout: the rendered prompt
//   tok_tool info TOKENIZER.bin
#include <iostream>
#include <iterator>
#include <sstream>

#include "tokenizer.h"

static std::string hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) out += d[c >> 4], out += d[c & 15];
  return out.empty() ? "-" : out;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: tok_tool encode|decode|chat|info TOKENIZER.bin [BOS]\n");
    return 2;
  }
  try {
    std::string mode = argv[1];
    if (mode != "info" && mode != "encode" && mode != "decode" && mode != "chat")
      throw llm::Error("unknown mode " + mode + " (encode, decode, chat or info)");
    const llm::Tokenizer tok = llm::load_tokenizer(argv[2]);
    std::string in((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    if (mode == "info") {
      std::printf("%s\n", llm::describe(tok).c_str());
    } else if (mode == "encode") {
      int bos = argc > 3 ? std::atoi(argv[3]) : -1;
      size_t start = 0;
      while (start <= in.size()) {
        size_t end = in.find('\0', start);
        if (end == std::string::npos) end = in.size();
        for (int id : llm::encode(tok, in.substr(start, end - start), bos)) std::printf("%d ", id);
        std::printf("\n");
        start = end + 1;
      }
    } else if (mode == "decode") {
      std::istringstream lines(in);
      std::string line;
      while (std::getline(lines, line)) {
        std::istringstream ls(line);
        std::vector<int> ids;
        int id;
        while (ls >> id) ids.push_back(id);
        llm::StreamDecoder sd{&tok};
        std::string streamed;
        for (int i : ids) streamed += llm::stream_put(sd, i);
        streamed += llm::stream_flush(sd);
        std::printf("%s %s\n", hex(llm::decode(tok, ids)).c_str(), hex(streamed).c_str());
      }
    } else if (mode == "chat") {
      std::vector<llm::Message> msgs;
      size_t start = 0;
      while (start < in.size()) {
        size_t end = in.find('\x1e', start);
        if (end == std::string::npos) end = in.size();
        std::string rec = in.substr(start, end - start);
        size_t sep = rec.find('\x1f');
        msgs.push_back({rec.substr(0, sep), sep == std::string::npos ? "" : rec.substr(sep + 1)});
        start = end + 1;
      }
      std::string out = llm::render_chat(tok, msgs, true);
      std::fwrite(out.data(), 1, out.size(), stdout);
    }
  } catch (const std::exception& e) {
    std::string msg = e.what();
    std::fprintf(stderr, "error: %s\n", msg.substr(0, msg.find('\n')).c_str());
    return 1;
  }
  return 0;
}
