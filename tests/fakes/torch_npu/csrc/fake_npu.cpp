// A test-only PrivateUse1 device backed by host memory ("npu", one device).
//
// Tensors on it are real PrivateUse1 tensors: their own dispatch key, their own
// allocator (host memory whose DataPtr says PrivateUse1) and device guard. Every
// op without a kernel here runs through one boxed fallback: each PrivateUse1
// tensor argument is replaced by a CPU tensor over the same memory, the op's
// CPU kernel runs, and each result is mapped back: an argument returned (an
// in-place op) is returned as itself, a view of an argument's memory becomes a
// PrivateUse1 view of that storage, a fresh result is moved to the device
// unless the call asked for another device.

#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cstdlib>
#include <unordered_map>
#include <cstring>

namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
const c10::Device kDevice(kType, 0);

void release(void* p) { std::free(p); }

struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? std::calloc(n, 1) : nullptr;
    TORCH_CHECK(n == 0 || p != nullptr, "fake npu: out of memory");
    return {p, p, &release, kDevice};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dst, const void* src, std::size_t n) const override { std::memcpy(dst, src, n); }
};

HostAllocator allocator;

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device) const override { return kDevice; }
  c10::Device getDevice() const override { return kDevice; }
  void setDevice(c10::Device d) const override { TORCH_CHECK(d.index() <= 0, "fake npu: one device"); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, kDevice); }
  c10::Stream getDefaultStream(c10::Device) const override { return c10::Stream(c10::Stream::DEFAULT, kDevice); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, kDevice); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device>, std::optional<bool>,
                               std::optional<at::MemoryFormat> memory_format) {
  const c10::DispatchKeySet keys(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_generic(size, &allocator, keys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<at::Device>, std::optional<bool>) {
  const c10::DispatchKeySet keys(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_strided_generic(size, stride, &allocator, keys, c10::dtype_or_default(dtype));
}

// A device tensor viewing `storage` (no dispatch: the fallback must not re-enter itself).
at::Tensor device_view(const c10::Storage& storage, const at::Tensor& like) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                      like.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  return out;
}

using HostStorages = std::unordered_map<const c10::StorageImpl*, c10::Storage>;

// A CPU tensor over a device tensor's memory (same storage bytes, sizes, strides, offset). Tensors of one
// device storage get one host storage, so that torch's overlap checks see them alias.
at::Tensor host_alias(const at::Tensor& t, HostStorages& storages) {
  const c10::Storage& s = t.storage();
  auto found = storages.find(s.unsafeGetStorageImpl());
  if (found == storages.end()) {
    // Resizable: an out= kernel may grow its output; sync_back moves the grown memory to the device tensor.
    c10::Storage host(c10::Storage::use_byte_size_t(), s.nbytes(),
                      c10::DataPtr(s.mutable_data(), c10::Device(c10::kCPU)), c10::GetAllocator(c10::kCPU), true);
    found = storages.emplace(s.unsafeGetStorageImpl(), std::move(host)).first;
  }
  auto out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(found->second),
                                                      c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return out;
}

at::Tensor as_host(const at::Tensor& t, HostStorages& storages) {
  return t.device().type() == kType ? host_alias(t, storages) : t;
}

// torch's copy_ hands every copy touching this device to _copy_from: both sides as host memory (one host
// storage per device storage, so that the CPU copy's overlap checks still see an aliasing pair).
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  HostStorages storages;
  as_host(dst, storages).copy_(as_host(self, storages));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// set_ shares storage: done on the TensorImpl itself (the fallback's host alias would share nothing).
at::Tensor& set_storage(at::Tensor& self, c10::Storage source, c10::SymInt offset, c10::SymIntArrayRef size,
                        c10::SymIntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kType, "fake npu: set_ to a storage on ", source.device());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_sizes_and_strides(C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
                              offset.expect_int());
  return self;
}

at::Tensor& set_whole_storage(at::Tensor& self, c10::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  const c10::SymInt sizes[] = {n};
  const c10::SymInt strides[] = {1};
  return set_storage(self, std::move(source), 0, sizes, strides);
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(source.storage());
  impl->set_sizes_and_strides(source.sizes(), source.strides(), source.storage_offset());
  return self;
}

struct Arg {
  at::Tensor device;  // the caller's tensor
  at::Tensor host;    // its CPU alias
};

// A result of the CPU kernel as the device call returns it.
at::Tensor map_back(const at::Tensor& r, const std::vector<Arg>& args, bool keep_host) {
  if (!r.defined() || !r.device().is_cpu() || !r.has_storage()) return r;
  const void* base = r.storage().data();
  for (const Arg& a : args) {
    if (a.host.unsafeGetTensorImpl() == r.unsafeGetTensorImpl()) return a.device;  // an in-place op's self
  }
  for (const Arg& a : args) {
    if (base != nullptr && a.host.storage().data() == base) return device_view(a.device.storage(), r);  // a view
  }
  if (keep_host) return r;
  // A fresh result: the whole storage moves to the device (views keep their offset).
  auto storage = c10::Storage(c10::Storage::use_byte_size_t(), r.storage().nbytes(), &allocator, false);
  if (r.storage().nbytes()) std::memcpy(storage.mutable_data(), r.storage().data(), r.storage().nbytes());
  return device_view(storage, r);
}

c10::IValue to_host(const c10::IValue& v, std::vector<Arg>& args, HostStorages& storages) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.device().type() == kType) {
      args.push_back({t, host_alias(t, storages)});
      return args.back().host;
    }
    return v;
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor t : v.toTensorList()) out.push_back(to_host(t, args, storages).toTensor());
    return out;
  }
  if (v.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> out;
    for (const std::optional<at::Tensor> t : v.toOptionalTensorList()) {
      out.push_back(t.has_value() ? std::optional<at::Tensor>(to_host(*t, args, storages).toTensor()) : std::nullopt);
    }
    return out;
  }
  return v;
}

