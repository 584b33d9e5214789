"""Strict-match answer extraction: what counts as an answer, and how it is normalised."""

from __future__ import annotations

import pytest
from gsm8k_gate import extract_answer, normalize_number

EXTRACTED = [
    # the "#### N" convention
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
    ("#### 72", "72"),
    ("####72", "72"),
    ("####   72", "72"),
    (" 5 + 3 = 8\n#### 8\n", "8"),
    ("#### 18.", "18"),  # a sentence full stop is not a decimal point
    ("#### 18 dollars", "18"),
    ("#### 18 apples.", "18"),
    ("#### 25%", "25"),
    ("#### 42)", "42"),
    # commas, currency, decimals
    ("#### 1,234", "1234"),
    ("#### 1,234,567", "1234567"),
    ("#### $1,234.50", "1234.5"),
    ("#### $ 5", "5"),
    ("#### \u20ac12", "12"),
    ("#### \u00a37.25", "7.25"),
    ("#### 7.50", "7.5"),
    ("#### 0.5", "0.5"),
    ("#### .5", "0.5"),
    ("#### 007", "7"),
    ("#### 100.000", "100"),
    ("#### 3.0", "3"),
    # signs
    ("#### -3.0", "-3"),
    ("#### -7", "-7"),
    ("#### \u22127", "-7"),  # Unicode minus
    ("#### +5", "5"),
    ("#### -$5", "-5"),
    ("#### $-5", "-5"),
    ("#### -0", "0"),
    ("#### -0.0", "0"),
    # "The answer is N"
    ("So she has 5 left. The answer is 5.", "5"),
    ("The answer is 1,000.", "1000"),
    ("the answer is $12.50", "12.5"),
    ("THE ANSWER IS 9", "9"),
    ("The final answer is 44.", "44"),
    ("The answer is: 44", "44"),
    ("The answer is -2.", "-2"),
    # the first well-formed "#### N" wins, and beats "The answer is"
    ("#### 5\n#### 6", "5"),
    ("The answer is 3.\n#### 4", "4"),
    ("#### \n#### 9", "9"),
    ("#### 3/4 ... #### 2", "2"),
    # a malformed "####" falls back to "The answer is"
    ("#### three. The answer is 3.", "3"),
]

NOT_EXTRACTED = [
    "",
    "72",  # a bare number is not strict-match
    "She has 72 clips.",
    "Answer: 72",
    "answer = 72",
    "#### seventy-two",
    "####",
    "#### 3/4",  # fractions are not GSM8K answers
    "#### 1,2345",  # malformed thousands separator
    "#### 12,34",
    "#### 18th",
    "#### 5kg",
    "#### 1e3",
    "#### -$-5",
    "#### +-5",
    "# 72",
    "### 72",
    "The answer is seventy-two.",
    "The answer is x = 4",
    "The answer is\n\n",
    "The result is 12.",
    "\\boxed{12}",
]


@pytest.mark.parametrize(("completion", "expected"), EXTRACTED)
def test_extracts(completion: str, expected: str) -> None:
    assert extract_answer(completion) == expected, f"completion {completion!r}"


@pytest.mark.parametrize("completion", NOT_EXTRACTED)
def test_refuses(completion: str) -> None:
    assert extract_answer(completion) is None, f"completion {completion!r}"


def test_stop_sequence_leftovers_are_harmless() -> None:
    # A completion cut at the stop string "Question:" keeps only its own answer.
    assert extract_answer(" 2 + 2 = <<2+2=4>>4\n#### 4") == "4"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$1,234.50", "1234.5"),
        ("-3.0", "-3"),
        ("  42 ", "42"),
        ("25000", "25000"),
        ("1,600", "1600"),
        ("0.30", "0.3"),
        ("-$0.25", "-0.25"),
        ("1234.5000", "1234.5"),
        ("12345678901234567890", "12345678901234567890"),  # no float rounding
        ("0.1", "0.1"),
    ],
)
def test_normalize_number(text: str, expected: str) -> None:
    assert normalize_number(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "1/2", "1 2", "1e5", "12,34", "--1", "$", "."])
def test_normalize_number_refuses(text: str) -> None:
    assert normalize_number(text) is None


def test_equal_values_normalise_equal() -> None:
    forms = ["1234.5", "1,234.50", "$1,234.5", "+1234.500", "$ 1,234.50"]
    assert {normalize_number(f) for f in forms} == {"1234.5"}
