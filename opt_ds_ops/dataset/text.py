"""Delimited text datasets (``.csv .txt .tsv``, optionally ``.gz``) as monitoring tools export them.

The rows are parsed by Apache Arrow's CSV reader (``pyarrow.csv.read_csv`` on 16 MiB chunks of
whole lines, C++ on Arrow's CPU threads):
RFC 4180 quoting (``"cpu","load"``, ``"{cpu=""0""}"``, quoted numbers), CRLF, a UTF-8 BOM and
blank lines; CR-only line ends (classic Mac OS, some Excel exports) become LF as the file is read. What Arrow does not decide is decided here, from the first lines:

- **Delimiter**: tab, ``;``, ``,`` or ``|``, the first that splits the first lines (quotes
  respected, by Python's ``csv`` module) into the same number (> 1) of fields; else runs of spaces
  and tabs when they do (turned into commas on the way to Arrow); else one column. A trailing
  delimiter on every line is allowed.
- **Header**: the first line is one when a field of it is text (not a number, not a timestamp),
  or when it has an empty field where the next line has a value (pandas' unnamed index).
  However wide: the header line is read up to the line limit, not a fixed buffer.
- **Decimal comma**: under ``;`` or tab, fields like ``44,08`` are read with ``,`` as the decimal
  point. Under ``,`` it is ambiguous: integer fields with a leading zero after a comma (``44,08``)
  are refused with a hint.
- **Columns**: time index, row index, text columns and the ``dataset:`` options, by
  :mod:`opt_ds_ops.dataset.columns`.

**Budgets**: text is counted while it is read (``job.max_decompressed_bytes``, after gzip and for
plain text too), a line may not run past ``job.max_columns`` x 256 bytes and the first line's
fields are counted before anything is parsed (``job.max_columns``); reading stops once the rows
would pass ``job.max_matrix_bytes``. Arrow parses blocks of ``2 x`` the line limit (at least
1 MiB), so the parse itself holds a few MiB, besides the float32 matrix.

**Errors** name the file, the line (1-based, as an editor shows it) and the column. Arrow does
not report lines; on its error the file is read again from the start (an error path only).

The byte streams under the parser (budgets counted while reading, CR line ends, chunks of whole
lines) are :mod:`opt_ds_ops.dataset.textstream`.
"""

from __future__ import annotations

import csv
import io
import re

import numpy as np

from ..config.conffile import DatasetConfig
from .columns import ColumnInfo, ColumnPlan, ZONED, is_iso_time, plan_columns
from .core import SNIFF_BYTES, DatasetError, DatasetLimits, Float32Builder, block_rows, clip, quoted, too_many_rows
from .textstream import CHUNK_BYTES, READ_BYTES, Prefixed, arrow_owned, line_chunks, open_text
from .timeindex import TimeCollector

SAMPLE_LINES = 50  # lines after the first that decide the dialect and the columns' kinds
DELIMITERS = ("\t", ";", ",", "|")
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|nan|inf|infinity)$", re.I)
_INTEGER = re.compile(r"^[+-]?\d+$")
_DECIMAL_COMMA = re.compile(r"^[+-]?\d+,\d+$")
_EXPECTED = re.compile(r"Expected (\d+) columns, got (\d+)")
_CONVERSION = re.compile(r"In CSV column #(\d+): CSV conversion error to \w+: invalid value '(.*)'$", re.S)


def _read_line(f, path: str, lineno: int, limits: DatasetLimits) -> bytes | None:
    """Return line ``lineno`` (1-based) of binary stream f with its newline, or None at the end.

    Read in pieces of 64 KiB; raise DatasetError as soon as the fields seen so far (under the
    delimiter they select) exceed ``limits.max_columns``, before the rest is read.
    """
    parts: list[bytes] = []
    tabs = semis = commas = pipes = words = 0
    while True:
        piece = f.readline(SNIFF_BYTES)
        if not piece:
            break
        if parts and not parts[-1][-1:].isspace() and not piece[:1].isspace():
            words -= 1  # a word cut in two by the piece boundary
        parts.append(piece)
        if piece.endswith(b"\n"):
            break
        tabs, semis = tabs + piece.count(b"\t"), semis + piece.count(b";")
        commas, pipes = commas + piece.count(b","), pipes + piece.count(b"|")
        words += len(piece.split())
        seen = max(tabs, semis, commas, pipes) + 1 if (tabs or semis or commas or pipes) else words
        if seen > limits.max_columns + 1:  # + 1: a trailing delimiter
            raise DatasetError(
                f"{path}: line {lineno} has more than {limits.max_columns} fields; job.max_columns is {limits.max_columns}"
            )
    return b"".join(parts) if parts else None


