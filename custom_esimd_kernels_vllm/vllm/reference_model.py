"""Pure-PyTorch reference of a ``Qwen38QSAForCausalLM`` checkpoint (no vLLM): greedy decoding.

Independent of the vLLM integration except for the model definition itself: one request,
contiguous per-layer K/V arrays, caches rebuilt for every step with an identity page table,
and the package's *reference* operators (``qsa_ops.reference``) for selection and attention,
so vLLM's paging, slot mapping, batching and incremental compressed-key writes are all
checked against it. Each tensor-parallel group (3 query heads, 1 KV head, 4 indexer heads)
is computed separately, as its rank would.

Numerics follow the served model: float32 everywhere except what the QSA caches and
operators hold in float16 (q, k, v, indexer q, compressed keys, attention output).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..qsa_ops import reference
from ..qsa_ops.contract import (
    ATTN_HEADS,
    CK_PAGE,
    COMPRESS_RATIO,
    HEAD_DIM,
    INDEX_DIM,
    INDEX_HEADS,
    KV_PAGE,
    WIDTH,
)
from . import paging
from .qsa_config import QSAConfig

HALF = torch.float16


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (rotate halves), float32: x [T, H, D], positions [T]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class QSAReferenceModel:
    def __init__(self, model_dir: str | Path) -> None:
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        self.config = json.loads((model_dir / "config.json").read_text())
        self.qsa = QSAConfig.from_hf(self.config)
        self.groups = self.qsa.num_kv_heads  # one tensor-parallel rank each
        self.qsa.check_rank(self.groups)
        self.w = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        self.eps = float(self.config["rms_norm_eps"])
        rope = self.config.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta", self.config.get("rope_theta", 1e6)))
        self.layers = int(self.config["num_hidden_layers"])
        self.reset()

    def reset(self) -> None:
        # per layer: K, V [N, G, 256] float16 of every stored token
        self.k = [None] * self.layers
        self.v = [None] * self.layers

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * weight

    def _qsa(self, layer: int, group: int, q, iq, positions, index_wk) -> torch.Tensor:
        """Attention of one group for the new rows: q [R,3,256], iq [R,4,128] float16."""
        k_all = self.k[layer][:, group]  # [N, 256]
        v_all = self.v[layer][:, group]
        n = k_all.shape[0]
        pages = -(-n // KV_PAGE)
        views, ck_cache = paging.allocate(pages)
        packed = views.packed.view(-1, 2 * HEAD_DIM)
        packed[:n, :HEAD_DIM] = k_all
        packed[:n, HEAD_DIM:] = v_all
        blocks = n // COMPRESS_RATIO
        if blocks:
            keys = k_all[: blocks * COMPRESS_RATIO].view(blocks, COMPRESS_RATIO, HEAD_DIM)
            ck_cache.view(pages * CK_PAGE, INDEX_DIM)[:blocks] = paging.compress_keys(
                keys, index_wk
            )
        rows = q.shape[0]
        page_table = torch.arange(pages, dtype=torch.int32)[None, :]
        token_to_req = torch.zeros(rows, dtype=torch.int32)
        seq_lens = torch.tensor([n], dtype=torch.int32)
        selected = torch.empty(rows, WIDTH, dtype=torch.int32)
        reference.select_paged_tokens_ref(
            iq, ck_cache, page_table, token_to_req, positions, seq_lens, selected
        )
        self.last_selected = selected
        out = torch.empty(rows, ATTN_HEADS, HEAD_DIM, dtype=HALF)
        reference.sparse_paged_attention_ref(
            q, views.k_cache, views.v_cache, selected, page_table, token_to_req, out, HEAD_DIM**-0.5
        )
        return out

    @torch.no_grad()
    def forward(self, token_ids: list[int], start: int) -> torch.Tensor:
        """Run new tokens at positions start.. (the cache holds exactly ``start`` tokens);
        returns the float32 logits of the last one."""
        w, g = self.w, self.groups
        positions = torch.arange(start, start + len(token_ids), dtype=torch.int64)
        x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            q = F.linear(h, w[p + "self_attn.q_proj.weight"]).view(-1, g * ATTN_HEADS, HEAD_DIM)
            k = F.linear(h, w[p + "self_attn.k_proj.weight"]).view(-1, g, HEAD_DIM)
            v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(-1, g, HEAD_DIM)
            q = _rope(self._norm(q, w[p + "self_attn.q_norm.weight"]), positions, self.theta)
            k = _rope(self._norm(k, w[p + "self_attn.k_norm.weight"]), positions, self.theta)
            iq = F.linear(h, w[p + "self_attn.index_wq.weight"]).view(
                -1, g * INDEX_HEADS, INDEX_DIM
            )
            k16, v16 = k.to(HALF), v.to(HALF)
            self.k[i] = k16 if self.k[i] is None else torch.cat([self.k[i], k16])
            self.v[i] = v16 if self.v[i] is None else torch.cat([self.v[i], v16])
            wk = w[p + "self_attn.index_wk.weight"].view(g, INDEX_DIM, HEAD_DIM)
            heads = [
                self._qsa(
                    i,
                    grp,
                    q[:, grp * ATTN_HEADS : (grp + 1) * ATTN_HEADS].to(HALF).contiguous(),
                    iq[:, grp * INDEX_HEADS : (grp + 1) * INDEX_HEADS].to(HALF).contiguous(),
                    positions,
                    wk[grp],
                )
                for grp in range(g)
            ]
            attn = torch.cat(heads, dim=1).float().reshape(len(token_ids), -1)
            x = x + F.linear(attn, w[p + "self_attn.o_proj.weight"])
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            mlp = F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) * F.linear(
                h, w[p + "mlp.up_proj.weight"]
            )
            x = x + F.linear(mlp, w[p + "mlp.down_proj.weight"])
        x = self._norm(x[-1:], w["model.norm.weight"])
        return F.linear(x, w["lm_head.weight"])[0]

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy token ids after ``prompt_ids`` (argmax, lowest id on exact ties)."""
        self.reset()
        logits = self.forward(list(prompt_ids), 0)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(torch.argmax(logits))
            out.append(token)
            if len(out) == max_new_tokens:
                break
            logits = self.forward([token], len(prompt_ids) + len(out) - 1)
        return out
