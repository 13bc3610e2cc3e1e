// The works the backend hands torch: operations started here
// (`NativeWork`), and the Python group's, wrapped (`PythonWork`).

#include "fairring_c10d.hpp"

#include <pybind11/chrono.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <cstdio>
#include <optional>
#include <stdexcept>
#include <thread>
#include <utility>

namespace fairring {

namespace {

// Sets `error` as Python's current exception (the GIL held).
void set_python_error(const py::object& error) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
}

py::object make_failure(
    const Shared& shared, const std::string& what, const Outcome& outcome) {
  py::object group = shared.group();
  if (!group.is_none()) {
    return group.attr("_native_failure")(what, outcome.status, outcome.message);
  }
  return py::module_::import("fairring._native")
      .attr("FairringError")(what, outcome.status, outcome.message);
}

// Runs `f` without the GIL if the calling thread holds it: a wait inside
// the library may need another thread to take it (the store's callbacks are
// Python's, and link a peer a message first names).
template <typename F>
auto without_gil(F&& f) {
  std::optional<py::gil_scoped_release> unlocked;
  if (Py_IsInitialized() && PyGILState_Check()) {
    unlocked.emplace();
  }
  return f();
}

// Waits for `handle` to finish, however long: the engine fails it within
// the group's timeout if a peer is lost.
fr_status wait_until_done(const Library& library, fr_work* handle) {
  return without_gil([&] {
    fr_status status;
    do {
      status = library.work_wait_timeout(handle, 1000);
    } while (status == FR_PENDING);
    return status;
  });
}

// The engine's message for `status`, read on the thread that got it.
Outcome outcome_of(const Library& library, fr_status status) {
  if (status == FR_OK) {
    return {};
  }
  const char* message = library.last_error();
  return {status, message != nullptr ? message : ""};
}

}  // namespace

void raise_failure(
    const Shared& shared, const std::string& what, const Outcome& outcome) {
  std::rethrow_exception(failure_ptr(shared, what, outcome));
}

std::exception_ptr failure_ptr(
    const Shared& shared, const std::string& what, const Outcome& outcome) {
  py::gil_scoped_acquire gil;
  set_python_error(make_failure(shared, what, outcome));
  return std::make_exception_ptr(py::error_already_set());
}

Shared::Shared(const Library* l, const py::object& group, int rank, bool callers)
    : library(l),
      group_ref(new py::object(py::weakref(group))),
      dispatcher(rank),
      callers_run_callbacks(callers) {}

Shared::~Shared() {
  close_dispatcher();
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    delete group_ref;
  }  // else the interpreter is gone, and the object with it
}

py::object Shared::group() const { return (*group_ref)(); }

void Shared::close_dispatcher() {
  without_gil([&] { dispatcher.close(); });
}

namespace {
std::atomic<int64_t> live_native_works{0};
}  // namespace

int64_t NativeWork::live() { return live_native_works.load(); }

NativeWork::NativeWork(
    std::shared_ptr<Shared> shared,
    fr_work* handle,
    std::string what,
    c10d::OpType type,
    std::vector<at::Tensor> result,
    std::vector<at::Tensor> keep,
    int source_rank)
    : c10d::Work(-1, type),
      shared_(std::move(shared)),
      handle_(handle),
      what_(std::move(what)),
      result_(std::move(result)),
      keep_(std::move(keep)),
      source_rank_(source_rank) {
  live_native_works.fetch_add(1);
}

namespace {

// What a dropped work leaves to the engine until its operation finishes.
struct Leftover {
  std::vector<at::Tensor> result;
  std::vector<at::Tensor> keep;
};

void release_leftover(void* user, fr_status /* status */) {
  delete static_cast<Leftover*>(user);
}

}  // namespace

NativeWork::~NativeWork() { release_resources(); }

