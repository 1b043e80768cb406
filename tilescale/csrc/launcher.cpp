// Kernel launches learned once from TileLang's entry functions, made again from C++: a call
// allocates the op's outputs, writes its tensors' addresses (directly or into TMA descriptors)
// and its scalars into each kernel's learned parameter bytes and calls cuLaunchKernelEx for each
// (Program). What fills the learned bytes and which of them belong to which argument is
// tilescale/op_launch.py's work.
//
// No CUDA headers: the driver's few structures are laid out here (CUDA 12.4's) and its entry
// points looked up through cuGetProcAddress, so the same source builds against a CPU torch.
#include <torch/extension.h>

#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int kCudaVersion = 12040;
constexpr size_t kTensorMapBytes = 128;

struct LaunchAttribute {  // CUlaunchAttribute
  unsigned id;
  unsigned char pad[4];
  unsigned char value[64];
};

struct LaunchConfig {  // CUlaunchConfig
  unsigned grid[3];
  unsigned block[3];
  unsigned shared_bytes;
  void* stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};

using LaunchKernelEx = int (*)(const LaunchConfig*, void*, void**, void**);
using TensorMapReplaceAddress = int (*)(void*, void*);
using GetErrorString = int (*)(int, const char**);
using GetProcAddress = int (*)(const char*, void**, int, uint64_t, int*);
using StreamIsCapturing = int (*)(void*, int*);

struct Driver {
  LaunchKernelEx launch = nullptr;
  TensorMapReplaceAddress replace_address = nullptr;
  GetErrorString error_string = nullptr;
  StreamIsCapturing is_capturing = nullptr;
  std::string missing;  // why the driver is not usable ("" when it is)
};

const Driver& driver() {
  static const Driver found = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.missing = "libcuda.so.1 could not be loaded (no NVIDIA driver)";
      return d;
    }
    auto lookup = reinterpret_cast<GetProcAddress>(dlsym(lib, "cuGetProcAddress_v2"));
    if (lookup == nullptr) {
      d.missing = "the CUDA driver has no cuGetProcAddress_v2";
      return d;
    }
    auto get = [&](const char* name) -> void* {
      void* address = nullptr;
      int status = 0;
      return lookup(name, &address, kCudaVersion, 0, &status) == 0 ? address : nullptr;
    };
    d.launch = reinterpret_cast<LaunchKernelEx>(get("cuLaunchKernelEx"));
    d.replace_address = reinterpret_cast<TensorMapReplaceAddress>(get("cuTensorMapReplaceAddress"));
    d.error_string = reinterpret_cast<GetErrorString>(get("cuGetErrorString"));
    d.is_capturing = reinterpret_cast<StreamIsCapturing>(get("cuStreamIsCapturing"));
    if (d.launch == nullptr || d.replace_address == nullptr || d.error_string == nullptr || d.is_capturing == nullptr) {
      d.missing = "the CUDA driver lacks cuLaunchKernelEx, cuTensorMapReplaceAddress or cuStreamIsCapturing (older "
                  "than CUDA 12.4)";
    }
    return d;
  }();
  return found;
}

const Driver& usable_driver() {
  const Driver& d = driver();
  TORCH_CHECK(d.missing.empty(), "tilescale launcher: ", d.missing);
  return d;
}

std::string error_text(const Driver& d, int rc) {
  const char* text = nullptr;
  d.error_string(rc, &text);
  return std::string(text != nullptr ? text : "unknown error") + " (" + std::to_string(rc) + ")";
}

// Where an argument goes: (argument index, byte offset) for addresses; scalars also carry a size.
struct Place {
  int64_t arg;
  int64_t offset;
};

struct ScalarPlace {
  int64_t arg;
  int64_t offset;
  int64_t size;
};

