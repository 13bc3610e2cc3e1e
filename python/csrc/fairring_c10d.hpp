// fairring as a C++ `c10d::Backend`: what the files of this folder share.
//
// torch.distributed registers the backend per device (CPU and CUDA), as it
// does gloo's and NCCL's, so a fairring group lists both in `_device_types`
// and `monitored_barrier` takes it. The common host calls on one dense,
// contiguous tensor (an all-reduce or reduce-scatter of a type the engine
// names, a broadcast, an all-gather into a tensor, a send or a receive) and
// the barrier start in the engine from here, through the C ABI, without the
// GIL: `NativeWork`. Every other call (lists, strided or empty tensors, CUDA
// tensors, reduce, gathers and scatters, all-to-all, PREMUL_SUM) goes to the
// Python group the package has always run
// (`fairring._backend.ProcessGroupFairring`), whose `Work` the backend hands
// back wrapped (`PythonWork`). Both start their operations on the one
// communicator, on the calling thread, so the engine sees them in the
// program's order.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/python.h>

#include "dispatcher.hpp"
#include "library.hpp"

namespace fairring {

namespace py = pybind11;

struct Shared;

// Raises the Python `FairringError` the group makes for `outcome` (with the
// hint about collectives issued from callbacks where it applies), as a C++
// exception that pybind11 hands back to Python as that very error.
[[noreturn]] void raise_failure(
    const Shared& shared, const std::string& what, const Outcome& outcome);

// The same error, as an exception pointer for a future.
std::exception_ptr failure_ptr(
    const Shared& shared, const std::string& what, const Outcome& outcome);

// What a backend's works share with it: the library, the Python group (for
// its errors), the dispatcher of futures, and how callbacks run. It goes with
// the last of them.
struct Shared {
  const Library* library;
  // A weak reference to the Python group: a work kept after its group is
  // destroyed keeps nothing of the group alive (its store, its engine).
  py::object* group_ref;
  Dispatcher dispatcher;
  // FAIRRING_CALLBACKS=caller: a future is handed out complete.
  bool callers_run_callbacks;
  // Set once a callback issued a collective on this group (mirrored into the
  // Python group, whose errors add the hint).
  std::atomic<bool> callbacks_issue{false};

  Shared(const Library* l, const py::object& group, int rank, bool callers);
  ~Shared();
  // The Python group, or None once it is gone (the GIL held).
  py::object group() const;
  // Closes the dispatcher, without the GIL while it waits for its threads
  // (their callbacks may need it).
  void close_dispatcher();
};

// An operation started here, on host tensors: `result` is what its future
// completes with, `keep` what the engine reads or writes besides (both stay
// alive until the operation has finished, even if the work is dropped).
class NativeWork : public c10d::Work {
 public:
  NativeWork(
      std::shared_ptr<Shared> shared,
      fr_work* handle,
      std::string what,
      c10d::OpType type,
      std::vector<at::Tensor> result,
      std::vector<at::Tensor> keep,
      int source_rank = -1);
  ~NativeWork() override;
  // Gives the handle back, or leaves the tensors to the engine until the
  // operation finishes; once, when the last strong reference goes (c10's
  // intrusive pointers call it).
  void release_resources() override;
  // How many are held in this process (strong references).
  static int64_t live();

  bool isCompleted() override;
  // Whether its outcome is known here already (without asking the engine).
  bool isSettled() const;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  // The rank a receive came from.
  int sourceRank() const override;
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  // A thread calls into the library on the handle between `enter` (false if
  // the operation is settled already: nothing to ask) and `leave`.
  bool enter();
  void leave();
  // Records the outcome once (later calls keep the first), and frees the
  // handle once no thread is inside the library on it.
  void settle(Outcome outcome);
  void free_if_done_locked();
  Outcome outcome() const;
  // Completes the future with the outcome (on a dispatcher, or the caller).
  void complete_future();
  static void on_complete(void* user, fr_status status);

  std::shared_ptr<Shared> shared_;
  fr_work* handle_;
  std::string what_;
  std::vector<at::Tensor> result_;
  std::vector<at::Tensor> keep_;
  int source_rank_;
  mutable std::mutex mutex_;
  bool settled_ = false;
  int users_ = 0;
  bool freed_ = false;
  bool released_ = false;
  Outcome outcome_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A Python `Work` of the group, as torch's C++ layers see it: every question
// goes to the Python object (with the GIL), which the holder keeps alive.
class PythonWork : public c10d::Work {
 public:
  explicit PythonWork(py::object work);
  ~PythonWork() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override;
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  py::object work_;
};

}  // namespace fairring
