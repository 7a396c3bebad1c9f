"""Request-level load traces, as public production LLM traces publish them, and the planner intervals they make.

One row per request: when it arrived, its input tokens and its output tokens. The layout is told from the file:

- **Azure** (the Azure LLM inference traces of AzurePublicDataset): CSV with the header
  ``TIMESTAMP,ContextTokens,GeneratedTokens``; ``TIMESTAMP`` is a date and time (``2023-11-16 18:15:46.6805900``).
- **BurstGPT**: CSV with the header ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``;
  ``Timestamp`` in seconds. Rows whose ``Response tokens`` is 0 are failed requests in BurstGPT's logs: kept, with no
  output (they still cost a prefill).
- **Mooncake** (the FAST'25 traces): JSON lines ``{"timestamp": ms, "input_length": n, "output_length": n, ...}``;
  ``timestamp`` in milliseconds. Session-only lines (no timestamp) are refused: their arrival times depend on the
  server that answered the previous turn.

Arrivals are made relative to the first request. ``compress`` scales a trace's arrival times so that it spans N
minutes (its rate grows by the same factor, the lengths stay), the way trace replays shorten a day of traffic to a
run; ``to_intervals`` counts the requests of each planner interval (the interval trace in predictors.py).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from phalanx.planner.errors import TraceError
from phalanx.planner.predictors import TRACE_FIELDS, TraceInterval, parse_trace

__all__ = [
    "TraceRequest",
    "compress",
    "load_any_trace",
    "load_request_trace",
    "parse_request_trace",
    "to_intervals",
]

_AZURE = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT = ("Timestamp", "Request tokens", "Response tokens")
_MOONCAKE = ("timestamp", "input_length", "output_length")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: seconds after the trace's first request, input and output tokens."""

    arrival_s: float
    isl: int
    osl: int


