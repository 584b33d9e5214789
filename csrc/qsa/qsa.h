// QSA kernels: torch-free interface (pointers, sizes, strides, cudaStream_t -> cudaError_t).
//
// The op layer (csrc/torch_ops.cpp) validates every argument against the contract before it
// calls in here; these entry points only launch. Every launch is followed by
// cudaGetLastError() and the first error is returned. Grid sizes depend on the shapes only,
// nothing is read back to the host, and nothing is allocated: the entry points are safe inside
// CUDA-graph capture. Contract constants: contract.h (QSA_*).
//
// pdl (selection, attention): the launch carries the programmatic-dependent-launch
// attribute, so that its CTAs may become resident while the kernel before it in the stream
// finishes; each kernel waits for that kernel's completion before its first global access,
// and lets the kernel after it start once its own heavy traffic is issued. Results are the
// same with and without it; the op layer sets it unless QSA_PDL=0.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "contract.h"

namespace qsa {

// Element types of the tensors a kernel reads (contract v2).
enum class DType : int32_t { kFloat16 = 0, kBFloat16 = 1, kFloat8E4M3 = 2 };

// ---------------------------------------------------------------------------------------------
// Selection: select_paged_tokens
// ---------------------------------------------------------------------------------------------
struct SelectParams {
  const void* q;                  // [R, 4, 128] `dtype`, contiguous
  const void* compressed_keys;    // [P, C, 1, 128] `dtype`: element (p, c, 0, d) at
                                  // p * ck_page_stride + c * ck_row_stride + d (elements);
                                  // data pointer and both strides 16-byte aligned
  const int32_t* page_table;      // [B, M] int32, row stride page_table_stride
  const int32_t* token_to_req;    // [R] int32
  const int64_t* query_positions; // [R] int64
  const int32_t* sequence_lengths;// [B] int32
  int32_t* out;                   // [R, 2051] int32, row stride out_stride
  int64_t rows;                   // R
  int64_t requests;               // B
  int64_t table_width;            // M
  int64_t pages;                  // P
  int64_t page_table_stride;      // elements between page_table rows (M when contiguous)
  int64_t out_stride;             // elements between out rows (2051 when contiguous)
  void* workspace;                // >= select_workspace_bytes(rows, table_width, keys_per_page)
  size_t workspace_bytes;
  int32_t* counters;              // >= select_counter_slots() int32, zero on first use;
                                  // every call leaves them zero again, but the pairs
                                  // select's row counters a multiple of their epoch
  bool generic_path;              // every row through the generic select (tests)
  bool pdl;                       // launched with programmatic dependent launch (see above)
  DType dtype = DType::kFloat16;  // q and the compressed keys (fp16, bf16 or fp8-e4m3)
  int64_t keys_per_page = QSA_CK_PAGE;                 // C: block j at row j % C of page j / C
  int64_t ck_page_stride = QSA_CK_PAGE * QSA_INDEX_DIM;  // elements between pages
  int64_t ck_row_stride = QSA_INDEX_DIM;                 // elements between a page's rows
};

// Bytes of scratch the selection needs: one uint32 score key per candidate block of a group
// of rows (rows are processed in groups so that the scratch stays bounded).
// keys_per_page: C (M * C candidate blocks per row).
size_t select_workspace_bytes(int64_t rows, int64_t table_width,
                              int64_t keys_per_page = QSA_CK_PAGE);
// Row-arrival counters of the fused kernel (one per row of a group, and the pairs select's).
int64_t select_counter_slots();
// Number of kernel launches one call makes: 1 per row group, whatever the dtype (0 when
// rows == 0).
int64_t select_launch_count(int64_t rows, int64_t table_width,
                            int64_t keys_per_page = QSA_CK_PAGE, DType dtype = DType::kFloat16);
cudaError_t select_paged_tokens(const SelectParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Sparse attention: sparse_paged_attention over a paged K/V cache
// ---------------------------------------------------------------------------------------------
struct AttentionParams {
  const void* q;                   // [R, 3, 256] `dtype` (fp16 or bf16), contiguous
  const void* k_cache;             // [P, page_size, 1, 256] `kv_dtype`: token (p, i) at
                                   // p * k_page_stride + i * k_token_stride (elements);
                                   // data pointer and strides 16-byte aligned
  const void* v_cache;             // the same for V (may share K's storage: packed K then V)
  const int32_t* logical_indices;  // [R, 2051] int32, row stride indices_stride
  const int32_t* page_table;       // [B, M] int32, row stride page_table_stride
  const int32_t* token_to_req;     // [R] int32
  void* out;                       // [R, 3, 256] `dtype`, contiguous
  const void* gate;                // [R, 3, 256] `dtype`, contiguous, or null:
                                   // out = dtype(float(dtype(attn)) * sigmoid(float(gate)))
  int64_t rows;                    // R
  int64_t requests;                // B
  int64_t table_width;             // M
  int64_t pages;                   // P
  int64_t page_size;               // tokens per page (> 0)
  int64_t k_page_stride;           // elements
  int64_t k_token_stride;
  int64_t v_page_stride;
  int64_t v_token_stride;
  int64_t indices_stride;          // elements between logical_indices rows
  int64_t page_table_stride;       // elements between page_table rows
  float softmax_scale;
  float k_scale;                   // fp8 caches: K = float(k) * k_scale (folded into the
                                   // softmax scale); 1 otherwise
  float v_scale;                   // fp8 caches: V = float(v) * v_scale (applied to the
                                   // output); 1 otherwise
  DType dtype;                     // q, out, gate: kFloat16 or kBFloat16
  DType kv_dtype;                  // the caches: `dtype` or kFloat8E4M3
  int splits;                      // CTAs per row; 0 = attention_splits(rows, device)
  void* workspace;                 // >= attention_workspace_bytes(rows, splits, device) bytes
  size_t workspace_bytes;
  int32_t* counters;               // >= attention_counter_slots() int32, zero on first use;
                                   // the cluster kernel's slots are left zero, the decode-size
                                   // kernel's row counters a multiple of 128 (epochs)
  bool pdl;                        // launched with programmatic dependent launch (see above)
};

// How many CTAs share one row (the split of the 2051 columns); 1 for large R.
// requested > 0 overrides the heuristic (clamped to what the kernel supports).
int attention_splits(int64_t rows, int requested, int device);
// Scratch for the per-split partial results (0 when splits == 1).
size_t attention_workspace_bytes(int64_t rows, int requested, int device);
// Row-completion counters the last-CTA merge needs.
int64_t attention_counter_slots();
int64_t attention_launch_count(int64_t rows);
cudaError_t sparse_paged_attention(const AttentionParams& p, cudaStream_t stream);

}  // namespace qsa
