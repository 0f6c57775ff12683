// flaggems' compiled dispatcher entry.
//
// One boxed kernel per routed op and dispatch key. Per call it builds a key from
// the arguments' metadata (dtypes, sizes, strides, storage offsets, pointer
// alignment, aliasing, devices, scalar values) and looks up a plan that the
// Python planner handed back for that key:
//   replay  allocate the outputs/workspaces and launch the recorded kernels
//           (CUDA driver API, loaded at run time; or a recorded Python launcher)
//   native  the captured native kernel (the planner declined for this key)
//   python  the Python entry (the call needs the host: a sync, a persistent
//           workspace, ...)
//   autograd a replayed forward under a C++ autograd node whose backward is
//           another keyed entry (a schema-only backward op with its own plans)
// A miss calls the planner, which runs the call through the Python entry and
// may return a plan. No op semantics live here: the planner decides them all.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/jit/frontend/function_schema_parser.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#include <dlfcn.h>

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------- CUDA driver
// The few driver API types used, laid out as in cuda.h (CUDA 12).
typedef int CUresult;
struct LaunchAttr {
  int id;
  char pad[4];
  union {
    char raw[64];
    int value;
  } value;
};
struct LaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
  void* stream;
  LaunchAttr* attrs;
  unsigned num_attrs;
};
typedef CUresult (*LaunchKernelEx)(const LaunchConfig*, void*, void**, void**);
typedef CUresult (*LaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                                 void**, void**);
typedef CUresult (*GetErrorString)(CUresult, const char**);
typedef CUresult (*CtxGetCurrent)(void**);
typedef CUresult (*CtxSetCurrent)(void*);
typedef CUresult (*DeviceGet)(int*, int);
typedef CUresult (*PrimaryCtxRetain)(void**, int);
constexpr int kAttrCooperative = 2;
constexpr int kAttrProgrammaticSerialization = 6;

struct Driver {
  LaunchKernelEx launch = nullptr;
  LaunchKernel launch_plain = nullptr;  // a launch without attributes
  GetErrorString error_string = nullptr;
  CtxGetCurrent context = nullptr;
  CtxSetCurrent set_context = nullptr;
  DeviceGet device_get = nullptr;
  PrimaryCtxRetain retain = nullptr;
  std::string reason = "not loaded";
};

Driver& driver() {
  static Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) {
      out.reason = "libcuda.so.1 not found";
      return out;
    }
    out.launch = reinterpret_cast<LaunchKernelEx>(dlsym(lib, "cuLaunchKernelEx"));
    out.launch_plain = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
    out.error_string = reinterpret_cast<GetErrorString>(dlsym(lib, "cuGetErrorString"));
    out.context = reinterpret_cast<CtxGetCurrent>(dlsym(lib, "cuCtxGetCurrent"));
    out.set_context = reinterpret_cast<CtxSetCurrent>(dlsym(lib, "cuCtxSetCurrent"));
    out.device_get = reinterpret_cast<DeviceGet>(dlsym(lib, "cuDeviceGet"));
    out.retain = reinterpret_cast<PrimaryCtxRetain>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    if (!out.context || !out.set_context || !out.device_get || !out.retain) out.launch = nullptr;
    out.reason = out.launch ? "cuLaunchKernelEx" : "cuLaunchKernelEx/cuCtxGetCurrent missing from libcuda";
    return out;
  }();
  return d;
}

// ---------------------------------------------------------------- plans
enum class PlanKind { kReplay = 0, kNative = 1, kPython = 2, kAutograd = 3 };
enum class Source { kInput = 0, kAlloc = 1, kPinned = 2 };

// One parameter of a driver launch: a pointer into an input or allocation, a
// constant (its bytes), or a null pointer (Triton's unused scratch slots).
struct Param {
  enum Kind : uint8_t { kPointer, kConstant, kNull } kind;
  Source source;
  uint8_t size;  // bytes of a constant
  int32_t index;
  int64_t value;  // byte delta of a pointer, or the constant's bits
};

struct DriverLaunch {
  void* function;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  bool pdl, cooperative;
  std::vector<Param> params;
};

struct ViewSpec {
  Source source;
  int32_t index;
  bool as_is;
  std::vector<int64_t> sizes, strides;
  int64_t offset;
};

struct PyTensorSlot {
  int32_t position;
  ViewSpec view;
};

struct PyLaunch {
  py::object launcher;
  py::object grid;
  std::vector<py::object> args;
  std::vector<PyTensorSlot> slots;
  ~PyLaunch() {
    py::gil_scoped_acquire gil;
    launcher = py::object();
    grid = py::object();
    args.clear();
  }
};

struct Step {
  std::unique_ptr<DriverLaunch> cuda;
  std::unique_ptr<PyLaunch> python;
};

struct AllocSpec {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
};

struct AutogradSpec;

struct Plan {
  PlanKind kind = PlanKind::kPython;
  std::vector<AllocSpec> allocs;
  std::vector<Step> steps;
  std::vector<ViewSpec> returns;  // index -1: an undefined tensor (a gradient not asked for)
  std::shared_ptr<const AutogradSpec> autograd;
  // State buffers the plan owns (zero between calls, e.g. a scan's status words): the plan replays on
  // ``stream`` only (another stream takes the Python path), one replay at a time.
  std::vector<at::Tensor> pinned;
  int64_t stream = 0;
  bool python_steps = false;
  mutable std::mutex serial;
  mutable std::atomic<bool> reused{false};  // served a call after the one that made it
};

// A call's tensor inputs, in key order: the boxed entry points into its own copies, the typed one into
// the caller's arguments (no copy, so no reference count moves).
using InputRefs = c10::SmallVector<const at::Tensor*, 8>;

InputRefs refs_of(const std::vector<at::Tensor>& tensors) {
  InputRefs refs;
  for (const at::Tensor& t : tensors) refs.push_back(&t);
  return refs;
}

// Where a launch parameter or a view points: the call's inputs, its fresh allocations, the plan's state.
struct Operands {
  const InputRefs& inputs;
  const std::vector<at::Tensor>& allocs;
  const std::vector<at::Tensor>& pinned;
  const at::Tensor& of(Source source, int32_t index) const {
    return source == Source::kInput ? *inputs[index] : source == Source::kAlloc ? allocs[index] : pinned[index];
  }
};

// ---------------------------------------------------------------- keys
struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : key) {
      h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

enum Tag : int64_t {
  kTagNone = 1, kTagTensor, kTagUndefined, kTagInt, kTagDouble, kTagBool, kTagIntList, kTagString,
  kTagDevice, kTagTensorList, kTagGrad, kTagBoolList,
};

using Ranges = std::vector<std::pair<uintptr_t, uintptr_t>>;

// What the key made of a call: keyed (plans may serve it), unkeyable (a value the key cannot describe:
// the Python entry serves it uncached) or unservable (a tensor no kernel of flaggems reads right: torch's
// own kernel serves it, for every implementation).
enum class Keyed { kYes, kUnkeyable, kUnservable };

// Tensors whose values are not what their storage holds, or that are not plain memory at all: the negative
// and conjugate bits (torch._neg_view, c.conj().imag), zero tensors, Python subclasses (fake tensors of
// torch.compile, wrapper subclasses), functorch wrappers (vmap, grad, jvp), functionalized and sparse or
// nested tensors. Below an Autograd key torch's fallbacks resolve most of them before a routed kernel
// runs; on an Autograd key (CompositeImplicitAutograd ops) they arrive as they are.
c10::DispatchKeySet unservable_keys() {
  using K = c10::DispatchKey;
  c10::DispatchKeySet set;
  for (K k : {K::Python, K::PythonTLSSnapshot, K::Negative, K::Conjugate, K::ZeroTensor, K::FuncTorchGradWrapper,
              K::FuncTorchBatched, K::BatchedNestedTensor, K::Functionalize, K::Sparse, K::SparseCsr,
              K::NestedTensor}) {
    set = set | c10::DispatchKeySet(k);
  }
  return set;
}

// Appends one tensor's key terms. A defined tensor is an input of the plan (the caller keeps it).
Keyed key_tensor(std::vector<int64_t>& key, const at::Tensor& t, Ranges& ranges, bool grad_sensitive) {
  static const c10::DispatchKeySet unservable = unservable_keys();
  if (!t.defined()) {
    key.push_back(kTagUndefined);
    return Keyed::kYes;
  }
  const auto* impl = t.unsafeGetTensorImpl();
  if (!(impl->key_set() & unservable).empty() || t.layout() != at::kStrided || !t.has_storage()) {
    return Keyed::kUnservable;
  }
  // On an Autograd key, a tensor with a forward-mode tangent needs torch's kernel to carry it. Autograd
  // metadata otherwise is keyed (requires grad, has metadata): the planner never makes a replay of a call
  // that needs a graph; a native plan (the captured kernel records its own) is safe.
  const bool has_meta = impl->autograd_meta() != nullptr;
  if (grad_sensitive && has_meta && torch::autograd::impl::get_autograd_meta(t)->fw_grad_ != nullptr) {
    return Keyed::kUnservable;
  }
  const auto device = t.device();
  key.push_back(kTagTensor);
  key.push_back(static_cast<int64_t>(t.scalar_type()) | (static_cast<int64_t>(device.type()) << 8) |
                ((static_cast<int64_t>(device.index()) + 1) << 16) | (int64_t(t.is_conj()) << 32) |
                (int64_t(t.is_neg()) << 33) | (int64_t(impl->is_wrapped_number()) << 34) |
                (int64_t(t.requires_grad()) << 35) | (int64_t(has_meta) << 36));
  const int64_t dim = t.dim();
  key.push_back(dim);
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (int64_t i = 0; i < dim; ++i) key.push_back(sizes[i]);
  for (int64_t i = 0; i < dim; ++i) key.push_back(strides[i]);
  key.push_back(t.storage_offset());
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  key.push_back(static_cast<int64_t>(address & 15));  // Triton specialises pointers on 16-byte alignment
  // Aliasing: the first earlier tensor whose storage overlaps this one's.
  const auto& storage = t.storage();
  const auto begin = reinterpret_cast<uintptr_t>(storage.data());
  const auto end = begin + storage.nbytes();
  int64_t alias = -1;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (begin < ranges[i].second && ranges[i].first < end) {
      alias = static_cast<int64_t>(i);
      break;
    }
  }
  key.push_back(alias);
  ranges.emplace_back(begin, end);
  return Keyed::kYes;
}