def _tokens(value: object, where: str, name: str) -> int:
    try:
        number = float(str(value).strip())
    except ValueError:
        raise TraceError(f"{where}: {name} {value!r} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise TraceError(f"{where}: {name} must be a finite count >= 0, got {value!r}")
    return int(number)


def _seconds(value: object, where: str, name: str) -> float:
    text = str(value).strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            seconds = datetime.fromisoformat(text).timestamp()
        except ValueError:
            raise TraceError(f"{where}: {name} {value!r} is neither seconds nor a date and time") from None
    if not math.isfinite(seconds):
        raise TraceError(f"{where}: {name} must be finite, got {value!r}")
    return seconds


def _relative(rows: list[tuple[float, int, int]], source: str) -> list[TraceRequest]:
    if not rows:
        raise TraceError(f"{source}: no request in the trace")
    rows.sort(key=lambda row: row[0])  # public traces are mostly, not always, in arrival order
    start = rows[0][0]
    return [TraceRequest(t - start, isl, osl) for t, isl, osl in rows]


def _from_csv(text: str, source: str) -> list[TraceRequest]:
    reader = csv.DictReader(io.StringIO(text))
    header = [name.strip() for name in reader.fieldnames or []]
    if set(_AZURE) <= set(header):
        layout, (t_name, isl_name, osl_name) = "Azure", _AZURE
    elif set(_BURSTGPT) <= set(header):
        layout, (t_name, isl_name, osl_name) = "BurstGPT", _BURSTGPT
    else:
        raise TraceError(
            f"{source}: a CSV request trace needs the header of an Azure trace ({','.join(_AZURE)}) or a BurstGPT one "
            f"({','.join(_BURSTGPT)} ...); got {header}"
        )
    rows = []
    for number, raw in enumerate(reader, start=2):
        row = {(k or "").strip(): v for k, v in raw.items()}
        where = f"{source}:row {number} ({layout})"
        if any(row.get(name) in (None, "") for name in (t_name, isl_name, osl_name)):
            raise TraceError(f"{where}: {t_name}, {isl_name} and {osl_name} are all needed")
        rows.append((_seconds(row[t_name], where, t_name), _tokens(row[isl_name], where, isl_name),
                     _tokens(row[osl_name], where, osl_name)))
    return _relative(rows, source)


def _from_jsonl(text: str, source: str) -> list[TraceRequest]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not set(_MOONCAKE) <= set(obj):
            raise TraceError(f"{where}: a Mooncake request needs {', '.join(_MOONCAKE)} (timestamp in ms)")
        rows.append((_seconds(obj["timestamp"], where, "timestamp") / 1000.0, _tokens(obj["input_length"], where, "input_length"),
                     _tokens(obj["output_length"], where, "output_length")))
    return _relative(rows, source)


def parse_request_trace(text: str, *, source: str = "trace") -> list[TraceRequest]:
    """The requests of an Azure or BurstGPT CSV, or a Mooncake JSON-lines trace, in arrival order from 0."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    if first.lstrip().startswith("{"):
        return _from_jsonl(text, source)
    return _from_csv(text, source)


def load_request_trace(path: str | Path) -> list[TraceRequest]:
    path = Path(path)
    return parse_request_trace(path.read_text(), source=str(path))


def compress(requests: Sequence[TraceRequest], minutes: float) -> list[TraceRequest]:
    """The same requests with arrival times scaled so that the last arrives at `minutes` (the rate grows as much)."""
    if not math.isfinite(minutes) or minutes <= 0:
        raise ValueError(f"minutes must be > 0, got {minutes}")
    span = requests[-1].arrival_s if requests else 0.0
    if span <= 0:
        return list(requests)
    factor = minutes * 60.0 / span
    return [replace(r, arrival_s=r.arrival_s * factor) for r in requests]


def to_intervals(requests: Sequence[TraceRequest], interval_s: float) -> list[TraceInterval]:
    """Requests per interval of `interval_s` from the first arrival, with the intervals' mean ISL and OSL.

    An interval with no request keeps the means of the last one that had some: an idle minute says nothing about
    the lengths of the next requests, and a length of 0 would read to the predictors as a real change.
    """
    if not math.isfinite(interval_s) or interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    if not requests:
        return []
    count = int(requests[-1].arrival_s // interval_s) + 1
    buckets: list[list[TraceRequest]] = [[] for _ in range(count)]
    for r in requests:
        buckets[int(r.arrival_s // interval_s)].append(r)
    first = next(b for b in buckets if b)
    isl, osl = sum(r.isl for r in first) / len(first), sum(r.osl for r in first) / len(first)
    intervals = []
    for index, bucket in enumerate(buckets):
        if bucket:
            isl, osl = sum(r.isl for r in bucket) / len(bucket), sum(r.osl for r in bucket) / len(bucket)
        intervals.append(TraceInterval(timestamp=index * interval_s, requests=float(len(bucket)), isl=isl, osl=osl))
    return intervals


def load_any_trace(path: str | Path, *, interval_s: float | None = None, minutes: float | None = None) -> tuple[list[TraceInterval], str]:
    """Planner intervals from an interval trace (predictors.py's format) or a request-level one, and which it was.

    A request-level trace is compressed to `minutes` first (when given) and counted per `interval_s` (default 30 s).
    An interval trace is taken as it is: `minutes` and `interval_s` apply to request-level traces only.
    """
    path = Path(path)
    text = path.read_text()
    first = next((line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")), "")
    is_interval = (
        all(f'"{name}"' in first for name in TRACE_FIELDS) if first.lstrip().startswith("{")
        else set(TRACE_FIELDS) <= {name.strip() for name in first.split(",")}
    )
    if is_interval:
        if minutes is not None or interval_s is not None:
            raise TraceError(f"{path}: an interval trace is replayed as it is; --minutes and --interval-s are for request traces")
        return parse_trace(text, fmt="jsonl" if first.lstrip().startswith("{") else "csv", source=str(path)), "intervals"
    requests = parse_request_trace(text, source=str(path))
    if minutes is not None:
        requests = compress(requests, minutes)
    return to_intervals(requests, interval_s or 30.0), "requests"
