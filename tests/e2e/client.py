"""Minimal OpenAI-completions client of the E2E suite: token ids in, greedy token ids out."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import requests

MODEL = "qsa-tiny"  # the name ci/vllm_server.py serves the checkpoint under
NEW_TOKENS = 8
FIRST_ID = 2  # ids 0 and 1 are the tokenizer's <|bos|> and <|eos|>
VOCAB = 1024


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 100_003 + length)
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(length)]


def completion(base_url: str, ids: list[int], **extra) -> dict:
    """The one choice of a greedy completion of NEW_TOKENS tokens (``extra``: more fields)."""
    body = {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    response = requests.post(f"{base_url}/v1/completions", json=body, timeout=900)
    assert response.status_code == 200, f"HTTP {response.status_code}: {response.text[:500]}"
    return response.json()["choices"][0]


def greedy(base_url: str, ids: list[int]) -> list[int]:
    return list(completion(base_url, ids)["token_ids"])


def greedy_concurrently(base_url: str, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(lambda ids: greedy(base_url, ids), prompts))
