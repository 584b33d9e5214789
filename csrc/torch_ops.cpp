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

#include <array>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
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

std::string fmt_ints(torch::headeronly::IntHeaderOnlyArrayRef values) {
  std::vector<std::string> items;
  for (int64_t v : values) items.push_back(std::to_string(v));
  return fmt_tuple(items);
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
// The ordered checks of contract.py (_Arg / _OpSpec / _full_check / _check_storage)
// ---------------------------------------------------------------------------------------------

// What the checks read of a tensor.
// NOTES: nothing here allocates unless a check fails (then the message is built): these checks
// run on every call, and a heap allocation per tensor was a measurable part of the host cost.
constexpr int kMaxDims = 8;  // the contract's tensors have rank <= 4; deeper ones are refused

struct Meta {
  DeviceId device;
  ScalarType dtype;
  int64_t dim;
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
  bool contiguous;
  uint64_t data;  // address of element 0
  int64_t element_size;
  int64_t numel;
  const Tensor* source;  // for messages about tensors deeper than kMaxDims

  static Meta of(const Tensor& t) {
    Meta m{device_of(t), t.scalar_type(), t.dim(), {}, {}, t.is_contiguous(),
           reinterpret_cast<uint64_t>(t.data_ptr()), static_cast<int64_t>(t.element_size()),
           t.numel(), &t};
    auto sz = t.sizes();
    auto st = t.strides();
    for (int64_t i = 0; i < m.dim && i < kMaxDims; ++i) {
      m.sizes[i] = sz[i];
      m.strides[i] = st[i];
    }
    return m;
  }
  std::string fmt_sizes() const {
    if (source && dim > kMaxDims) return fmt_ints(source->sizes());
    return fmt_ints(torch::headeronly::IntHeaderOnlyArrayRef(sizes, dim));
  }
  std::string fmt_strides() const {
    if (source && dim > kMaxDims) return fmt_ints(source->strides());
    return fmt_ints(torch::headeronly::IntHeaderOnlyArrayRef(strides, dim));
  }
};

// One entry of a shape pattern: a fixed size, or a symbol (R, P, C, B, M, page_size, ...)
// taken from an argument.
struct Dim {
  int64_t size;     // when sym == nullptr
  const char* sym;
};
constexpr Dim S(const char* s) { return {0, s}; }
constexpr Dim F(int64_t n) { return {n, nullptr}; }

// A shape pattern of rank <= 4 (copied out of its braced list, so it owns its entries).
struct Shape {
  Dim d[4] = {};
  size_t rank = 0;
  Shape(std::initializer_list<Dim> dims) {
    for (const Dim& x : dims) d[rank++] = x;
  }
  const Dim* begin() const { return d; }
  const Dim* end() const { return d + rank; }
  size_t size() const { return rank; }
};

// contract.CONTIGUOUS / ROWS / PAGED
enum class Layout { kContiguous, kRows, kPaged };
constexpr int64_t kCacheAlign = 16;  // contract.CACHE_ALIGN (bytes)
constexpr int64_t kPageMultiple = QSA_COMPRESS_RATIO;  // contract.PAGE_MULTIPLE

// contract._Arg: the dtype rule (fixed alternatives, or an earlier argument's dtype first),
// the layout rule and the shape pattern of one tensor argument. m == nullptr: an absent
// optional argument (nothing is checked).
struct Arg {
  const char* name;
  const Meta* m;
  std::array<ScalarType, 3> dtypes;
  int n_dtypes;
  int like;  // index of the argument whose dtype is also allowed (named first); -1: none
  Layout layout;
  Shape shape;
};

Arg arg(const char* name, const Meta* m, std::initializer_list<ScalarType> dtypes, int like,
        Layout layout, Shape shape) {
  Arg a{name, m, {}, 0, like, layout, shape};
  for (ScalarType t : dtypes) a.dtypes[a.n_dtypes++] = t;
  return a;
}

struct SizeSource {
  const char* sym;
  int arg;
  int dim;
};

std::string fmt_pattern(const Shape& p) {
  std::vector<std::string> items;
  for (const Dim& d : p) items.push_back(d.sym ? std::string(d.sym) : std::to_string(d.size));
  return fmt_tuple(items);
}

// contract._fmt_dtypes: "a", "a or b", "a, b or c"
std::string fmt_dtypes(const ScalarType* dtypes, int n) {
  std::string s;
  for (int i = 0; i < n; ++i)
    s += (i == 0 ? "" : i + 1 == n ? " or " : ", ") + dtype_name(dtypes[i]);
  return s;
}

// [start, end) of the bytes a tensor can address; {0, 0} when empty.
std::pair<uint64_t, uint64_t> byte_range(const Meta& m) {
  if (m.numel == 0) return {0, 0};
  if (m.contiguous) return {m.data, m.data + m.numel * m.element_size};
  int64_t span = 1;
  for (int64_t i = 0; i < m.dim && i < kMaxDims; ++i)
    span += (m.sizes[i] - 1) * std::llabs(m.strides[i]);
  return {m.data, m.data + span * m.element_size};
}

// contract._check_layout
void check_layout(const Arg& a) {
  const Meta& m = *a.m;
  if (a.layout == Layout::kContiguous) {
    if (!m.contiguous)
      value_error(std::string(a.name) + " must be contiguous, got strides " + m.fmt_strides() +
                  " for shape " + m.fmt_sizes());
    return;
  }
  if (m.dim >= 1 && m.dim <= kMaxDims && m.strides[m.dim - 1] != 1)
    value_error(std::string(a.name) + " must have last stride 1, got strides " + m.fmt_strides());
  if (a.layout == Layout::kPaged) {
    const int64_t step = kCacheAlign / m.element_size;
    for (int64_t i = 0; i + 1 < m.dim && i < kMaxDims; ++i)
      if (m.sizes[i] > 1 && m.strides[i] % step != 0)
        value_error(std::string(a.name) + " must have strides in multiples of " +
                    std::to_string(kCacheAlign) + " bytes (" + std::to_string(step) +
                    " elements of " + dtype_name(m.dtype) +
                    ") in every dimension of size > 1 but the last, got strides " +
                    m.fmt_strides() + " for shape " + m.fmt_sizes());
  }
}

// contract._full_check (types and ints are the schema's): devices, dtypes, layouts, shapes,
// sizes, in this order over the present arguments.
template <size_t N, size_t NS>
void check_tensors(const std::array<Arg, N>& args, const std::array<SizeSource, NS>& sources) {
  const Arg& first = args[0];
  for (size_t i = 1; i < N; ++i)
    if (args[i].m && !(args[i].m->device == first.m->device))
      value_error(std::string(args[i].name) + " must be on the same device as " + first.name +
                  " (" + device_name(first.m->device) + "), got " +
                  device_name(args[i].m->device));
  for (const Arg& a : args) {
    if (!a.m) continue;
    const ScalarType given = a.m->dtype;
    bool ok = a.like >= 0 && given == args[a.like].m->dtype;
    for (int i = 0; i < a.n_dtypes; ++i) ok = ok || given == a.dtypes[i];
    if (ok) continue;
    std::string want;
    if (a.like >= 0) {
      want = dtype_name(args[a.like].m->dtype) + " (" + args[a.like].name + "'s)";
      if (a.n_dtypes) want += " or " + fmt_dtypes(a.dtypes.data(), a.n_dtypes);
    } else {
      want = fmt_dtypes(a.dtypes.data(), a.n_dtypes);
    }
    type_error(std::string(a.name) + " must have dtype " + want + ", got " + dtype_name(given));
  }
  for (const Arg& a : args)
    if (a.m) check_layout(a);
  for (const Arg& a : args) {
    if (!a.m) continue;
    bool ok = a.m->dim == static_cast<int64_t>(a.shape.size());
    int64_t d = 0;
    for (const Dim& p : a.shape) {
      if (!ok) break;
      ok = p.sym || a.m->sizes[d] == p.size;
      ++d;
    }
    if (!ok)
      value_error(std::string(a.name) + " must have shape " + fmt_pattern(a.shape) + ", got " +
                  a.m->fmt_sizes());
  }
  auto size_of = [&](const char* sym) -> const SizeSource& {
    for (const SizeSource& s : sources)
      if (std::strcmp(s.sym, sym) == 0) return s;
    throw std::logic_error("qsa: unknown size symbol");
  };
  auto value_of = [&](const char* sym) {
    const SizeSource& src = size_of(sym);
    return args[src.arg].m->sizes[src.dim];
  };
  for (const Arg& a : args) {
    if (!a.m) continue;
    int64_t d = 0;
    for (const Dim& p : a.shape) {
      if (p.sym && a.m->sizes[d] != value_of(p.sym)) {
        std::vector<std::string> expected;
        for (const Dim& x : a.shape)
          expected.push_back(std::to_string(x.sym ? value_of(x.sym) : x.size));
        value_error(std::string(a.name) + " must have shape " + fmt_pattern(a.shape) + " = " +
                    fmt_tuple(expected) + " (" + p.sym + " = " +
                    std::to_string(value_of(p.sym)) + " from " + args[size_of(p.sym).arg].name +
                    "), got " + a.m->fmt_sizes());
      }
      ++d;
    }
  }
}

// contract._check_int_value
void check_int_value(const char* name, int64_t value, int64_t expected) {
  if (value != expected)
    value_error(std::string(name) + " must be " + std::to_string(expected) + ", got " +
                std::to_string(value));
}

// contract._check_no_overlap: `out` against each of `inputs` (absent ones skipped).
void check_no_overlap(const Arg& out, const Arg* inputs, size_t n) {
  const auto o = byte_range(*out.m);
  if (o.first == o.second) return;
  for (size_t i = 0; i < n; ++i) {
    if (!inputs[i].m) continue;
    const auto r = byte_range(*inputs[i].m);
    if (r.first != r.second && r.first < o.second && o.first < r.second)
      value_error(std::string(out.name) + " must not overlap any input, got overlap with " +
                  inputs[i].name + " (bytes [" + fmt_hex(o.first) + ", " + fmt_hex(o.second) +
                  ") and [" + fmt_hex(r.first) + ", " + fmt_hex(r.second) + "))");
  }
}

// contract._check_storage: paged arguments aligned, then `out` (last) against every input.
template <size_t N>
void check_storage(const std::array<Arg, N>& args) {
  for (const Arg& a : args)
    if (a.m && a.layout == Layout::kPaged && a.m->numel > 0 && a.m->data % kCacheAlign != 0)
      value_error(std::string(a.name) + " must start at a " + std::to_string(kCacheAlign) +
                  "-byte aligned address, got " + fmt_hex(a.m->data));
  check_no_overlap(args[N - 1], args.data(), N - 1);
}

// contract._check_scale_value
double check_scale_value(const char* name, double v) {
  if (!(std::isfinite(v) && v > 0.0))
    value_error(std::string(name) + " must be finite and > 0, got " + fmt_float(v));
  return v;
}

constexpr ScalarType kFp8 = ScalarType::Float8_e4m3fn;

void validate_select(const Tensor& q, const Tensor& ck, const Tensor& page_table,
                     const Tensor& token_to_req, const Tensor& query_positions,
                     const Tensor& sequence_lengths, int64_t token_topk, int64_t compress_ratio,
                     const Tensor& out) {
  const Meta mq = Meta::of(q), mck = Meta::of(ck), mpt = Meta::of(page_table),
             mtr = Meta::of(token_to_req), mqp = Meta::of(query_positions),
             msl = Meta::of(sequence_lengths), mout = Meta::of(out);
  using L = Layout;
  const ScalarType I32 = ScalarType::Int;
  const std::array<Arg, 7> args = {
      arg("q", &mq, {ScalarType::Half, ScalarType::BFloat16, kFp8}, -1, L::kContiguous,
          {S("R"), F(QSA_INDEX_HEADS), F(QSA_INDEX_DIM)}),
      arg("compressed_key_cache", &mck, {}, 0, L::kPaged,
          {S("P"), S("C"), F(1), F(QSA_INDEX_DIM)}),
      arg("page_table", &mpt, {I32}, -1, L::kRows, {S("B"), S("M")}),
      arg("token_to_req", &mtr, {I32}, -1, L::kContiguous, {S("R")}),
      arg("query_positions", &mqp, {ScalarType::Long}, -1, L::kContiguous, {S("R")}),
      arg("sequence_lengths", &msl, {I32}, -1, L::kContiguous, {S("B")}),
      arg("out", &mout, {I32}, -1, L::kRows, {S("R"), F(QSA_WIDTH)}),
  };
  check_tensors(args, std::array<SizeSource, 5>{{{"R", 0, 0},
                                                  {"P", 1, 0},
                                                  {"C", 1, 1},
                                                  {"B", 2, 0},
                                                  {"M", 2, 1}}});
  if (mck.sizes[1] < 1)
    value_error("compressed_key_cache must hold C >= 1 keys per page, got shape " +
                mck.fmt_sizes());
  if (mout.sizes[0] > 1 && mout.strides[0] < QSA_WIDTH)
    value_error("out must have row stride >= " + std::to_string(QSA_WIDTH) +
                " (rows must not overlap), got strides " + mout.fmt_strides());
  check_int_value("token_topk", token_topk, QSA_TOKEN_TOPK);
  check_int_value("compress_ratio", compress_ratio, QSA_COMPRESS_RATIO);
  check_storage(args);
}

constexpr double kDefaultSoftmaxScale = 0.0625;  // 1/sqrt(QSA_HEAD_DIM), exact
static_assert(QSA_HEAD_DIM == 256, "kDefaultSoftmaxScale is 1/sqrt(256)");

// The resolved scales of an attention call (contract.validate_attention_args' return value).
struct AttentionScales {
  double softmax;
  double k;  // 1.0 unless the caches are float8
  double v;
};

AttentionScales validate_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                   const Tensor& logical_indices, const Tensor& page_table,
                                   const Tensor& token_to_req, int64_t page_size,
                                   const Tensor& out, std::optional<double> softmax_scale,
                                   std::optional<double> k_scale, std::optional<double> v_scale,
                                   const std::optional<Tensor>& gate) {
  const Meta mq = Meta::of(q), mk = Meta::of(k_cache), mv = Meta::of(v_cache),
             mli = Meta::of(logical_indices), mpt = Meta::of(page_table),
             mtr = Meta::of(token_to_req), mout = Meta::of(out);
  const std::optional<Meta> mgate = gate ? std::optional<Meta>(Meta::of(*gate)) : std::nullopt;
  using L = Layout;
  const ScalarType I32 = ScalarType::Int;
  const std::array<Arg, 8> args = {
      arg("q", &mq, {ScalarType::Half, ScalarType::BFloat16}, -1, L::kContiguous,
          {S("R"), F(QSA_ATTN_HEADS), F(QSA_HEAD_DIM)}),
      arg("k_cache", &mk, {kFp8}, 0, L::kPaged, {S("P"), S("page_size"), F(1), F(QSA_HEAD_DIM)}),
      arg("v_cache", &mv, {}, 1, L::kPaged, {S("P"), S("page_size"), F(1), F(QSA_HEAD_DIM)}),
      arg("logical_indices", &mli, {I32}, -1, L::kRows, {S("R"), F(QSA_WIDTH)}),
      arg("page_table", &mpt, {I32}, -1, L::kRows, {S("B"), S("M")}),
      arg("token_to_req", &mtr, {I32}, -1, L::kContiguous, {S("R")}),
      arg("gate", mgate ? &*mgate : nullptr, {}, 0, L::kContiguous,
          {S("R"), F(QSA_ATTN_HEADS), F(QSA_HEAD_DIM)}),
      arg("out", &mout, {}, 0, L::kContiguous, {S("R"), F(QSA_ATTN_HEADS), F(QSA_HEAD_DIM)}),
  };
  check_tensors(args, std::array<SizeSource, 5>{{{"R", 0, 0},
                                                  {"P", 1, 0},
                                                  {"page_size", 1, 1},
                                                  {"B", 4, 0},
                                                  {"M", 4, 1}}});
  if (page_size <= 0 || page_size % kPageMultiple != 0)
    value_error("page_size must be a positive multiple of " + std::to_string(kPageMultiple) +
                ", got " + std::to_string(page_size));
  if (page_size != mk.sizes[1])
    value_error("page_size must be k_cache.shape[1] = " + std::to_string(mk.sizes[1]) + ", got " +
                std::to_string(page_size));
  AttentionScales scales{kDefaultSoftmaxScale, 1.0, 1.0};
  if (softmax_scale) scales.softmax = check_scale_value("softmax_scale", *softmax_scale);
  const bool fp8 = mk.dtype == kFp8;
  const std::pair<const char*, const char*> names[2] = {{"k_scale", "k_cache"},
                                                        {"v_scale", "v_cache"}};
  const std::optional<double>* given[2] = {&k_scale, &v_scale};
  double* resolved[2] = {&scales.k, &scales.v};
  for (int i = 0; i < 2; ++i) {
    if (fp8) {
      if (!*given[i])
        value_error(std::string(names[i].first) + " must be a float > 0 when " + names[i].second +
                    " is " + dtype_name(kFp8) + ", got None");
      *resolved[i] = check_scale_value(names[i].first, **given[i]);
    } else if (*given[i]) {
      value_error(std::string(names[i].first) + " must be None when " + names[i].second +
                  " is " + dtype_name(mk.dtype) + " (only " + dtype_name(kFp8) +
                  " caches are scaled), got " + fmt_float(**given[i]));
    }
  }
  check_storage(args);
  return scales;
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
  if (fn == nullptr) {
    throw std::runtime_error(
        "qsa: libtorch_cuda.so is not loaded: a CUDA build of torch is needed");
  }
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(fn(device, &stream));
  return static_cast<cudaStream_t>(stream);
}

