"""Documents from a user's data (``moeflow train --data``, ``moeflow prepare-data``).

A *source* is a path (or a dataset name from the local Hugging Face cache):

- a text file (``.txt``, ``.md``, or any other name that is not one of the kinds below): one
  document, UTF-8;
- a ``.jsonl`` file: one document per line, a JSON object whose ``text_field`` holds the text;
- a ``.json`` file: a list of such objects (or an object with one list of them);
- a ``.parquet`` file: one document per row of its ``text_field`` column (``pyarrow``);
- a folder: a Hugging Face ``datasets`` directory written by ``save_to_disk`` (it holds
  ``dataset_info.json`` or ``dataset_dict.json``), else every file of the kinds above inside it,
  recursively, in sorted path order (hidden files and folders skipped);
- ``hf:NAME`` (or ``hf:NAME:SPLIT``): a dataset from the local ``datasets`` cache (nothing is
  downloaded: ``HF_DATASETS_OFFLINE`` is honoured by ``datasets`` itself; here the cache must
  hold it).

Bad data is a ``DataError`` (a ``ValueError``) that names the file, and the line where there is
one: an empty file, a JSONL line that is not JSON or lacks the field (or whose field is not a
string), invalid UTF-8, an empty folder. Nothing is skipped silently: an empty document is an
error too, unless the caller asks to skip empty ones (``skip_empty``), and then they are counted
(``Documents.skipped``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DataError", "Document", "Documents", "documents", "source_files", "TEXT_SUFFIXES"]

TEXT_SUFFIXES = (".jsonl", ".json", ".parquet")  # anything else in a folder counts as plain text only if below
PLAIN_SUFFIXES = (".txt", ".md", ".text")


class DataError(ValueError):
    """A source that cannot be read as documents; the message names the file (and line)."""


@dataclass(frozen=True)
class Document:
    text: str
    where: str  # "path", "path:line" or "path[row]": for messages


@dataclass
class Documents:
    """The documents of some sources, read lazily (``__iter__``), and what was skipped."""

    sources: list[str]
    text_field: str = "text"
    skip_empty: bool = False
    skipped: int = 0
    files: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Document]:
        self.skipped = 0
        self.files.clear()
        for source in self.sources:
            for doc in _source_documents(source, self.text_field, self.files):
                if doc.text:
                    yield doc
                elif self.skip_empty:
                    self.skipped += 1
                else:
                    raise DataError(f"{doc.where}: an empty document (ask to skip empty ones: --skip-empty)")


def documents(sources: list[str | Path], *, text_field: str = "text", skip_empty: bool = False) -> Documents:
    """The documents of ``sources`` in order (module docstring), read when iterated."""
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field must be a non-empty string, got {text_field!r}")
    if not sources:
        raise ValueError("sources is empty: give at least one file, folder or hf:NAME")
    return Documents([str(s) for s in sources], text_field, skip_empty)


def source_files(source: str | Path) -> list[Path]:
    """The files a path source reads, in order (a file itself; a folder's supported files)."""
    path = Path(source)
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if path.is_file():
        return [path]
    if _is_hf_dataset_dir(path):
        return [path]
    found = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".")
                   for part in p.relative_to(path).parts) and p.suffix.lower() in (*TEXT_SUFFIXES, *PLAIN_SUFFIXES))
    if not found:
        raise DataError(f"{path}: a folder without data files ({', '.join((*PLAIN_SUFFIXES, *TEXT_SUFFIXES))})")
    return found


def _is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())


def _source_documents(source: str, text_field: str, files: list[str]) -> Iterator[Document]:
    if source.startswith("hf:"):
        files.append(source)
        yield from _hf_cache_documents(source, text_field)
        return
    for path in source_files(source):
        files.append(str(path))
        if _is_hf_dataset_dir(path):
            yield from _hf_dir_documents(path, text_field)
        elif path.suffix.lower() == ".jsonl":
            yield from _jsonl_documents(path, text_field)
        elif path.suffix.lower() == ".json":
            yield from _json_documents(path, text_field)
        elif path.suffix.lower() == ".parquet":
            yield from _parquet_documents(path, text_field)
        else:
            yield Document(_read_text(path), str(path))