def _decode(path: str, lineno: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: line {lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _split(line: str, delim: str | None) -> list[str]:
    """Return the fields of one line: RFC 4180 under a delimiter, runs of whitespace without."""
    if delim is None:
        return line.split()
    return next(csv.reader([line], delimiter=delim, quotechar='"', doublequote=True, skipinitialspace=True), [])


def _field_counts(lines: list[str], delim: str | None) -> list[int]:
    return [len(_split(line, delim)) for line in lines]


def _choose_delimiter(lines: list[str]) -> str | None:
    """Return the delimiter of the first lines (see the module docstring); None: whitespace."""
    for delim in DELIMITERS:
        counts = _field_counts(lines, delim)
        if counts[0] > 1 and len(set(counts)) == 1:
            return delim
        if len(counts) > 1 and counts[1] > 1 and len(set(counts[1:])) == 1 and counts[0] in (counts[1], counts[1] - 1):
            return delim  # a header one name short: a trailing delimiter on the rows only, or an unnamed index
    counts = _field_counts(lines, None)
    if len(lines) > 1 and counts[1] > 1 and len(set(counts[1:])) == 1 and counts[0] in (counts[1], counts[1] - 1):
        return None
    if counts[0] > 1 and len(set(counts)) == 1:
        return None
    for delim in DELIMITERS:  # ragged under every choice: the delimiter that is there, to name the ragged line
        if delim in lines[0]:
            return delim
    return ","


def _kind(value: str) -> str:
    v = value.strip()
    if not v:
        return "empty"
    if _NUMBER.match(v):
        return "number"
    return "time" if is_iso_time(v) else "text"


def _is_header(first: list[str], below: list[list[str]]) -> bool:
    """True if the first line names the columns: a text field over values that are not text, or
    that never repeat it; or an empty field where the next line has a value (pandas' index)."""
    for c, v in enumerate(first):
        if _kind(v) != "text":
            continue
        column = [r[c].strip() for r in below if c < len(r)]
        if any(_kind(x) != "text" for x in column) or v.strip() not in column:
            return True
    if not below or len(first) != len(below[0]):
        return False
    return any(not a.strip() and b.strip() for a, b in zip(first, below[0]))


class _Dialect:
    """What the first lines say: delimiter, decimal point, header, field count, data start."""

    def __init__(self, delim, decimal, header, fields, trailing, skip_lines):
        self.delim, self.decimal, self.header = delim, decimal, header
        self.fields, self.trailing = fields, trailing
        self.skip_lines = skip_lines


def _column_infos(path: str, header: list[str] | None, rows: list[tuple[int, list[str]]], n: int) -> list[ColumnInfo]:
    infos = []
    for c in range(n):
        cells = [(lineno, r[c].strip()) for lineno, r in rows if c < len(r)]
        kinds = [_kind(v) for _, v in cells]
        present = [k for k in kinds if k != "empty"]
        name = header[c].strip() if header is not None else None
        if not present:
            infos.append(ColumnInfo(name, "empty"))
            continue
        if all(k == "number" for k in present):
            vals = np.array([float(v) for _, v in cells if v], dtype=np.float64)
            infos.append(ColumnInfo(name, "number", values=vals))
            continue
        kind = "time" if all(k == "time" for k in present) else "text"
        # the example: a time (a time column), else a text cell, else (times and numbers) the first odd one out
        want = kind if kind == "time" or "text" in present else next(k for k in present if k != present[0])
        lineno, example = next((ln, v) for (ln, v), k in zip(cells, kinds) if k == want)
        zoned = kind == "time" and bool(ZONED.search(example))
        infos.append(ColumnInfo(name, kind, example=example, where=f"line {lineno}", zoned=zoned,
                                mixed="text" in present and "number" in present))
    return infos


def _sniff(path: str, f, limits: DatasetLimits):
    """Read the first lines of f; return (dialect, column infos, the data bytes already read)."""
    lineno = 0
    while True:
        raw = _read_line(f, path, lineno + 1, limits)
        if raw is None:
            raise DatasetError(f"{path}: empty file (no data rows)")
        lineno += 1
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if raw.strip():
            break
    first_no = lineno
    lines, raws, linenos = [_decode(path, lineno, raw)], [], []
    while len(linenos) < SAMPLE_LINES:
        raw = _read_line(f, path, lineno + 1, limits)
        if raw is None:
            break
        lineno += 1
        raws.append(raw)
        if raw.strip():
            lines.append(_decode(path, lineno, raw))
            linenos.append(lineno)
    delim = _choose_delimiter(lines)
    split = [_split(line, delim) for line in lines]
    first = split[0]
    if len(first) > limits.max_columns + (1 if delim and first[-1:] == [""] else 0):
        raise DatasetError(f"{path}: line {first_no} has {len(first)} fields; job.max_columns is {limits.max_columns}")
    header = first if _is_header(first, split[1:]) else None
    data_rows = list(zip(linenos, split[1:])) if header is not None else [(first_no, first)] + list(zip(linenos, split[1:]))
    if header is not None and not data_rows:
        raise DatasetError(f"{path}: only a header line (line {first_no}), no data rows")
    fields = len(data_rows[0][1])
    trailing = bool(delim) and fields > 1 and all(r[-1:] == [""] for _, r in data_rows if len(r) == fields)
    n = fields - 1 if trailing else fields
    if n > limits.max_columns:
        raise DatasetError(f"{path}: line {data_rows[0][0]} has {n} fields; job.max_columns is {limits.max_columns}")
    if header is not None:
        if len(header) == n + 1 and header[-1] == "":
            header = header[:-1]  # a trailing delimiter on the header line
        if len(header) == n - 1:
            header = [""] + header  # pandas' index column: no name in the header
        if len(header) != n:
            hint = ""
            if delim == "," and all(_INTEGER.match(v.strip()) for _, r in data_rows for v in r if v.strip()):
                hint = " (a decimal comma? write numbers with '.' or separate fields with ';')"
            raise DatasetError(f"{path}: line {first_no}: the header has {len(header)} names but line "
                               f"{data_rows[0][0]} has {n} fields{hint}")
    decimal = "."
    cells = [v.strip() for _, r in data_rows for v in r[:n]]
    if delim in ("\t", ";") and any(_DECIMAL_COMMA.match(v) for v in cells) and not any("." in v and _NUMBER.match(v) for v in cells):
        decimal = ","
        data_rows = [(ln, [v.replace(",", ".") if _DECIMAL_COMMA.match(v.strip()) else v for v in r]) for ln, r in data_rows]
    if delim == ",":
        _refuse_decimal_comma(path, data_rows, n)
    infos = _column_infos(path, header, data_rows, n)
    skip = first_no if header is not None else first_no - 1
    prefix = b"".join(raws) if header is not None else raw_first(lines[0], raws)
    dialect = _Dialect(delim, decimal, header, fields, trailing, skip)
    return dialect, infos, prefix


def raw_first(first_line: str, raws: list[bytes]) -> bytes:
    """The bytes Arrow must parse when the first line is data: that line (BOM dropped) and the rest."""
    return first_line.encode("utf-8") + b"\n" + b"".join(raws)


def _refuse_decimal_comma(path: str, rows: list[tuple[int, list[str]]], n: int) -> None:
    """Raise DatasetError if comma-separated integer fields look like decimal commas (``44,08``)."""
    if not rows or any(not _INTEGER.match(v.strip()) for _, r in rows for v in r[:n] if v.strip()):
        return
    for lineno, r in rows:
        for c, v in enumerate(r[1:n], start=1):
            v = v.strip()
            if len(v) > 1 and v.lstrip("+-").startswith("0"):
                raise DatasetError(
                    f"{path}: line {lineno}: {quoted(','.join(x.strip() for x in r[:n]))} looks like a number with a "
                    f"decimal comma ({r[c - 1].strip()},{v}), which is ambiguous in a comma-separated file. Write "
                    "numbers with '.' as the decimal point, or separate fields with ';' (then '44,08' reads as 44.08)"
                )


def load_text(path: str, limits: DatasetLimits, opts: DatasetConfig, stop_at: int | None = None):
    """Return (float32 matrix, float64 offset, plan, TimeIndex or None, where) of a text dataset;
    ``where(row)`` names a 0-based data row as its file line (``line 7``).

    ``stop_at``: bytes of the file (after decompression) after which it is taken to end (set when
    the rest holds only whitespace lines). Raises DatasetError (see the module docstring), also
    where Python's ``csv`` module cannot split a line (a quoted field over its 131,072 characters).
    """
    try:
        return _load_text(path, limits, opts, stop_at)
    except csv.Error as e:
        raise DatasetError(f"{path}: cannot split the lines into fields: {clip(str(e))}") from None


def _load_text(path: str, limits: DatasetLimits, opts: DatasetConfig, stop_at: int | None):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    with open_text(path, limits, stop_at) as f:
        dialect, infos, prefix = _sniff(path, f, limits)
        plan = plan_columns(path, infos, opts)
        names = [f"c{i}" for i in range(dialect.fields)]
        types = {names[i]: pa.float64() for i in plan.features}
        if plan.index is not None:
            types[names[plan.index]] = pa.float64()
        if plan.time is not None:
            types[names[plan.time]] = pa.string() if plan.time_kind == "iso8601" else pa.float64()
        include = [names[i] for i in range(dialect.fields) if names[i] in types]
        block = max(1 << 20, 2 * limits.max_line_bytes)
        stream = io.BufferedReader(Prefixed(prefix, f, dialect.delim is None), buffer_size=READ_BYTES)
        reader_args = dict(
            read_options=pacsv.ReadOptions(column_names=names, block_size=block, use_threads=True),
            parse_options=pacsv.ParseOptions(delimiter=dialect.delim or ",", quote_char='"', double_quote=True,
                                             newlines_in_values=False, ignore_empty_lines=True),
            convert_options=pacsv.ConvertOptions(column_types=types, include_columns=include,
                                                 decimal_point=dialect.decimal, strings_can_be_null=False),
        )

        def line_of(row: int) -> int:
            return _line_of_row(path, limits, dialect, row)

        max_rows = limits.max_rows(len(plan.features))
        # one row past the budget shows it is exceeded, unless the rows spill to a .npy (core's docstring)
        build = Float32Builder(path, len(plan.features), lambda r: f"line {line_of(r)}",
                               max_rows=max_rows if limits.spill_dir else max_rows + 1, column=plan.feature_label,
                               nan_is_missing=True, spill_dir=limits.spill_dir)
        times = TimeCollector(path, plan, lambda r: f"line {line_of(r)}") if plan.time is not None else None
        try:
            for chunk in line_chunks(stream, max(CHUNK_BYTES, 2 * limits.max_line_bytes)):
                # Arrow parses each chunk of whole lines from memory on its CPU threads, from a
                # buffer it owns (see arrow_owned): no Arrow thread ever takes the GIL, so none can
                # be caught by the interpreter's exit (SIGABRT). It is never handed the Python
                # stream, which its streaming reader would read on its I/O threads, with the GIL.
                for batch in pacsv.read_csv(pa.BufferReader(arrow_owned(pa, chunk)), **reader_args).to_batches():
                    _add_batch(path, batch, plan, names, build, times, line_of)
                if build.n > max_rows and not build.spilled:
                    raise too_many_rows(path, max_rows, len(plan.features), limits)
        except pa.ArrowInvalid as e:
            error = str(e)
        else:
            error = None
        if error is not None:
            cut = _arrow_error(path, limits, dialect, plan, error, None if limits.spill_dir else max_rows,
                               stop_at is None)
            return _load_text(path, limits, opts, stop_at=cut)
    data, offset = build.finish()
    if data.shape[0] == 0:
        raise DatasetError(f"{path}: empty file (no data rows)")
    time = times.finish(data.shape[0]) if times is not None else None
    return data, offset, plan, time, lambda r: f"line {line_of(r)}"


def _add_batch(path, batch, plan: ColumnPlan, names, build: Float32Builder, times, line_of) -> None:
    rows = batch.num_rows
    if rows == 0:
        return
    if plan.index is not None:
        idx = batch.column(names[plan.index]).to_numpy(zero_copy_only=False)
        if plan.index_start is not None:
            want = plan.index_start + build.n + np.arange(rows)
            bad = np.flatnonzero(idx != want)
            expected = lambda r: f"the row index {want[r]}"  # noqa: E731
        else:
            bad = np.flatnonzero(~(idx == np.round(idx)))
            expected = lambda r: "an integer row index"  # noqa: E731
        if len(bad):
            r = int(bad[0])
            raise DatasetError(
                f"{path}: line {line_of(build.n + r)}, {plan.labels[plan.index]}: {idx[r]:g} where {expected(r)} "
                "was expected; this first column is not a row index: name it in the header, or set dataset.columns"
            )
    if times is not None:
        times.add(batch.column(names[plan.time]), build.n)
    cols = [batch.column(names[i]).to_numpy(zero_copy_only=False) for i in plan.features]
    block = np.empty((rows, len(cols)), dtype=np.float64)
    for j, col in enumerate(cols):
        block[:, j] = col
    step = block_rows(len(cols))
    for start in range(0, rows, step):
        build.add(block[start : start + step])


def _scan(path: str, limits: DatasetLimits, dialect: _Dialect):
    """Yield (line number, fields) of every non-blank data line (error path: a Python scan)."""
    with open_text(path, limits) as f:
        text = io.TextIOWrapper(f, encoding="utf-8-sig", errors="replace", newline=None)
        for lineno, line in enumerate(text, 1):
            if lineno <= dialect.skip_lines:
                continue
            line = line.rstrip("\r\n")
            if not line or (dialect.delim is None and not line.strip()):
                continue
            yield lineno, _split(line, dialect.delim)


def _line_of_row(path: str, limits: DatasetLimits, dialect: _Dialect, row: int) -> int:
    """Return the 1-based file line of 0-based data row ``row``."""
    last = dialect.skip_lines
    for n, (lineno, _) in enumerate(_scan(path, limits, dialect)):
        last = lineno
        if n == row:
            return lineno
    return last + 1


def _arrow_error(path: str, limits: DatasetLimits, dialect: _Dialect, plan: ColumnPlan, msg: str,
                 max_rows: int | None, tail_ok: bool) -> int:
    """Turn Arrow's error into a DatasetError naming the line (or the row limit, if the bad line
    lies past ``max_rows`` rows; None: no limit, the rows spill); or, if the file only has lines of
    whitespace from there on and ``tail_ok``, return the byte offset to cut it at."""
    expected = _EXPECTED.search(msg)
    conv = _CONVERSION.search(msg)
    want = dialect.fields
    for row, (lineno, fields) in enumerate(_scan(path, limits, dialect)):
        if max_rows is not None and row >= max_rows and any(x.strip() for x in fields):
            raise too_many_rows(path, max_rows, len(plan.features), limits)
        if conv:
            c, value = int(conv.group(1)), conv.group(2)
            if c < len(fields) and fields[c].strip() == value.strip():
                raise DatasetError(f"{path}: line {lineno}, {plan.labels[c]}: {quoted(value)} is not a number") from None
        elif len(fields) != want:
            if tail_ok and all(not x.strip() for x in fields):
                cut = _blank_tail_offset(path, limits, lineno)
                if cut is not None:
                    return cut
            n_have = len(fields) - (1 if dialect.trailing and fields[-1:] == [""] else 0)
            n_want = want - (1 if dialect.trailing else 0)
            raise DatasetError(f"{path}: line {lineno}: ragged rows: the number of columns changes from "
                               f"{n_want} to {n_have}") from None
    if expected:
        raise DatasetError(f"{path}: ragged rows: {clip(msg)}") from None
    raise DatasetError(f"{path}: {clip(msg.strip())}") from None


def _blank_tail_offset(path: str, limits: DatasetLimits, lineno: int) -> int | None:
    """Return the byte offset where line ``lineno`` starts if it and every later line hold only
    whitespace (an export's tail), else None."""
    offset = 0
    with open_text(path, limits) as f:
        for i, line in enumerate(f, 1):
            if i >= lineno and line.strip():
                return None
            if i < lineno:
                offset += len(line)
    return offset
