"""An independent oracle: Hugging Face transformers' own Qwen4Exp QSA layer.

A tiny random Qwen4Exp QSA attention layer (transformers' ``Qwen4ExpTextAttention``, bfloat16,
the contract's shapes: 3 query heads and 1 KV head of 256, an indexer of 4 x 128, budget 2048,
ratio 4) runs a prefill longer than 2,051 tokens, so that its last rows select sparsely. What it
computes inside is recorded as it runs (a torch function mode sees the indexer's block scores,
queries and block keys, and the gate; the attention kernel and the output projection are
observed from outside), and the same quantities go through our operators on a paged cache in
vLLM's layout:

* the indexer's block scores equal ours (``reference.block_scores``) to float32 rounding;
* the chosen set of every checked row equals transformers' (its top-k has no tie order: sets
  are compared, blocks whose score lies within the rounding bound of the cut excepted);
* our gated attention over transformers' selection, and transformers' own output, are both
  the contract's float64 quantity: ours within 2e-3, transformers' within its bfloat16
  arithmetic (weights rounded to bfloat16 before the value product: measured ~5e-3).
"""

from __future__ import annotations

import math

import pytest
import torch

from custom_esimd_kernels_vllm import qsa_ops
from custom_esimd_kernels_vllm.qsa_ops import contract, reference, testing

modeling = pytest.importorskip(
    "transformers.models.qwen4_exp.modeling_qwen4_exp",
    reason="transformers with Qwen4Exp (5.16.1 or later) is not installed",
)
from transformers import Qwen4ExpTextConfig  # noqa: E402

TOKENS = 2112  # > 2051 + 4: the last rows see more than 512 blocks
CHECKED = [5, 700, 2050, 2051, 2060, 2093, 2111]  # dense rows, then sparse ones
TRANSFORMERS_BAND = 1e-2  # bf16 weights before the value product (measured ~5e-3)


