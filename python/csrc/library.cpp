// Finds the C ABI's entry points in the library the Python package loaded.

#include "library.hpp"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

namespace fairring {

namespace {

template <typename F>
void find(void* handle, const std::string& path, const char* name, F& out) {
  void* symbol = dlsym(handle, name);
  if (symbol == nullptr) {
    throw std::runtime_error(
        "fairring: the library " + path + " does not export " + name +
        ": it is older than this package; rebuild the package");
  }
  out = reinterpret_cast<F>(symbol);
}

}  // namespace

const Library& Library::load(const std::string& path) {
  static std::mutex mutex;
  static std::string loaded_from;
  static Library library{};
  std::lock_guard<std::mutex> lock(mutex);
  if (!loaded_from.empty()) {
    if (path != loaded_from) {
      throw std::runtime_error(
          "fairring: the library is loaded from " + loaded_from +
          " already, not " + path);
    }
    return library;
  }
  // The Python package has loaded it (ctypes): this finds the same copy, and
  // keeps it loaded for as long as the process lives.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error(
        "fairring: cannot load the library " + path + ": " +
        (why != nullptr ? why : "unknown error"));
  }
  Library found{};
  find(handle, path, "fr_start", found.start);
  find(handle, path, "fr_work_test", found.work_test);
  find(handle, path, "fr_work_wait_timeout", found.work_wait_timeout);
  find(handle, path, "fr_work_on_complete", found.work_on_complete);
  find(handle, path, "fr_work_free", found.work_free);
  find(handle, path, "fr_last_error", found.last_error);
  library = found;
  loaded_from = path;
  return library;
}

}  // namespace fairring
