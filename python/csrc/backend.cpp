// The backend torch.distributed registers for a fairring group, and the
// Python module that makes it (`fairring._c10d`).

#include "fairring_c10d.hpp"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <utility>

namespace fairring {

namespace {

// The FR_DTYPE_* code of a type the engine reduces, if it is one.
std::optional<int32_t> dtype_code(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return FR_DTYPE_F32;
    case at::kDouble: return FR_DTYPE_F64;
    case at::kHalf: return FR_DTYPE_F16;
    case at::kBFloat16: return FR_DTYPE_BF16;
    case at::kInt: return FR_DTYPE_I32;
    case at::kLong: return FR_DTYPE_I64;
    case at::kByte: return FR_DTYPE_U8;
    case at::kChar: return FR_DTYPE_I8;
    case at::kShort: return FR_DTYPE_I16;
    case at::kBool: return FR_DTYPE_BOOL;
    default: return std::nullopt;
  }
}

// The FR_OP_* code of an operator the engine runs as it is (PREMUL_SUM,
// which scales first, is the Python group's).
std::optional<int32_t> op_code(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return FR_OP_SUM;
    case c10d::ReduceOp::AVG: return FR_OP_AVG;
    case c10d::ReduceOp::PRODUCT: return FR_OP_PRODUCT;
    case c10d::ReduceOp::MIN: return FR_OP_MIN;
    case c10d::ReduceOp::MAX: return FR_OP_MAX;
    case c10d::ReduceOp::BAND: return FR_OP_BAND;
    case c10d::ReduceOp::BOR: return FR_OP_BOR;
    case c10d::ReduceOp::BXOR: return FR_OP_BXOR;
    default: return std::nullopt;
  }
}

// Whether the engine can take `t` where it lies, as bytes: dense host
// memory, in order, not empty, with no lazy negation or conjugation (a
// message of any type, a broadcast, an all-gather).
bool dense_host(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided &&
      t.is_contiguous() && t.numel() > 0 && !t.is_neg() && !t.is_conj();
}

// As `dense_host`, of a type the engine names (what it reduces).
bool in_place(const at::Tensor& t) {
  return dense_host(t) && dtype_code(t.scalar_type()).has_value();
}

uint64_t byte_count(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * t.element_size();
}

fr_call call_of(int32_t collective, const at::Tensor& input, const at::Tensor& output) {
  fr_call c{};
  c.collective = collective;
  c.input = input.data_ptr();
  c.output = output.data_ptr();
  c.memory = FR_MEMORY_HOST;
  return c;
}

}  // namespace

// fairring's c10d::Backend (see fairring_c10d.hpp).
class Backend : public c10d::Backend {
 public:
  Backend(
      py::object group,
      uintptr_t comm,
      int rank,
      int size,
      bool callers_run_callbacks,
      const std::string& library,
      bool native_calls)
      : c10d::Backend(rank, size),
        comm_(reinterpret_cast<fr_comm*>(comm)),
        native_calls_(native_calls),
        gate_(std::make_shared<Gate>()),
        shared_(std::make_shared<Shared>(
            &Library::load(library), group, rank, callers_run_callbacks)),
        group_(new py::object(std::move(group))) {}