class Launcher {
 public:
  // func: the CUfunction; params: each parameter's byte offset; blob: the parameters' bytes as
  // learned; attrs: (CUlaunchAttributeID, value bytes); pointers / tensor_maps: where each
  // address argument goes (arguments are the call's tensors, then its outputs); scalars: where
  // each scalar argument goes; address_count / scalar_count: the addresses (tensors and outputs)
  // and scalars a call passes, placed or not (a kernel of several in a Program takes some; a
  // scalar the compiled kernel does not take is in no parameter).
  Launcher(int64_t func, std::vector<int64_t> grid, std::vector<int64_t> block, int64_t shared_bytes,
           std::vector<std::pair<int64_t, std::string>> attrs, std::vector<int64_t> params, const std::string& blob,
           std::vector<std::pair<int64_t, int64_t>> pointers, std::vector<std::pair<int64_t, int64_t>> tensor_maps,
           std::vector<std::tuple<int64_t, int64_t, int64_t>> scalars, int64_t address_count, int64_t scalar_count)
      : func_(reinterpret_cast<void*>(func)), size_(blob.size()), address_count_(address_count),
        scalar_count_(scalar_count) {
    TORCH_CHECK(grid.size() == 3 && block.size() == 3, "grid and block need three dimensions");
    // cuTensorMapReplaceAddress takes a 64-byte aligned CUtensorMap. The descriptors' offsets
    // agree modulo 64 (they are aligned in the kernel's parameter space, which starts off 64),
    // so the parameters' copy here starts where every descriptor lands on a 64-byte boundary.
    int64_t phase = tensor_maps.empty() ? 0 : tensor_maps[0].second % 64;
    for (auto [arg, offset] : tensor_maps) {
      TORCH_CHECK(offset % 64 == phase, "TMA descriptors' offsets must agree modulo 64");
    }
    storage_.reset(new unsigned char[size_ + 128]);
    auto start = reinterpret_cast<uintptr_t>(storage_.get());
    base_ = storage_.get() + ((64 - start % 64) % 64) + (64 - phase) % 64;
    std::memcpy(base_, blob.data(), size_);
    for (int64_t offset : params) {
      TORCH_CHECK(offset >= 0 && static_cast<size_t>(offset) < std::max<size_t>(size_, 1), "parameter offset out of range");
      param_pointers_.push_back(base_ + offset);
    }
    for (auto [arg, offset] : pointers) pointers_.push_back({arg, check_place(arg, address_count, offset, 8)});
    for (auto [arg, offset] : tensor_maps) {
      tensor_maps_.push_back({arg, check_place(arg, address_count, offset, kTensorMapBytes)});
    }
    for (auto [arg, offset, size] : scalars) {
      TORCH_CHECK(size == 4 || size == 8, "scalar parameters are 4 or 8 bytes");
      scalars_.push_back({arg, check_place(arg, scalar_count, offset, size), size});
    }
    maps_at_.assign(tensor_maps_.size(), 0);
    attrs_.resize(attrs.size());
    for (size_t i = 0; i < attrs.size(); ++i) {
      TORCH_CHECK(attrs[i].second.size() <= sizeof(attrs_[i].value), "launch attribute value too large");
      std::memset(&attrs_[i], 0, sizeof(LaunchAttribute));
      attrs_[i].id = static_cast<unsigned>(attrs[i].first);
      std::memcpy(attrs_[i].value, attrs[i].second.data(), attrs[i].second.size());
    }
    for (int i = 0; i < 3; ++i) {
      config_.grid[i] = static_cast<unsigned>(grid[i]);
      config_.block[i] = static_cast<unsigned>(block[i]);
    }
    config_.shared_bytes = static_cast<unsigned>(shared_bytes);
    config_.attrs = attrs_.empty() ? nullptr : attrs_.data();
    config_.num_attrs = static_cast<unsigned>(attrs_.size());
  }

  // Write the arguments (addresses of the call's tensors then its outputs; scalars) into the
  // parameters without launching; false if a TMA descriptor refused an address.
  bool write(const std::vector<int64_t>& addresses, const std::vector<int64_t>& scalars) {
    TORCH_CHECK(addresses.size() == address_count_, "launcher: ", address_count_, " addresses expected, got ",
                addresses.size());
    TORCH_CHECK(scalars.size() == scalar_count_, "launcher: ", scalar_count_, " scalars expected, got ",
                scalars.size());
    for (const Place& p : pointers_) std::memcpy(base_ + p.offset, &addresses[p.arg], 8);
    for (size_t i = 0; i < tensor_maps_.size(); ++i) {
      int64_t address = addresses[tensor_maps_[i].arg];
      if (maps_at_[i] == address) continue;  // descriptors keep an address until it changes
      if (usable_driver().replace_address(base_ + tensor_maps_[i].offset, reinterpret_cast<void*>(address)) != 0) {
        maps_at_[i] = 0;
        return false;
      }
      maps_at_[i] = address;
    }
    for (const ScalarPlace& s : scalars_) std::memcpy(base_ + s.offset, &scalars[s.arg], s.size);  // little endian
    return true;
  }

