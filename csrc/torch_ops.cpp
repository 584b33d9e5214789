// The CUDA registration of the qsa ops on the LibTorch stable ABI, and their C++ validation.
//
// Schemas are defined once, in Python (qsa_ops/ops.py: SCHEMAS); this file registers
//   * qsa::<op> for the CUDA key: validate every argument, then launch (csrc/qsa/qsa.h);
//   * qsa_check::<op> for every key (CompositeExplicitAutograd): the same validation, no launch,
//     so that the parity test can compare these messages with contract.py on any machine.
//
// NOTES: built with -DTORCH_TARGET_VERSION=2.11 against any newer torch's headers, the binary
// loads into torch 2.11 and later, and holds no CPython symbol, so one file serves every Python.
//
// Validation follows qsa_ops/contract.py step by step (device, dtype, layout, shape,
// consistency, fixed values, storage) and words every message exactly as it does; a refusal
// throws before anything is launched. The message travels to Python inside a std::exception
// (the stable ABI turns it into a RuntimeError), prefixed "[qsa:TypeError] " or
// "[qsa:ValueError] ": the public Python functions re-raise it as that exception class with the
// bare message (qsa_ops.ops.raise_refusal).
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "qsa/qsa.h"

#ifndef QSA_SOURCE_SHA256
#define QSA_SOURCE_SHA256 "unknown"
#endif
#ifndef QSA_VERSION
#define QSA_VERSION "unknown"
#endif
#ifndef QSA_ARCH
#define QSA_ARCH "unknown"
#endif

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

namespace {

// ---------------------------------------------------------------------------------------------
// Refusals and their wording (Python's formatting of tuples, dtypes, devices, floats, hex)
// ---------------------------------------------------------------------------------------------

[[noreturn]] void refuse(const char* kind, const std::string& message) {
  throw std::runtime_error(std::string("[qsa:") + kind + "] " + message);
}
[[noreturn]] void value_error(const std::string& m) { refuse("ValueError", m); }
[[noreturn]] void type_error(const std::string& m) { refuse("TypeError", m); }

std::string fmt_tuple(const std::vector<std::string>& items) {
  std::string s = "(";
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ", " : "") + items[i];
  return s + (items.size() == 1 ? ",)" : ")");
}

std::string fmt_hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%#llx", static_cast<unsigned long long>(v));
  return v == 0 ? "0x0" : buf;
}

// repr() of a Python float: shortest round-trip digits, fixed notation for exponents in
// [-4, 16), scientific otherwise.
std::string fmt_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // e.g. "-1.5e+00"
  const size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  const int exp = std::stoi(sci.substr(e + 1));
  const bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out = "0." + std::string(-exp - 1, '0') + digits;
    } else if (static_cast<size_t>(exp) + 1 >= digits.size()) {
      out = digits + std::string(exp + 1 - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
    }
  } else {
    out = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "");
    char ebuf[16];
    std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += ebuf;
  }
  return (neg ? "-" : "") + out;
}

std::string dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Byte: return "torch.uint8";
    case ScalarType::Char: return "torch.int8";
    case ScalarType::Short: return "torch.int16";
    case ScalarType::Int: return "torch.int32";
    case ScalarType::Long: return "torch.int64";
    case ScalarType::Half: return "torch.float16";
    case ScalarType::Float: return "torch.float32";
    case ScalarType::Double: return "torch.float64";
    case ScalarType::ComplexHalf: return "torch.complex32";
    case ScalarType::ComplexFloat: return "torch.complex64";
    case ScalarType::ComplexDouble: return "torch.complex128";
    case ScalarType::Bool: return "torch.bool";
    case ScalarType::BFloat16: return "torch.bfloat16";
    case ScalarType::Float8_e5m2: return "torch.float8_e5m2";
    case ScalarType::Float8_e4m3fn: return "torch.float8_e4m3fn";
    case ScalarType::Float8_e5m2fnuz: return "torch.float8_e5m2fnuz";
    case ScalarType::Float8_e4m3fnuz: return "torch.float8_e4m3fnuz";
    case ScalarType::UInt16: return "torch.uint16";
    case ScalarType::UInt32: return "torch.uint32";
    case ScalarType::UInt64: return "torch.uint64";
    default: return "torch.dtype(" + std::to_string(static_cast<int>(t)) + ")";
  }
}

