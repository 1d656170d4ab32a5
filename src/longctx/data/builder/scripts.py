"""Scripts written without spaces between words (CJK, Thai, Lao, Myanmar, Khmer, full-width forms):
each of their characters is taken as a word of its own by the dedup shingles (dedup.py) and the
clustering features (features.py); a whitespace or word-character split would make a whole clause
one "word", and two texts on one topic would then share none."""

from __future__ import annotations

import re

UNSPACED = ("\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3001-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
            "\uff00-\uffef\U00020000-\U0003134f")
HAS_UNSPACED = re.compile(f"[{UNSPACED}]")
