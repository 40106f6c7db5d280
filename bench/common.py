"""Shared pieces of the benchmark suite: result rows, statistics, the table, process helpers."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    """One measured line of the table: a side of a comparison, with its raw samples.

    ``group`` names the comparison (rows of one group are compared with its ``ref`` row,
    torch's component); ``better`` is ``"lower"`` or ``"higher"``. ``status`` is empty
    when the side ran in full, else what cut it short (``"timed out after 60 s (1 of 3
    runs)"``, ``"failed: ..."``); its samples are those measured before.
    """

    case: str
    group: str
    side: str
    unit: str
    samples: list[float]
    better: str = "lower"
    ref: bool = False
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    status: str = ""


@dataclass
class Check:
    """A target of the issue and whether this run met it."""

    case: str
    target: str
    value: str
    met: bool


@dataclass
class CaseResult:
    name: str
    rows: list[Row] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CaseResult:
        rows = [Row(**r) for r in doc.get("rows", [])]
        checks = [Check(**c) for c in doc.get("checks", [])]
        return cls(doc["name"], rows, checks, doc.get("seconds", 0.0), doc.get("error", ""))


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for no samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples) if samples else math.nan


def _fmt(value: float) -> str:
    if value is None or math.isnan(value):
        return "-"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def ratio(row: Row, ref: Row | None) -> str:
    """How many times better ``row`` is than torch's ``ref`` row (by median)."""
    if ref is None:
        return "-"
    if row is ref:
        return "1 (torch)"
    mine, theirs = median(row.samples), median(ref.samples)
    if math.isnan(mine) or math.isnan(theirs):
        return "-"
    if row.better == "lower":
        if mine <= 0:
            return "inf"
        factor = theirs / mine
    else:
        if theirs <= 0:
            return "inf" if mine > 0 else "-"
        factor = mine / theirs
    return f"{factor:.2f}x" if factor < 10 else f"{factor:.0f}x"


def table(results: Sequence[CaseResult]) -> str:
    """The markdown table of all rows, then the targets."""
    lines = [
        "| case | comparison | side | n | min | median | p99 | max | unit | vs torch |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    checks: list[Check] = []
    for result in results:
        refs = {row.group: row for row in result.rows if row.ref}
        for row in result.rows:
            s = row.samples
            unit = row.unit + (" (lower better)" if row.better == "lower" else " (higher better)")
            lo, hi = (min(s), max(s)) if s else (math.nan, math.nan)
            versus = ratio(row, refs.get(row.group))
            if row.status:
                versus = f"{versus}; {row.status}" if s else row.status
            lines.append(
                f"| {row.case} | {row.group} | {row.side} | {len(s)} | {_fmt(lo)} "
                f"| {_fmt(median(s))} | {_fmt(percentile(s, 99))} | {_fmt(hi)} "
                f"| {unit} | {versus} |"
            )
        if result.error:
            lines.append(f"| {result.name} | ERROR | {result.error[:150]} | 0 | | | | | | |")
        checks.extend(result.checks)
    lines.append("")
    lines.append("vs torch: how many times better than torch's component in the same group")
    lines.append("(by median; > 1 means kelastic wins).")
    if checks:
        lines += ["", "| case | target | this run | met |", "|---|---|---|---|"]
        for check in checks:
            met = "yes" if check.met else "**no**"
            lines.append(f"| {check.case} | {check.target} | {check.value} | {met} |")
    notes = [f"- {r.case} / {r.side}: {r.note}" for res in results for r in res.rows if r.note]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines)


#: where :func:`save_partial` writes (set by ``python -m bench`` in a case's process)
PARTIAL_OUT: str | None = None


def save_partial(result: CaseResult) -> None:
    """Write the rows measured so far where the suite reads them if the case's time limit
    ends its process, so that a late hang costs only the rows not yet measured."""
    if PARTIAL_OUT is None:
        return
    tmp = f"{PARTIAL_OUT}.partial"
    Path(tmp).write_text(json.dumps(result.to_json()))
    os.replace(tmp, PARTIAL_OUT)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def child_env(**extra: str) -> dict[str, str]:
    """Environment for helper processes: the repo's packages importable, plus ``extra``."""
    env = dict(os.environ)
    paths = [str(REPO), str(REPO / "worker_lib"), str(REPO / "sidecar"), str(REPO / "operator")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def stop_process(proc: subprocess.Popen[Any] | None, grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; reaps. Safe on a dead process."""
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()


def kill_pids(pids: Sequence[int]) -> None:
    """SIGKILL and reap our forked children ``pids`` (ignoring those already gone)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


@contextlib.contextmanager
def embedded_etcd() -> Iterator[str]:
    """A real etcd on loopback (kelastic's ``EmbeddedEtcd``); yields ``host:port``."""
    from kelastic_operator.local.etcd import EmbeddedEtcd

    server = EmbeddedEtcd().start()
    try:
        yield server.endpoint
    finally:
        server.stop()


class LineReader:
    """Reads a child's stdout lines on a daemon thread; :meth:`get` waits for the next one."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        import queue
        import threading

        self.proc = proc
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.suppress(Exception):
            for line in self.proc.stdout:
                self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def get(self, timeout: float) -> str:
        """The next line within ``timeout`` s; ``TimeoutError`` or ``RuntimeError`` (EOF)."""
        import queue

        try:
            line = self._queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            what = f"no output from pid {self.proc.pid} within {timeout:.1f}s"
            raise TimeoutError(what) from None
        if line is None:
            self._queue.put(None)
            raise RuntimeError(f"pid {self.proc.pid} exited (code {self.proc.poll()})")
        return line


def read_events(path: Path) -> list[dict[str, Any]]:
    """The JSON-lines events a benchmark trainer appended to ``path`` (none if missing).

    A line that does not parse (the writer was killed mid-line) is skipped.
    """
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


#: The ElasticJob that ``kelastic run`` gets in the DDP benchmarks (hang, goodput, mttr).
JOB = """\
apiVersion: kelastic.dev/v1alpha1
kind: ElasticJob
metadata:
  name: bench-{name}
spec:
  replicas: {replicas}
  minReplicas: {replicas}
  maxReplicas: {replicas}
  nprocPerNode: {nproc}
  maxRestarts: {max_restarts}{extra_spec}
  rendezvous:
    lastCallTimeoutSeconds: 1
    leaseTTLSeconds: 5
  template:
    spec:
      containers:
        - name: trainer
          image: bench
          command: ["python", "{train}"]
"""


def spawn_logged(
    args: Sequence[str], env: dict[str, str], log_path: Path, cwd: Path
) -> subprocess.Popen[bytes]:
    """Start ``args`` in its own session, stdout and stderr to ``log_path``."""
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            list(args),
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )


def start_kelastic(
    tmp: Path,
    name: str,
    train: Path,
    replicas: int,
    nproc: int,
    events: Path,
    *,
    warm: bool = False,
    max_restarts: int = 100,
    extra_spec: str = "",
    extra_env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """``kelastic run`` of :data:`JOB` with ``train`` (events to ``events``), in ``tmp``.

    ``extra_spec`` is YAML indented by two spaces, inserted under ``spec:`` (e.g. an
    ``inProcess:`` block); ``extra_env`` is added to ``kelastic run``'s environment;
    ``extra_args`` to its command line (e.g. ``--etcd HOST:PORT``).
    """
    job = tmp / f"{name}.yaml"
    job.write_text(
        JOB.format(name=name, replicas=replicas, nproc=nproc, max_restarts=max_restarts,
                   train=train, extra_spec=("\n" + extra_spec.rstrip()) if extra_spec else "")
    )  # fmt: skip
    env = child_env(BENCH_EVENTS=str(events), **(extra_env or {}))
    env.pop("TORCHELASTIC_TIMER_FILE", None)
    env.pop("BENCH_TIMER", None)
    cli = "import sys; from kelastic_operator.cli import main; sys.exit(main())"
    args = [sys.executable, "-c", cli, "run", str(job), "--workdir", str(tmp / f"work-{name}"),
            "--warm-start" if warm else "--no-warm-start", *extra_args]  # fmt: skip
    return spawn_logged(args, env, tmp / f"kelastic-{name}.log", tmp)


def start_torchrun_pair(
    tmp: Path, name: str, train: Path, env: dict[str, str], max_restarts: int
) -> list[subprocess.Popen[bytes]]:
    """Two ``torchrun`` agents x 2 workers on localhost, c10d rendezvous, unshared store."""
    from kelastic_operator.local.etcd import free_port

    port = free_port()
    run_id = uuid.uuid4().hex[:8]
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    procs = []
    for node in range(2):
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
                "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
                str(train)]  # fmt: skip
        procs.append(spawn_logged(args, env, tmp / f"torchrun-{name}-{node}.log", tmp))
    return procs