struct DeviceId {
  int32_t type;
  int32_t index;
  bool operator==(const DeviceId& o) const { return type == o.type && index == o.index; }
};

DeviceId device_of(const Tensor& t) {
  int32_t type = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(t.get(), &type));
  return {type, t.get_device()};
}

std::string device_name(DeviceId d) {
  std::string name;
  if (d.type == aoti_torch_device_type_cpu()) return "cpu";  // torch prints no index for CPU
  if (d.type == aoti_torch_device_type_cuda()) name = "cuda";
  else if (d.type == aoti_torch_device_type_meta()) name = "meta";
  else if (d.type == aoti_torch_device_type_xpu()) name = "xpu";
  else name = "device_type_" + std::to_string(d.type);
  return d.index >= 0 ? name + ":" + std::to_string(d.index) : name;
}

// ---------------------------------------------------------------------------------------------
// The ordered checks of contract.py (_OpSpec / _full_check / _validate)
// ---------------------------------------------------------------------------------------------

// What the checks read of a tensor. The exact-packed k_cache/v_cache views are not operator
// arguments (the schema takes their [P, 512, 512] buffer: see contract.packed_kv_buffer) but the
// contract words its checks on them, so their metadata is derived from the buffer.
struct Meta {
  DeviceId device;
  ScalarType dtype;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  bool contiguous;
  uint64_t data;  // address of element 0
  int64_t storage_offset;
  int64_t element_size;
  int64_t numel;

  static Meta of(const Tensor& t) {
    auto sz = t.sizes();
    auto st = t.strides();
    return {device_of(t),
            t.scalar_type(),
            std::vector<int64_t>(sz.begin(), sz.end()),
            std::vector<int64_t>(st.begin(), st.end()),
            t.is_contiguous(),
            reinterpret_cast<uint64_t>(t.data_ptr()),
            t.storage_offset(),
            static_cast<int64_t>(t.element_size()),
            t.numel()};
  }
};

std::string fmt_ints(const std::vector<int64_t>& values) {
  std::vector<std::string> items;
  for (int64_t v : values) items.push_back(std::to_string(v));
  return fmt_tuple(items);
}

// One entry of a shape pattern: a fixed size, or a symbol (R, P, B, M) taken from an argument.
struct Dim {
  int64_t size;  // when sym == 0
  char sym;
};
constexpr Dim S(char c) { return {0, c}; }
constexpr Dim F(int64_t n) { return {n, 0}; }

struct Arg {
  const char* name;
  Meta m;
  ScalarType dtype;
  std::vector<Dim> shape;
  bool packed;  // exact-packed K/V view: fixed strides instead of contiguity
};

struct SizeSource {
  char sym;
  int arg;
  int dim;
};

struct IntArg {
  const char* name;
  int64_t value;
  int64_t expected;
};

std::string fmt_pattern(const std::vector<Dim>& p) {
  std::vector<std::string> items;
  for (const Dim& d : p) items.push_back(d.sym ? std::string(1, d.sym) : std::to_string(d.size));
  return fmt_tuple(items);
}

const std::vector<int64_t> kKvStrides = {QSA_KV_PAGE * 2 * QSA_HEAD_DIM, 2 * QSA_HEAD_DIM,
                                         QSA_HEAD_DIM, 1};
const std::vector<int64_t> kPackedStrides = {QSA_KV_PAGE * 2 * QSA_HEAD_DIM, 2 * QSA_HEAD_DIM, 1};

// [start, end) of the bytes a tensor can address; nullopt when empty.
std::optional<std::pair<uint64_t, uint64_t>> byte_range(const Meta& m) {
  if (m.numel == 0) return std::nullopt;
  if (m.contiguous) return std::make_pair(m.data, m.data + m.numel * m.element_size);
  int64_t span = 1;
  for (size_t i = 0; i < m.sizes.size(); ++i) span += (m.sizes[i] - 1) * std::llabs(m.strides[i]);
  return std::make_pair(m.data, m.data + span * m.element_size);
}

void check_devices(const std::vector<Arg>& args) {
  const DeviceId first = args[0].m.device;
  for (size_t i = 1; i < args.size(); ++i)
    if (!(args[i].m.device == first))
      value_error(std::string(args[i].name) + " must be on the same device as " + args[0].name +
                  " (" + device_name(first) + "), got " + device_name(args[i].m.device));
}

