"""Open-loop load (docs/architecture.md §15): requests sent on a schedule that does not wait for answers, latency
counted from the **scheduled** send time, and the numbers ``vllm bench serve`` reports, under its names.

A closed-loop user waits for each answer before it sends the next request, so when the service slows down the load
slows down with it and the latency under overload is under-reported (coordinated omission). Here the schedule is
fixed before the first request: ``arrival_offsets`` draws it (constant spacing, or gamma-distributed gaps whose
``burstiness`` is vLLM's: 1 = Poisson, < 1 burstier, > 1 steadier), the locustfile's ``OpenLoopUser`` fires each
request at its offset without waiting for the others, and every request leaves a ``RequestRecord``. A request sent
late still counts from its scheduled time, and the generator's own lateness (``schedule_lag``) is reported: a run
where the generator, not the service, fell behind is refused (``MAX_LAG_P99_MS``, settable).

``summarise`` turns the records of one rate into ``vllm bench serve``'s fields (``request_throughput``,
``request_goodput``, ``output_throughput``, ``mean_/median_/std_/pNN_{ttft,tpot,itl,e2el}_ms``) plus the rejection
rate (429s, which count against goodput) and the schedule lag. Pure numpy: unit-tested on hand-made records.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from verl.errors import ConfigError, DataError

ARRIVALS = ("constant", "poisson")
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")  # vllm bench serve's --goodput / --percentile-metrics names
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)
# The generator is the bottleneck when its sends run this late at p99: the latencies then measure the client.
MAX_LAG_P99_MS = 10.0
OPEN_RECORDS_SUFFIX = "_requests.jsonl"  # beside Locust's CSVs: <csv prefix>_requests.jsonl


def arrival_offsets(rate: float, duration_s: float, arrival: str = "poisson", burstiness: float = 1.0,
                    seed: int = 0) -> np.ndarray:
    """Send times ``(n,)`` in seconds from the start, all below ``duration_s``, for ``rate`` requests/s.

    ``constant``: every ``1/rate`` s from 0. ``poisson``: gaps drawn from a gamma distribution with shape
    ``burstiness`` and mean ``1/rate`` (scale ``1/(rate·burstiness)``), as ``vllm bench serve --burstiness`` draws
    them; burstiness 1 is a Poisson process.
    """
    if not rate > 0 or not math.isfinite(rate):
        raise ConfigError(f"--rate must be a positive number of requests/s (got {rate})")
    if not duration_s > 0:
        raise ConfigError(f"--duration must be > 0 seconds (got {duration_s})")
    if arrival not in ARRIVALS:
        raise ConfigError(f"--arrival must be one of {', '.join(ARRIVALS)} (got {arrival!r})")
    if not burstiness > 0:
        raise ConfigError(f"--burstiness must be > 0 (got {burstiness}; 1 = Poisson)")
    if arrival == "constant":
        return np.arange(0.0, duration_s, 1.0 / rate)
    rng = np.random.default_rng(seed)
    expected = int(rate * duration_s)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=expected + 10 * int(math.sqrt(expected + 1)) + 10)
    offsets = np.concatenate([[0.0], np.cumsum(gaps)[:-1]])
    while offsets[-1] < duration_s:  # a slow draw: extend until the window is covered
        more = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=len(gaps))
        offsets = np.concatenate([offsets, offsets[-1] + np.cumsum(more)])
    return offsets[offsets < duration_s]


@dataclass
class RequestRecord:
    """One scheduled request; times in seconds from the run's start (``None`` where it never got there)."""

    scheduled_s: float
    sent_s: float | None = None
    status: int | None = None  # HTTP status; None: no response (connection error, timeout)
    ttft_s: float | None = None  # first generated token's arrival
    end_s: float | None = None  # the stream's end
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # gaps between generated chunks after the first
    finish_reason: str | None = None
    error: str | None = None
    turns: int | None = None  # --open-sessions: the agent session's turns and tool calls
    tool_calls: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.end_s is not None

    def latencies_ms(self) -> dict[str, float | None]:
        """TTFT and end-to-end latency from the **scheduled** send, and TPOT (excluding the first token)."""
        if not self.ok:
            return {"ttft": None, "tpot": None, "e2el": None}
        e2el = self.end_s - self.scheduled_s
        if self.ttft_s is None:  # an agent session's turns are not streamed: no first token to time
            return {"ttft": None, "tpot": None, "e2el": e2el * 1000}
        ttft = self.ttft_s - self.scheduled_s
        tpot = (e2el - ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None
        return {"ttft": ttft * 1000, "tpot": None if tpot is None else tpot * 1000, "e2el": e2el * 1000}


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft:300,tpot:50,e2el:2000`` (ms; vLLM's ``--goodput`` names) -> ``{"ttft": 300.0, ...}``."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        name, sep, value = part.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ConfigError(f"--slo '{part}': write METRIC:MS with METRIC one of {', '.join(SLO_METRICS)} "
                              "(e.g. --slo ttft:300,tpot:50,e2el:2000)")
        try:
            out[name] = float(value)
        except ValueError:
            raise ConfigError(f"--slo '{part}': '{value}' is not a number of milliseconds") from None
        if not out[name] > 0:
            raise ConfigError(f"--slo '{part}': the limit must be > 0 ms")
    return out


def parse_rates(text: str) -> list[float]:
    """``2,4,8`` -> ``[2.0, 4.0, 8.0]`` requests/s."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"--rate '{text}': write requests/s, comma-separated (e.g. --rate 2,4,8)") from None
    if not rates or any(not r > 0 or not math.isfinite(r) for r in rates):
        raise ConfigError(f"--rate '{text}': every rate must be a positive number of requests/s")
    return rates


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Succeeded and within every limit; ITL's limit applies to each gap (vLLM checks it per token too)."""
    if not record.ok:
        return False
    lat = record.latencies_ms()
    for name, limit in slo.items():
        if name == "itl":
            if any(gap * 1000 > limit for gap in record.itl_s):
                return False
        elif lat[name] is not None and lat[name] > limit:
            return False
    return True


def _stats(name: str, values: list[float], percentiles: tuple[float, ...]) -> dict[str, float | None]:
    arr = np.asarray(values, dtype=np.float64)
    stats = {"mean": np.mean, "median": np.median, "std": np.std,
             **{f"p{_pname(p)}": lambda a, p=p: np.percentile(a, p) for p in percentiles}}
    return {f"{key}_{name}_ms": float(stat(arr)) if arr.size else None for key, stat in stats.items()}


def _pname(p: float) -> str:
    return f"{p:g}".replace(".", "_")


def summarise(records: list[RequestRecord], rate: float, duration_s: float, slo: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = DEFAULT_PERCENTILES, arrival: str = "poisson",
              burstiness: float = 1.0, max_lag_p99_ms: float = MAX_LAG_P99_MS) -> dict[str, Any]:
    """One rate's result in ``vllm bench serve``'s field names, plus the rejections and the schedule lag.

    Rates are over ``duration`` = the last answer's end (or the schedule's end, if later) from the start, as
    vLLM divides by the benchmark's wall time; percentiles are over successful requests only.
    """
    slo = slo or {}
    ok = [r for r in records if r.ok]
    ends = [r.end_s for r in ok]
    duration = max([duration_s, *ends]) if ends else duration_s
    rejected = sum(1 for r in records if r.status == 429)
    good = sum(1 for r in records if meets_slo(r, slo))
    lags = [(r.sent_s - r.scheduled_s) * 1000 for r in records if r.sent_s is not None]
    lat = [r.latencies_ms() for r in ok]
    result: dict[str, Any] = {
        "request_rate": rate, "burstiness": burstiness if arrival == "poisson" else None, "arrival": arrival,
        "duration": duration, "num_prompts": len(records), "completed": len(ok),
        "failed": len(records) - len(ok), "rejected": rejected,
        "rejection_rate": rejected / len(records) if records else None,
        "total_output_tokens": int(sum(r.output_tokens for r in ok)),
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slo else None,
        "goodput_share_of_offered": (good / len(records)) if slo and records else None,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "goodput_slo_ms": dict(slo),
        "finish_length_share": (sum(1 for r in ok if r.finish_reason == "length") / len(ok)) if ok else None,
    }
    sessions = [r for r in ok if r.turns is not None]
    if sessions:  # --open-sessions: what the sessions did (e2el is then the session's latency)
        result["sessions"] = {"completed": len(sessions), "turns_mean": float(np.mean([r.turns for r in sessions])),
                              "tool_calls_mean": float(np.mean([r.tool_calls or 0 for r in sessions])),
                              "without_tool_call_share": sum(1 for r in sessions if not r.tool_calls) / len(sessions)}
    for name in ("ttft", "tpot", "e2el"):
        result.update(_stats(name, [v[name] for v in lat if v[name] is not None], percentiles))
    result.update(_stats("itl", [g * 1000 for r in ok for g in r.itl_s], percentiles))
    lag = np.asarray(lags, dtype=np.float64)
    result["schedule_lag_p50_ms"] = float(np.percentile(lag, 50)) if lag.size else None
    result["schedule_lag_p99_ms"] = float(np.percentile(lag, 99)) if lag.size else None
    result["generator_bound"] = bool(lag.size and result["schedule_lag_p99_ms"] > max_lag_p99_ms)
    result["max_lag_p99_ms"] = max_lag_p99_ms
    errors = Counter(r.error or f"HTTP {r.status}" for r in records if not r.ok)
    result["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])
    return result


def write_records(path: str | Path, records: list[RequestRecord]) -> None:
    Path(path).write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))


