// libFuzzer target over runner-et's .pte verification (tests/test_libfuzzer.py builds and runs it when clang is there):
// each input is a whole .pte. check_pte_header() (pte_check.h) must accept it or throw llm::Error; an accepted one
// goes to ExecuTorch's Program::load with Verification::InternalConsistency, the verification runner-et relies on,
// and a program that passes has its methods' metadata read (names, inputs, outputs) as Module::method_names() and
// load_method() read them. Method::init and execution stay out: a verified program can still crash them (an
// operator index past the table), which runner-et's crash isolation (runner.h: supervise) reports as one line.
#include <executorch/extension/data_loader/buffer_data_loader.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/runtime.h>

#include <cstring>

#include "pte_check.h"

// ExecuTorch's log is silent here: every rejected input would print "Verification failed".
static void quiet(et_timestamp_t, et_pal_log_level_t, const char*, const char*, size_t, const char*, size_t) {}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool init = (executorch::runtime::register_pal(executorch::runtime::PalImpl::create(quiet, __FILE__)),
                            executorch::runtime::runtime_init(), true);
  (void)init;
  char head[64] = {};
  std::memcpy(head, data, size < 64 ? size : 64);
  try {
    check_pte_header(head, size, "fuzz.pte");
  } catch (const llm::Error&) {
    return 0;
  }
  executorch::extension::BufferDataLoader loader(data, size);
  auto program = executorch::runtime::Program::load(&loader, executorch::runtime::Program::Verification::InternalConsistency);
  if (!program.ok()) return 0;
  for (size_t i = 0; i < program->num_methods(); i++) {
    auto name = program->get_method_name(i);
    if (!name.ok()) continue;
    auto meta = program->method_meta(*name);
    if (!meta.ok()) continue;
    for (size_t k = 0; k < meta->num_inputs(); k++) (void)meta->input_tag(k);
    for (size_t k = 0; k < meta->num_outputs(); k++) (void)meta->output_tag(k);
  }
  return 0;
}
