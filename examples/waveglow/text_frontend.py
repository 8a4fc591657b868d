"""Text to Tacotron 2 symbol ids: English normalisation, then one id per character.

The symbol table is the one the published checkpoints were trained with (148 symbols: padding,
``-``, punctuation, letters, then ``@``-prefixed ARPAbet phones), so ids mean the same thing to
our model as to NVIDIA's. Normalisation follows the recipe's "english cleaners": spell out
numbers and money (inflect), transliterate to ASCII (Unidecode), lower-case, expand common
abbreviations, collapse whitespace. Phones can be given inline in braces: ``{HH AH0 L OW1}``.
"""

from __future__ import annotations

import re

_VOWELS = ("AA", "AE", "AH", "AO", "AW", "AY", "EH", "ER", "EY", "IH", "IY", "OW", "OY", "UH", "UW")
_CONSONANTS = ("B", "CH", "D", "DH", "F", "G", "HH", "JH", "K", "L", "M", "N", "NG", "P", "R", "S",
               "SH", "T", "TH", "V", "W", "Y", "Z", "ZH")  # fmt: skip
# CMUdict's phone set: each vowel bare and with stress 0, 1, 2; sorted as the recipe lists them.
ARPABET = tuple(sorted([v + s for v in _VOWELS for s in ("", "0", "1", "2")] + list(_CONSONANTS)))
PAD = "_"
SYMBOLS = (
    [PAD, "-"]
    + list("!'(),.:;? ")
    + list("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
    + ["@" + p for p in ARPABET]
)
SYMBOL_IDS = {s: i for i, s in enumerate(SYMBOLS)}
_FIRST_LETTER = SYMBOL_IDS["A"]  # letters, then phones, run to the end of the table

_ABBREVIATIONS = [
    (re.compile(rf"\b{short}\.", re.IGNORECASE), full)
    for short, full in (
        ("mrs", "missus"), ("mr", "mister"), ("dr", "doctor"), ("st", "saint"),
        ("co", "company"), ("jr", "junior"), ("maj", "major"), ("gen", "general"),
        ("drs", "doctors"), ("rev", "reverend"), ("lt", "lieutenant"), ("hon", "honorable"),
        ("sgt", "sergeant"), ("capt", "captain"), ("esq", "esquire"), ("ltd", "limited"),
        ("col", "colonel"), ("ft", "fort"),
    )
]  # fmt: skip
_BRACES = re.compile(r"(.*?)\{(.+?)\}(.*)", re.DOTALL)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3})")
_POUNDS = re.compile(r"£(\d+)")
_DOLLARS = re.compile(r"\$(\d+(?:\.\d+)?)")
_DECIMAL = re.compile(r"(\d+)\.(\d+)")
_ORDINAL = re.compile(r"\b(\d+)(st|nd|rd|th)\b")
_NUMBER = re.compile(r"\d+")
_WHITESPACE = re.compile(r"\s+")


class TextFrontend:
    """Owns the ``inflect`` engine (building it is slow) and turns text into symbol ids."""

    def __init__(self) -> None:
        # Imported here, not at the top: the symbol table above is usable (by the benchmark, by
        # tests) where the model's requirements are not installed.
        import inflect
        from unidecode import unidecode

        self._inflect = inflect.engine()
        self._unidecode = unidecode

    def normalize(self, text: str) -> str:
        """The recipe's English cleaning, so that the model sees what it was trained on."""
        return self._clean(text).strip()

    def _clean(self, text: str) -> str:
        # Money first: transliteration would turn "£" into "PS".
        text = self._unidecode(self._expand_numbers(text)).lower()
        for pattern, full in _ABBREVIATIONS:
            text = pattern.sub(full, text)
        return _WHITESPACE.sub(" ", text)

    def to_ids(self, text: str) -> list[int]:
        """Symbol ids for ``text``: braces hold ARPAbet phones, everything else is normalised.

        Characters outside the symbol table are dropped, as the recipe does.
        """
        ids: list[int] = []
        rest = text.strip()
        while rest:
            match = _BRACES.match(rest)
            if match is None:
                ids += self._chars(self._clean(rest))
                break
            before, phones, rest = match.groups()
            ids += self._chars(self._clean(before))
            ids += [SYMBOL_IDS["@" + p] for p in phones.split() if "@" + p in SYMBOL_IDS]
        return ids

    @staticmethod
    def speakable(ids: list[int]) -> bool:
        """Whether ``ids`` hold a letter or a phone: punctuation and spaces alone say nothing."""
        return any(i >= _FIRST_LETTER for i in ids)

    @staticmethod
    def _chars(text: str) -> list[int]:
        return [SYMBOL_IDS[c] for c in text if c in SYMBOL_IDS and c != PAD]

    def _words(self, number: str) -> str:
        words = self._inflect.number_to_words(number, andword="")
        return words if isinstance(words, str) else " ".join(words)

    def _year_or_number(self, match: re.Match[str]) -> str:
        value = int(match.group(0))
        # Years are read in pairs of digits ("nineteen eighty-four"), as an English reader would.
        if 1000 < value < 3000 and value % 1000 >= 10 and not 2000 <= value < 2010:
            return self._words(str(value // 100)) + " " + self._words(str(value % 100))
        return self._words(match.group(0))

    def _dollars(self, match: re.Match[str]) -> str:
        whole, _, cents = match.group(1).partition(".")
        dollars_n, cents_n = int(whole), int(cents) if cents else 0
        parts = []
        if dollars_n or not cents_n:
            parts.append(f"{dollars_n} dollar" + ("" if dollars_n == 1 else "s"))
        if cents_n:
            parts.append(f"{cents_n} cent" + ("" if cents_n == 1 else "s"))
        return ", ".join(parts)

    def _expand_numbers(self, text: str) -> str:
        text = _THOUSANDS.sub("", text)
        text = _POUNDS.sub(r"\1 pounds", text)
        text = _DOLLARS.sub(self._dollars, text)
        text = _DECIMAL.sub(r"\1 point \2", text)
        text = _ORDINAL.sub(lambda m: self._words(m.group(0)), text)
        return _NUMBER.sub(self._year_or_number, text)