def worker_share(count: int, worker: int, workers: int) -> range:
    """The arrivals (indices into a schedule of ``count``) that Locust process ``worker`` of ``workers`` sends
    (``--processes``): every ``workers``-th from its own index, so the processes together send the whole schedule
    and each one's share keeps the schedule's rate divided by ``workers`` (and, for Poisson arrivals, its shape)."""
    if not 0 <= worker < workers:
        raise ValueError(f"worker {worker} is not one of {workers}")
    return range(worker, count, workers)


def worker_records_path(csv_prefix: str | Path, worker: int | str) -> Path:
    """Where Locust worker process ``worker`` writes its share's records (``worker="*"``: the pattern of all of
    them); ``merge_worker_records`` joins them."""
    return Path(f"{csv_prefix}{OPEN_RECORDS_SUFFIX.removesuffix('.jsonl')}.w{worker}.jsonl")


def merge_worker_records(csv_prefix: str | Path, processes: int = 1) -> Path:
    """``<prefix>_requests.jsonl`` from the worker processes' files (when there are any: a run with
    ``--processes``), in schedule order; the worker files are removed once the merged file is in place. A worker
    of ``processes`` with no file is an error: the report would count part of the schedule as all of it."""
    merged = Path(f"{csv_prefix}{OPEN_RECORDS_SUFFIX}")
    parts = sorted(merged.parent.glob(worker_records_path(csv_prefix, "*").name))
    if not parts:
        return merged
    missing = [w for w in range(processes) if not worker_records_path(csv_prefix, w).is_file()]
    if missing:
        raise DataError(f"Locust worker process(es) {missing} of {processes} wrote no open-loop records next to "
                        f"'{csv_prefix}': their share of the schedule is missing (see '{csv_prefix}.log' for why); "
                        "run again, with fewer --processes on a busy machine")
    records = sorted((r for part in parts for r in read_records(part)), key=lambda r: r.scheduled_s)
    temporary = merged.with_suffix(".jsonl.tmp")
    write_records(temporary, records)
    temporary.replace(merged)
    for part in parts:
        part.unlink()
    return merged