Keyed add_tensor(std::vector<int64_t>& key, const at::Tensor& t, std::vector<at::Tensor>& inputs, Ranges& ranges,
                 bool grad_sensitive) {
  const Keyed keyed = key_tensor(key, t, ranges, grad_sensitive);
  if (keyed == Keyed::kYes && t.defined()) inputs.push_back(t);
  return keyed;
}

// Key terms of the scalar arguments, one writer for the boxed (add_ivalue) and the typed (TypedKey)
// entries: a typed call must find the plan its boxed form made.
void key_int(std::vector<int64_t>& key, int64_t v) { key.insert(key.end(), {kTagInt, v}); }
void key_bool(std::vector<int64_t>& key, bool v) { key.insert(key.end(), {kTagBool, int64_t(v)}); }
void key_double(std::vector<int64_t>& key, double v) {
  int64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  key.insert(key.end(), {kTagDouble, bits});
}
void key_device(std::vector<int64_t>& key, at::Device d) {
  key.insert(key.end(), {kTagDevice, (static_cast<int64_t>(d.type()) << 8) | (static_cast<int64_t>(d.index()) + 1)});
}

Keyed add_ivalue(std::vector<int64_t>& key, const c10::IValue& v, std::vector<at::Tensor>& inputs,
                 std::vector<std::pair<uintptr_t, uintptr_t>>& ranges, bool grad_sensitive) {
  if (v.isTensor()) return add_tensor(key, v.toTensor(), inputs, ranges, grad_sensitive);
  if (v.isNone()) {
    key.push_back(kTagNone);
  } else if (v.isInt()) {
    key_int(key, v.toInt());
  } else if (v.isDouble()) {
    key_double(key, v.toDouble());
  } else if (v.isBool()) {
    key_bool(key, v.toBool());
  } else if (v.isIntList()) {
    key.push_back(kTagIntList);
    const auto list = v.toIntVector();
    key.push_back(static_cast<int64_t>(list.size()));
    key.insert(key.end(), list.begin(), list.end());
  } else if (v.isBoolList()) {
    key.push_back(kTagBoolList);
    const auto list = v.toBoolList();
    key.push_back(static_cast<int64_t>(list.size()));
    for (size_t i = 0; i < list.size(); ++i) key.push_back(list.get(i));
  } else if (v.isString()) {
    key.push_back(kTagString);
    key.push_back(static_cast<int64_t>(std::hash<std::string>()(v.toStringRef())));
  } else if (v.isDevice()) {
    key_device(key, v.toDevice());
  } else if (v.isTensorList()) {
    const auto list = v.toTensorList();
    key.push_back(kTagTensorList);
    key.push_back(static_cast<int64_t>(list.size()));
    for (const at::Tensor t : list) {
      const Keyed keyed = add_tensor(key, t, inputs, ranges, grad_sensitive);
      if (keyed != Keyed::kYes) return keyed;
    }
  } else {
    return Keyed::kUnkeyable;
  }
  return Keyed::kYes;
}

// ---------------------------------------------------------------- per-op state
struct Stats {
  std::atomic<int64_t> replay{0}, native{0}, python{0}, miss{0}, uncached{0}, evicted{0}, rejected{0};
  // Plans made that served a later call; misses served without planning (the budget), and the skip count
  // that paces the retries.
  std::atomic<int64_t> reused{0}, unplanned{0}, skips{0};
  std::atomic<int64_t> typed{0};  // replays served by the typed kernel (also counted in replay)
  std::atomic<int64_t> unservable{0};  // calls with a tensor no kernel reads right (key_tensor): torch's kernel
  // Nanoseconds spent per phase of replayed calls, summed while profiling is on (benchmarks read them).
  std::atomic<int64_t> profiled{0}, key_ns{0}, lookup_ns{0}, alloc_ns{0}, launch_ns{0}, finish_ns{0};
};

// When a miss may call the planner. Planning runs the call in Python under a dispatch mode (150-230 µs
// a miss on the H200, against 12-22 µs for the Python entry), which pays only if the key comes back.
struct PlanBudget {
  size_t capacity;       // plans kept (all are dropped when full)
  int64_t free_misses;   // misses always planned
  int64_t retry_every;   // past those, while fewer than half the plans made were reused: plan one miss in this many
  bool strict = false;   // a malformed plan raises (FLAGGEMS_STRICT) instead of being counted in stats.rejected
};

std::atomic<bool> profiling{false};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Phase clock of one replayed call; every method is a no-op unless profiling was on at its start.
struct PhaseClock {
  bool on = profiling.load(std::memory_order_relaxed);
  int64_t last = on ? now_ns() : 0;
  void lap(std::atomic<int64_t>& into) {
    if (!on) return;
    const int64_t t = now_ns();
    into.fetch_add(t - last, std::memory_order_relaxed);
    last = t;
  }
};

thread_local int native_depth = 0;

struct OpState;

// The backward ops of one registry, by name: schema-only entries (never registered with the
// dispatcher) that autograd plans call from their nodes.
struct BackwardOps {
  std::mutex lock;
  std::unordered_map<std::string, std::shared_ptr<OpState>> ops;
};

struct OpState {
  std::string name;
  std::optional<c10::OperatorHandle> op;  // absent for a backward op
  c10::FunctionSchema schema;
  std::optional<c10::SafeKernelFunction> native;
  c10::DispatchKeySet native_keys;
  py::object entry;    // the Python entry (binding.build_entry)
  py::object planner;  // (args, kwargs, inputs) -> (result, spec or None)
  bool grad_sensitive;  // registered on an Autograd key: grad mode is part of the key
  PlanBudget budget;
  bool typed = false;  // registered with a typed kernel (unboxed calls skip the boxing)
  std::shared_mutex lock;
  std::unordered_map<std::vector<int64_t>, std::shared_ptr<const Plan>, KeyHash> plans;
  Stats stats;
  std::shared_ptr<BackwardOps> backwards;

  OpState(std::string n, c10::OperatorHandle h, c10::SafeKernelFunction k, c10::DispatchKey key, py::object e,
          py::object p, bool grad, PlanBudget bud, std::shared_ptr<BackwardOps> b)
      : name(std::move(n)), op(h), schema(h.schema()), native(std::move(k)), native_keys(key), entry(std::move(e)),
        planner(std::move(p)), grad_sensitive(grad), budget(bud), backwards(std::move(b)) {}

  // A backward op: only a schema; its "native" is its Python entry.
  OpState(std::string n, c10::FunctionSchema s, py::object e, py::object p, PlanBudget bud,
          std::shared_ptr<BackwardOps> b)
      : name(std::move(n)), schema(std::move(s)), entry(std::move(e)), planner(std::move(p)), grad_sensitive(false),
        budget(bud), backwards(std::move(b)) {}