  ~Backend() override {
    shared_->close_dispatcher();
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete group_;
    }  // else the interpreter is gone, and the group with it
  }

  const std::string getBackendName() const override { return "fairring"; }

  // The calls started here.

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    auto op = op_code(opts.reduceOp);
    if (native_calls_ && tensors.size() == 1 && op && in_place(tensors[0])) {
      at::Tensor& t = tensors[0];
      fr_call c = call_of(FR_COLLECTIVE_ALL_REDUCE, t, t);
      c.count = static_cast<uint64_t>(t.numel());
      c.dtype = *dtype_code(t.scalar_type());
      c.op = *op;
      return start("allreduce", c10d::OpType::ALLREDUCE, c, tensors, {});
    }
    return delegate("allreduce", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    if (native_calls_ && tensors.size() == 1 && opts.rootTensor == 0 && dense_host(tensors[0]) &&
        opts.rootRank >= 0 && opts.rootRank < getSize()) {
      at::Tensor& t = tensors[0];
      // Bit-exact for every type: the engine moves bytes.
      fr_call c = call_of(FR_COLLECTIVE_BROADCAST, t, t);
      c.count = byte_count(t);
      c.dtype = FR_DTYPE_U8;
      c.root = static_cast<uint32_t>(opts.rootRank);
      return start("broadcast", c10d::OpType::BROADCAST, c, tensors, {});
    }
    return delegate("broadcast", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> all_gather_single(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    if (native_calls_ && dense_host(output) && dense_host(input) &&
        output.scalar_type() == input.scalar_type() &&
        output.numel() == input.numel() * getSize()) {
      fr_call c = call_of(FR_COLLECTIVE_ALL_GATHER, input, output);
      c.count = byte_count(input);
      c.dtype = FR_DTYPE_U8;
      std::vector<at::Tensor> result{output};
      return start(
          "all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, c, result, {input});
    }
    return delegate("all_gather_single", output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_single(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    auto op = op_code(opts.reduceOp);
    if (native_calls_ && op && in_place(output) && input.defined() && input.device().is_cpu() &&
        input.layout() == at::kStrided && input.scalar_type() == output.scalar_type() &&
        input.numel() == output.numel() * getSize()) {
      // The engine reduces its input in place: a copy of the caller's.
      at::Tensor flat = input.reshape(-1).clone(at::MemoryFormat::Contiguous);
      fr_call c = call_of(FR_COLLECTIVE_REDUCE_SCATTER, flat, output);
      c.count = static_cast<uint64_t>(output.numel());
      c.dtype = *dtype_code(output.scalar_type());
      c.op = *op;
      std::vector<at::Tensor> result{output};
      return start(
          "reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, c, result, {flat});
    }
    return delegate("reduce_scatter_single", output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    if (!native_calls_) {
      return delegate("barrier", opts);
    }
    fr_call c{};
    c.collective = FR_COLLECTIVE_BARRIER;
    return start("barrier", c10d::OpType::BARRIER, c, {}, {});
  }

  // The calls the Python group runs. Of each pair torch names twice (a
  // `_single` form and its older alias), the `_single` form: torch's base
  // class forwards the alias to it.

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override {
    return delegate("allreduce_coalesced", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    return delegate("reduce", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return delegate("allgather", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return delegate("allgather_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> all_gather_single_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return delegate("allgather_into_tensor_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    return delegate("gather", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    return delegate("scatter", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return delegate("reduce_scatter", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_single_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return delegate("reduce_scatter_tensor_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> all_to_all_single(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& output_splits,
      std::vector<int64_t>& input_splits,
      const c10d::AllToAllOptions& opts) override {
    return delegate("alltoall_base", output, input, output_splits, input_splits, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override {
    return delegate("alltoall", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors, int dst, int tag) override {
    if (native_message(tensors, dst, tag)) {
      fr_call c = message_call(FR_COLLECTIVE_SEND, tensors[0], dst, tag);
      std::string what = "send to rank " + std::to_string(dst);
      return start(what, c10d::OpType::SEND, c, tensors, {});
    }
    return delegate("send", tensors, dst, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors, int src, int tag) override {
    if (native_message(tensors, src, tag)) {
      fr_call c = message_call(FR_COLLECTIVE_RECV, tensors[0], src, tag);
      std::string what = "recv from rank " + std::to_string(src);
      return start(what, c10d::OpType::RECV, c, tensors, {}, src);
    }
    return delegate("recv", tensors, src, tag);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors, int tag) override {
    return delegate("recv_anysource", tensors, tag);
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    py::gil_scoped_acquire gil;
    group().attr("monitored_barrier")(opts.timeout, wait_all_ranks);
  }

  // Lifetime.

  void abort() override {
    py::gil_scoped_acquire gil;
    group().attr("abort")();
  }

  void shutdown() override {
    shared_->close_dispatcher();
    py::gil_scoped_acquire gil;
    group().attr("shutdown")();
  }

  // The Python group.
  py::object& group() const { return *group_; }

  // What the Python group calls before it destroys the communicator: waits
  // for calls starting here to have started, refuses later ones (as the
  // group does), and closes the dispatcher of futures. It holds no reference
  // to the backend or the group.
  py::cpp_function closer() const {
    return py::cpp_function([gate = gate_, weak = std::weak_ptr<Shared>(shared_)] {
      {
        py::gil_scoped_release unlocked;
        std::unique_lock<std::shared_mutex> lock(gate->mutex);
        gate->open = false;
      }
      if (auto shared = weak.lock()) {
        shared->close_dispatcher();
      }
    });
  }

 private:
  // Whether a message of `tensors` with `peer` and `tag` starts here: one
  // tensor where it lies, another rank of the group, a tag the engine takes
  // (anything else goes to the Python group, which names what is wrong).
  bool native_message(const std::vector<at::Tensor>& tensors, int peer, int tag) const {
    return native_calls_ && tensors.size() == 1 && dense_host(tensors[0]) &&
        peer >= 0 && peer < getSize() && peer != getRank() && tag >= 0;
  }

  // A send or receive of `t`, in the engine's type where it names one, else
  // as bytes.
  static fr_call message_call(int32_t collective, const at::Tensor& t, int peer, int tag) {
    fr_call c = call_of(collective, t, t);
    if (auto code = dtype_code(t.scalar_type())) {
      c.count = static_cast<uint64_t>(t.numel());
      c.dtype = *code;
    } else {
      c.count = byte_count(t);
      c.dtype = FR_DTYPE_U8;
    }
    c.peer = static_cast<uint32_t>(peer);
    c.tag = static_cast<uint32_t>(tag);
    return c;
  }

  // Starts `call` in the engine; `result` is what its future completes
  // with, `keep` what else the engine uses; `source` the rank a receive
  // comes from.
  c10::intrusive_ptr<c10d::Work> start(
      const std::string& what,
      c10d::OpType type,
      const fr_call& call,
      std::vector<at::Tensor> result,
      std::vector<at::Tensor> keep,
      int source = -1) {
    note_callback_issue();
    const Library& library = *shared_->library;
    fr_work* handle = nullptr;
    fr_status status;
    {
      // The communicator lives while the gate is open: the Python group
      // closes it (and waits for this) before destroying the communicator.
      std::shared_lock<std::shared_mutex> lock(gate_->mutex);
      if (!gate_->open) {
        throw std::runtime_error(
            "fairring: " + what + ": the process group has been shut down");
      }
      status = library.start(comm_, &call, 1, &handle);
    }
    if (status != FR_OK && status != FR_PENDING) {
      const char* message = library.last_error();
      raise_failure(*shared_, what, Outcome{status, message != nullptr ? message : ""});
    }
    auto work = c10::make_intrusive<NativeWork>(
        shared_, handle, what, type, std::move(result), std::move(keep), source);
    sweep(work);
    return work;
  }

  // Keeps track of the works started here that nobody has seen finish, and
  // settles the oldest of them once more than `kUnseenLimit` are: a finished
  // work its caller keeps but never waits on, polls or asks a future of
  // then gives its engine handle back within that many operations, long
  // before the engine's table of operations (1,024 entries, reused in turn)
  // comes back to its entry. The operations finish in order, so the sweep
  // stops at the first still running.
  void sweep(const c10::intrusive_ptr<NativeWork>& started) {
    std::lock_guard<std::mutex> lock(unseen_mutex_);
    unseen_.push_back(c10::weak_intrusive_ptr<NativeWork>(started));
    while (!unseen_.empty()) {
      c10::intrusive_ptr<NativeWork> oldest = unseen_.front().lock();
      bool seen = !oldest || oldest->isSettled() ||
          (unseen_.size() > kUnseenLimit && oldest->isCompleted());
      if (!seen) {
        break;
      }
      unseen_.pop_front();
    }
  }

  static constexpr size_t kUnseenLimit = 256;

  // Has the Python group run the call `name`.
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> delegate(const char* name, Args&&... args) {
    note_callback_issue();
    py::gil_scoped_acquire gil;
    py::object work = group().attr(name)(std::forward<Args>(args)...);
    return c10::make_intrusive<PythonWork>(std::move(work));
  }

  // A call issued from a future's callback: the group's errors then say how
  // such calls may race (see the Python group's `_CALLBACK_RACE`).
  void note_callback_issue() {
    if (on_callback_thread() && !shared_->callbacks_issue.exchange(true)) {
      py::gil_scoped_acquire gil;
      group().attr("_note_callbacks_issue")();
    }
  }

  fr_comm* comm_;
  // FAIRRING_TORCH_CALLS=native: the common host calls start here.
  bool native_calls_;
  // Whether the communicator may be used: closed by the Python group
  // before it destroys it (`closer`).
  struct Gate {
    std::shared_mutex mutex;
    bool open = true;
  };
  std::shared_ptr<Gate> gate_;
  // The works started here not yet seen finished, oldest first (`sweep`).
  std::mutex unseen_mutex_;
  std::deque<c10::weak_intrusive_ptr<NativeWork>> unseen_;
  std::shared_ptr<Shared> shared_;
  // The Python group, owned here (released with the GIL held).
  py::object* group_;
};

// A fairring group as torch sees it: torch's own ProcessGroup, with the
// backend registered for CPU and CUDA tensors (`fairring._backend.create`),
// that names itself "fairring" (where a plain one would say "custom": DDP's
// logging data and anything else asking the group's name).
class ProcessGroup : public c10d::ProcessGroup {
 public:
  using c10d::ProcessGroup::ProcessGroup;
  const std::string getBackendName() const override { return "fairring"; }
};

}  // namespace fairring

PYBIND11_MODULE(_c10d, m) {
  m.doc() = "fairring's torch.distributed backend as a C++ c10d::Backend";
  m.attr("torch_version") = FAIRRING_TORCH_VERSION;
  py::class_<fairring::Backend, c10d::Backend, c10::intrusive_ptr<fairring::Backend>>(
      m, "Backend")
      .def(
          py::init<py::object, uintptr_t, int, int, bool, const std::string&, bool>(),
          py::arg("group"),
          py::arg("comm"),
          py::arg("rank"),
          py::arg("size"),
          py::arg("callers_run_callbacks"),
          py::arg("library"),
          py::arg("native_calls"))
      .def_property_readonly("group", [](const fairring::Backend& b) { return b.group(); })
      .def_property_readonly("closer", &fairring::Backend::closer);
  py::class_<
      fairring::ProcessGroup,
      c10d::ProcessGroup,
      c10::intrusive_ptr<fairring::ProcessGroup>>(m, "ProcessGroup")
      .def(
          py::init<c10::intrusive_ptr<c10d::Store>, int, int>(),
          py::arg("store"),
          py::arg("rank"),
          py::arg("size"));
  m.def(
      "live_native_works",
      &fairring::NativeWork::live,
      "How many works of calls this backend started are alive in this process.");
  m.def(
      "mark_callback_thread",
      &fairring::mark_callback_thread,
      "Marks the calling thread as one that runs a fairring group's callbacks.");
}