void NativeWork::release_resources() {
  // The last strong reference is gone (weak ones, the backend's sweep, may
  // outlive it): the engine's handle goes now, not with the memory.
  std::lock_guard<std::mutex> lock(mutex_);
  if (released_) {
    return;
  }
  released_ = true;
  live_native_works.fetch_sub(1);
  if (freed_) {
    result_.clear();
    keep_.clear();
    return;
  }
  freed_ = true;
  const Library& library = *shared_->library;
  bool done = false;
  fr_status status = library.work_test(handle_, &done);
  if (!done && status == FR_OK) {
    // The engine still reads or writes the tensors: they go when it is done.
    auto* leftover = new Leftover{std::move(result_), std::move(keep_)};
    if (library.work_on_complete(handle_, release_leftover, leftover) != FR_OK) {
      // The communicator is destroyed: freeing the handle waits for the
      // operation, and only then may the tensors go.
      without_gil([&] { library.work_free(handle_); });
      delete leftover;
      return;
    }
  }
  without_gil([&] { library.work_free(handle_); });
  result_.clear();
  keep_.clear();
}

bool NativeWork::enter() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (settled_) {
    return false;
  }
  users_ += 1;
  return true;
}

void NativeWork::leave() {
  std::lock_guard<std::mutex> lock(mutex_);
  users_ -= 1;
  free_if_done_locked();
}

void NativeWork::free_if_done_locked() {
  if (settled_ && users_ == 0 && !freed_) {
    // The engine's entry for the operation goes back now: a finished work
    // the caller keeps holds none (the engine reuses its entries in turn).
    freed_ = true;
    shared_->library->work_free(handle_);
  }
}

void NativeWork::settle(Outcome outcome) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!settled_) {
    settled_ = true;
    outcome_ = std::move(outcome);
  }
  free_if_done_locked();
}

Outcome NativeWork::outcome() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return outcome_;
}

bool NativeWork::isCompleted() {
  if (!enter()) {
    return true;
  }
  const Library& library = *shared_->library;
  bool done = false;
  fr_status status = library.work_test(handle_, &done);
  if (status != FR_OK || done) {
    settle(outcome_of(library, status));
  }
  leave();
  return status != FR_OK || done;
}

bool NativeWork::isSettled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return settled_;
}

bool NativeWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return settled_ && !outcome_.failed();
}

std::exception_ptr NativeWork::exception() const {
  Outcome outcome;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!settled_ || !outcome_.failed()) {
      return nullptr;
    }
    outcome = outcome_;
  }
  return failure_ptr(*shared_, what_, outcome);
}

std::vector<at::Tensor> NativeWork::result() { return result_; }

int NativeWork::sourceRank() const {
  if (source_rank_ < 0) {
    return c10d::Work::sourceRank();  // not a receive: torch's refusal
  }
  return source_rank_;
}

bool NativeWork::wait(std::chrono::milliseconds timeout) {
  if (enter()) {
    const Library& library = *shared_->library;
    fr_status status = timeout.count() <= 0
        ? wait_until_done(library, handle_)
        : without_gil([&] {
            return library.work_wait_timeout(handle_, static_cast<uint64_t>(timeout.count()));
          });
    if (status != FR_PENDING) {
      settle(outcome_of(library, status));
    }
    leave();
    if (status == FR_PENDING) {
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%g", timeout.count() / 1000.0);
      throw std::runtime_error(
          "fairring: " + what_ + " did not finish within " + seconds +
          " s (it still runs; the group's own timeout fails it if a peer is lost)");
    }
  }
  Outcome outcome = this->outcome();
  if (outcome.failed()) {
    raise_failure(*shared_, what_, outcome);
  }
  return true;
}

void NativeWork::on_complete(void* user, fr_status status) {
  // On the communicator's completion thread: record, and hand the future's
  // callbacks to a dispatcher.
  auto* work = static_cast<c10::intrusive_ptr<NativeWork>*>(user);
  c10::intrusive_ptr<NativeWork> w = std::move(*work);
  delete work;
  w->settle(outcome_of(*w->shared_->library, status));
  Shared& shared = *w->shared_;
  bool handed = false;
  try {
    handed = shared.dispatcher.hand_over([w] { w->complete_future(); });
  } catch (const std::exception&) {
    // No thread for a new dispatcher: as if closed. Nothing may unwind into
    // the library's thread.
  }
  if (!handed) {
    // The group is closing: a thread of its own, for callbacks may wait on
    // later operations, which this (the engine's one completion thread) is
    // to finish.
    try {
      std::thread([w] { w->complete_future(); }).detach();
    } catch (const std::exception&) {
      w->complete_future();  // no thread to be had: here, then
    }
  }
}