void check_no_overlap(const std::vector<Arg>& args) {
  const Arg& out = args.back();
  const auto o = byte_range(out.m);
  if (!o) return;
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    const auto r = byte_range(args[i].m);
    if (r && r->first < o->second && o->first < r->second)
      value_error(std::string(out.name) + " must not overlap any input, got overlap with " +
                  args[i].name + " (bytes [" + fmt_hex(o->first) + ", " + fmt_hex(o->second) +
                  ") and [" + fmt_hex(r->first) + ", " + fmt_hex(r->second) + "))");
  }
}

// contract._validate for tensor arguments `args` (out last) and fixed-valued ints `ints`.
// The storage half of the exact-packed check (V at +256 in K's storage, which holds every page)
// holds by construction for views derived from a valid buffer, so it is not repeated here.
// overlap=false leaves the storage checks to the caller (update_caches has two outputs).
void validate(const std::vector<Arg>& args, const std::vector<SizeSource>& sources,
              const std::vector<IntArg>& ints, bool overlap = true) {
  check_devices(args);
  for (const Arg& a : args)
    if (a.m.dtype != a.dtype)
      type_error(std::string(a.name) + " must have dtype " + dtype_name(a.dtype) + ", got " +
                 dtype_name(a.m.dtype));
  for (const Arg& a : args)
    if (!a.packed && !a.m.contiguous)
      value_error(std::string(a.name) + " must be contiguous, got strides " + fmt_ints(a.m.strides) +
                  " for shape " + fmt_ints(a.m.sizes));
  for (const Arg& a : args)
    if (a.packed && a.m.strides != kKvStrides)
      value_error(std::string(a.name) + " must have strides " + fmt_ints(kKvStrides) +
                  " (exact-packed K/V), got " + fmt_ints(a.m.strides));
  for (const Arg& a : args) {
    bool ok = a.m.sizes.size() == a.shape.size();
    for (size_t d = 0; ok && d < a.shape.size(); ++d)
      ok = a.shape[d].sym || a.m.sizes[d] == a.shape[d].size;
    if (!ok)
      value_error(std::string(a.name) + " must have shape " + fmt_pattern(a.shape) + ", got " +
                  fmt_ints(a.m.sizes));
  }
  std::map<char, std::pair<int64_t, const char*>> sizes;
  for (const SizeSource& s : sources)
    sizes[s.sym] = {args[s.arg].m.sizes[s.dim], args[s.arg].name};
  for (const Arg& a : args) {
    for (size_t d = 0; d < a.shape.size(); ++d) {
      const Dim& p = a.shape[d];
      if (!p.sym || a.m.sizes[d] == sizes[p.sym].first) continue;
      std::vector<std::string> expected;
      for (const Dim& x : a.shape)
        expected.push_back(std::to_string(x.sym ? sizes[x.sym].first : x.size));
      value_error(std::string(a.name) + " must have shape " + fmt_pattern(a.shape) + " = " +
                  fmt_tuple(expected) + " (" + std::string(1, p.sym) + " = " +
                  std::to_string(sizes[p.sym].first) + " from " + sizes[p.sym].second +
                  "), got " + fmt_ints(a.m.sizes));
    }
  }
  for (const IntArg& i : ints)
    if (i.value != i.expected)
      value_error(std::string(i.name) + " must be " + std::to_string(i.expected) + ", got " +
                  std::to_string(i.value));
  if (overlap) check_no_overlap(args);
}

constexpr double kDefaultSoftmaxScale = 0.0625;  // 1/sqrt(QSA_HEAD_DIM), exact
static_assert(QSA_HEAD_DIM == 256, "kDefaultSoftmaxScale is 1/sqrt(256)");

