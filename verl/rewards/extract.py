"""Answer extraction and normalisation, as lm-evaluation-harness and verl define them.

- gsm8k ``strict-match``: regex ``#### (\\-?[0-9\\.\\,]+)``, first match.
- ``flexible-extract``: regex ``(-?[$0-9.,]{2,})|(-?[0-9]+)``, last match.
- No match gives ``[invalid]``. Before comparing, prediction and reference both lose ``,``, ``$``, everything up
  to ``#### ``, and a trailing ``.``; case is ignored.
- The arithmetic task's strict format is ``>> N`` (the analogue of ``#### N``).
- ``\\boxed{...}`` answers: the last box, braces balanced.
"""

from __future__ import annotations

import re

INVALID = "[invalid]"
GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
ARITHMETIC_STRICT = re.compile(r">> (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE = [re.compile(r","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$")]


def normalize_answer(text: str) -> str:
    """lm-eval's gsm8k normalisation: drop ``,`` ``$`` ``... #### `` and a trailing ``.``, lower-case, strip."""
    for pattern in _IGNORE:
        text = pattern.sub("", text)
    return text.lower().strip()


def extract_strict(response: str, pattern: re.Pattern = GSM8K_STRICT, last: bool = False) -> str:
    """First (lm-eval) or, with ``last=True``, last (verl's gsm8k reward) match of the strict pattern's group,
    or ``[invalid]``."""
    matches = [m.group(1) for m in pattern.finditer(response)]
    if not matches:
        return INVALID
    return (matches[-1] if last else matches[0]).strip()


def extract_flexible(response: str) -> str:
    """Last number-like span (``flexible-extract``), or ``[invalid]``."""
    matches = FLEXIBLE.findall(response)
    if not matches:
        return INVALID
    groups = matches[-1]
    chosen = next((g for g in groups if g), "")
    return chosen.strip() or INVALID


def answers_match(prediction: str, reference: str) -> bool:
    if prediction == INVALID:
        return False
    return normalize_answer(prediction) == normalize_answer(str(reference))


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        # "\boxed 5" form: the token after a space
        rest = text[start:].split(" ", 1)
        return rest[1].split("$")[0].strip() if len(rest) == 2 else None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None


_MATH_STRIP = [r"\left", r"\right", r"\!", r"\,", r"\;", r"\ ", "$", r"\displaystyle"]


def normalize_math(text: str) -> str:
    """Light normalisation of a math answer: spacing and sizing commands, ``\\text{}``, ``dfrac``, trailing ``.``."""
    out = text.strip()
    for token in _MATH_STRIP:
        out = out.replace(token, "")
    out = re.sub(r"\\text\{(.*?)\}", r"\1", out)
    out = out.replace("dfrac", "frac").replace("tfrac", "frac").replace(" ", "")
    out = out.rstrip(".")
    if re.fullmatch(r"-?\d+\.0+", out):
        out = out.split(".")[0]
    return out


def math_equal(prediction: str | None, reference: str) -> bool:
    if prediction is None:
        return False
    a, b = normalize_math(prediction), normalize_math(str(reference))
    if a == b:
        return True
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return False