  ~OpState() {
    py::gil_scoped_acquire gil;
    entry = py::object();
    planner = py::object();
    plans.clear();
  }
};

thread_local std::vector<const OpState*> busy_ops;

struct BusyGuard {
  explicit BusyGuard(const OpState* s) { busy_ops.push_back(s); }
  ~BusyGuard() { busy_ops.pop_back(); }
};

bool is_busy(const OpState* s) {
  for (const OpState* b : busy_ops) {
    if (b == s) return true;
  }
  return false;
}

// One argument of a backward call: an incoming gradient, a saved tensor, a constant, or the
// per-slot "needs a gradient" flags.
struct ArgItem {
  enum Kind : uint8_t { kGrad, kSaved, kConst, kNeeds } kind;
  int32_t index;
  c10::IValue value;
};

// A differentiable call served in C++: the forward replays ``forward`` (its returns: the op's
// outputs, then tensors saved only for the backward) under a torch::autograd::Function node whose
// backward calls ``backward`` (a keyed entry of its own) with ``args``.
struct AutogradSpec {
  std::shared_ptr<const Plan> forward;
  size_t num_outputs = 0;
  std::vector<int32_t> slots;                        // per differentiable slot: index of the call's input, -1 absent
  std::vector<std::pair<Source, int32_t>> saved;     // an input, or (kAlloc) a forward return
  std::shared_ptr<OpState> backward;
  std::vector<ArgItem> args;
  py::object double_backward;                        // called with args + extra under create_graph
  std::vector<ArgItem> extra;
  ~AutogradSpec() {
    py::gil_scoped_acquire gil;
    double_backward = py::object();
    args.clear();
    extra.clear();
  }
};

[[noreturn]] void rethrow_python(py::error_already_set& e) {
  e.restore();
  python_error err;
  err.persist();
  throw err;
}

// ---------------------------------------------------------------- replay
at::Tensor view_of(const ViewSpec& v, const Operands& ops) {
  if (v.index < 0) return at::Tensor();
  const at::Tensor& base = ops.of(v.source, v.index);
  if (v.as_is) return base;
  return base.as_strided(v.sizes, v.strides, v.offset);
}

void launch_driver(const DriverLaunch& l, const Operands& ops, void* stream) {
  const size_t n = l.params.size();
  int64_t storage[64];
  void* pointers[64];
  TORCH_CHECK(n <= 64, "flaggems: more than 64 kernel parameters");
  for (size_t i = 0; i < n; ++i) {
    const Param& p = l.params[i];
    switch (p.kind) {
      case Param::kPointer: {
        const at::Tensor& base = ops.of(p.source, p.index);
        storage[i] = reinterpret_cast<int64_t>(base.data_ptr()) + p.value;
        break;
      }
      case Param::kConstant:
        storage[i] = p.value;
        break;
      case Param::kNull:
        storage[i] = 0;
        break;
    }
    pointers[i] = &storage[i];  // little-endian: a narrower constant is read from the low bytes
  }
  LaunchAttr attrs[2];
  unsigned num_attrs = 0;
  if (l.pdl) {
    std::memset(&attrs[num_attrs], 0, sizeof(LaunchAttr));
    attrs[num_attrs].id = kAttrProgrammaticSerialization;
    attrs[num_attrs++].value.value = 1;
  }
  if (l.cooperative) {
    std::memset(&attrs[num_attrs], 0, sizeof(LaunchAttr));
    attrs[num_attrs].id = kAttrCooperative;
    attrs[num_attrs++].value.value = 1;
  }
  CUresult status;
  if (num_attrs == 0 && driver().launch_plain != nullptr) {
    status = driver().launch_plain(l.function, l.grid[0], l.grid[1], l.grid[2], l.block, 1, 1, l.shared, stream,
                                   pointers, nullptr);
  } else {
    LaunchConfig config{l.grid[0], l.grid[1], l.grid[2], l.block, 1, 1, l.shared, stream, attrs, num_attrs};
    status = driver().launch(&config, l.function, pointers, nullptr);
  }
  if (status != 0) {
    const char* text = nullptr;
    if (driver().error_string) driver().error_string(status, &text);
    TORCH_CHECK(false, "flaggems: kernel launch failed: ", text ? text : "unknown error", " (", status, ")");
  }
}

void launch_python(const PyLaunch& l, const Operands& ops) {
  py::gil_scoped_acquire gil;
  py::tuple args(l.args.size());
  for (size_t i = 0; i < l.args.size(); ++i) args[i] = l.args[i];
  for (const PyTensorSlot& slot : l.slots) {
    args[slot.position] = py::reinterpret_steal<py::object>(THPVariable_Wrap(view_of(slot.view, ops)));
  }
  try {
    l.launcher(l.grid, *args);
  } catch (py::error_already_set& e) {
    rethrow_python(e);
  }
}

// A thread that has not used the device yet has no current context (a cached allocation and an
// unchanged current device never make one): bind the device's primary context, as Triton's launcher does.
void ensure_context(int ordinal) {
  const Driver& d = driver();
  if (d.launch == nullptr) return;
  void* context = nullptr;
  if (d.context(&context) == 0 && context != nullptr) return;
  int device = 0;
  TORCH_CHECK(d.device_get(&device, ordinal) == 0 && d.retain(&context, device) == 0 &&
                  d.set_context(context) == 0,
              "flaggems: cannot make CUDA device ", ordinal, "'s primary context current");
}

// The device type's registered allocator, looked up once; null where none is registered (then
// at::empty_strided, through the dispatcher, allocates instead).
c10::Allocator* registered_allocator(c10::DeviceType type) {
  static std::atomic<c10::Allocator*> found[static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)];
  static std::atomic<bool> looked[static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)];
  const int slot = static_cast<int>(type);
  if (!looked[slot].load(std::memory_order_acquire)) {
    c10::Allocator* allocator = nullptr;
    try {
      allocator = c10::GetAllocator(type);
    } catch (const std::exception&) {
      allocator = nullptr;
    }
    found[slot].store(allocator, std::memory_order_relaxed);
    looked[slot].store(true, std::memory_order_release);
  }
  return found[slot].load(std::memory_order_relaxed);
}

// An output as the device's own empty_strided makes it, without a dispatcher round trip (BackendSelect,
// then the backend's kernel). Called under the device's guard: allocators serve the current device.
at::Tensor allocate(const AllocSpec& a, const at::Device& device) {
  if (c10::Allocator* allocator = registered_allocator(device.type())) {
    const c10::DispatchKeySet keys(c10::computeDispatchKey(a.dtype, at::kStrided, device));
    return at::detail::empty_strided_generic(a.sizes, a.strides, allocator, keys, a.dtype);
  }
  return at::empty_strided(a.sizes, a.strides, at::TensorOptions().dtype(a.dtype).device(device));
}

void launch_steps(const Plan& plan, const Operands& ops, void* stream) {
  for (const Step& step : plan.steps) {
    if (step.cuda) {
      launch_driver(*step.cuda, ops, stream);
    } else {
      launch_python(*step.python, ops);
    }
  }
}

// A plan with state: one replay at a time, and the state zeroed again if a launch fails half-way (the
// next replay must find it zero). Lock order: the plan's mutex, then the GIL (a Python step's torch ops
// release the GIL while its replay holds the mutex), so a thread holding the GIL waits without it.
void launch_serially(const Plan& plan, const Operands& ops, void* stream) {
  std::unique_lock<std::mutex> serial(plan.serial, std::try_to_lock);
  if (!serial.owns_lock()) {
    if (PyGILState_Check()) {
      py::gil_scoped_release released;
      serial.lock();
    } else {
      serial.lock();
    }
  }
  std::optional<py::gil_scoped_acquire> gil;
  if (plan.python_steps) gil.emplace();
  try {
    launch_steps(plan, ops, stream);
  } catch (...) {
    for (const at::Tensor& state : plan.pinned) const_cast<at::Tensor&>(state).zero_();
    throw;
  }
}

// Whether a plan with state may replay here: on the stream it was recorded on (CPU: always).
bool on_plan_stream(const Plan& plan, const std::vector<at::Tensor>& inputs) {
  if (plan.pinned.empty()) return true;
  const at::Device device = inputs.empty() ? at::Device(at::kCPU) : inputs[0].device();
  if (device.type() == at::kCPU) return true;
  if (device.type() != at::kCUDA) return false;
  c10::impl::VirtualGuardImpl impl(device.type());
  return reinterpret_cast<int64_t>(impl.getStream(device).native_handle()) == plan.stream;
}