// The kernels are compiled for one architecture (sm_90a): refuse any other device with the
// reason instead of failing inside a launch. The verdict is kept per device (first call only).
void check_capability(int device) {
  constexpr int kDevices = 64;
  static std::atomic<int8_t> verdict[kDevices] = {};  // 0 unknown, 1 supported, -1 not
  if (device >= 0 && device < kDevices && verdict[device].load(std::memory_order_relaxed) == 1)
    return;
  int major = 0, minor = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "qsa");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "qsa");
  const bool ok = major == 9 && minor == 0;
  if (device >= 0 && device < kDevices) verdict[device].store(ok ? 1 : -1);
  if (!ok)
    throw std::runtime_error("qsa kernels are built for " QSA_ARCH
                             " (compute capability 9.0), device cuda:" +
                             std::to_string(device) + " has " + std::to_string(major) + "." +
                             std::to_string(minor));
}

// The zeroed int32 counters of one (device, stream): the attention's, then the selection's.
int64_t counter_slots() { return qsa::attention_counter_slots() + qsa::select_counter_slots(); }

// Scratch bytes and zeroed int32 counters of one (device, stream), from torch's caching
// allocator. NOTES: a buffer is never freed once handed out (a CUDA graph captured earlier may
// point at it: growth keeps the old one in `retired`), and none is created or grown inside
// CUDA-graph capture: such a call takes a temporary from the graph's private pool instead
// (stream-ordered like any captured intermediate; warm up once before capture to avoid it).
struct Workspace {
  std::optional<Tensor> scratch;
  std::optional<Tensor> counters;
  std::vector<Tensor> retired;
  // NOTES: the temporaries of the capture in progress on this stream (from its graph's pool),
  // shared by that capture's calls, which run in stream order like the eager calls that share
  // `scratch` and `counters`: such a graph replays one zero fill, not one per call. Kept until
  // the next capture on this stream (a block of a destroyed graph's pool stays valid while held).
  unsigned long long capture_id = 0;
  std::optional<Tensor> capture_scratch;
  std::optional<Tensor> capture_counters;
};