def read_records(path: str | Path) -> list[RequestRecord]:
    file = Path(path)
    if not file.is_file():
        raise DataError(f"no open-loop records at '{file}' (the Locust run wrote none: see its log)")
    records = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(RequestRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError) as exc:
            raise DataError(f"{file} line {number} is not an open-loop request record ({exc})") from None
    return records


# ---------------------------------------------------------------------------------------------- replay

REPLAY_SUFFIX = "replay_schedule.jsonl"  # in --out: the schedule a replay sends (offset, messages, max_tokens)


def replay_schedule(records: list[dict], speed: float, task_prompts: list[tuple[dict, ...]]
                    ) -> tuple[list[dict], list[str]]:
    """The service's own records (``verl/data/records.py`` request rows) as a schedule to send again.

    Each request once (the first choice of a completion, never a shadow copy), at its recorded ``arrival`` from the
    first one, divided by ``speed`` (2 = twice as fast); ``max_tokens`` = its recorded output length (``ignore_eos``
    then holds the lengths); the prompt as sent where the service kept texts (a completion's text prompt becomes
    one user message), else the task prompt nearest in length to its recorded ``prompt_tokens`` (words as a
    stand-in for tokens), which the notes say. Returns the rows (``offset_s``, ``messages``, ``max_tokens``,
    ``recorded_prompt``) sorted by offset, and the notes.
    """
    if not speed > 0:
        raise ConfigError(f"--replay-speed must be > 0 (got {speed}; 2 replays twice as fast)")
    requests = [r for r in records if r.get("kind", "request") == "request" and not r.get("shadow")
                and int(r.get("index") or 0) == 0]
    arrivals = []
    for r in requests:
        arrival = r.get("arrival")
        if arrival is None and r.get("time") is not None and r.get("e2e_s") is not None:
            arrival = float(r["time"]) - float(r["e2e_s"])  # older records: finish time minus latency
        if arrival is not None:
            arrivals.append((float(arrival), r))
    if not arrivals:
        raise DataError("no request rows with an arrival time in the records: replay needs the service's request "
                        "records (records_path or GET /admin/records)")
    arrivals.sort(key=lambda pair: pair[0])
    start = arrivals[0][0]
    lengths = [sum(len(str(m.get("content") or "").split()) for m in p) for p in task_prompts]
    rows, stand_ins = [], 0
    for arrival, r in arrivals:
        prompt = r.get("prompt")
        if isinstance(prompt, list) and prompt:
            messages, recorded = prompt, True
        elif isinstance(prompt, str) and prompt:
            messages, recorded = [{"role": "user", "content": prompt}], True
        else:
            if not task_prompts:
                raise DataError("the records hold no prompts (the service did not keep texts) and no task prompts "
                                "were given to stand in for them")
            want = int(r.get("prompt_tokens") or 0)
            nearest = min(range(len(task_prompts)), key=lambda i: abs(lengths[i] - want))
            messages, recorded = list(task_prompts[nearest]), False
            stand_ins += 1
        rows.append({"offset_s": (arrival - start) / speed, "messages": messages,
                     "max_tokens": max(1, int(r.get("completion_tokens") or 1)), "recorded_prompt": recorded})
    notes = [f"replayed {len(rows)} recorded requests over {rows[-1]['offset_s']:.1f} s (recorded arrivals / "
             f"{speed:g}); max_tokens = each request's recorded output length"]
    if stand_ins:
        notes.append(f"{stand_ins} of {len(rows)} records carry no prompt (the service did not keep texts: "
                     "record_texts): they were sent with the task prompt nearest to their recorded prompt length")
    return rows, notes