void validate_select(const Tensor& q, const Tensor& ck, const Tensor& page_table,
                     const Tensor& token_to_req, const Tensor& query_positions,
                     const Tensor& sequence_lengths, int64_t token_topk, int64_t compress_ratio,
                     const Tensor& out) {
  const std::vector<Arg> args = {
      {"q", Meta::of(q), ScalarType::Half, {S('R'), F(QSA_INDEX_HEADS), F(QSA_INDEX_DIM)}, false},
      {"compressed_key_cache", Meta::of(ck), ScalarType::Half,
       {S('P'), F(QSA_CK_PAGE), F(1), F(QSA_INDEX_DIM)}, false},
      {"page_table", Meta::of(page_table), ScalarType::Int, {S('B'), S('M')}, false},
      {"token_to_req", Meta::of(token_to_req), ScalarType::Int, {S('R')}, false},
      {"query_positions", Meta::of(query_positions), ScalarType::Long, {S('R')}, false},
      {"sequence_lengths", Meta::of(sequence_lengths), ScalarType::Int, {S('B')}, false},
      {"out", Meta::of(out), ScalarType::Int, {S('R'), F(QSA_WIDTH)}, false},
  };
  validate(args, {{'R', 0, 0}, {'P', 1, 0}, {'B', 2, 0}, {'M', 2, 1}},
           {{"token_topk", token_topk, QSA_TOKEN_TOPK},
            {"compress_ratio", compress_ratio, QSA_COMPRESS_RATIO}});
}

// contract.validate_packed_kv: the [P, 512, 512] buffer the operator takes.
void validate_packed_kv(const Tensor& kv) {
  if (kv.scalar_type() != ScalarType::Half)
    type_error("kv must have dtype torch.float16, got " + dtype_name(kv.scalar_type()));
  if (kv.dim() != 3 || kv.size(1) != QSA_KV_PAGE || kv.size(2) != 2 * QSA_HEAD_DIM)
    value_error("kv must have shape (P, " + std::to_string(QSA_KV_PAGE) + ", " +
                std::to_string(2 * QSA_HEAD_DIM) + "), got " + fmt_ints(Meta::of(kv).sizes));
  const Meta m = Meta::of(kv);
  if (m.strides != kPackedStrides)
    value_error("kv must have strides " + fmt_ints(kPackedStrides) + ", got " +
                fmt_ints(m.strides));
}

// contract.kv_views: k_cache = kv[:, :, :256].unsqueeze(2), v_cache = kv[:, :, 256:].unsqueeze(2).
std::pair<Meta, Meta> kv_views(const Tensor& kv) {
  Meta k = Meta::of(kv);
  k.sizes = {k.sizes[0], QSA_KV_PAGE, 1, QSA_HEAD_DIM};
  k.strides = kKvStrides;
  k.numel = k.sizes[0] * QSA_KV_PAGE * QSA_HEAD_DIM;
  k.contiguous = false;
  Meta v = k;
  v.data += QSA_HEAD_DIM * k.element_size;
  v.storage_offset += QSA_HEAD_DIM;
  return {k, v};
}

double validate_attention(const Tensor& q, const Tensor& kv, const Tensor& logical_indices,
                          const Tensor& page_table, const Tensor& token_to_req, int64_t page_size,
                          const Tensor& out, std::optional<double> softmax_scale) {
  validate_packed_kv(kv);
  const auto [k_cache, v_cache] = kv_views(kv);
  const std::vector<Dim> kvp = {S('P'), F(QSA_KV_PAGE), F(1), F(QSA_HEAD_DIM)};
  const std::vector<Dim> heads = {S('R'), F(QSA_ATTN_HEADS), F(QSA_HEAD_DIM)};
  const std::vector<Arg> args = {
      {"q", Meta::of(q), ScalarType::Half, heads, false},
      {"k_cache", k_cache, ScalarType::Half, kvp, true},
      {"v_cache", v_cache, ScalarType::Half, kvp, true},
      {"logical_indices", Meta::of(logical_indices), ScalarType::Int, {S('R'), F(QSA_WIDTH)},
       false},
      {"page_table", Meta::of(page_table), ScalarType::Int, {S('B'), S('M')}, false},
      {"token_to_req", Meta::of(token_to_req), ScalarType::Int, {S('R')}, false},
      {"out", Meta::of(out), ScalarType::Half, heads, false},
  };
  validate(args, {{'R', 0, 0}, {'P', 1, 0}, {'B', 4, 0}, {'M', 4, 1}},
           {{"page_size", page_size, QSA_KV_PAGE}});
  if (!softmax_scale) return kDefaultSoftmaxScale;
  const double s = *softmax_scale;
  if (!(std::isfinite(s) && s > 0.0))
    value_error("softmax_scale must be finite and > 0, got " + fmt_float(s));
  return s;
}

// ---------------------------------------------------------------------------------------------
// CUDA plumbing: errors, device, stream, workspaces
// ---------------------------------------------------------------------------------------------

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": CUDA error " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
}