void NativeWork::complete_future() {
  // On a thread of ours or the engine's: nothing may escape.
  try {
    Outcome outcome = this->outcome();
    if (outcome.failed()) {
      future_->setError(failure_ptr(*shared_, what_, outcome));
    } else {
      future_->markCompleted(c10::IValue(result_));
    }
  } catch (const std::exception& e) {
    // The future was completed already (set by its holder), or making the
    // error failed: it keeps what it has.
    TORCH_WARN("fairring: ", what_, ": its future could not be completed: ", e.what());
  }
}

c10::intrusive_ptr<c10::ivalue::Future> NativeWork::getFuture() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (future_) {
      return future_;
    }
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()));
  }
  if (shared_->callers_run_callbacks) {
    // FAIRRING_CALLBACKS=caller: complete before it is handed out, so that
    // callbacks run at once on the attaching thread, in program order.
    if (enter()) {
      const Library& library = *shared_->library;
      settle(outcome_of(library, wait_until_done(library, handle_)));
      without_gil([&] { leave(); });
    }
    complete_future();
    return future_;
  }
  if (!enter()) {
    // Finished already; no callback is attached yet, so none runs here.
    complete_future();
    return future_;
  }
  const Library& library = *shared_->library;
  auto* self = new c10::intrusive_ptr<NativeWork>(
      c10::intrusive_ptr<NativeWork>::reclaim_copy(this));
  fr_status status = library.work_on_complete(handle_, on_complete, self);
  if (status != FR_OK) {
    // Refused (the communicator is destroyed): the operation's own outcome,
    // waited for here.
    delete self;
    settle(outcome_of(library, wait_until_done(library, handle_)));
  }
  without_gil([&] { leave(); });
  if (status != FR_OK) {
    complete_future();
  }
  return future_;
}

PythonWork::PythonWork(py::object work)
    : c10d::Work(-1, c10d::OpType::UNKNOWN), work_(std::move(work)) {}

PythonWork::~PythonWork() {
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    work_ = py::object();
  } else {
    work_.release();  // the interpreter is gone: nothing to release it to
  }
}

bool PythonWork::isCompleted() {
  py::gil_scoped_acquire gil;
  return work_.attr("is_completed")().cast<bool>();
}

bool PythonWork::isSuccess() const {
  py::gil_scoped_acquire gil;
  return work_.attr("is_success")().cast<bool>();
}

std::exception_ptr PythonWork::exception() const {
  py::gil_scoped_acquire gil;
  py::object error = work_.attr("exception")();
  if (error.is_none()) {
    return nullptr;
  }
  set_python_error(error);
  return std::make_exception_ptr(py::error_already_set());
}

std::vector<at::Tensor> PythonWork::result() {
  py::gil_scoped_acquire gil;
  return work_.attr("result")().cast<std::vector<at::Tensor>>();
}

int PythonWork::sourceRank() const {
  py::gil_scoped_acquire gil;
  return work_.attr("source_rank")().cast<int>();
}

bool PythonWork::wait(std::chrono::milliseconds timeout) {
  py::gil_scoped_acquire gil;
  return work_.attr("wait")(timeout).cast<bool>();
}

void PythonWork::synchronize() {
  py::gil_scoped_acquire gil;
  work_.attr("synchronize")();
}

void PythonWork::abort() {
  py::gil_scoped_acquire gil;
  work_.attr("abort")();
}

c10::intrusive_ptr<c10::ivalue::Future> PythonWork::getFuture() {
  py::gil_scoped_acquire gil;
  py::object future = work_.attr("get_future")();
  return future.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
}

}  // namespace fairring