// Allocates and launches; returns the allocations (the returns are views of them, or of the inputs).
std::vector<at::Tensor> execute(const Plan& plan, const InputRefs& inputs, PhaseClock& clock, Stats& stats) {
  const at::Device device = inputs.empty() ? at::Device(at::kCPU) : inputs[0]->device();
  c10::OptionalDeviceGuard guard;
  void* stream = nullptr;
  if (device.type() != at::kCPU) {
    guard.reset_device(device);
    if (!plan.steps.empty() && device.type() == at::kCUDA) {  // driver steps launch on CUDA devices only
      c10::impl::VirtualGuardImpl impl(device.type());
      stream = impl.getStream(device).native_handle();
      ensure_context(device.index());
    }
  }
  std::vector<at::Tensor> allocs;
  allocs.reserve(plan.allocs.size());
  for (const AllocSpec& a : plan.allocs) allocs.push_back(allocate(a, device));
  clock.lap(stats.alloc_ns);
  const Operands ops{inputs, allocs, plan.pinned};
  if (plan.pinned.empty()) {
    launch_steps(plan, ops, stream);
  } else {
    launch_serially(plan, ops, stream);
  }
  clock.lap(stats.launch_ns);
  return allocs;
}

std::vector<at::Tensor> run_plan(const Plan& plan, const InputRefs& inputs, PhaseClock& clock, Stats& stats) {
  const std::vector<at::Tensor> allocs = execute(plan, inputs, clock, stats);
  const Operands ops{inputs, allocs, plan.pinned};
  std::vector<at::Tensor> results;
  results.reserve(plan.returns.size());
  for (const ViewSpec& r : plan.returns) results.push_back(view_of(r, ops));
  return results;
}

void replay(const Plan& plan, const std::vector<at::Tensor>& inputs, torch::jit::Stack* stack, size_t num_args,
            PhaseClock& clock, Stats& stats) {
  std::vector<at::Tensor> results = run_plan(plan, refs_of(inputs), clock, stats);
  torch::jit::drop(*stack, num_args);
  for (at::Tensor& r : results) stack->emplace_back(std::move(r));
}

// ---------------------------------------------------------------- plan specs from Python
std::vector<int64_t> int_vector(py::handle h) {
  std::vector<int64_t> out;
  for (py::handle item : h) out.push_back(item.cast<int64_t>());
  return out;
}

ViewSpec parse_view(py::handle h) {
  // (source, index, as_is, sizes, strides, offset), or None: an undefined tensor
  if (h.is_none()) return ViewSpec{Source::kInput, -1, true, {}, {}, 0};
  py::tuple t = py::reinterpret_borrow<py::tuple>(h);
  ViewSpec v;
  v.source = static_cast<Source>(t[0].cast<int>());
  v.index = t[1].cast<int32_t>();
  v.as_is = t[2].cast<bool>();
  v.sizes = int_vector(t[3]);
  v.strides = int_vector(t[4]);
  v.offset = t[5].cast<int64_t>();
  return v;
}

std::unique_ptr<DriverLaunch> parse_cuda(py::tuple t) {
  // ("cuda", function, (gx, gy, gz), block, shared, pdl, cooperative, params)
  auto l = std::make_unique<DriverLaunch>();
  l->function = reinterpret_cast<void*>(t[1].cast<uintptr_t>());
  py::tuple grid = t[2].cast<py::tuple>();
  for (int i = 0; i < 3; ++i) l->grid[i] = grid[i].cast<unsigned>();
  l->block = t[3].cast<unsigned>();
  l->shared = t[4].cast<unsigned>();
  l->pdl = t[5].cast<bool>();
  l->cooperative = t[6].cast<bool>();
  for (py::handle item : t[7]) {
    // ("ptr", source, index, delta) | ("const", size, bits) | ("null",)
    py::tuple p = py::reinterpret_borrow<py::tuple>(item);
    const std::string kind = p[0].cast<std::string>();
    Param param{Param::kNull, Source::kInput, 8, 0, 0};
    if (kind == "ptr") {
      param.kind = Param::kPointer;
      param.source = static_cast<Source>(p[1].cast<int>());
      param.index = p[2].cast<int32_t>();
      param.value = p[3].cast<int64_t>();
    } else if (kind == "const") {
      param.kind = Param::kConstant;
      param.size = p[1].cast<uint8_t>();
      param.value = p[2].cast<int64_t>();
    }
    l->params.push_back(param);
  }
  TORCH_CHECK(l->params.size() <= 64, "flaggems: more than 64 kernel parameters");
  return l;
}

std::unique_ptr<PyLaunch> parse_python(py::tuple t) {
  // ("python", launcher, grid, args, ((position, view), ...))
  auto l = std::make_unique<PyLaunch>();
  l->launcher = py::reinterpret_borrow<py::object>(t[1]);
  l->grid = py::reinterpret_borrow<py::object>(t[2]);
  for (py::handle a : t[3]) l->args.push_back(py::reinterpret_borrow<py::object>(a));
  for (py::handle item : t[4]) {
    py::tuple s = py::reinterpret_borrow<py::tuple>(item);
    l->slots.push_back({s[0].cast<int32_t>(), parse_view(s[1])});
  }
  return l;
}

std::shared_ptr<Plan> parse_replay(py::tuple t) {
  // ("replay", allocations, steps, returns)
  auto plan = std::make_shared<Plan>();
  plan->kind = PlanKind::kReplay;
  for (py::handle a : t[1]) {
    py::tuple at_ = py::reinterpret_borrow<py::tuple>(a);
    PyObject* dtype = at_[2].ptr();
    TORCH_CHECK(THPDtype_Check(dtype), "flaggems: allocation dtype must be a torch.dtype");
    plan->allocs.push_back({int_vector(at_[0]), int_vector(at_[1]), reinterpret_cast<THPDtype*>(dtype)->scalar_type});
  }
  for (py::handle s : t[2]) {
    py::tuple step = py::reinterpret_borrow<py::tuple>(s);
    Step out;
    if (step[0].cast<std::string>() == "cuda") {
      out.cuda = parse_cuda(step);
    } else {
      out.python = parse_python(step);
      plan->python_steps = true;
    }
    plan->steps.push_back(std::move(out));
  }
  for (py::handle r : t[3]) plan->returns.push_back(parse_view(r));
  if (t.size() > 4) {  // (..., pinned, stream)
    for (py::handle p : t[4]) {
      TORCH_CHECK(THPVariable_Check(p.ptr()), "flaggems: a pinned state buffer must be a tensor");
      plan->pinned.push_back(THPVariable_Unpack(p.ptr()));
    }
    plan->stream = t[5].cast<int64_t>();
  }
  return plan;
}

// The backward op ``name`` of this registry, made on first use from (name, schema, entry, planner).
std::shared_ptr<OpState> backward_op(OpState& st, py::tuple b) {
  TORCH_CHECK(st.backwards, "flaggems: ", st.name, " cannot make backward ops");
  const std::string name = b[0].cast<std::string>();
  std::lock_guard<std::mutex> guard(st.backwards->lock);
  auto found = st.backwards->ops.find(name);
  if (found != st.backwards->ops.end()) return found->second;
  auto op = std::make_shared<OpState>(name, torch::jit::parseSchema(b[1].cast<std::string>()),
                                      py::reinterpret_borrow<py::object>(b[2]),
                                      py::reinterpret_borrow<py::object>(b[3]), st.budget, nullptr);
  st.backwards->ops.emplace(name, op);
  return op;
}

// ("grad", i) | ("saved", j) | ("const", value) | ("needs",); a constant typed as ``type`` (or inferred).
ArgItem parse_item(py::handle h, const c10::TypePtr& type) {
  py::tuple t = py::reinterpret_borrow<py::tuple>(h);
  const std::string kind = t[0].cast<std::string>();
  if (kind == "grad") return {ArgItem::kGrad, t[1].cast<int32_t>(), {}};
  if (kind == "saved") return {ArgItem::kSaved, t[1].cast<int32_t>(), {}};
  if (kind == "needs") return {ArgItem::kNeeds, 0, {}};
  TORCH_CHECK(kind == "const", "flaggems: unknown backward argument ", kind);
  if (type) return {ArgItem::kConst, 0, torch::jit::toIValue(t[1], type)};
  py::handle v = t[1];  // an extra constant: None or a Python number
  if (v.is_none()) return {ArgItem::kConst, 0, c10::IValue()};
  if (py::isinstance<py::bool_>(v)) return {ArgItem::kConst, 0, c10::IValue(v.cast<bool>())};
  if (py::isinstance<py::int_>(v)) return {ArgItem::kConst, 0, c10::IValue(v.cast<int64_t>())};
  TORCH_CHECK(py::isinstance<py::float_>(v), "flaggems: an extra backward constant must be None, bool, int or float");
  return {ArgItem::kConst, 0, c10::IValue(v.cast<double>())};
}