  void launch(int64_t stream) {
    const Driver& d = usable_driver();
    config_.stream = reinterpret_cast<void*>(stream);
    int rc = d.launch(&config_, func_, param_pointers_.data(), nullptr);
    TORCH_CHECK(rc == 0, "cuLaunchKernelEx failed: ", error_text(d, rc));
  }

  // The parameters' bytes as they stand.
  py::bytes blob() const { return py::bytes(reinterpret_cast<const char*>(base_), size_); }

  // Forget the addresses the descriptors hold: the next write puts every one again.
  void forget_addresses() { std::fill(maps_at_.begin(), maps_at_.end(), 0); }

 private:
  int64_t check_place(int64_t arg, int64_t args, int64_t offset, size_t bytes) const {
    TORCH_CHECK(arg >= 0 && arg < args, "launcher: a place names argument ", arg, " of ", args);
    TORCH_CHECK(offset >= 0 && static_cast<size_t>(offset) + bytes <= size_,
                "launcher: a parameter place is outside the parameters");
    return offset;
  }

  void* func_;
  size_t size_;
  std::unique_ptr<unsigned char[]> storage_;
  unsigned char* base_ = nullptr;
  std::vector<void*> param_pointers_;
  std::vector<Place> pointers_;
  std::vector<Place> tensor_maps_;
  std::vector<int64_t> maps_at_;
  std::vector<ScalarPlace> scalars_;
  size_t address_count_;
  size_t scalar_count_;
  std::vector<LaunchAttribute> attrs_;
  LaunchConfig config_{};
};

// An output a Program's call allocates: its shape, its dtype (none: the call's first tensor's), its
// byte offset in the call's one allocation of packed outputs (-1: an allocation of its own), and
// whether it is scratch.
struct Output {
  std::vector<int64_t> shape;
  std::optional<at::ScalarType> dtype;
  int64_t offset;
  bool scratch = false;  // packed, written by the kernels, not returned (no tensor made for it)
};

// A new contiguous tensor like at::empty's, without a pass through the dispatcher (a few
// microseconds of every eager call): the device's allocator (the caching allocator on GPUs),
// the tensor made directly.
at::Tensor allocate(const at::Tensor& like, const std::vector<int64_t>& shape, at::ScalarType dtype) {
  c10::Device device = like.device();
  int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t d : shape) bytes *= d;
  c10::DeviceGuard guard(device);  // the allocator takes the current device
  c10::Allocator* allocator = c10::GetAllocator(device.type());
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, allocator->allocate(bytes), allocator, false);
  auto keys = c10::DispatchKeySet(c10::computeDispatchKey(dtype, at::kStrided, device));
  auto made = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, c10::scalarTypeToTypeMeta(dtype));
  made.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return made;
}

// A tensor of `dtype` on `base`'s bytes, made directly (no dispatcher call); the caller sets its
// sizes, strides and offset: a packed output, or a View.
at::Tensor viewing(const at::Tensor& base, at::ScalarType dtype) {
  return at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                  c10::scalarTypeToTypeMeta(dtype));
}

// A view a Program's call returns after its outputs: of output `of` (its own allocation, its dtype
// known) as `dtype`, `shape` and `strides` from element `offset` of `dtype`.
struct View {
  int64_t of;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  int64_t offset;
  at::ScalarType dtype;
};

// Every group's wait-status record (tilescale/groups.py): a kernel whose wait timed out, or that
// found its ranks disagreeing, writes 1 into the record's first word, in pinned host memory. A
// Program's call reads them before it launches anything, as the entry path does in Python
// (runtime.check_device_waits), and leaves the message to Python. The tensors are kept here, so a
// word read is never freed memory; the runtime replaces the list whenever its groups change.
struct WaitWords {
  std::vector<at::Tensor> records;
  std::vector<const volatile int64_t*> first;
};

WaitWords& wait_words() {
  static WaitWords words;
  return words;
}

void watch_waits(const std::vector<at::Tensor>& records) {
  WaitWords& words = wait_words();
  words.first.clear();
  for (const auto& r : records) {
    TORCH_CHECK(r.device().is_cpu() && r.scalar_type() == at::kLong && r.numel() > 0 && r.is_contiguous(),
                "watch_waits: a wait-status record is a contiguous int64 host tensor");
    words.first.push_back(static_cast<const volatile int64_t*>(r.data_ptr<int64_t>()));
  }
  words.records = records;
}