def _read_bytes(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read it ({err.strerror or err})") from None
    if not data:
        raise DataError(f"{path}: the file is empty")
    return data


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: invalid UTF-8 at byte {err.start} ({err.reason})") from None


def _read_text(path: Path) -> str:
    return _decode(_read_bytes(path), str(path))


def _text_of(obj: object, text_field: str, where: str) -> str:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with a {text_field!r} field, got {type(obj).__name__}")
    if text_field not in obj:
        raise DataError(f"{where}: no {text_field!r} field (fields: {', '.join(sorted(map(str, obj))) or 'none'}; "
                        "--text-field names another)")
    text = obj[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: the {text_field!r} field is {type(text).__name__}, not text")
    return text


def _jsonl_documents(path: Path, text_field: str) -> Iterator[Document]:
    """One document per line, read a line at a time (a JSONL file may be larger than memory)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, also when the generator is dropped
    except OSError as err:
        raise DataError(f"{path}: cannot read it ({err.strerror or err})") from None
    with f:
        seen = False
        for i, line in enumerate(f, start=1):
            seen = seen or bool(line)
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                obj = json.loads(_decode(line, where))
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
            yield Document(_text_of(obj, text_field, where), where)
        if not seen:
            raise DataError(f"{path}: the file is empty")


def _json_documents(path: Path, text_field: str) -> Iterator[Document]:
    try:
        obj = json.loads(_read_text(path))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not JSON ({err.msg})") from None
    if isinstance(obj, dict):
        lists = [v for v in obj.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a list of objects, or an object holding one list of them")
        obj = lists[0]
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a list of objects with a {text_field!r} field, got {type(obj).__name__}")
    if not obj:
        raise DataError(f"{path}: an empty list of documents")
    for i, item in enumerate(obj):
        yield Document(_text_of(item, text_field, f"{path}[{i}]"), f"{path}[{i}]")


def _column(schema, text_field: str, where: str) -> None:  # type: ignore[no-untyped-def]
    if text_field not in schema.names:
        raise DataError(f"{where}: no {text_field!r} column (columns: {', '.join(schema.names)}; "
                        "--text-field names another)")


def _parquet_documents(path: Path, text_field: str) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError("reading Parquet needs pyarrow: pip install 'moeflow[data]'") from err
    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises its own error types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({str(err)[:120]})") from None
    if pf.metadata.num_rows == 0:
        raise DataError(f"{path}: the Parquet file has no rows")
    _column(pf.schema_arrow, text_field, str(path))  # (an arrow schema has column names too)
    row = 0
    for batch in pf.iter_batches(columns=[text_field]):  # a row group at a time, the text column only
        column = batch.column(text_field)
        for value in column.to_pylist():
            where = f"{path}[{row}]"
            if not isinstance(value, str):
                raise DataError(f"{where}: the {text_field!r} value is {type(value).__name__}, not text")
            yield Document(value, where)
            row += 1


def _dataset_documents(ds, text_field: str, where: str) -> Iterator[Document]:  # type: ignore[no-untyped-def]
    if text_field not in ds.column_names:
        raise DataError(f"{where}: no {text_field!r} column (columns: {', '.join(ds.column_names)}; "
                        "--text-field names another)")
    if len(ds) == 0:
        raise DataError(f"{where}: the dataset has no rows")
    for i, value in enumerate(ds[text_field]):
        if not isinstance(value, str):
            raise DataError(f"{where}[{i}]: the {text_field!r} value is {type(value).__name__}, not text")
        yield Document(value, f"{where}[{i}]")


def _splits(obj, where: str, split: str | None):  # type: ignore[no-untyped-def]
    """One dataset from a ``Dataset`` or ``DatasetDict`` (``split``, else "train", else the only one)."""
    if hasattr(obj, "column_names") and not isinstance(obj.column_names, dict):
        return obj
    names = list(obj)
    pick = split or ("train" if "train" in names else names[0] if len(names) == 1 else None)
    if pick not in names:
        raise DataError(f"{where}: splits {names}; name one ({where}:SPLIT)")
    return obj[pick]


def _hf_dir_documents(path: Path, text_field: str) -> Iterator[Document]:
    try:
        import datasets
    except ImportError as err:
        raise ImportError("reading a datasets directory needs datasets: pip install 'moeflow[data]'") from err
    try:
        obj = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds for a damaged directory
        raise DataError(f"{path}: not a readable datasets directory ({str(err)[:120]})") from None
    yield from _dataset_documents(_splits(obj, str(path), None), text_field, str(path))


def _hf_cache_documents(source: str, text_field: str) -> Iterator[Document]:
    try:
        import datasets
    except ImportError as err:
        raise ImportError("hf:NAME sources need datasets: pip install 'moeflow[data]'") from err
    name, _, split = source[3:].partition(":")
    if not name:
        raise DataError(f"{source}: name a dataset (hf:NAME or hf:NAME:SPLIT)")
    try:
        obj = datasets.load_dataset(name, split=split or None, download_mode="reuse_cache_if_exists")
    except Exception as err:  # noqa: BLE001 - not in the cache, or offline: datasets' own errors
        raise DataError(f"{source}: not in the local datasets cache ({str(err).splitlines()[0][:160]})") from None
    yield from _dataset_documents(_splits(obj, source, split or None), text_field, source)
