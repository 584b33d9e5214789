// pybind11 module custom_esimd_kernels_vllm._qsa_cuda: declarations only.
//
// Torch-free: tensors arrive as raw device pointers (ints), sizes and strides, the stream as
// the raw cudaStream_t handle of torch.cuda.current_stream(). The Python adapter
// (qsa_ops/_cuda.py) validates everything first; a CUDA error becomes a RuntimeError.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

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

namespace py = pybind11;
using ptr_t = std::uintptr_t;

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": CUDA error " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

// Makes `device` current for one call and restores the caller's device afterwards: the
// driver context is shared with torch's runtime, so a leaked cudaSetDevice would silently
// change torch.cuda.current_device().
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* what) : device_(device) {
    check(cudaGetDevice(&previous_), what);
    if (previous_ != device_) check(cudaSetDevice(device_), what);
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

template <typename T>
T* as_ptr(ptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace

PYBIND11_MODULE(_qsa_cuda, m) {
  m.doc() = "QSA CUDA kernels (private; use custom_esimd_kernels_vllm.qsa_ops)";

  m.def(
      "select_paged_tokens",
      [](int device, ptr_t q, ptr_t compressed_keys, ptr_t page_table, ptr_t token_to_req,
         ptr_t query_positions, ptr_t sequence_lengths, ptr_t out, int64_t rows, int64_t requests,
         int64_t table_width, int64_t pages, int64_t page_table_stride, int64_t out_stride,
         ptr_t workspace, size_t workspace_bytes, ptr_t stream) {
        const DeviceGuard guard(device, "select_paged_tokens: selecting the device");
        const qsa::SelectParams p{as_ptr<const void>(q), as_ptr<const void>(compressed_keys),
                                  as_ptr<const int32_t>(page_table),
                                  as_ptr<const int32_t>(token_to_req),
                                  as_ptr<const int64_t>(query_positions),
                                  as_ptr<const int32_t>(sequence_lengths), as_ptr<int32_t>(out),
                                  rows, requests, table_width, pages, page_table_stride,
                                  out_stride, as_ptr<void>(workspace), workspace_bytes};
        check(qsa::select_paged_tokens(p, as_ptr<CUstream_st>(stream)), "select_paged_tokens");
      },
      py::arg("device"), py::arg("q"), py::arg("compressed_keys"), py::arg("page_table"),
      py::arg("token_to_req"), py::arg("query_positions"), py::arg("sequence_lengths"),
      py::arg("out"), py::arg("rows"), py::arg("requests"), py::arg("table_width"),
      py::arg("pages"), py::arg("page_table_stride"), py::arg("out_stride"), py::arg("workspace"),
      py::arg("workspace_bytes"), py::arg("stream"));

  m.def(
      "sparse_paged_attention",
      [](int device, ptr_t q, ptr_t kv, ptr_t logical_indices, ptr_t page_table,
         ptr_t token_to_req, ptr_t out, int64_t rows, int64_t requests, int64_t table_width,
         int64_t pages, int64_t indices_stride, int64_t page_table_stride, float softmax_scale,
         int splits, ptr_t workspace, size_t workspace_bytes, ptr_t counters, ptr_t stream) {
        const DeviceGuard guard(device, "sparse_paged_attention: selecting the device");
        const qsa::AttentionParams p{as_ptr<const void>(q), as_ptr<const void>(kv),
                                     as_ptr<const int32_t>(logical_indices),
                                     as_ptr<const int32_t>(page_table),
                                     as_ptr<const int32_t>(token_to_req), as_ptr<void>(out), rows,
                                     requests, table_width, pages, indices_stride,
                                     page_table_stride, softmax_scale, splits,
                                     as_ptr<void>(workspace),
                                     workspace_bytes, as_ptr<int32_t>(counters)};
        check(qsa::sparse_paged_attention(p, as_ptr<CUstream_st>(stream)),
              "sparse_paged_attention");
      },
      py::arg("device"), py::arg("q"), py::arg("kv"), py::arg("logical_indices"),
      py::arg("page_table"), py::arg("token_to_req"), py::arg("out"), py::arg("rows"),
      py::arg("requests"), py::arg("table_width"), py::arg("pages"), py::arg("indices_stride"),
      py::arg("page_table_stride"), py::arg("softmax_scale"), py::arg("splits"),
      py::arg("workspace"),
      py::arg("workspace_bytes"), py::arg("counters"), py::arg("stream"));

  m.def("select_workspace_bytes", &qsa::select_workspace_bytes, py::arg("rows"),
        py::arg("table_width"));
  m.def("select_launch_count", &qsa::select_launch_count, py::arg("rows"), py::arg("table_width"));
  m.def("attention_splits", &qsa::attention_splits, py::arg("rows"), py::arg("requested"),
        py::arg("device"));
  m.def("attention_workspace_bytes", &qsa::attention_workspace_bytes, py::arg("rows"),
        py::arg("requested"), py::arg("device"));
  m.def("attention_counter_slots", &qsa::attention_counter_slots);
  m.def("attention_launch_count", &qsa::attention_launch_count, py::arg("rows"));

  m.def("build_info", [] {
    py::dict macros;
    macros["QSA_TOKEN_TOPK"] = QSA_TOKEN_TOPK;
    macros["QSA_COMPRESS_RATIO"] = QSA_COMPRESS_RATIO;
    macros["QSA_BLOCK_TOPK"] = QSA_BLOCK_TOPK;
    macros["QSA_TAIL"] = QSA_TAIL;
    macros["QSA_WIDTH"] = QSA_WIDTH;
    macros["QSA_KV_PAGE"] = QSA_KV_PAGE;
    macros["QSA_CK_PAGE"] = QSA_CK_PAGE;
    macros["QSA_ATTN_HEADS"] = QSA_ATTN_HEADS;
    macros["QSA_HEAD_DIM"] = QSA_HEAD_DIM;
    macros["QSA_INDEX_HEADS"] = QSA_INDEX_HEADS;
    macros["QSA_INDEX_DIM"] = QSA_INDEX_DIM;
    int runtime = 0;
    cudaRuntimeGetVersion(&runtime);
    py::dict info;
    info["backend"] = "cuda";
    info["arch"] = QSA_ARCH;
    info["macros"] = macros;
    info["version"] = QSA_VERSION;
    info["source_sha256"] = QSA_SOURCE_SHA256;
    info["cuda_runtime"] = runtime;
    return info;
  });
}