def _config() -> Qwen4ExpTextConfig:
    config = Qwen4ExpTextConfig(
        vocab_size=64, hidden_size=256, num_hidden_layers=1, layer_types=["indexed_attention"],
        num_attention_heads=3, num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6,
        max_position_embeddings=4096, output_gate_type="sigmoid",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
        indexer_compress_ratio=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return config


class _Recorder(torch.overrides.TorchFunctionMode):
    """Records the indexer's block scores (its topk input), the matmul operands of each
    query row and the attention's gate (the sigmoid input)."""

    def __init__(self):
        super().__init__()
        self.scores, self.operands, self.gates = [], [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.topk:
            self.scores.append(args[0].detach().clone())
        elif func is torch.matmul and args[0].dim() == 2 and args[0].shape == (4, 128):
            self.operands.append((args[0].detach().clone(), args[1].detach().clone()))
        elif func is torch.sigmoid:
            self.gates.append(args[0].detach().clone())
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def layer_run():
    torch.manual_seed(0)
    config = _config()
    attn = modeling.Qwen4ExpTextAttention(config, 0).to(torch.bfloat16).eval()
    rotary = modeling.Qwen4ExpTextRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            std = 0.1 if "norm" in name else 1.0 / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    hidden = torch.randn(1, TOKENS, 256, generator=gen).to(torch.bfloat16)
    positions = torch.arange(TOKENS)[None]
    cos_sin = rotary(hidden, positions)
    causal = torch.ones(TOKENS, TOKENS, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, TOKENS, TOKENS, dtype=torch.bfloat16)
    mask.masked_fill_(~causal, torch.finfo(torch.bfloat16).min)

    seen = {}

    def eager(module, query, key, value, attention_mask, scaling, **kw):
        seen.update(query=query, key=key, value=value, mask=attention_mask, scaling=scaling)
        return modeling.eager_attention_forward(module, query, key, value, attention_mask,
                                                scaling, **kw)  # fmt: skip

    config._attn_implementation = "qsa_oracle"
    modeling.ALL_ATTENTION_FUNCTIONS["qsa_oracle"] = eager
    pre = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.update(gated=a[0].clone()))
    recorder = _Recorder()
    try:
        with torch.no_grad(), recorder:
            attn(hidden, cos_sin, mask)
    finally:
        pre.remove()
        del modeling.ALL_ATTENTION_FUNCTIONS["qsa_oracle"]
    return recorder, seen


def _block_keys(recorder) -> torch.Tensor:
    """The block keys of the last row (every block of the prefill), bfloat16 [J, 128]."""
    return recorder.operands[-1][1].transpose(0, 1).to(torch.bfloat16)


def _query(recorder, rows) -> torch.Tensor:
    """The indexer's (normed, rotated) queries of ``rows``: [R, 4, 128] bfloat16. The matmul
    runs once per row with at least one complete block (from position 3 on)."""
    return torch.stack([recorder.operands[r - 3][0] for r in rows]).to(torch.bfloat16)


def test_indexer_scores_equal_ours(layer_run):
    recorder, _ = layer_run
    keys = _block_keys(recorder)
    q = _query(recorder, CHECKED)
    for k, r in enumerate(CHECKED):
        blocks = (r + 1) // 4
        theirs = recorder.scores[r - 3].double()
        ours = reference.block_scores(q[k : k + 1], keys[None, :blocks])[0].double()
        bound = 1e-5 * float(theirs.abs().max())  # float32 sums in another order
        assert float((ours - theirs).abs().max()) <= bound, f"row {r}"


def _paged(keys: torch.Tensor, per_page: int, layers: int, gen):
    """keys [J, D] -> (cache [P, per_page, 1, D] in a layer-spanning layout, page_table [1, M])
    with the logical pages on shuffled physical pages."""
    pages = -(-keys.shape[0] // per_page)
    perm = torch.randperm(pages, generator=gen)
    values = torch.zeros(pages, per_page, 1, keys.shape[-1], dtype=keys.dtype)
    values.view(-1, keys.shape[-1])[: keys.shape[0]] = keys
    physical = torch.empty_like(values)
    physical[perm] = values
    _, cache = testing.paged_cache(physical, layers, "cpu")
    return cache, perm[None].to(torch.int32)


def test_chosen_sets_equal_transformers(layer_run):
    recorder, seen = layer_run
    keys = _block_keys(recorder)
    gen = torch.Generator().manual_seed(2)
    cache, table = _paged(keys, 196, 3, gen)  # vLLM's 784-token pages: 196 keys each
    q = _query(recorder, CHECKED)
    rows = len(CHECKED)
    _, out = testing._rows_view(rows, contract.WIDTH, 2052, torch.int32, "cpu")
    qsa_ops.select_paged_tokens(
        q, cache, table, torch.zeros(rows, dtype=torch.int32), torch.tensor(CHECKED),
        torch.tensor([TOKENS], dtype=torch.int32), 2048, 4, out,
    )  # fmt: skip
    selected = seen["mask"][0, 0] == 0  # transformers' causal & selected mask, [T, T]
    for k, r in enumerate(CHECKED):
        row = out[k]
        ours = set(row[row >= 0].tolist())
        theirs = set(selected[r].nonzero().flatten().tolist())
        scores = recorder.scores[r - 3].double()
        blocks = scores.numel()
        if blocks > contract.BLOCK_TOPK:  # tokens of blocks within the bound of the cut
            cut = float(scores.sort(descending=True).values[contract.BLOCK_TOPK - 1])
            tol = testing.SELECTION_TOLERANCE * float(scores.abs().max())
            near = (scores - cut).abs() <= tol
            ambiguous = {4 * j + i for j in near.nonzero().flatten().tolist() for i in range(4)}
            assert (r + 1) // 4 > contract.BLOCK_TOPK and len(ours) == 2048 + (r + 1) % 4
        else:
            ambiguous = set()
            assert ours == set(range(r + 1)), f"row {r}: a dense row selects every token"
        assert not ((ours ^ theirs) - ambiguous), f"row {r}: {sorted(ours ^ theirs)[:8]}"


def test_gated_attention_equals_transformers(layer_run):
    recorder, seen = layer_run
    rows = torch.tensor(CHECKED)
    q = seen["query"][0].transpose(0, 1)[rows].contiguous()  # [R, 3, 256]
    key, value = seen["key"][0, 0], seen["value"][0, 0]  # [T, 256]
    gate = recorder.gates[-1][0].view(TOKENS, 3, 256)[rows].contiguous()
    selected = seen["mask"][0, 0][rows] == 0
    indices = torch.full((len(CHECKED), contract.WIDTH), -1, dtype=torch.int32)
    for k in range(len(CHECKED)):
        tokens = selected[k].nonzero().flatten()
        indices[k, : tokens.numel()] = tokens.to(torch.int32)
    lay = testing.Layout(dtype=torch.bfloat16, page_size=784, layers=4, gate=True)
    gen = torch.Generator().manual_seed(3)
    pages = -(-TOKENS // 784)
    values = torch.zeros(pages * 784, 512, dtype=torch.bfloat16)
    values[:TOKENS, :256], values[:TOKENS, 256:] = key, value
    perm = torch.randperm(pages, generator=gen)
    physical = torch.empty(pages, 784, 512, dtype=torch.bfloat16)
    physical[perm] = values.view(pages, 784, 512)
    case = testing._attention_case(
        "transformers", q, physical, indices, [perm.tolist()], [0] * len(CHECKED), "cpu",
        float(seen["scaling"]), layout=lay,
    )  # fmt: skip
    case.gate = gate
    qsa_ops.sparse_paged_attention(*case.args(), **case.kwargs())
    want = testing.expected_attention(case)  # float64, the contract's roundings
    theirs = seen["gated"][0, rows].view(len(CHECKED), 3, 256).double()
    err_theirs = float((theirs - want).norm() / want.norm())
    assert err_theirs < TRANSFORMERS_BAND, f"transformers vs the float64 quantity: {err_theirs}"
    err_ours = testing.check_attention(case, case.out)
    assert err_ours < err_theirs, (err_ours, err_theirs)
