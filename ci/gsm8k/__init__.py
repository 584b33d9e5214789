"""The GSM8K strict gate's parts (the command line is ci/gsm8k_gate.py), each importing only
those before it:

    answers.py      strict-match answer extraction and number normalisation
    config.py       the per-model config (GateConfig, ParityConfig), GateError
    data.py         the splits (bundled, downloaded, given), exemplars and prompts
    client.py       a minimal OpenAI-compatible client with retries
    evaluation.py   asking every question with bounded concurrency; parity of two runs
    gate.py         the gate: one verdict and its record (result.json, questions.jsonl)

Beside them: configs/ (per-model configs), data/ (the bundled splits), requirements.txt.
"""
