""""Did you mean ...?" for a name that is not one of a known few: a model, a field, an engine flag."""

from __future__ import annotations

import difflib
from typing import Any, Iterable


def closest(word: Any, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The one of `choices` that `word` most likely meant (another case, a typo), or None."""
    if not isinstance(word, str) or len(word) > 256:
        return None
    folded = {c.casefold(): c for c in choices}
    close = difflib.get_close_matches(word.strip().casefold(), list(folded), n=1, cutoff=cutoff)
    return folded[close[0]] if close else None


def did_you_mean(word: Any, choices: Iterable[str], cutoff: float = 0.6) -> str:
    """`; did you mean 'vllm'?` for the closest of `choices` to `word`, else ''."""
    best = closest(word, choices, cutoff)
    return f"; did you mean {best!r}?" if best is not None else ""
