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
// may return a plan; a miss whose layout class has a generic plan (one replay
// computed from the call's sizes, entry_generic.inc) is served from it without
// Python. No op semantics live here: the planner decides them all.
//
// One translation unit in parts: each entry_<part>.inc below is a section of
// it, included in order inside the anonymous namespace (not a standalone
// header); the module's Python bindings are here at the end. The plan records
// are Python's (flaggems/toolkit/plans.py): their fields are read where the
// layout Python hands over says (entry_layout.inc), never at fixed positions.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
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

#include <algorithm>
#include <array>
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

#include "entry_driver.inc"  // CUDA driver
#include "entry_plans.inc"  // plans
#include "entry_layout.inc"  // the plan layout (the records' fields, from Python)
#include "entry_keys.inc"  // keys
#include "entry_state.inc"  // per-op state
#include "entry_replay.inc"  // replay
#include "entry_specs.inc"  // plan specs from Python
#include "entry_generic.inc"  // plans generic over sizes
#include "entry_describe.inc"  // plans described (debugging, tests)
#include "entry_kernel.inc"  // the kernel
#include "entry_slots.inc"  // slots
#include "entry_typed.inc"  // typed entries
#include "entry_registry.inc"  // registrations

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
  m.def("set_layout", &set_layout, py::arg("fields"), py::arg("tags"),
        "Where the plan records' fields are ({record: {field: index}}) and their tags ({name: tag}): "
        "flaggems.toolkit.plans.field_layout() and TAGS. Raises naming a record, field or tag the entry reads "
        "and the layout lacks (the layout in force is then kept).");
  m.def("layout", &layout_given, "The layout in force, as set_layout took it: (fields, tags).");
  m.def("describe_plan", &describe_plan, py::arg("record"), py::arg("atoms") = py::none(), py::arg("routed") = true,
        "A plan record parsed as a miss parses it, described instead of stored (nothing is launched); a generic "
        "plan with the template's patches and guards, and its instance for ``atoms`` (None: a guard fails).");
  m.def("call_atoms", [](const std::vector<at::Tensor>& inputs) {
    std::vector<int64_t> atoms;
    call_atoms(refs_of(inputs), atoms);
    return atoms;
  }, "The atoms a generic plan computes from (flaggems.generalize.atoms must agree).");
}