// Makes `device` current for one call and restores the caller's device: the runtime shares
// torch's primary context, so a leaked cudaSetDevice would change torch.cuda.current_device().
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* what) : device_(device) {
    check_cuda(cudaGetDevice(&previous_), what);
    if (previous_ != device_) check_cuda(cudaSetDevice(device_), what);
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

// NOTES: aoti_torch_get_current_cuda_stream lives in libtorch_cuda, which CPU builds of torch
// lack; it is resolved from the already-loaded library at first use instead of being linked,
// so that the same binary also loads (for the qsa_check ops) under a CPU-only torch.
using GetStreamFn = AOTITorchError (*)(int32_t, void**);
cudaStream_t current_stream(int device) {
  static GetStreamFn fn = [] {
    void* lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    return lib ? reinterpret_cast<GetStreamFn>(dlsym(lib, "aoti_torch_get_current_cuda_stream"))
               : nullptr;
  }();
  if (fn == nullptr)
    throw std::runtime_error("qsa: libtorch_cuda.so is not loaded: a CUDA build of torch is needed");
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(fn(device, &stream));
  return static_cast<cudaStream_t>(stream);
}

// The kernels are compiled for one architecture (sm_90a): refuse any other device once, with
// the reason, instead of failing inside a launch.
void check_capability(int device) {
  static std::mutex mu;
  static std::map<int, std::string> verdicts;
  std::lock_guard<std::mutex> lock(mu);
  auto it = verdicts.find(device);
  if (it == verdicts.end()) {
    int major = 0, minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "qsa");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "qsa");
    std::string why;
    if (major != 9 || minor != 0)
      why = "qsa kernels are built for " QSA_ARCH " (compute capability 9.0), device cuda:" +
            std::to_string(device) + " has " + std::to_string(major) + "." + std::to_string(minor);
    it = verdicts.emplace(device, why).first;
  }
  if (!it->second.empty()) throw std::runtime_error(it->second);
}

// Scratch bytes and zeroed int32 counters of one (device, stream), from torch's caching
// allocator. NOTES: a buffer is never freed once handed out (a CUDA graph captured earlier may
// point at it: growth keeps the old one in `retired`), and none is created or grown inside
// CUDA-graph capture: such a call takes a temporary from the graph's private pool instead
// (stream-ordered like any captured intermediate; warm up once before capture to avoid it).
struct Workspace {
  std::optional<Tensor> scratch;
  std::optional<Tensor> counters;
  std::vector<Tensor> retired;
};

struct WorkspaceView {
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  int32_t* counters = nullptr;
  std::optional<Tensor> keep;  // a capture-time temporary lives until the launch is enqueued
  std::optional<Tensor> keep_counters;
};

WorkspaceView workspace(const Tensor& like, int device, cudaStream_t stream, size_t bytes,
                        int64_t counter_slots) {
  // Leaked on purpose: tensors must not be destroyed after torch shuts down at exit.
  static auto* mu = new std::mutex;
  static auto* all = new std::map<std::pair<int, cudaStream_t>, Workspace>;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "qsa workspace");
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  std::lock_guard<std::mutex> lock(*mu);
  Workspace& ws = (*all)[{device, stream}];
  WorkspaceView view;
  if (bytes > 0) {
    const int64_t have = ws.scratch ? ws.scratch->numel() : 0;
    if (have < static_cast<int64_t>(bytes)) {
      if (capturing) {
        view.keep = torch::stable::new_empty(like, {static_cast<int64_t>(bytes)}, ScalarType::Byte);
      } else {
        const int64_t size = std::max<int64_t>(bytes, have ? 2 * have : int64_t(1) << 20);
        if (ws.scratch) ws.retired.push_back(*ws.scratch);
        ws.scratch = torch::stable::new_empty(like, {size}, ScalarType::Byte);
      }
    }
    const Tensor& t = view.keep ? *view.keep : *ws.scratch;
    view.scratch = t.mutable_data_ptr();
    view.scratch_bytes = t.numel();
  }
  if (counter_slots > 0) {
    if (!ws.counters) {
      if (capturing) {  // the zero fill is captured too: every replay starts from zeros
        view.keep_counters = torch::stable::new_zeros(like, {counter_slots}, ScalarType::Int);
      } else {
        ws.counters = torch::stable::new_zeros(like, {counter_slots}, ScalarType::Int);
      }
    }
    const Tensor& c = view.keep_counters ? *view.keep_counters : *ws.counters;
    view.counters = static_cast<int32_t*>(c.mutable_data_ptr());
  }
  return view;
}