std::shared_ptr<const Plan> parse_autograd(py::tuple t, OpState& st) {
  // ("autograd", forward, num_outputs, slots, saved, (name, schema, entry, planner), args, double_backward, extra)
  auto spec = std::make_shared<AutogradSpec>();
  spec->forward = parse_replay(t[1].cast<py::tuple>());
  spec->num_outputs = t[2].cast<size_t>();
  TORCH_CHECK(spec->num_outputs <= spec->forward->returns.size(), "flaggems: more outputs than forward returns");
  for (py::handle i : t[3]) spec->slots.push_back(i.cast<int32_t>());
  for (py::handle item : t[4]) {
    py::tuple pair = py::reinterpret_borrow<py::tuple>(item);
    spec->saved.emplace_back(static_cast<Source>(pair[0].cast<int>()), pair[1].cast<int32_t>());
  }
  spec->backward = backward_op(st, t[5].cast<py::tuple>());
  const auto& arguments = spec->backward->schema.arguments();
  py::tuple args = t[6].cast<py::tuple>();
  TORCH_CHECK(args.size() == arguments.size(), "flaggems: backward ", spec->backward->name, " takes ",
              arguments.size(), " arguments, the plan gives ", args.size());
  for (size_t i = 0; i < args.size(); ++i) spec->args.push_back(parse_item(args[i], arguments[i].real_type()));
  spec->double_backward = py::reinterpret_borrow<py::object>(t[7]);
  for (py::handle item : t[8]) spec->extra.push_back(parse_item(item, nullptr));
  auto plan = std::make_shared<Plan>();
  plan->kind = PlanKind::kAutograd;
  plan->autograd = std::move(spec);
  return plan;
}

// The plan records are defined once, in Python: flaggems/toolkit/plans.py (named tuples, read here by
// position; tests/test_plans.py pins their field order).
std::shared_ptr<const Plan> parse_plan(py::handle spec, OpState& st) {
  auto plan = std::make_shared<Plan>();
  py::tuple t = py::reinterpret_borrow<py::tuple>(spec);
  const std::string kind = t[0].cast<std::string>();
  if (kind == "native") {
    plan->kind = st.op ? PlanKind::kNative : PlanKind::kPython;  // a backward op's fallback is its entry
    return plan;
  }
  if (kind == "python") {
    plan->kind = PlanKind::kPython;
    return plan;
  }
  if (kind == "autograd") return parse_autograd(t, st);
  TORCH_CHECK(kind == "replay", "flaggems: unknown plan kind ", kind);
  return parse_replay(t);
}

// ---------------------------------------------------------------- the kernel
py::object call_python(OpState& st, py::handle fn, const std::vector<at::Tensor>* inputs, torch::jit::Stack* stack,
                       size_t num_args);
void push_result(OpState& st, torch::jit::Stack* stack, size_t num_args, const py::object& result);

void call_native(OpState& st, torch::jit::Stack* stack) {
  if (st.op) {
    st.native->callBoxed(*st.op, st.native_keys, stack);
    return;
  }
  py::gil_scoped_acquire gil;  // a backward op has no native kernel: its Python entry serves
  st.stats.python.fetch_add(1, std::memory_order_relaxed);
  const size_t num_args = st.schema.arguments().size();
  py::object result = call_python(st, st.entry, nullptr, stack, num_args);
  push_result(st, stack, num_args, result);
}

// One argument as the Python kernel of torch.library receives it: dtypes,
// layouts and memory formats as torch objects, wrapped numbers as Python numbers.
py::object argument_to_python(const c10::Argument& arg, const c10::IValue& value) {
  if (value.isNone()) return py::none();
  auto kind = arg.real_type()->kind();
  if (kind == c10::OptionalType::Kind) kind = arg.real_type()->castRaw<c10::OptionalType>()->getElementType()->kind();
  if (kind == c10::ScalarTypeType::Kind) {
    return py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(value.toInt()))));
  }
  if (kind == c10::LayoutType::Kind) {
    return py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(value.toInt()))));
  }
  if (kind == c10::MemoryFormatType::Kind) {
    return py::reinterpret_borrow<py::object>(
        torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(value.toInt())));
  }
  return torch::jit::toPyObject(value);
}

bool is_default(const c10::Argument& arg, const c10::IValue& value) {
  return arg.default_value().has_value() && *arg.default_value() == value;
}

// The stack's arguments as ``(args, kwargs)``: keyword-only ones by name, trailing
// defaulted ones left out (as torch.library's Python kernels receive them).
std::pair<py::tuple, py::dict> python_arguments(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                                                size_t num_args) {
  const auto& specs = schema.arguments();
  const c10::IValue* values = stack.data() + (stack.size() - num_args);
  size_t kwarg_start = num_args;
  while (kwarg_start > 0 && specs[kwarg_start - 1].kwarg_only()) --kwarg_start;
  size_t positional = kwarg_start;
  while (positional > 0 && is_default(specs[positional - 1], values[positional - 1])) --positional;
  py::tuple args(positional);
  for (size_t i = 0; i < positional; ++i) args[i] = argument_to_python(specs[i], values[i]);
  py::dict kwargs;
  for (size_t i = kwarg_start; i < num_args; ++i) {
    if (!is_default(specs[i], values[i])) kwargs[py::str(specs[i].name())] = argument_to_python(specs[i], values[i]);
  }
  return {std::move(args), std::move(kwargs)};
}

// Calls ``fn(*args, **kwargs)``, or the planner ``fn(args, kwargs, inputs)``; returns what it returned.
py::object call_python(OpState& st, py::handle fn, const std::vector<at::Tensor>* inputs, torch::jit::Stack* stack,
                       size_t num_args) {
  auto [args, kwargs] = python_arguments(st.schema, *stack, num_args);
  try {
    if (inputs == nullptr) return fn(*args, **kwargs);
    py::tuple py_inputs(inputs->size());
    for (size_t i = 0; i < inputs->size(); ++i) {
      py_inputs[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap((*inputs)[i]));
    }
    return fn(args, kwargs, py_inputs);
  } catch (py::error_already_set& e) {
    rethrow_python(e);
  }
}

void push_result(OpState& st, torch::jit::Stack* stack, size_t num_args, const py::object& result) {
  torch::jit::drop(*stack, num_args);
  const auto& returns = st.schema.returns();
  if (returns.size() == 1) {
    stack->push_back(torch::jit::toIValue(result, returns[0].real_type()));
    return;
  }
  py::sequence outs = result.cast<py::sequence>();
  TORCH_CHECK(outs.size() == returns.size(), "flaggems: ", st.name, " returned ", outs.size(), " values, expected ",
              returns.size());
  for (size_t i = 0; i < returns.size(); ++i) stack->push_back(torch::jit::toIValue(outs[i], returns[i].real_type()));
}

void store(OpState& st, std::vector<int64_t>&& key, std::shared_ptr<const Plan> plan) {
  decltype(st.plans) dropped;
  {
    std::unique_lock<std::shared_mutex> guard(st.lock);
    if (st.plans.size() >= st.budget.capacity) {
      dropped.swap(st.plans);
      st.stats.evicted.fetch_add(static_cast<int64_t>(dropped.size()), std::memory_order_relaxed);
    }
    st.plans.emplace(std::move(key), std::move(plan));
  }
}

void serve(OpState& st, torch::jit::Stack* stack);

std::shared_ptr<const Plan> find_plan(OpState& st, const std::vector<int64_t>& key) {
  std::shared_lock<std::shared_mutex> guard(st.lock);
  auto found = st.plans.find(key);
  return found != st.plans.end() ? found->second : nullptr;
}

// Notes a plan serving a call: the first time, it counts as reused.
void note_hit(OpState& st, const Plan& plan) {
  if (!plan.reused.load(std::memory_order_relaxed) && !plan.reused.exchange(true, std::memory_order_relaxed)) {
    st.stats.reused.fetch_add(1, std::memory_order_relaxed);
  }
}

// Whether this miss calls the planner (see PlanBudget): keys that never come back (a shape new at every
// call) would pay the planner each time; the periodic retry lets a workload that settles be planned again.
bool may_plan(OpState& st) {
  const int64_t made = st.stats.miss.load(std::memory_order_relaxed);
  if (made < st.budget.free_misses || 2 * st.stats.reused.load(std::memory_order_relaxed) >= made) return true;
  return (st.stats.skips.fetch_add(1, std::memory_order_relaxed) + 1) % st.budget.retry_every == 0;
}

