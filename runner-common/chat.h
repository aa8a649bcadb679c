// Chat templates for the C++ tokenizer (header-only, C++17): the renderings scripts/export_tokenizer_bin.py checked
// against the model's Jinja template (render_chat there) and stored as tokenizer.bin's chat kind: chatml (SmolLM2,
// Qwen; with the template's default system prompt), llama2 ([INST], <<SYS>>), llama3 (header ids), zephyr, gemma
// (<start_of_turn>; Gemma 3 folds a system message into the first user turn), phi3 / phi4 (<|role|> ... <|end|>),
// mistral (v0.1 / Mixtral [INST]), smollm3 (reasoning modes, today's date). A template that refuses a system message (Gemma 1/2, Mistral) is refused here too.
#pragma once

#include <ctime>
#include <string>
#include <vector>

#include "tokenizer_file.h"

namespace llm {

struct Message {
  std::string role, content;
};

// tokenizer.py's token_text(): the literal text of a special token (BPE: else the vocab piece); "" if none
inline std::string token_text(const Tokenizer& t, int id) {
  for (auto& s : t.specials)
    if (s.second == id) return s.first;
  if (t.kind == BPE && id >= 0 && id < t.n_vocab) return t.pieces[id];
  return "";
}

// Python's str.replace(a, "") (every occurrence, left to right) and str.rstrip()
inline std::string py_remove(std::string s, const std::string& a) {
  for (size_t p = s.find(a); p != std::string::npos; p = s.find(a, p)) s.erase(p, a.size());
  return s;
}
inline std::string py_rstrip(const Tokenizer& t, const std::string& s) {
  std::vector<uint32_t> cps = utf8_to_cps(s);
  while (!cps.empty() && t.pyspace.has(cps.back())) cps.pop_back();
  return cps_to_utf8(cps);
}

// SmolLM3's template: a metadata system block (today's date, the reasoning mode /think or /no_think that the system
// message may name, its text as custom instructions or the mode's default ones; /system_override: that text alone),
// then ChatML turns; in /no_think mode assistant turns start with an empty <think></think>.
inline std::string render_smollm3(const Tokenizer& t, const std::vector<Message>& messages, bool add_generation_prompt) {
  bool think = true, has_system = !messages.empty() && messages[0].role == "system";
  std::string custom, out;
  if (has_system) {
    const std::string& s = messages[0].content;
    think = s.find("/no_think") != std::string::npos ? false : s.find("/think") != std::string::npos ? true : think;
    custom = py_rstrip(t, py_remove(py_remove(s, "/no_think"), "/think"));
  }
  if (has_system && messages[0].content.find("/system_override") != std::string::npos) {
    out = "<|im_start|>system\n" + py_rstrip(t, py_remove(custom, "/system_override")) + "<|im_end|>\n";
  } else {
    char today[64];
    std::time_t now = std::time(nullptr);
    std::strftime(today, sizeof today, "%d %B %Y", std::localtime(&now));
    out = std::string("<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nToday Date: ") + today +
          "\nReasoning Mode: " + (think ? "/think" : "/no_think") + "\n\n## Custom Instructions\n\n" +
          (!custom.empty() ? custom : think ? t.default_system : t.default_system_no_think) + "\n\n";
  }
  const std::string open = think ? "" : "<think>\n\n</think>\n";
  for (auto& m : messages) {
    if (m.role == "user" || m.role == "tool") out += "<|im_start|>user\n" + m.content + "<|im_end|>\n";
    else if (m.role == "assistant")
      out += "<|im_start|>assistant\n" + open + m.content.substr(std::min(m.content.find_first_not_of('\n'),
                                                                         m.content.size())) + "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n" + open;
  return out;
}

// Python's str.strip()
inline std::string py_strip(const Tokenizer& t, const std::string& s) {
  std::vector<uint32_t> cps = utf8_to_cps(s);
  size_t a = 0, b = cps.size();
  while (a < b && t.pyspace.has(cps[a])) a++;
  while (b > a && t.pyspace.has(cps[b - 1])) b--;
  return cps_to_utf8(std::vector<uint32_t>(cps.begin() + a, cps.begin() + b));
}

inline std::string render_chat(const Tokenizer& t, const std::vector<Message>& messages,
                               bool add_generation_prompt = true) {
  std::string out;
  const std::string bos = token_text(t, t.bos_id), eos = token_text(t, t.eos_id);
  if (t.no_system && !messages.empty() && messages[0].role == "system" && t.chat_kind != CHAT_NONE)
    throw Error("this model's chat template does not take a system message");
  switch (t.chat_kind) {
    case CHAT_CHATML:
      if (t.has_default_system && (messages.empty() || messages[0].role != "system"))
        out += "<|im_start|>system\n" + t.default_system + "<|im_end|>\n";
      for (auto& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    case CHAT_LLAMA2: {
      size_t first = 0;
      const std::string* system = nullptr;
      if (!messages.empty() && messages[0].role == "system") {
        system = &messages[0].content;
        first = 1;
      }
      for (size_t i = first; i < messages.size(); i++) {
        std::string content = messages[i].content;
        if (i == first && system) content = "<<SYS>>\n" + *system + "\n<</SYS>>\n\n" + content;
        if (messages[i].role == "user") out += bos + "[INST] " + py_strip(t, content) + " [/INST]";
        else if (messages[i].role == "assistant") out += " " + py_strip(t, content) + " " + eos;
      }
      break;
    }
    case CHAT_LLAMA3:
      for (size_t i = 0; i < messages.size(); i++)
        out += (i == 0 ? bos : std::string()) + "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n" +
               py_strip(t, messages[i].content) + "<|eot_id|>";
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case CHAT_GEMMA: {
      size_t first = !messages.empty() && messages[0].role == "system" ? 1 : 0;
      out = bos;
      for (size_t i = first; i < messages.size(); i++) {
        const std::string& role = messages[i].role == "assistant" ? std::string("model") : messages[i].role;
        out += "<start_of_turn>" + role + "\n" + (i == first && first ? messages[0].content + "\n\n" : std::string()) +
               py_strip(t, messages[i].content) + "<end_of_turn>\n";
      }
      if (add_generation_prompt) out += "<start_of_turn>model\n";
      break;
    }
    case CHAT_PHI3:
    case CHAT_PHI4: {
      const std::string nl = t.chat_kind == CHAT_PHI3 ? "\n" : "";
      for (auto& m : messages) {
        if (m.role == "system" && m.content.empty() && t.chat_kind == CHAT_PHI3) continue;
        out += "<|" + m.role + "|>" + nl + m.content + "<|end|>" + nl;
      }
      out += add_generation_prompt ? "<|assistant|>" + nl : eos;
      break;
    }
    case CHAT_SMOLLM3:
      out = render_smollm3(t, messages, add_generation_prompt);
      break;
    case CHAT_MISTRAL:
      out = bos;
      for (auto& m : messages) out += m.role == "user" ? "[INST] " + m.content + " [/INST]" : m.content + eos;
      break;
    case CHAT_ZEPHYR:
      for (auto& m : messages) out += "<|" + m.role + "|>\n" + m.content + eos + "\n";
      if (add_generation_prompt) out += "<|assistant|>\n";
      break;
    default:
      throw Error("this tokenizer has no chat template the runner can render (tokenizer.bin chat kind " +
                  std::string(chat_kind_name(t.chat_kind)) + "); use generate mode");
  }
  return out;
}

}  // namespace llm
