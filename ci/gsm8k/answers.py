"""Strict-match answer extraction: the number after ``#### `` or "The answer is", normalised
(commas, currency symbols, signs, decimals). Standard library only."""

from __future__ import annotations

import re
from decimal import Decimal

# --------------------------------------------------------------------------------------------

# One number: an optional sign (ASCII or Unicode minus) before or after an optional currency
# symbol, digits with optional well-formed thousands separators, optional decimals. It must end
# the token: a following letter, digit, "/" or a separator followed by a digit ("1,2345", "3/4",
# "18th") makes the match fail rather than silently truncating the number.
_NUMBER = r"""
    (?P<sign>[-+\u2212]?)(?:[$\u20ac\u00a3\u00a5]\s?)?(?P<sign2>[-+\u2212]?)
    (?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)
    (?![\w/]|[.,]\d)
"""
_NUMBER_RE = re.compile(_NUMBER, re.VERBOSE)
# NOTES: "#" starts a comment in a VERBOSE pattern, hence the escaped "\#".
_HASH_RE = re.compile(r"\#\#\#\#\s*" + _NUMBER, re.VERBOSE)
_ANSWER_IS_RE = re.compile(r"\bthe\s+(?:final\s+)?answer\s+is:?\s*" + _NUMBER, re.VERBOSE | re.I)
_MINUS = ("-", "\u2212")


def _canonical(match: re.Match[str]) -> str | None:
    if match["sign"] and match["sign2"]:  # "-$-5", "+-5": not a number
        return None
    value = Decimal(match["digits"].replace(",", ""))
    if match["sign"] in _MINUS or match["sign2"] in _MINUS:
        value = -value
    if value == value.to_integral_value():
        return str(int(value))  # also turns -0 into 0
    return format(value.normalize(), "f")


def normalize_number(text: str) -> str | None:
    """Canonical form of a number string: ``"$1,234.50" -> "1234.5"``, ``"-3.0" -> "-3"``.

    Returns None for anything that is not one plain decimal number.
    """
    match = _NUMBER_RE.fullmatch(text.strip())
    return _canonical(match) if match else None


def extract_answer(completion: str) -> str | None:
    """Strict-match answer of a completion: the normalised number, or None (counted wrong).

    The first ``#### N`` wins; without one, the first "The answer is N" (case-insensitive,
    optional "final" and colon). Commas, currency symbols, signs and decimals are normalised.
    """
    for pattern in (_HASH_RE, _ANSWER_IS_RE):
        match = pattern.search(completion)
        if match:
            return _canonical(match)
    return None