// The plan of a call being served, for its autograd node (saved as a capsule in the node's context).
struct PlanHolder : torch::CustomClassHolder {
  explicit PlanHolder(std::shared_ptr<const Plan> p) : plan(std::move(p)) {}
  std::shared_ptr<const Plan> plan;
};

struct AutogradCall {
  std::shared_ptr<const Plan> plan;
  const std::vector<at::Tensor>* inputs;
};

c10::IValue argument(const ArgItem& item, const torch::autograd::variable_list& grads,
                     const torch::autograd::variable_list& saved, const c10::List<bool>& needs) {
  switch (item.kind) {
    case ArgItem::kGrad:
      return grads[item.index];
    case ArgItem::kSaved:
      return saved[item.index];
    case ArgItem::kNeeds:
      return needs;
    case ArgItem::kConst:
      break;
  }
  return item.value;
}

torch::autograd::variable_list tensors_of(const py::object& result, size_t count, const std::string& name) {
  py::sequence seq = result.cast<py::sequence>();
  TORCH_CHECK(seq.size() == count, "flaggems: ", name, " returned ", seq.size(), " gradients, expected ", count);
  torch::autograd::variable_list out;
  for (py::handle g : seq) out.push_back(g.is_none() ? at::Tensor() : THPVariable_Unpack(g.ptr()));
  return out;
}

// torch's C++ custom-function machinery: edges, saved-variable version checks, materialised
// gradients, needs_input_grad. Only the forward replay and the backward call are ours.
struct FlaggemsFunction : public torch::autograd::Function<FlaggemsFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const AutogradCall& call,
                                                at::TensorList /*differentiable*/) {
    const AutogradSpec& spec = *call.plan->autograd;
    PhaseClock clock;
    std::vector<at::Tensor> results = run_plan(*spec.forward, refs_of(*call.inputs), clock, spec.backward->stats);
    torch::autograd::variable_list to_save;
    for (const auto& [source, index] : spec.saved) {
      to_save.push_back(source == Source::kInput ? (*call.inputs)[index] : results[index]);
    }
    ctx->save_for_backward(std::move(to_save));
    ctx->saved_data["plan"] = c10::IValue::make_capsule(c10::make_intrusive<PlanHolder>(call.plan));
    results.resize(spec.num_outputs);
    return results;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto holder = c10::static_intrusive_pointer_cast<PlanHolder>(ctx->saved_data["plan"].toCapsule());
    const AutogradSpec& spec = *holder->plan->autograd;
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    c10::List<bool> needs;
    size_t edge = 0;
    for (int32_t slot : spec.slots) needs.push_back(slot >= 0 && ctx->needs_input_grad(edge++));
    torch::jit::Stack stack;
    for (const ArgItem& item : spec.args) stack.push_back(argument(item, grads, saved, needs));
    const size_t count = spec.slots.size();
    torch::autograd::variable_list found;
    if (at::GradMode::is_enabled()) {  // create_graph: a differentiable backward, in Python
      py::gil_scoped_acquire gil;
      py::tuple args(stack.size() + spec.extra.size());
      for (size_t i = 0; i < stack.size(); ++i) args[i] = torch::jit::toPyObject(stack[i]);
      for (size_t i = 0; i < spec.extra.size(); ++i) {
        args[stack.size() + i] = torch::jit::toPyObject(argument(spec.extra[i], grads, saved, needs));
      }
      try {
        found = tensors_of(spec.double_backward(*args), count, spec.backward->name);
      } catch (py::error_already_set& e) {
        rethrow_python(e);
      }
    } else {
      serve(*spec.backward, &stack);
      TORCH_CHECK(stack.size() == count, "flaggems: ", spec.backward->name, " returned ", stack.size(),
                  " values, expected ", count);
      for (c10::IValue& v : stack) found.push_back(v.isNone() ? at::Tensor() : std::move(v).toTensor());
    }
    torch::autograd::variable_list out{at::Tensor()};  // the AutogradCall argument
    for (size_t k = 0; k < count; ++k) {
      if (spec.slots[k] >= 0) out.push_back(needs[k] ? found[k] : at::Tensor());
    }
    return out;
  }
};

void serve_autograd(const std::shared_ptr<const Plan>& plan, const std::vector<at::Tensor>& inputs,
                    torch::jit::Stack* stack, size_t num_args) {
  std::vector<at::Tensor> differentiable;
  for (int32_t slot : plan->autograd->slots) {
    if (slot >= 0) differentiable.push_back(inputs[slot]);
  }
  AutogradCall call{plan, &inputs};
  torch::autograd::variable_list outputs = FlaggemsFunction::apply(call, at::TensorList(differentiable));
  torch::jit::drop(*stack, num_args);
  for (at::Tensor& out : outputs) stack->emplace_back(std::move(out));
}

// Serves one call of ``st`` on ``stack`` (its arguments in, its results out).
void serve(OpState& st, torch::jit::Stack* stack) {
  const size_t num_args = st.schema.arguments().size();
  if (native_depth > 0 || is_busy(&st)) {
    call_native(st, stack);
    return;
  }
  PhaseClock clock;
  thread_local std::vector<int64_t> key;
  thread_local std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  std::vector<at::Tensor> inputs;
  key.clear();
  ranges.clear();
  Keyed keying = Keyed::kYes;
  if (st.grad_sensitive) {
    key.push_back(kTagGrad);
    key.push_back(at::GradMode::is_enabled());
  }
  for (auto it = stack->end() - num_args; it != stack->end() && keying == Keyed::kYes; ++it) {
    keying = add_ivalue(key, *it, inputs, ranges, st.grad_sensitive);
  }
  if (keying == Keyed::kUnservable) {
    st.stats.unservable.fetch_add(1, std::memory_order_relaxed);
    call_native(st, stack);
    return;
  }
  const bool keyed = keying == Keyed::kYes;
  clock.lap(st.stats.key_ns);
  std::shared_ptr<const Plan> plan = keyed ? find_plan(st, key) : nullptr;
  clock.lap(st.stats.lookup_ns);
  if (plan) note_hit(st, *plan);
  if (plan && !on_plan_stream(*plan, inputs)) {
    py::gil_scoped_acquire gil;  // another stream than the plan's state serves: the Python path, uncached
    st.stats.python.fetch_add(1, std::memory_order_relaxed);
    py::object result = call_python(st, st.entry, nullptr, stack, num_args);
    push_result(st, stack, num_args, result);
    return;
  }
  if (plan) {
    switch (plan->kind) {
      case PlanKind::kReplay:
        st.stats.replay.fetch_add(1, std::memory_order_relaxed);
        replay(*plan, inputs, stack, num_args, clock, st.stats);
        inputs.clear();
        plan.reset();
        clock.lap(st.stats.finish_ns);
        if (clock.on) st.stats.profiled.fetch_add(1, std::memory_order_relaxed);
        return;
      case PlanKind::kNative:
        st.stats.native.fetch_add(1, std::memory_order_relaxed);
        call_native(st, stack);
        return;
      case PlanKind::kAutograd:
        st.stats.replay.fetch_add(1, std::memory_order_relaxed);
        serve_autograd(plan, inputs, stack, num_args);
        return;
      case PlanKind::kPython:
        break;
    }
  }
  py::gil_scoped_acquire gil;
  if (plan || !keyed) {
    (plan ? st.stats.python : st.stats.uncached).fetch_add(1, std::memory_order_relaxed);
    py::object result = call_python(st, st.entry, nullptr, stack, num_args);
    push_result(st, stack, num_args, result);
    return;
  }
  if (!may_plan(st)) {
    st.stats.unplanned.fetch_add(1, std::memory_order_relaxed);
    py::object result = call_python(st, st.entry, nullptr, stack, num_args);
    push_result(st, stack, num_args, result);
    return;
  }
  st.stats.miss.fetch_add(1, std::memory_order_relaxed);
  std::vector<int64_t> miss_key = key;  // the planner may re-enter (other ops) and reuse the buffer
  py::object answer;
  {
    BusyGuard busy(&st);
    answer = call_python(st, st.planner, &inputs, stack, num_args);
  }
  py::tuple pair = answer.cast<py::tuple>();
  if (!pair[1].is_none()) {
    std::shared_ptr<const Plan> made;
    try {
      made = parse_plan(pair[1], st);
    } catch (const std::exception& e) {
      st.stats.rejected.fetch_add(1, std::memory_order_relaxed);  // a malformed plan: the call stays served
      TORCH_CHECK(!st.budget.strict, "flaggems: the planner of ", st.name, " returned a malformed plan (",
                  e.what(), "); FLAGGEMS_STRICT makes this an error");
    }
    if (made) store(st, std::move(miss_key), std::move(made));
  }
  push_result(st, stack, num_args, py::reinterpret_borrow<py::object>(pair[0]));
}