// Raised by a Program's call, which launched nothing, when a wait-status record reports a failure.
struct DeviceWaitFailed : std::exception {
  const char* what() const noexcept override { return "a device-side wait failed (see the wait-status records)"; }
};

// Kernels launched by Programs in this process (tilescale.op_launch.counts()).
int64_t& native_launches() {
  static int64_t launched = 0;
  return launched;
}

// Calls Sites made in this process (tilescale.op_launch.counts()).
int64_t& direct_calls() {
  static int64_t made = 0;
  return made;
}

// Whether `stream` is being captured into a CUDA graph (or the driver cannot say). Without a driver
// (the CPU path, whose programs launch nothing) nothing is captured.
bool capturing(int64_t stream) {
  const Driver& d = driver();
  if (!d.missing.empty()) return false;
  int status = 0;
  return d.is_capturing(reinterpret_cast<void*>(stream), &status) != 0 || status != 0;
}

// An op's kernels launched in order by one call: the outputs allocated, every kernel's arguments
// written, every kernel enqueued on the stream.
class Program {
 public:
  Program(std::vector<std::shared_ptr<Launcher>> steps,
          std::vector<std::tuple<std::vector<int64_t>, std::optional<at::ScalarType>, int64_t>> outputs,
          int64_t packed_bytes,
          std::vector<std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>, int64_t, at::ScalarType>> views,
          const std::vector<int64_t>& scratch)
      : steps_(std::move(steps)), packed_bytes_(packed_bytes) {
    for (auto& [shape, dtype, offset] : outputs) {
      if (offset >= 0) {  // a packed output: whole elements inside the packed bytes
        TORCH_CHECK(dtype, "program: a packed output needs a dtype");
        int64_t size = static_cast<int64_t>(c10::elementSize(*dtype));
        int64_t bytes = size;
        for (int64_t d : shape) bytes *= d;
        TORCH_CHECK(offset % size == 0 && offset + bytes <= packed_bytes_, "program: a packed output at byte ", offset,
                    " does not fit ", packed_bytes_, " bytes");
      }
      outputs_.push_back({shape, dtype, offset});
    }
    for (int64_t i : scratch) {  // packed outputs the kernels write and the call does not return
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(outputs_.size()) && outputs_[i].offset >= 0,
                  "program: a scratch output is a packed output");
      outputs_[i].scratch = true;
    }
    for (auto& [of, shape, strides, offset, dtype] : views) {  // inside its output's bytes
      TORCH_CHECK(of >= 0 && of < static_cast<int64_t>(outputs_.size()) && outputs_[of].offset < 0 &&
                      outputs_[of].dtype && shape.size() == strides.size() && offset >= 0,
                  "program: a view is of an output with a dtype and an allocation of its own");
      int64_t bytes = static_cast<int64_t>(c10::elementSize(*outputs_[of].dtype));
      for (int64_t d : outputs_[of].shape) bytes *= d;
      int64_t last = offset;  // the last element the view reaches
      bool empty = false;
      for (size_t i = 0; i < shape.size(); ++i) {
        TORCH_CHECK(shape[i] >= 0 && strides[i] >= 0, "program: a view's sizes and strides are not negative");
        empty = empty || shape[i] == 0;
        last += (shape[i] - 1) * strides[i];
      }
      TORCH_CHECK(empty || (last + 1) * static_cast<int64_t>(c10::elementSize(dtype)) <= bytes,
                  "program: a view reaches past its output's ", bytes, " bytes");
      views_.push_back({of, shape, strides, offset, dtype});
    }
  }

  // The call's outputs (None if none; the output if one; a list), its kernels enqueued on stream.
  py::object call(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& scalars, int64_t stream) {
    return run(tensors, scalars, stream, nullptr, 0);
  }

  // As call; with `counter`, `*counter = count` once every kernel's arguments are written (nothing
  // refused them): a call that raises before it launches has not used its call number.
  py::object run(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& scalars, int64_t stream,
                 int64_t* counter, int64_t count) {
    TORCH_CHECK(!tensors.empty(), "program: a call needs its tensors");
    for (const volatile int64_t* word : wait_words().first) {
      if (*word == 1) throw DeviceWaitFailed();
    }
    const at::Tensor& first = tensors[0];
    at::Tensor packed = packed_bytes_ > 0 ? allocate(first, {packed_bytes_}, at::kByte) : at::Tensor();
    std::vector<int64_t> addresses;
    addresses.reserve(tensors.size() + outputs_.size());
    for (const auto& t : tensors) addresses.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
    std::vector<at::Tensor> made;  // the returned outputs
    made.reserve(outputs_.size());
    std::vector<int64_t> made_as(outputs_.size(), -1);  // each output's place in `made` (-1: scratch)
    for (size_t i = 0; i < outputs_.size(); ++i) {
      const Output& o = outputs_[i];
      if (o.scratch) {  // no tensor made: its bytes stay the packed allocation's, used in stream order
        addresses.push_back(reinterpret_cast<int64_t>(static_cast<char*>(packed.data_ptr()) + o.offset));
        continue;
      }
      auto dtype = o.dtype ? *o.dtype : first.scalar_type();
      if (o.offset < 0) {
        made.push_back(allocate(first, o.shape, dtype));
      } else {  // a view of the packed bytes: one tensor made, no dispatcher calls
        auto view = viewing(packed, dtype);
        view.unsafeGetTensorImpl()->set_storage_offset(o.offset / c10::elementSize(dtype));
        view.unsafeGetTensorImpl()->set_sizes_contiguous(o.shape);
        made.push_back(std::move(view));
      }
      made_as[i] = static_cast<int64_t>(made.size()) - 1;
      addresses.push_back(reinterpret_cast<int64_t>(made.back().data_ptr()));
    }
    // Every kernel's arguments first: a refused address (a TMA descriptor's alignment) launches
    // nothing, and the caller routes the whole call through the entry functions.
    for (const auto& step : steps_) {
      if (!step->write(addresses, scalars)) throw py::value_error("cuTensorMapReplaceAddress refused an address");
    }
    if (counter != nullptr) *counter = count;
    for (const auto& step : steps_) step->launch(stream);
    native_launches() += static_cast<int64_t>(steps_.size());
    for (const View& v : views_) {  // one tensor made each, no dispatcher calls
      auto view = viewing(made[made_as[v.of]], v.dtype);
      view.unsafeGetTensorImpl()->set_sizes_and_strides(v.shape, v.strides, v.offset);
      made.push_back(std::move(view));
    }
    if (made.empty()) return py::none();
    if (made.size() == 1) return py::cast(made[0]);
    return py::cast(made);
  }

 private:
  std::vector<std::shared_ptr<Launcher>> steps_;
  std::vector<Output> outputs_;
  std::vector<View> views_;
  int64_t packed_bytes_;
};

