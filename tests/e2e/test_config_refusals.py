"""Load-time refusals of unsupported vLLM settings (config hook), each naming the setting
and what would work; one through a real server start."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the E2E suite runs in a vLLM environment (nox -s e2e)")

from servers import QSAServer  # noqa: E402
from vllm_server import VLLMServerError  # noqa: E402

from custom_esimd_kernels_vllm.vllm.config_hook import (  # noqa: E402
    Qwen38QSAConfig,
    UnsupportedQSAConfig,
    add_splitting_op,
    check_supported,
)

HF = {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 256, "index_n_heads": 4}


def _config(*, pp=1, tp=1, dcp=1, spec=None, cache_dtype="auto", hf=None):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=pp,
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=1,
        ),
        speculative_config=spec,
        cache_config=SimpleNamespace(
            cache_dtype=cache_dtype, block_size=16, user_specified_block_size=False
        ),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(**(hf or HF))),
        compilation_config=SimpleNamespace(splitting_ops=None),
    )


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"pp": 2}, r"--pipeline-parallel-size 2 is not supported .* use --pipeline-parallel-size 1"),
        ({"dcp": 2}, r"--decode-context-parallel-size 2 is not supported .* use --decode-context"),
        ({"spec": object()}, r"speculative decoding \(--speculative-config\) is not supported"),
        ({"cache_dtype": "fp8"}, r"--kv-cache-dtype fp8 is not supported .* use --kv-cache-dtype auto"),
        ({"tp": 2}, r"--tensor-parallel-size 2 does not fit .* use --tensor-parallel-size 1"),
    ],
)  # fmt: skip
def test_refusals_name_the_setting(changes, match):
    with pytest.raises(UnsupportedQSAConfig, match=match):
        check_supported(_config(**changes))


def test_supported_config_sets_block_size_and_splitting_op():
    config = _config(hf={**HF, "num_attention_heads": 6, "num_key_value_heads": 2,
                         "index_n_heads": 8}, tp=2)  # fmt: skip
    Qwen38QSAConfig.verify_and_update_config(config)
    assert config.cache_config.block_size == 512
    ops = config.compilation_config.splitting_ops
    assert ops[-1] == "vllm::qsa_attention"
    assert "vllm::unified_attention_with_output" in ops  # vLLM's defaults kept


def test_splitting_op_added_once_and_empty_list_kept():
    cc = SimpleNamespace(splitting_ops=["vllm::x"])
    add_splitting_op(cc)
    add_splitting_op(cc)
    assert cc.splitting_ops == ["vllm::x", "vllm::qsa_attention"]
    cc = SimpleNamespace(splitting_ops=[])
    add_splitting_op(cc)
    assert cc.splitting_ops == []


def test_server_refuses_quantized_kv_cache_at_load(tiny_model):
    timeout = float(os.environ.get("QSA_E2E_SERVER_TIMEOUT", "600"))
    server = QSAServer(tiny_model, timeout=timeout, extra_args=["--kv-cache-dtype", "fp8"])
    with pytest.raises(VLLMServerError, match="--kv-cache-dtype fp8 is not supported"):
        with server:
            pass
