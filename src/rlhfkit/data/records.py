"""Reading records from the sources users have: JSONL, JSON, CSV and Parquet files, ``save_to_disk``
directories, hub dataset ids, lists of dicts and ``datasets.Dataset``. Errors locate a record as
``path:LINE`` (1-based) or ``list[i]`` / ``dataset[i]`` (0-based)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any


class DataError(ValueError):
    """A malformed source or record; the message says where (``path:LINE``), which field,
    and what was expected."""


_DATASET_FILES = (".json", ".parquet", ".csv")


def _jsonl_records(path: str) -> list[tuple[str, Any]]:
    out = []
    try:
        f = open(path, "rb")  # bytes, decoded line by line, so a bad byte is reported at its line
    except OSError as e:
        raise DataError(f"{path}: cannot read this data file ({e.strerror or e}); check the path "
                        "(data.path) points to a JSONL file") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # tolerate a BOM
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {e.start + 1} of the line); "
                                "re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                out.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}); "
                                "each line must be one JSON object") from None
    return out


def _json_records(path: str) -> list[tuple[str, Any]]:
    """A ``.json`` file: one JSON array of records, or JSON lines (as ``datasets`` reads both)."""
    try:
        text = open(path, encoding="utf-8-sig").read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read this JSON file ({e}); check the path and that it is UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if not text.lstrip().startswith("["):
            return _jsonl_records(path)  # JSON lines under a .json name
        # an array: the error is where Python's parser found it in the document, not at line 1
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno}); a .json file holds one "
                        "JSON array of records (or one JSON object a line)") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of records (or one JSON object a line), got "
                        f"{type(data).__name__}")
    return [(f"{path}[{i}]", rec) for i, rec in enumerate(data)]


def _csv_records(path: str) -> list[tuple[str, Any]]:
    """A ``.csv`` file with a header row, every cell the string it is (``007`` stays ``"007"``: a
    reward function sees the same values whatever the other rows hold), an empty one None."""
    import csv

    try:
        f = open(path, encoding="utf-8-sig", newline="")
    except OSError as e:
        raise DataError(f"{path}: cannot read this CSV file ({e.strerror or e}); check the path (data.path)") from None
    out: list[tuple[str, Any]] = []
    with f:
        reader = csv.reader(f)
        try:
            header, start = None, 1
            for row in reader:
                where, start = f"{path}:{start}", reader.line_num + 1  # a quoted cell may span lines
                if not row:  # a blank line
                    continue
                if header is None:
                    header = row
                    dup = sorted({c for c in header if header.count(c) > 1})
                    if dup:
                        raise DataError(f"{where}: the header names column {dup[0]!r} twice; rename one")
                    continue
                if len(row) > len(header):
                    raise DataError(f"{where}: {len(row)} cells but the header (line 1) names {len(header)} "
                                    "columns; quote cells that contain commas")
                out.append((where, {c: (v if v != "" else None) for c, v in zip(header, row + [""] * len(header))}))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{reader.line_num + 1}: not UTF-8 text (byte {e.start + 1}); re-encode the file "
                            "as UTF-8") from None
        except csv.Error as e:
            raise DataError(f"{path}:{reader.line_num}: not valid CSV ({e})") from None
    return out


def _open_dataset(path: str, split: str | None):
    """A Parquet file, a ``Dataset.save_to_disk`` directory, or a hub dataset id
    (``datasets.load_dataset``) as a ``datasets.Dataset``; ``split`` picks one of several."""
    import datasets

    try:
        if os.path.isdir(path):
            if not any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
                raise DataError(f"{path}: cannot read this directory as data: it is not a directory written by "
                                "Dataset.save_to_disk; point data.path at a JSONL/JSON/Parquet/CSV file or such a "
                                "directory")
            ds = datasets.load_from_disk(path)
        elif os.path.isfile(path):
            ds = datasets.load_dataset("parquet", data_files=path, split="train")
        elif os.path.sep in path and not path.count("/") == 1:
            raise DataError(f"{path}: no such file or directory; check the path (data.path)")
        else:  # a hub id such as 'trl-lib/tldr'
            ds = datasets.load_dataset(path, split=split or "train")
    except DataError:
        raise
    except Exception as e:  # datasets' own errors are many and long: one line that names the source
        raise DataError(f"{path}: cannot load it as a dataset ({type(e).__name__}: {first_line(e)}); data.path takes a "
                        "JSONL/JSON/Parquet/CSV file, a save_to_disk directory or a hub dataset id") from None
    if isinstance(ds, datasets.DatasetDict):
        want = split or ("train" if "train" in ds else None)
        if want not in ds:
            raise DataError(f"{path}: holds splits {sorted(ds)}; choose one with data.split")
        ds = ds[want]
    return ds


def _located_records(source, split: str | None = None) -> tuple[str, list[tuple[str, Any]]]:
    """``(source name, [(location, record), ...])``; records are not checked here."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if path.endswith(".jsonl") or (os.path.isfile(path) and not path.endswith(_DATASET_FILES)):
            return path, _jsonl_records(path)
        if path.endswith(".json") and os.path.isfile(path):
            return path, _json_records(path)
        if path.endswith(".csv") and os.path.isfile(path):
            return path, _csv_records(path)
        return path, [(f"{path}[{i}]", rec) for i, rec in enumerate(_open_dataset(path, split))]
    ds = sys.modules.get("datasets")  # only a caller who imported datasets can hand us a Dataset
    if ds is not None and isinstance(source, ds.DatasetDict | ds.IterableDatasetDict):
        raise DataError(f"got a DatasetDict with splits {list(source)}: pass one split, e.g. source['train']")
    if ds is not None and isinstance(source, ds.Dataset | ds.IterableDataset):
        return "dataset", [(f"dataset[{i}]", rec) for i, rec in enumerate(source)]
    if isinstance(source, Sequence) and not isinstance(source, bytes):
        return "list", [(f"list[{i}]", rec) for i, rec in enumerate(source)]
    raise TypeError(f"source must be a JSONL path, a list of dicts or a datasets.Dataset, got {type(source).__name__}")


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _kind(value) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _records(source, allow_empty: bool = False, split: str | None = None) -> list[tuple[str, dict]]:
    name, located = _located_records(source, split)
    if not located and not allow_empty:  # an empty training set is a wrong path or a bad export
        raise DataError(f"{name}: no records (empty or blank); check the path or the export that wrote it")
    for where, rec in located:
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object (a dict of fields), got {_kind(rec)}")
    return located


def load_records(source) -> list[dict]:
    """The raw records of ``source``; DataError names the line that is not a JSON object."""
    return [rec for _, rec in _records(source, allow_empty=True)]


def write_jsonl(source, path: str | os.PathLike) -> str:
    """Write ``source``'s records (a list of dicts or a ``datasets.Dataset``) to the JSONL file
    ``path``, so a run given in-memory data reads, and records, a file; returns the path."""
    lines = []
    for where, rec in _records(source):
        try:
            lines.append(json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n")
        except (TypeError, ValueError) as e:
            raise DataError(f"{where}: cannot be written as JSON ({e}); give its fields as strings, numbers, "
                            "booleans, None, lists or dicts") from None
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # each process of a launch writes its own, then renames
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(tmp, path)
    return path