// The layout a learned program's tensor had: what an op's plan checked of it once.
struct Layout {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  c10::Device device;
  bool contiguous;

  explicit Layout(const at::Tensor& t)
      : sizes(t.sizes().vec()), dtype(t.scalar_type()), device(t.device()), contiguous(t.is_contiguous()) {}

  bool matches(const at::Tensor& t) const {
    return t.scalar_type() == dtype && t.device() == device && t.sizes().equals(sizes) && t.is_contiguous() == contiguous;
  }
};

// One call site's learned programs, called straight from here (tilescale.op_launch.Direct): each
// with the layouts of the tensors it was learned on and its signature. A call whose tensors have
// one's layouts, outside a stream capture, runs that program with the call's scalars, then its
// identity as the last scalar: (the group's next call number << 32) | signature, the number
// taken from and put back into `counter` (a ctypes.c_int64 the group's Python calls number
// their calls with too); a site without a counter runs programs that take no identity. Else
// nothing happens and the call returns NotImplemented: the caller takes the op's Python path.
class Site {
 public:
  explicit Site(py::object counter) : counter_(std::move(counter)) {
    if (!counter_.is_none()) {
      count_ = reinterpret_cast<int64_t*>(py::module_::import("ctypes").attr("addressof")(counter_).cast<intptr_t>());
    }
  }