// QSA_ATTN_SPLITS: CTAs per attention row (tuning and tests only; unset or 0 = heuristic).
// NOTES: read per call (a getenv is tens of ns), so that a sweep can change it between calls.
int requested_splits() {
  const char* v = std::getenv("QSA_ATTN_SPLITS");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 0)
    throw std::runtime_error(std::string("QSA_ATTN_SPLITS must be a non-negative integer, got '") +
                             v + "'");
  return static_cast<int>(n);
}

constexpr int64_t kInt32Max = 2147483647;

// ---------------------------------------------------------------------------------------------
// The ops
// ---------------------------------------------------------------------------------------------

void select_paged_tokens(Tensor q, Tensor ck, Tensor page_table, Tensor token_to_req,
                         Tensor query_positions, Tensor sequence_lengths, int64_t token_topk,
                         int64_t compress_ratio, Tensor out) {
  validate_select(q, ck, page_table, token_to_req, query_positions, sequence_lengths, token_topk,
                  compress_ratio, out);
  const int64_t rows = q.size(0), requests = page_table.size(0), width = page_table.size(1);
  if (width * QSA_CK_PAGE > kInt32Max)
    value_error("page_table width M must be at most " + std::to_string(kInt32Max / QSA_CK_PAGE) +
                " for the CUDA kernels (M * " + std::to_string(QSA_CK_PAGE) +
                " blocks index an int32), got " + std::to_string(width));
  const int device = q.get_device();
  check_capability(device);
  const DeviceGuard guard(device, "select_paged_tokens: selecting the device");
  const cudaStream_t stream = current_stream(device);
  const WorkspaceView ws =
      workspace(q, device, stream, qsa::select_workspace_bytes(rows, width), 0);
  const qsa::SelectParams p{q.const_data_ptr(),
                            ck.const_data_ptr(),
                            static_cast<const int32_t*>(page_table.const_data_ptr()),
                            static_cast<const int32_t*>(token_to_req.const_data_ptr()),
                            static_cast<const int64_t*>(query_positions.const_data_ptr()),
                            static_cast<const int32_t*>(sequence_lengths.const_data_ptr()),
                            static_cast<int32_t*>(out.mutable_data_ptr()),
                            rows,
                            requests,
                            width,
                            ck.size(0),
                            width,
                            QSA_WIDTH,
                            ws.scratch,
                            ws.scratch_bytes};
  check_cuda(qsa::select_paged_tokens(p, stream), "select_paged_tokens");
}

void sparse_paged_attention(Tensor q, Tensor kv, Tensor logical_indices, Tensor page_table,
                            Tensor token_to_req, int64_t page_size, Tensor out,
                            std::optional<double> softmax_scale) {
  const double scale = validate_attention(q, kv, logical_indices, page_table, token_to_req,
                                          page_size, out, softmax_scale);
  const int64_t rows = q.size(0), pages = kv.size(0);
  const int64_t requests = page_table.size(0), width = page_table.size(1);
  if (pages * QSA_KV_PAGE > kInt32Max)
    value_error("k_cache must have at most " + std::to_string(kInt32Max / QSA_KV_PAGE) +
                " pages for the CUDA kernels (cache slots index an int32), got " +
                std::to_string(pages));
  const int device = q.get_device();
  check_capability(device);
  const DeviceGuard guard(device, "sparse_paged_attention: selecting the device");
  const cudaStream_t stream = current_stream(device);
  const int splits = requested_splits();
  const WorkspaceView ws =
      workspace(q, device, stream, qsa::attention_workspace_bytes(rows, splits, device),
                qsa::attention_counter_slots());
  const qsa::AttentionParams p{q.const_data_ptr(),
                               kv.const_data_ptr(),
                               static_cast<const int32_t*>(logical_indices.const_data_ptr()),
                               static_cast<const int32_t*>(page_table.const_data_ptr()),
                               static_cast<const int32_t*>(token_to_req.const_data_ptr()),
                               out.mutable_data_ptr(),
                               rows,
                               requests,
                               width,
                               pages,
                               QSA_WIDTH,
                               width,
                               static_cast<float>(scale),
                               splits,
                               ws.scratch,
                               ws.scratch_bytes,
                               ws.counters};
  check_cuda(qsa::sparse_paged_attention(p, stream), "sparse_paged_attention");
}

