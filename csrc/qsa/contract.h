// The validated contract of the QSA operators (one rank of TP8): the C++ half of its one
// definition per language. qsa_ops/contract.py holds the Python half; tests/cpu/test_contract.py
// reads this file and compares the two, and the compiled library reports these values
// (qsa_build_info_json), which qsa_ops checks against contract.py when it loads them.
#pragma once

#define QSA_TOKEN_TOPK 2048     // tokens chosen by the indexer
#define QSA_COMPRESS_RATIO 4    // tokens per compressed key (one block)
#define QSA_BLOCK_TOPK 512      // = QSA_TOKEN_TOPK / QSA_COMPRESS_RATIO
#define QSA_TAIL 3              // at most QSA_COMPRESS_RATIO - 1 trailing tokens
#define QSA_WIDTH 2051          // = QSA_TOKEN_TOPK + QSA_TAIL, row width of the index tensor
#define QSA_KV_PAGE 512         // tokens per KV-cache page
#define QSA_CK_PAGE 128         // compressed keys per page = QSA_KV_PAGE / QSA_COMPRESS_RATIO
#define QSA_ATTN_HEADS 3        // attention query heads (one KV head)
#define QSA_HEAD_DIM 256        // attention head dimension
#define QSA_INDEX_HEADS 4       // indexer heads
#define QSA_INDEX_DIM 128       // indexer head dimension

static_assert(QSA_BLOCK_TOPK * QSA_COMPRESS_RATIO == QSA_TOKEN_TOPK, "BLOCK_TOPK = TOPK / RATIO");
static_assert(QSA_TAIL == QSA_COMPRESS_RATIO - 1, "TAIL = RATIO - 1");
static_assert(QSA_WIDTH == QSA_TOKEN_TOPK + QSA_TAIL, "WIDTH = TOPK + TAIL");
static_assert(QSA_CK_PAGE * QSA_COMPRESS_RATIO == QSA_KV_PAGE, "CK_PAGE = KV_PAGE / RATIO");
