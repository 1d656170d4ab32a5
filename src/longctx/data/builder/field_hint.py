"""What a build that kept no document says when its records lacked the field it was told to read: the fields
the first records DO have, read again from the inputs (only on this failure path, a few records), and the flag
to pass, instead of advice to point --input at other data."""

from __future__ import annotations

from collections import Counter

from .inputs import input_files
from .readers import field_value, jsonl_lines, jsonl_records, unit_format

RECORDS = 20  # records read for the fields they have
NAMES = 12  # field names shown at most
# skip reason -> (the option naming the field, what it holds)
_FIELD_SKIPS = {"missing_text_field": ("--text-field", "document text"),
                "missing_response_field": ("--response-field", "response")}


def _first_records(inputs: list[str], limit: int = RECORDS) -> list[dict]:
    """Up to `limit` JSON objects from the first lines of the inputs' .jsonl units, read as the build reads them
    (readers.jsonl_records: a UTF-16 / UTF-32 unit gives none, a line is UTF-8; json.loads of a line's bytes took
    UTF-16 too, and named fields the build never read). Best effort: what cannot be read gives none."""
    records: list[dict] = []
    for spec in inputs:
        try:
            _, files, _ = input_files(spec)
        except Exception:  # noqa: BLE001 (a hint: the input was read by the build already)
            continue
        for path in files:
            fmt, compression = unit_format(path)
            if fmt != "jsonl":
                continue
            try:
                with open(path, "rb") as f:
                    for _, record in jsonl_records(jsonl_lines(f, compression, path), Counter()):
                        records.append(record)
                        if len(records) >= limit:
                            return records
            except Exception:  # noqa: BLE001 (a corrupt or unreadable unit: counted by the build already)
                continue
    return records


def _names(records: list[dict]) -> list[str]:
    """The records' field names in the order first seen, a nested object's keys as dotted names (`meta.text`)
    after its own name."""
    names: dict[str, None] = {}
    for record in records:
        for key, value in record.items():
            names.setdefault(key)
            if isinstance(value, dict):
                for sub in value:
                    names.setdefault(f"{key}.{sub}")
    return list(names)


def missing_field_hint(inputs: list[str], skipped: dict, fields: dict[str, str]) -> str | None:
    """The advice for a build whose skips are all or mostly records without a field (`fields`: option -> the
    name it was given), or None where they are not (then the usual advice fits)."""
    total = sum(skipped.values())
    reason, n = max(((r, skipped.get(r, 0)) for r in _FIELD_SKIPS), key=lambda rn: rn[1])
    if not n or 2 * n < total:
        return None
    flag, holds = _FIELD_SKIPS[reason]
    field = fields.get(flag, "")
    records = _first_records(inputs)
    names = _names(records)
    found = [r for r in records if field_value(r, field) is not None]
    if found:  # present, but no string: an object, a list, a number
        kinds = sorted({type(field_value(r, field)).__name__ for r in found})
        what = (f"{n:,} record(s) have no string under {field!r} ({flag}; the first records hold "
                f"{'/'.join(kinds)} values there)")
    else:
        what = f"{n:,} record(s) have no field {field!r} ({flag})"
    shown = ", ".join(names[:NAMES]) + (f" and {len(names) - NAMES} more" if len(names) > NAMES else "")
    have = f"; the first records read have the fields: {shown}" if names else ""
    nested = (" A dotted name (meta.text) reads a nested object's field; a key with the dot in its name wins."
              if "." not in field else "")
    return (f"{what}{have}. Pass {flag} NAME with the field that holds the {holds} as a string.{nested}")