// qsa_check: validation only (any device), for the parity test.
void check_select(Tensor q, Tensor ck, Tensor page_table, Tensor token_to_req,
                  Tensor query_positions, Tensor sequence_lengths, int64_t token_topk,
                  int64_t compress_ratio, Tensor out) {
  validate_select(q, ck, page_table, token_to_req, query_positions, sequence_lengths, token_topk,
                  compress_ratio, out);
}

void check_attention(Tensor q, Tensor kv, Tensor logical_indices, Tensor page_table,
                     Tensor token_to_req, int64_t page_size, Tensor out,
                     std::optional<double> softmax_scale) {
  validate_attention(q, kv, logical_indices, page_table, token_to_req, page_size, out,
                     softmax_scale);
}

// ---------------------------------------------------------------------------------------------
// update_caches (the third operator): validation and launch
// ---------------------------------------------------------------------------------------------

// contract.validate_update_args: the common ordered checks over all seven tensors, then the
// storage checks of the two outputs (each against the inputs, then against each other).
void check_outputs_disjoint(const std::vector<Arg>& args, size_t first_output) {
  for (size_t o = first_output; o < args.size(); ++o) {
    const auto out = byte_range(args[o].m);
    if (!out) continue;
    for (size_t i = 0; i < first_output; ++i) {
      const auto r = byte_range(args[i].m);
      if (r && r->first < out->second && out->first < r->second)
        value_error(std::string(args[o].name) + " must not overlap any input, got overlap with " +
                    args[i].name + " (bytes [" + fmt_hex(out->first) + ", " +
                    fmt_hex(out->second) + ") and [" + fmt_hex(r->first) + ", " +
                    fmt_hex(r->second) + "))");
    }
  }
  const auto kv = byte_range(args[first_output].m), ck = byte_range(args[first_output + 1].m);
  if (kv && ck && ck->first < kv->second && kv->first < ck->second)
    value_error(std::string(args[first_output + 1].name) + " must not overlap " +
                args[first_output].name + " (the other output), got bytes [" +
                fmt_hex(ck->first) + ", " + fmt_hex(ck->second) + ") and [" + fmt_hex(kv->first) +
                ", " + fmt_hex(kv->second) + ")");
}

void validate_update(const Tensor& key, const Tensor& value, const Tensor& slot_mapping,
                     const Tensor& compressed_slot_mapping, const Tensor& index_wk,
                     const Tensor& kv_cache, const Tensor& compressed_key_cache) {
  const std::vector<Dim> rows = {S('T'), F(QSA_HEAD_DIM)};
  const std::vector<Arg> args = {
      {"key", Meta::of(key), ScalarType::Half, rows, false},
      {"value", Meta::of(value), ScalarType::Half, rows, false},
      {"slot_mapping", Meta::of(slot_mapping), ScalarType::Long, {S('T')}, false},
      {"compressed_slot_mapping", Meta::of(compressed_slot_mapping), ScalarType::Long, {S('T')},
       false},
      {"index_wk", Meta::of(index_wk), ScalarType::Float, {F(QSA_INDEX_DIM), F(QSA_HEAD_DIM)},
       false},
      {"kv_cache", Meta::of(kv_cache), ScalarType::Half,
       {S('P'), F(QSA_KV_PAGE), F(2 * QSA_HEAD_DIM)}, false},
      {"compressed_key_cache", Meta::of(compressed_key_cache), ScalarType::Half,
       {S('Q'), F(QSA_CK_PAGE), F(1), F(QSA_INDEX_DIM)}, false},
  };
  validate(args, {{'T', 0, 0}, {'P', 5, 0}, {'Q', 6, 0}}, {}, /*overlap=*/false);
  check_outputs_disjoint(args, 5);
}

