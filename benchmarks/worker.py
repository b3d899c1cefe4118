"""The subprocess side of the benchmark: one worker process per implementation group.

    python -m <worker module> --json-in JOBS.json --json-out RESULTS.jsonl

JOBS.json holds {"jobs": [...], "settings": {...}, "deadline": unix time}.
RESULTS.jsonl gets one JSON object a line, flushed as soon as it is known, so
that a crash loses only the case that was running:

    {"type": "info", ...}     first: the worker's versions and device
    {"type": "result", "job_id": ..., ...}   then one per (job, mode)

A result's status is "ok", "oom" (out of device memory, from XLA's
RESOURCE_EXHAUSTED, torch's OutOfMemoryError, or the compiled memory analysis
exceeding the device), "skipped" (package or device missing, time budget
spent, a decay or packing the implementation cannot take, a peer refusing the
case (`Refused`); with the reason) or "error" (any other exception; with its
message).
Pure Python: the backends import their frameworks.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import sys
import time
import traceback

from benchmarks import cases

RESULT_FIELDS = ("impl", "group", "batch", "seq_len", "heads", "dim_k", "dim_v", "dtype", "decay", "segments",
                 "states")


def package_versions(names) -> dict:
  """Installed versions of the distributions `names` (None when missing), without importing them."""
  versions = {}
  for name in names:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return versions


def missing_module(modules: dict) -> str | None:
  """Why {module: pip name} cannot be used: a package not installed, or a module failing to import."""
  for module, pip_name in modules.items():
    if importlib.util.find_spec(module.split(".")[0]) is None:
      return f"{module.split('.')[0]} is not installed (pip install {pip_name}; see benchmarks/README.md)"
  for module in modules:
    try:
      importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 -- a broken install is a reason to skip
      return f"{module} does not import: {type(exc).__name__}: {exc}"[:600]
  return None


class DeviceMemoryExceeded(Exception):
  """Raised before running a case whose compiled memory analysis exceeds the device's memory."""


class Refused(Exception):
  """A peer's refusal of a case (its own check of the inputs or the environment): the case is skipped."""


class Backend:
  """What a worker module provides; the defaults describe an always-available backend."""

  def info(self) -> dict:
    return {}

  def unavailable_reason(self, job: dict) -> str | None:
    """Why `job` cannot run here (missing package, no GPU), or None."""
    del job
    return None

  @contextlib.contextmanager
  def open_job(self, job: dict, settings: dict):
    """Prepares a job (inputs, compiled functions); yields the context `measure` takes."""
    raise NotImplementedError
    yield

  def measure(self, ctx, mode: str) -> dict:
    """Measures one mode of an open job; returns the result fields (time_ms, memory, ...)."""
    raise NotImplementedError


class Unavailable(Backend):
  """A backend whose package cannot be imported: every job is skipped with the reason."""

  def __init__(self, reason: str):
    self.reason = reason

  def info(self) -> dict:
    return {"available": False, "reason": self.reason}

  def unavailable_reason(self, job: dict) -> str:
    return self.reason


def classify(exc: BaseException) -> tuple[str, str]:
  """(status, reason) of a failed case: "skipped" for a `Refused` one, "oom" for out-of-device-memory errors, else
  "error"."""
  if isinstance(exc, Refused):
    return "skipped", str(exc)[:600]
  message = f"{type(exc).__name__}: {exc}".strip()
  oom = (isinstance(exc, DeviceMemoryExceeded) or "RESOURCE_EXHAUSTED" in message
         or "out of memory" in message.lower() or "OutOfMemory" in type(exc).__name__)
  return ("oom" if oom else "error"), message[:600]


def result(job: dict, mode: str, status: str, **fields) -> dict:
  """One measurement: the job's fields, the mode, the status and `fields`."""
  return {**{f: job[f] for f in RESULT_FIELDS}, "mode": mode, "status": status, **fields}


TIME_BUDGET = "time budget (--max-seconds) spent"


def run_job(backend: Backend, job: dict, settings: dict, deadline: float):
  """Yields one result per mode of `job`; never raises."""
  pending = list(job["modes"])
  try:
    reason = cases.unsupported(job) or backend.unavailable_reason(job)
    if reason is None and time.time() > deadline:
      reason = TIME_BUDGET
    if reason is not None:
      for mode in pending:
        yield result(job, mode, "skipped", reason=reason)
      return
    with backend.open_job(job, settings) as ctx:
      while pending and time.time() <= deadline:
        try:
          yield result(job, pending[0], "ok", **backend.measure(ctx, pending[0]))
        except Exception as exc:  # noqa: BLE001 -- a failed case is a result
          status, message = classify(exc)
          yield result(job, pending[0], status, reason=message)
        pending.pop(0)
  except Exception as exc:  # noqa: BLE001 -- no inputs or no compiled functions: every pending mode
    status, message = classify(exc)
    traceback.print_exc(file=sys.stderr)
    for mode in pending:
      yield result(job, mode, status, reason=message)
    return
  for mode in pending:
    yield result(job, mode, "skipped", reason=TIME_BUDGET)


def main(make_backend, argv=None):
  """Worker entry point: `make_backend()` returns a Backend (or an `Unavailable`)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json-in", required=True)
  parser.add_argument("--json-out", required=True)
  args = parser.parse_args(argv)
  with open(args.json_in) as f:
    spec = json.load(f)
  with open(args.json_out, "a") as out:
    def emit(obj):
      out.write(json.dumps(obj) + "\n")
      out.flush()

    backend = make_backend()
    emit({"type": "info", **backend.info()})
    for job in spec["jobs"]:
      for res in run_job(backend, job, spec["settings"], spec["deadline"]):
        emit({"type": "result", "job_id": job["id"], **res})