  // A program learned on `tensors`; `runtime` gets `spans` as its last_kernel_spans at each call
  // (what a failed wait names).
  void add(const std::vector<at::Tensor>& tensors, std::shared_ptr<Program> program, int64_t sig,
           py::object runtime, py::object spans) {
    if (count_ == nullptr) {
      TORCH_CHECK(sig == -1, "site: a site without a call counter runs programs without an identity (sig -1)");
    } else {
      TORCH_CHECK(sig >= 0 && sig < (int64_t{1} << 32), "site: a signature is 32 bits");
    }
    std::vector<Layout> layouts;
    for (const auto& t : tensors) layouts.emplace_back(t);
    entries_.push_back({std::move(layouts), std::move(program), sig, std::move(runtime), std::move(spans)});
  }

  // `scalars`: the call's scalars (before its identity, where the site has a counter).
  py::object call(const std::vector<at::Tensor>& tensors, int64_t stream, std::vector<int64_t> scalars) {
    const Entry* e = find(tensors);
    if (e == nullptr || capturing(stream)) {  // a capture may take another plan: the op's Python decides
      return py::reinterpret_borrow<py::object>(Py_NotImplemented);
    }
    py::setattr(e->runtime, "last_kernel_spans", e->spans);
    py::object out;
    if (count_ == nullptr) {
      out = e->program->run(tensors, scalars, stream, nullptr, 0);
    } else {
      int64_t count = *count_ % 0x7FFFFFFF + 1;
      scalars.push_back((count << 32) | e->sig);
      out = e->program->run(tensors, scalars, stream, count_, count);
    }
    ++direct_calls();
    return out;
  }

  // Whether a program was learned on tensors of these layouts.
  bool covers(const std::vector<at::Tensor>& tensors) const { return find(tensors) != nullptr; }

  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::vector<Layout> layouts;
    std::shared_ptr<Program> program;
    int64_t sig;
    py::object runtime;
    py::object spans;
  };
  const Entry* find(const std::vector<at::Tensor>& tensors) const {
    for (const Entry& e : entries_) {
      if (e.layouts.size() != tensors.size()) continue;
      bool same = true;
      for (size_t i = 0; same && i < tensors.size(); ++i) same = e.layouts[i].matches(tensors[i]);
      if (same) return &e;
    }
    return nullptr;
  }

  py::object counter_;  // kept alive: count_ points into it (None: no identity)
  int64_t* count_ = nullptr;
  std::vector<Entry> entries_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("driver_missing", [] { return driver().missing; }, "Why the CUDA driver cannot be used ('' if it can).");
  m.def("watch_waits", &watch_waits, "The wait-status records every Program call checks first (every group's).");
  py::register_exception<DeviceWaitFailed>(m, "DeviceWaitFailed", PyExc_RuntimeError);
  py::class_<Launcher, std::shared_ptr<Launcher>>(m, "Launcher")
      .def(py::init<int64_t, std::vector<int64_t>, std::vector<int64_t>, int64_t,
                    std::vector<std::pair<int64_t, std::string>>, std::vector<int64_t>, const std::string&,
                    std::vector<std::pair<int64_t, int64_t>>, std::vector<std::pair<int64_t, int64_t>>,
                    std::vector<std::tuple<int64_t, int64_t, int64_t>>, int64_t, int64_t>())
      .def("write", &Launcher::write)
      .def("launch", &Launcher::launch)
      .def("blob", &Launcher::blob)
      .def("forget_addresses", &Launcher::forget_addresses);
  m.def("native_launches", [] { return native_launches(); }, "Kernels launched by Programs in this process.");
  m.def("direct_calls", [] { return direct_calls(); }, "Calls Sites made in this process.");
  py::class_<Program, std::shared_ptr<Program>>(m, "Program")
      .def(py::init<std::vector<std::shared_ptr<Launcher>>,
                    std::vector<std::tuple<std::vector<int64_t>, std::optional<at::ScalarType>, int64_t>>, int64_t,
                    std::vector<std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>, int64_t,
                                           at::ScalarType>>,
                    const std::vector<int64_t>&>(),
           py::arg("steps"), py::arg("outputs"), py::arg("packed_bytes"),
           py::arg("views") = std::vector<std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>, int64_t,
                                                     at::ScalarType>>(),
           py::arg("scratch") = std::vector<int64_t>())
      .def("call", &Program::call);
  py::class_<Site>(m, "Site")
      .def(py::init<py::object>(), py::arg("counter"))
      .def("add", &Site::add)
      .def("call", &Site::call, py::arg("tensors"), py::arg("stream"), py::arg("scalars") = std::vector<int64_t>{})
      .def("covers", &Site::covers)
      .def("__len__", &Site::size);
}