void update_caches(Tensor key, Tensor value, Tensor slot_mapping, Tensor compressed_slot_mapping,
                   Tensor index_wk, Tensor kv_cache, Tensor compressed_key_cache) {
  validate_update(key, value, slot_mapping, compressed_slot_mapping, index_wk, kv_cache,
                  compressed_key_cache);
  const int64_t rows = key.size(0);
  if (rows > kInt32Max)
    value_error("key must have at most " + std::to_string(kInt32Max) +
                " rows for the CUDA kernels (one CTA per row), got " + std::to_string(rows));
  const int device = key.get_device();
  check_capability(device);
  const DeviceGuard guard(device, "update_caches: selecting the device");
  const cudaStream_t stream = current_stream(device);
  const qsa::UpdateParams p{key.const_data_ptr(),
                            value.const_data_ptr(),
                            static_cast<const int64_t*>(slot_mapping.const_data_ptr()),
                            static_cast<const int64_t*>(compressed_slot_mapping.const_data_ptr()),
                            static_cast<const float*>(index_wk.const_data_ptr()),
                            kv_cache.mutable_data_ptr(),
                            compressed_key_cache.mutable_data_ptr(),
                            rows,
                            kv_cache.size(0),
                            compressed_key_cache.size(0)};
  check_cuda(qsa::update_caches(p, stream), "update_caches");
}

void check_update(Tensor key, Tensor value, Tensor slot_mapping, Tensor compressed_slot_mapping,
                  Tensor index_wk, Tensor kv_cache, Tensor compressed_key_cache) {
  validate_update(key, value, slot_mapping, compressed_slot_mapping, index_wk, kv_cache,
                  compressed_key_cache);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(qsa, CUDA, m) {
  m.impl("select_paged_tokens", TORCH_BOX(&select_paged_tokens));
  m.impl("sparse_paged_attention", TORCH_BOX(&sparse_paged_attention));
  m.impl("update_caches", TORCH_BOX(&update_caches));
}

STABLE_TORCH_LIBRARY_IMPL(qsa_check, CompositeExplicitAutograd, m) {
  m.impl("select_paged_tokens", TORCH_BOX(&check_select));
  m.impl("sparse_paged_attention", TORCH_BOX(&check_attention));
  m.impl("update_caches", TORCH_BOX(&check_update));
}

// ---------------------------------------------------------------------------------------------
// Plain C entry points (read with ctypes by qsa_ops/ops.py): build facts and kernel geometry
// ---------------------------------------------------------------------------------------------

#define QSA_EXPORT extern "C" __attribute__((visibility("default")))

QSA_EXPORT const char* qsa_build_info_json() {
  static const std::string json = [] {
    int runtime = 0;
    cudaRuntimeGetVersion(&runtime);
    std::string s = "{\"backend\": \"cuda\", \"arch\": \"" QSA_ARCH "\", \"version\": \"" QSA_VERSION
                    "\", \"source_sha256\": \"" QSA_SOURCE_SHA256 "\", \"cuda_runtime\": " +
                    std::to_string(runtime) + ", \"torch_target_version\": \"" +
                    fmt_hex(static_cast<uint64_t>(TORCH_TARGET_VERSION)) + "\", \"macros\": {";
    const std::pair<const char*, int> macros[] = {
        {"QSA_TOKEN_TOPK", QSA_TOKEN_TOPK}, {"QSA_COMPRESS_RATIO", QSA_COMPRESS_RATIO},
        {"QSA_BLOCK_TOPK", QSA_BLOCK_TOPK}, {"QSA_TAIL", QSA_TAIL},
        {"QSA_WIDTH", QSA_WIDTH},           {"QSA_KV_PAGE", QSA_KV_PAGE},
        {"QSA_CK_PAGE", QSA_CK_PAGE},       {"QSA_ATTN_HEADS", QSA_ATTN_HEADS},
        {"QSA_HEAD_DIM", QSA_HEAD_DIM},     {"QSA_INDEX_HEADS", QSA_INDEX_HEADS},
        {"QSA_INDEX_DIM", QSA_INDEX_DIM}};
    bool first = true;
    for (const auto& [name, value] : macros) {
      s += std::string(first ? "" : ", ") + "\"" + name + "\": " + std::to_string(value);
      first = false;
    }
    return s + "}}";
  }();
  return json.c_str();
}

QSA_EXPORT int qsa_attention_splits(int64_t rows, int requested, int device) {
  return qsa::attention_splits(rows, requested, device);
}
QSA_EXPORT int64_t qsa_select_launch_count(int64_t rows, int64_t table_width) {
  return qsa::select_launch_count(rows, table_width);
}
QSA_EXPORT int64_t qsa_attention_launch_count(int64_t rows) {
  return qsa::attention_launch_count(rows);
}
QSA_EXPORT int64_t qsa_update_launch_count(int64_t rows) { return qsa::update_launch_count(rows); }