struct WorkspaceView {
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  int32_t* counters = nullptr;
  std::optional<Tensor> keep;  // a capture-time temporary lives until the launch is enqueued
  std::optional<Tensor> keep_counters;
};

WorkspaceView workspace(const Tensor& like, int device, cudaStream_t stream, size_t bytes) {
  // Leaked on purpose: tensors must not be destroyed after torch shuts down at exit.
  static auto* mu = new std::mutex;
  static auto* all = new std::map<std::pair<int, cudaStream_t>, Workspace>;
  std::lock_guard<std::mutex> lock(*mu);
  Workspace& ws = (*all)[{device, stream}];
  WorkspaceView view;
  // Asked only when something must be allocated (the common call needs no runtime call here).
  auto capturing = [&] {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    check_cuda(cudaStreamGetCaptureInfo(stream, &capture, &id), "qsa workspace");
    if (capture == cudaStreamCaptureStatusNone) return false;
    if (id != ws.capture_id) {  // a new capture on this stream
      ws.capture_id = id;
      ws.capture_scratch.reset();
      ws.capture_counters.reset();
    }
    return true;
  };
  if (bytes > 0) {
    const int64_t have = ws.scratch ? ws.scratch->numel() : 0;
    if (have < static_cast<int64_t>(bytes)) {
      if (capturing()) {
        if (!ws.capture_scratch || ws.capture_scratch->numel() < static_cast<int64_t>(bytes))
          ws.capture_scratch =
              torch::stable::new_empty(like, {static_cast<int64_t>(bytes)}, ScalarType::Byte);
        view.keep = *ws.capture_scratch;
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
  if (!ws.counters) {
    if (capturing()) {  // the zero fill is captured too: every replay starts from zeros
      if (!ws.capture_counters)
        ws.capture_counters = torch::stable::new_zeros(like, {counter_slots()}, ScalarType::Int);
      view.keep_counters = *ws.capture_counters;
    } else {
      ws.counters = torch::stable::new_zeros(like, {counter_slots()}, ScalarType::Int);
    }
  }
  const Tensor& c = view.keep_counters ? *view.keep_counters : *ws.counters;
  view.counters = static_cast<int32_t*>(c.mutable_data_ptr());
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

// QSA_SELECT_PATH: "generic" makes every selection row take the generic path (mass-tie rows
// take it anyway); unset, empty or "auto" = the kernel decides. Tests run both paths with it.
bool select_generic_path() {
  const char* v = std::getenv("QSA_SELECT_PATH");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return false;
  if (std::strcmp(v, "generic") == 0) return true;
  throw std::runtime_error(std::string("QSA_SELECT_PATH must be 'auto' or 'generic', got '") + v +
                           "'");
}

// QSA_PDL: "0" launches the kernels of the three ops without programmatic dependent
// launch (csrc/qsa/qsa.h); unset, empty or "1" = with it. Read per call, like the two above.
bool pdl_enabled() {
  const char* v = std::getenv("QSA_PDL");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "1") == 0) return true;
  if (std::strcmp(v, "0") == 0) return false;
  throw std::runtime_error(std::string("QSA_PDL must be '0' or '1', got '") + v + "'");
}

constexpr int64_t kInt32Max = 2147483647;

// ---------------------------------------------------------------------------------------------
// Kernel parameters from the validated tensors (contract v2: every dtype and layout)
// ---------------------------------------------------------------------------------------------

qsa::DType kernel_dtype(ScalarType t) {
  return t == ScalarType::BFloat16 ? qsa::DType::kBFloat16
         : t == kFp8               ? qsa::DType::kFloat8E4M3
                                   : qsa::DType::kFloat16;
}

// Elements between rows of a 2-D argument (any value is fine for 0 or 1 rows).
int64_t row_stride(const Tensor& t) { return t.size(0) > 1 ? t.stride(0) : t.size(1); }

// ---------------------------------------------------------------------------------------------
// The ops
// ---------------------------------------------------------------------------------------------

void select_paged_tokens(Tensor q, Tensor ck, Tensor page_table, Tensor token_to_req,
                         Tensor query_positions, Tensor sequence_lengths, int64_t token_topk,
                         int64_t compress_ratio, Tensor out) {
  validate_select(q, ck, page_table, token_to_req, query_positions, sequence_lengths, token_topk,
                  compress_ratio, out);
  const int64_t rows = q.size(0), requests = page_table.size(0), width = page_table.size(1);
  const int64_t keys_per_page = ck.size(1);
  if (width * keys_per_page > kInt32Max)
    value_error("page_table width M times the keys per page C must be at most " +
                std::to_string(kInt32Max) + " for the CUDA kernels (M * C blocks index an " +
                "int32), got " + std::to_string(width) + " * " + std::to_string(keys_per_page));
  const int device = q.get_device();
  check_capability(device);
  const DeviceGuard guard(device, "select_paged_tokens: selecting the device");
  const cudaStream_t stream = current_stream(device);
  const bool generic = select_generic_path(), pdl = pdl_enabled();
  const WorkspaceView ws =
      workspace(q, device, stream, qsa::select_workspace_bytes(rows, width, keys_per_page));
  qsa::SelectParams p{};
  p.q = q.const_data_ptr();
  p.compressed_keys = ck.const_data_ptr();
  p.page_table = static_cast<const int32_t*>(page_table.const_data_ptr());
  p.token_to_req = static_cast<const int32_t*>(token_to_req.const_data_ptr());
  p.query_positions = static_cast<const int64_t*>(query_positions.const_data_ptr());
  p.sequence_lengths = static_cast<const int32_t*>(sequence_lengths.const_data_ptr());
  p.out = static_cast<int32_t*>(out.mutable_data_ptr());
  p.rows = rows;
  p.requests = requests;
  p.table_width = width;
  p.pages = ck.size(0);
  p.page_table_stride = row_stride(page_table);
  p.out_stride = row_stride(out);
  p.workspace = ws.scratch;
  p.workspace_bytes = ws.scratch_bytes;
  p.counters = ws.counters + qsa::attention_counter_slots();
  p.generic_path = generic;
  p.pdl = pdl;
  p.dtype = kernel_dtype(q.scalar_type());
  p.keys_per_page = keys_per_page;
  p.ck_page_stride = ck.stride(0);
  p.ck_row_stride = ck.stride(1);
  check_cuda(qsa::select_paged_tokens(p, stream), "select_paged_tokens");
}

void sparse_paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor logical_indices,
                            Tensor page_table, Tensor token_to_req, int64_t page_size, Tensor out,
                            std::optional<double> softmax_scale, std::optional<double> k_scale,
                            std::optional<double> v_scale, std::optional<Tensor> gate) {
  const AttentionScales scales =
      validate_attention(q, k_cache, v_cache, logical_indices, page_table, token_to_req,
                         page_size, out, softmax_scale, k_scale, v_scale, gate);
  const int64_t rows = q.size(0), pages = k_cache.size(0);
  const int64_t requests = page_table.size(0), width = page_table.size(1);
  const int device = q.get_device();
  check_capability(device);
  const DeviceGuard guard(device, "sparse_paged_attention: selecting the device");
  const cudaStream_t stream = current_stream(device);
  const int splits = requested_splits();
  const bool pdl = pdl_enabled();
  const WorkspaceView ws =
      workspace(q, device, stream, qsa::attention_workspace_bytes(rows, splits, device));
  qsa::AttentionParams p{};
  p.q = q.const_data_ptr();
  p.k_cache = k_cache.const_data_ptr();
  p.v_cache = v_cache.const_data_ptr();
  p.logical_indices = static_cast<const int32_t*>(logical_indices.const_data_ptr());
  p.page_table = static_cast<const int32_t*>(page_table.const_data_ptr());
  p.token_to_req = static_cast<const int32_t*>(token_to_req.const_data_ptr());
  p.out = out.mutable_data_ptr();
  p.gate = gate ? gate->const_data_ptr() : nullptr;
  p.rows = rows;
  p.requests = requests;
  p.table_width = width;
  p.pages = pages;
  p.page_size = page_size;
  p.k_page_stride = k_cache.stride(0);
  p.k_token_stride = k_cache.stride(1);
  p.v_page_stride = v_cache.stride(0);
  p.v_token_stride = v_cache.stride(1);
  p.indices_stride = row_stride(logical_indices);
  p.page_table_stride = row_stride(page_table);
  p.softmax_scale = static_cast<float>(scales.softmax);
  p.k_scale = static_cast<float>(scales.k);
  p.v_scale = static_cast<float>(scales.v);
  p.dtype = kernel_dtype(q.scalar_type());
  p.kv_dtype = kernel_dtype(k_cache.scalar_type());
  p.splits = splits;
  p.workspace = ws.scratch;
  p.workspace_bytes = ws.scratch_bytes;
  p.counters = ws.counters;
  p.pdl = pdl;
  check_cuda(qsa::sparse_paged_attention(p, stream), "sparse_paged_attention");
}

// qsa_check: validation only (any device), for the parity test.
void check_select(Tensor q, Tensor ck, Tensor page_table, Tensor token_to_req,
                  Tensor query_positions, Tensor sequence_lengths, int64_t token_topk,
                  int64_t compress_ratio, Tensor out) {
  validate_select(q, ck, page_table, token_to_req, query_positions, sequence_lengths, token_topk,
                  compress_ratio, out);
}

void check_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor logical_indices,
                     Tensor page_table, Tensor token_to_req, int64_t page_size, Tensor out,
                     std::optional<double> softmax_scale, std::optional<double> k_scale,
                     std::optional<double> v_scale, std::optional<Tensor> gate) {
  validate_attention(q, k_cache, v_cache, logical_indices, page_table, token_to_req, page_size,
                     out, softmax_scale, k_scale, v_scale, gate);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(qsa, CUDA, m) {
  m.impl("select_paged_tokens", TORCH_BOX(&select_paged_tokens));
  m.impl("sparse_paged_attention", TORCH_BOX(&sparse_paged_attention));
}

STABLE_TORCH_LIBRARY_IMPL(qsa_check, CompositeExplicitAutograd, m) {
  m.impl("select_paged_tokens", TORCH_BOX(&check_select));
  m.impl("sparse_paged_attention", TORCH_BOX(&check_attention));
}

// ---------------------------------------------------------------------------------------------
// Plain C entry points (read with ctypes by qsa_ops/ops.py): build facts and kernel geometry
// ---------------------------------------------------------------------------------------------

#define QSA_EXPORT extern "C" __attribute__((visibility("default")))

QSA_EXPORT const char* qsa_build_info_json() {
  static const std::string json = [] {
    int runtime = 0;
    cudaRuntimeGetVersion(&runtime);
    std::string s = "{\"backend\": \"cuda\", \"arch\": \"" QSA_ARCH "\", \"version\": \""
                    QSA_VERSION "\", \"source_sha256\": \"" QSA_SOURCE_SHA256
                    "\", \"cuda_runtime\": " +
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

// The split count a call would take now (QSA_ATTN_SPLITS read here, as by the op); -1 when the
// variable is malformed: the op's refusal then reads qsa_attention_splits_error(), so that the
// text exists once.
thread_local std::string splits_error;  // this thread's last refusal, "" after a success
QSA_EXPORT int qsa_attention_splits(int64_t rows, int device) {
  int requested = 0;
  try {
    requested = requested_splits();
  } catch (const std::exception& e) {
    splits_error = e.what();
    return -1;
  }
  splits_error.clear();
  return qsa::attention_splits(rows, requested, device);
}
QSA_EXPORT const char* qsa_attention_splits_error() { return splits_error.c_str(); }
// dtype: the name of q's torch dtype ("torch.float8_e4m3fn"); -1 for a dtype the selection
// does not take.
QSA_EXPORT int64_t qsa_select_launch_count(int64_t rows, int64_t table_width,
                                           int64_t keys_per_page, const char* dtype) {
  for (const ScalarType t : {ScalarType::Half, ScalarType::BFloat16, kFp8}) {
    if (dtype != nullptr && dtype_name(t) == dtype) {
      return qsa::select_launch_count(rows, table_width, keys_per_page, kernel_dtype(t));
    }
  }
  return -1;
}
QSA_EXPORT int64_t qsa_attention_launch_count(int64_t rows) {
  return qsa::attention_launch_count(rows);
}