// ---------------------------------------------------------------- slots
// One registration of one op on one dispatch key, made the first time an enable() routes the op there and
// kept for the process: enable() points it at that enable's OpState, disable() at none, and then the kernel
// it covers serves. torch's dispatcher is not safe against registering or removing a kernel while another
// thread calls the op (a toggling thread crashed six calling ones within 20 s), so enable() and disable()
// never do either after the first time; release() removes every registration, on request.
struct Slot {
  c10::OperatorHandle op;
  c10::DispatchKey key;
  c10::SafeKernelFunction below;   // the kernel this registration covers (captured before it is made)
  std::shared_ptr<OpState> state;  // read and written through std::atomic_load / std::atomic_store only
  std::unique_ptr<torch::Library> library;
  bool typed = false;

  std::shared_ptr<OpState> current() const { return std::atomic_load_explicit(&state, std::memory_order_acquire); }
  void call_below(torch::jit::Stack* stack) const { below.callBoxed(op, c10::DispatchKeySet(key), stack); }
};

class Entry final : public c10::OperatorKernel {
 public:
  explicit Entry(Slot* slot) : slot_(slot) {}

  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const std::shared_ptr<OpState> state = slot_->current();
    if (state) {
      serve(*state, stack);
    } else {
      slot_->call_below(stack);
    }
  }

 private:
  Slot* slot_;  // slots live as long as the process
};

// ---------------------------------------------------------------- typed entries
// A kernel the dispatcher calls unboxed, for the C++ signatures the routed small ops have. Boxing costs
// a stack and a reference per tensor argument, and a tensor whose count goes 1 -> 2 takes the GIL to
// keep its Python object alive (torch >= 2.10), both ways: about 0.35 µs of a 3 µs call on the CI host.
// The typed entry keys the arguments where they are and replays a plain replay plan; anything else (a
// miss, a non-replay plan, state buffers, a re-entrant call) is boxed and served as above.

// The key terms add_ivalue writes for the boxed form of each argument type (enums are boxed as ints).
struct TypedKey {
  std::vector<int64_t>& key;
  Ranges& ranges;
  InputRefs& inputs;
  bool ok = true;

  void operator()(const at::Tensor& t) {
    if (ok && (ok = key_tensor(key, t, ranges, false) == Keyed::kYes) && t.defined()) inputs.push_back(&t);
  }
  void operator()(int64_t v) { key_int(key, v); }
  void operator()(bool v) { key_bool(key, v); }
  void operator()(double v) { key_double(key, v); }
  void operator()(at::ScalarType v) { key_int(key, static_cast<int64_t>(v)); }
  void operator()(at::Layout v) { key_int(key, static_cast<int64_t>(v)); }
  void operator()(at::MemoryFormat v) { key_int(key, static_cast<int64_t>(v)); }
  void operator()(at::Device d) { key_device(key, d); }
  template <class T>
  void operator()(const std::optional<T>& v) {
    if (v.has_value()) {
      (*this)(*v);
    } else {
      key.push_back(kTagNone);
    }
  }
};

// The plan a typed call may replay itself: a plain replay whose returns its return type can carry.
template <class Ret>
bool typed_replayable(const Plan& plan) {
  if (plan.kind != PlanKind::kReplay || !plan.pinned.empty() || plan.returns.size() != 1) return false;
  if constexpr (std::is_same_v<Ret, at::Tensor&>) {  // in place: the result is the first argument itself
    const ViewSpec& r = plan.returns[0];
    return r.source == Source::kInput && r.index == 0 && r.as_is;
  }
  return true;
}

// Boxes a typed call and runs ``call`` on its stack (the boxed entry, or the kernel a slot covers).
template <class Ret, class Call, class... Args>
Ret call_boxed(const std::string& name, Call&& call, Args... args) {
  torch::jit::Stack stack;
  stack.reserve(sizeof...(Args));
  torch::jit::push(stack, args...);
  call(&stack);
  if constexpr (std::is_same_v<Ret, at::Tensor&>) {
    return std::get<0>(std::forward_as_tuple(args...));  // what the dispatcher's own boxing returns
  } else {
    TORCH_CHECK(stack.size() == 1, "flaggems: ", name, " returned ", stack.size(), " values, expected 1");
    return std::move(stack.back()).toTensor();
  }
}

template <class Ret, class... Args>
Ret serve_boxed(OpState& st, Args... args) {
  return call_boxed<Ret>(st.name, [&st](torch::jit::Stack* stack) { serve(st, stack); }, args...);
}

template <class Ret, class... Args>
Ret serve_typed(OpState& st, Args... args) {
  if (native_depth == 0 && !is_busy(&st)) {
    PhaseClock clock;
    thread_local std::vector<int64_t> key;  // free again once the plan is found (before any launch)
    thread_local Ranges ranges;
    key.clear();
    ranges.clear();
    InputRefs inputs;
    TypedKey keyer{key, ranges, inputs};
    (keyer(args), ...);
    clock.lap(st.stats.key_ns);
    std::shared_ptr<const Plan> plan = keyer.ok ? find_plan(st, key) : nullptr;
    clock.lap(st.stats.lookup_ns);
    if (plan && typed_replayable<Ret>(*plan)) {
      note_hit(st, *plan);
      st.stats.replay.fetch_add(1, std::memory_order_relaxed);
      st.stats.typed.fetch_add(1, std::memory_order_relaxed);
      std::vector<at::Tensor> allocs = execute(*plan, inputs, clock, st.stats);
      if constexpr (std::is_same_v<Ret, at::Tensor&>) {
        clock.lap(st.stats.finish_ns);
        if (clock.on) st.stats.profiled.fetch_add(1, std::memory_order_relaxed);
        return std::get<0>(std::forward_as_tuple(args...));
      } else {
        at::Tensor result = view_of(plan->returns[0], Operands{inputs, allocs, plan->pinned});
        allocs.clear();
        plan.reset();
        clock.lap(st.stats.finish_ns);
        if (clock.on) st.stats.profiled.fetch_add(1, std::memory_order_relaxed);
        return result;
      }
    }
  }
  return serve_boxed<Ret, Args...>(st, args...);
}

template <class Ret, class... Args>
torch::CppFunction typed_kernel(Slot* slot, Ret (*)(Args...)) {
  return torch::CppFunction([slot](Args... args) -> Ret {
    const std::shared_ptr<OpState> state = slot->current();
    if (state) return serve_typed<Ret, Args...>(*state, args...);
    return call_boxed<Ret>(slot->op.schema().name(), [slot](torch::jit::Stack* stack) { slot->call_below(stack); },
                           args...);
  });
}

// The signatures served typed (copy_, _to_copy, index_copy_, index_copy, index_select): the dispatcher
// checks a kernel's schema and C++ signature when it is registered, so an op matching none is boxed.
using CopyInPlace = at::Tensor&(at::Tensor&, const at::Tensor&, bool);
using ToCopy = at::Tensor(const at::Tensor&, std::optional<at::ScalarType>, std::optional<at::Layout>,
                          std::optional<at::Device>, std::optional<bool>, bool, std::optional<at::MemoryFormat>);
using IndexCopyInPlace = at::Tensor&(at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&);
using IndexCopy = at::Tensor(const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&);
using IndexSelect = at::Tensor(const at::Tensor&, int64_t, const at::Tensor&);

// "arg,arg,...->return": argument types, "!" on those written in place (the C++ reference is mutable).
std::string signature_of(const c10::FunctionSchema& schema) {
  std::string out;
  for (const c10::Argument& a : schema.arguments()) {
    if (!out.empty()) out += ",";
    out += a.real_type()->str();
    if (a.alias_info() && a.alias_info()->isWrite()) out += "!";
  }
  out += "->";
  if (schema.returns().size() == 1) out += schema.returns()[0].real_type()->str();
  return out;
}

