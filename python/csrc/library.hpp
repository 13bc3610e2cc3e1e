// The C ABI as this backend reaches it, without torch's headers.
#pragma once

#include <string>

#include "fairring.h"

namespace fairring {

// The C ABI's entry points, looked up in the library the Python package
// loaded (`FAIRRING_LIBRARY` or the package's own), so that both layers drive
// one engine.
struct Library {
  decltype(&fr_start) start;
  decltype(&fr_work_test) work_test;
  decltype(&fr_work_wait_timeout) work_wait_timeout;
  decltype(&fr_work_on_complete) work_on_complete;
  decltype(&fr_work_free) work_free;
  decltype(&fr_last_error) last_error;

  // Loads the library at `path` once (later calls must name the same file);
  // throws std::runtime_error naming the path or the missing symbol.
  static const Library& load(const std::string& path);
};

// How an operation ended: `FR_OK`, or its error code and message.
struct Outcome {
  fr_status status = FR_OK;
  std::string message;
  bool failed() const { return status != FR_OK; }
};

}  // namespace fairring
