// Development shim (GPU host, not part of the package): the torch-free kernel entry points of
// csrc/qsa behind extern "C" functions that ctypes can call with raw pointers, so that
// scripts/v2_harness.py can check and time the kernels of one build against another (and
// against upstream) in one run, without the op layer. Built by scripts/build_v2_harness.sh,
// once against this tree's kernels (QSA_SHIM_V2) and once against a baseline commit's.
#include <cstdint>

#include "qsa.h"

extern "C" {

#ifdef QSA_SHIM_V2
int shim_attention(const void* q, const void* k, const void* v, const int32_t* idx,
                   const int32_t* table, const int32_t* t2r, void* out, const void* gate,
                   int64_t rows, int64_t requests, int64_t width, int64_t pages, int64_t page_size,
                   int64_t kps, int64_t kts, int64_t vps, int64_t vts, int64_t idx_stride,
                   int64_t table_stride, float scale, float k_scale, float v_scale, int dtype,
                   int kv_dtype, int splits, void* ws, uint64_t ws_bytes, int32_t* counters,
                   int pdl, void* stream) {
  qsa::AttentionParams p{};
  p.q = q;
  p.k_cache = k;
  p.v_cache = v;
  p.logical_indices = idx;
  p.page_table = table;
  p.token_to_req = t2r;
  p.out = out;
  p.gate = gate;
  p.rows = rows;
  p.requests = requests;
  p.table_width = width;
  p.pages = pages;
  p.page_size = page_size;
  p.k_page_stride = kps;
  p.k_token_stride = kts;
  p.v_page_stride = vps;
  p.v_token_stride = vts;
  p.indices_stride = idx_stride;
  p.page_table_stride = table_stride;
  p.softmax_scale = scale;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  p.dtype = static_cast<qsa::DType>(dtype);
  p.kv_dtype = static_cast<qsa::DType>(kv_dtype);
  p.splits = splits;
  p.workspace = ws;
  p.workspace_bytes = ws_bytes;
  p.counters = counters;
  p.pdl = pdl != 0;
  return static_cast<int>(qsa::sparse_paged_attention(p, static_cast<cudaStream_t>(stream)));
}

int shim_select(const void* q, const void* ck, const int32_t* table, const int32_t* t2r,
                const int64_t* pos, const int32_t* lens, int32_t* out, int64_t rows,
                int64_t requests, int64_t width, int64_t pages, int64_t table_stride,
                int64_t out_stride, int64_t c, int64_t cps, int64_t crs, int dtype, void* ws,
                uint64_t ws_bytes, int32_t* counters, int generic, int pdl, void* stream) {
  qsa::SelectParams p{};
  p.q = q;
  p.compressed_keys = ck;
  p.page_table = table;
  p.token_to_req = t2r;
  p.query_positions = pos;
  p.sequence_lengths = lens;
  p.out = out;
  p.rows = rows;
  p.requests = requests;
  p.table_width = width;
  p.pages = pages;
  p.page_table_stride = table_stride;
  p.out_stride = out_stride;
  p.workspace = ws;
  p.workspace_bytes = ws_bytes;
  p.counters = counters;
  p.generic_path = generic != 0;
  p.pdl = pdl != 0;
  p.dtype = static_cast<qsa::DType>(dtype);
  p.keys_per_page = c;
  p.ck_page_stride = cps;
  p.ck_row_stride = crs;
  return static_cast<int>(qsa::select_paged_tokens(p, static_cast<cudaStream_t>(stream)));
}

uint64_t shim_select_ws(int64_t rows, int64_t width, int64_t c) {
  return qsa::select_workspace_bytes(rows, width, c);
}
#else
// The seed's kernels: exact-packed fp16 K/V ([P, 512, 512]), C = 128 contiguous keys.
int shim_attention(const void* q, const void* kv, const int32_t* idx, const int32_t* table,
                   const int32_t* t2r, void* out, int64_t rows, int64_t requests, int64_t width,
                   int64_t pages, int64_t idx_stride, int64_t table_stride, float scale,
                   int splits, void* ws, uint64_t ws_bytes, int32_t* counters, int pdl,
                   void* stream) {
  const qsa::AttentionParams p{q,      kv,          idx,   table,     t2r,         out,
                               rows,   requests,    width, pages,     idx_stride,  table_stride,
                               scale,  splits,      ws,    ws_bytes,  counters,    pdl != 0};
  return static_cast<int>(qsa::sparse_paged_attention(p, static_cast<cudaStream_t>(stream)));
}

int shim_select(const void* q, const void* ck, const int32_t* table, const int32_t* t2r,
                const int64_t* pos, const int32_t* lens, int32_t* out, int64_t rows,
                int64_t requests, int64_t width, int64_t pages, int64_t table_stride,
                int64_t out_stride, void* ws, uint64_t ws_bytes, int32_t* counters, int generic,
                int pdl, void* stream) {
  const qsa::SelectParams p{q,     ck,    table,        t2r,        pos,  lens,     out,
                            rows,  requests, width,     pages,      table_stride, out_stride,
                            ws,    ws_bytes, counters,  generic != 0, pdl != 0};
  return static_cast<int>(qsa::select_paged_tokens(p, static_cast<cudaStream_t>(stream)));
}

uint64_t shim_select_ws(int64_t rows, int64_t width, int64_t c) {
  (void)c;
  return qsa::select_workspace_bytes(rows, width);
}
#endif

uint64_t shim_attention_ws(int64_t rows, int splits, int device) {
  return qsa::attention_workspace_bytes(rows, splits, device);
}
int64_t shim_attention_counters() { return qsa::attention_counter_slots(); }
int64_t shim_select_counters() { return qsa::select_counter_slots(); }
int shim_attention_splits(int64_t rows, int splits, int device) {
  return qsa::attention_splits(rows, splits, device);
}
}