// The typed kernel for the op's signature, or nothing (the boxed entry serves it).
std::optional<torch::CppFunction> typed_for(Slot* slot, bool grad_sensitive) {
  if (grad_sensitive) return std::nullopt;  // grad mode is part of those keys: the boxed entry keys it
  const std::string type = signature_of(slot->op.schema());
  if (type == "Tensor!,Tensor,bool->Tensor") return typed_kernel(slot, static_cast<CopyInPlace*>(nullptr));
  if (type == "Tensor,ScalarType?,Layout?,Device?,bool?,bool,MemoryFormat?->Tensor") {
    return typed_kernel(slot, static_cast<ToCopy*>(nullptr));
  }
  if (type == "Tensor!,int,Tensor,Tensor->Tensor") return typed_kernel(slot, static_cast<IndexCopyInPlace*>(nullptr));
  if (type == "Tensor,int,Tensor,Tensor->Tensor") return typed_kernel(slot, static_cast<IndexCopy*>(nullptr));
  if (type == "Tensor,int,Tensor->Tensor") return typed_kernel(slot, static_cast<IndexSelect*>(nullptr));
  return std::nullopt;
}

// ---------------------------------------------------------------- registrations
struct SilentWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// Every slot made in this process, by "aten::name.overload@Key"; a slot is never freed (a call in flight
// may hold it), only its registration is removed by release().
std::mutex slots_lock;
std::unordered_map<std::string, std::unique_ptr<Slot>> slots;

// The slot of ``op`` on ``key``; a new one (or one released) captures the kernel it will cover now, before
// anything of this registry is registered.
Slot& slot_for(const c10::OperatorHandle& op, const std::string& full, c10::DispatchKey key,
               const std::string& key_name) {
  std::lock_guard<std::mutex> guard(slots_lock);
  std::unique_ptr<Slot>& slot = slots[full + "@" + key_name];
  if (!slot) {
    slot.reset(new Slot{op, key, op.getComputedKernelForDispatchKey(key), nullptr, nullptr, false});
  } else if (!slot->library) {
    slot->below = op.getComputedKernelForDispatchKey(key);
  }
  return *slot;
}

// Registers a slot's kernel with the dispatcher (once: the first enable() routing the op on that key).
void register_slot(Slot& slot, const std::string& full, bool grad_sensitive) {
  SilentWarnings silent;  // torch warns once per override of a C++ kernel: that is the point here
  c10::WarningUtils::WarningHandlerGuard guard(&silent);
  const std::string ns = full.substr(0, full.find("::"));  // "aten", or "flaggems" for flaggems' own ops
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, slot.key, __FILE__, __LINE__);
  bool typed = false;
  if (auto kernel = typed_for(&slot, grad_sensitive)) {
    try {
      lib->impl(full.c_str(), std::move(*kernel));
      typed = true;
    } catch (const c10::Error&) {  // a schema or C++ signature the dispatcher does not take: boxed
    }
  }
  if (!typed) lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Entry>(&slot)));
  slot.typed = typed;
  slot.library = std::move(lib);
}

// Removes every registration of every slot (``flaggems.release()``): the dispatcher's own kernels serve again.
// Unlike disable(), this changes the dispatcher's tables: no other thread may be calling torch ops.
void release_slots() {
  std::lock_guard<std::mutex> guard(slots_lock);
  for (auto& [name, slot] : slots) {
    std::atomic_store_explicit(&slot->state, std::shared_ptr<OpState>(), std::memory_order_release);
    slot->library.reset();
    slot->typed = false;
  }
}

class Registry {
 public:
  // Captures the native kernels now (before any override of this registry).
  void add(const std::string& name, const std::string& overload, const std::string& key_name, py::object entry,
           py::object planner, size_t capacity, int64_t free_misses, int64_t retry_every, bool strict) {
    TORCH_CHECK(capacity > 0 && free_misses >= 0 && retry_every > 0, "flaggems: bad plan budget");
    const auto key = c10::parseDispatchKey(key_name);
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const bool grad = key_name.rfind("Autograd", 0) == 0;
    const std::string full = overload.empty() ? name : name + "." + overload;
    Slot& slot = slot_for(handle, full, key, key_name);
    auto state = std::make_shared<OpState>(full, handle, slot.below, key, std::move(entry), std::move(planner), grad,
                                           PlanBudget{capacity, free_misses, retry_every, strict}, backwards_);
    pending_.push_back({state, &slot});
    states_[full + "@" + key_name] = state;
  }

  // Points every slot of this registry at its state (registering the slots new to the dispatcher).
  void register_all() {
    for (auto& [state, slot] : pending_) {
      if (!slot->library) register_slot(*slot, state->name, state->grad_sensitive);
      state->typed = slot->typed;
      std::atomic_store_explicit(&slot->state, state, std::memory_order_release);
      active_.emplace_back(slot, state);
    }
    pending_.clear();
  }

  // Switches this registry's slots off (those still pointing at its states): the kernels they cover serve.
  void unregister_all() {
    for (auto& [slot, state] : active_) {
      std::shared_ptr<OpState> expected = state;
      std::atomic_compare_exchange_strong(&slot->state, &expected, std::shared_ptr<OpState>());
    }
    active_.clear();
    pending_.clear();
  }

  void clear_plans() {
    for (auto& [name, state] : all_states()) {
      decltype(state->plans) dropped;
      std::unique_lock<std::shared_mutex> guard(state->lock);
      dropped.swap(state->plans);
    }
  }

  // Every op state: the registered ones, then the backward ops made so far (named "<name>@backward").
  std::vector<std::pair<std::string, std::shared_ptr<OpState>>> all_states() {
    std::vector<std::pair<std::string, std::shared_ptr<OpState>>> out(states_.begin(), states_.end());
    std::lock_guard<std::mutex> guard(backwards_->lock);
    for (auto& [name, state] : backwards_->ops) out.emplace_back(name + "@backward", state);
    return out;
  }

  py::dict stats() {
    py::dict out;
    for (auto& [name, state] : all_states()) {
      size_t size;
      {
        std::shared_lock<std::shared_mutex> guard(state->lock);
        size = state->plans.size();
      }
      const Stats& s = state->stats;
      py::dict row;
      row["plans"] = size;
      row["replay"] = s.replay.load();
      row["native"] = s.native.load();
      row["python"] = s.python.load();
      row["miss"] = s.miss.load();
      row["uncached"] = s.uncached.load();
      row["evicted"] = s.evicted.load();
      row["rejected"] = s.rejected.load();
      row["reused"] = s.reused.load();
      row["unplanned"] = s.unplanned.load();
      row["typed"] = state->typed;
      row["typed_replay"] = s.typed.load();
      row["unservable"] = s.unservable.load();
      if (s.profiled.load() > 0) {
        py::dict phases;
        const double calls = static_cast<double>(s.profiled.load());
        phases["calls"] = s.profiled.load();
        phases["key_us"] = s.key_ns.load() / calls / 1e3;
        phases["lookup_us"] = s.lookup_ns.load() / calls / 1e3;
        phases["alloc_us"] = s.alloc_ns.load() / calls / 1e3;
        phases["launch_us"] = s.launch_ns.load() / calls / 1e3;
        phases["finish_us"] = s.finish_ns.load() / calls / 1e3;
        row["phases"] = phases;
      }
      out[py::str(name)] = row;
    }
    return out;
  }

  ~Registry() { unregister_all(); }

 private:
  std::vector<std::pair<std::shared_ptr<OpState>, Slot*>> pending_;
  std::vector<std::pair<Slot*, std::shared_ptr<OpState>>> active_;
  std::unordered_map<std::string, std::shared_ptr<OpState>> states_;
  std::shared_ptr<BackwardOps> backwards_ = std::make_shared<BackwardOps>();
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flaggems' compiled dispatcher entry (plan cache under the Python planner)";
  py::class_<Registry>(m, "Registry")
      .def(py::init<>())
      .def("add", &Registry::add, py::arg("name"), py::arg("overload"), py::arg("key"), py::arg("entry"),
           py::arg("planner"), py::arg("capacity"), py::arg("free_misses"), py::arg("retry_every"),
           py::arg("strict") = false)
      .def("register_all", &Registry::register_all)
      .def("unregister_all", &Registry::unregister_all)
      .def("clear_plans", &Registry::clear_plans)
      .def("stats", &Registry::stats);
  m.def("set_profiling", [](bool on) { profiling.store(on); },
        "Time the phases of replayed calls (key, lookup, alloc, launch, finish) into stats()['phases'].");
  m.def("release", &release_slots,
        "Remove every registration from the dispatcher (unsafe while other threads call torch ops).");
  m.def("native_enter", [] { ++native_depth; });
  m.def("native_exit", [] { --native_depth; });
  m.def("driver", [] { return py::make_tuple(driver().launch != nullptr, driver().reason); });
}