c10::IValue from_host(const c10::IValue& v, const std::vector<Arg>& args, bool keep_host) {
  if (v.isTensor()) return map_back(v.toTensor(), args, keep_host);
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor t : v.toTensorList()) out.push_back(map_back(t, args, keep_host));
    return out;
  }
  return v;
}

// An argument the CPU kernel resized (out= variants): the device tensor takes its memory and shape.
void sync_back(const Arg& a) {
  const c10::Storage& host = a.host.storage();
  c10::StorageImpl* device = a.device.storage().unsafeGetStorageImpl();
  if (host.data() != device->data() || host.nbytes() != device->nbytes()) {
    device->set_data_ptr_noswap(allocator.allocate(host.nbytes()));
    device->set_nbytes(host.nbytes());
    if (host.nbytes()) std::memcpy(device->mutable_data(), host.data(), host.nbytes());
  }
  if (a.host.sizes() != a.device.sizes() || a.host.strides() != a.device.strides() ||
      a.host.storage_offset() != a.device.storage_offset()) {
    a.device.unsafeGetTensorImpl()->set_sizes_and_strides(a.host.sizes(), a.host.strides(),
                                                          a.host.storage_offset());
  }
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  std::vector<Arg> args;
  HostStorages storages;
  bool other_device = false;  // the call names a device that is not this one (e.g. .cpu())
  for (size_t i = stack->size() - n; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isDevice() && v.toDevice().type() != kType) other_device = true;
    v = to_host(v, args, storages);
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  for (const Arg& a : args) sync_back(a);
  const size_t m = schema.returns().size();
  for (size_t i = stack->size() - m; i < stack->size(); ++i) (*stack)[i] = from_host((*stack)[i], args, other_device);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_whole_storage);
  m.impl("set_.source_Tensor", set_tensor);
  // Ops whose CompositeExplicitAutograd kernel would run on PrivateUse1 instead of the fallback, without
  // the CPU kernel's argument checks (group=0 divides by zero); an NPU backend has kernels of its own.
  for (const char* name : {"native_group_norm", "native_group_norm_backward"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "test-only PrivateUse1 device over host memory";
  m.def("register_allocator", [] { c10::SetAllocator(kType, &allocator); });
}
