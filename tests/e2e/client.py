"""Minimal OpenAI-completions client of the E2E suite: token ids in, greedy token ids out."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import requests

MODEL = "qsa-tiny"
NEW_TOKENS = 8
FIRST_ID = 2  # ids 0 and 1 are the tokenizer's <|bos|> and <|eos|>
VOCAB = 1024


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 100_003 + length)
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(length)]


def greedy(
    base_url: str, ids: list[int], max_tokens: int = NEW_TOKENS, timeout: float = 900
) -> list[int]:
    body = {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = requests.post(f"{base_url}/v1/completions", json=body, timeout=timeout)
    assert response.status_code == 200, f"HTTP {response.status_code}: {response.text[:500]}"
    return list(response.json()["choices"][0]["token_ids"])


def greedy_concurrently(base_url: str, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(lambda ids: greedy(base_url, ids), prompts))
