"""Benchmark CLI: lightning_jax against cuDNN FlashAttention, XLA softmax attention and the peers.

    python -m benchmarks.run --smoke --save --plot --report --out-dir /tmp/bench   # CPU, seconds
    python -m benchmarks.run --profile full --save --plot --report                  # a full GPU run

Every implementation group runs in its own subprocess (`benchmarks.jax_impls`,
`benchmarks.peers.*`), one after the other; this process imports neither JAX
nor torch. A probe subprocess first records the device and measures the copy
bandwidth of the HBM floor. The groups first run every case with T up to 16K
(the Lightning Attention-3 shapes), then, in a second round of workers, the
longer ones; within a round the peers and baselines go first and ours last.

`--repeats N` runs that sequence N times, the order of the groups within a
round reversed on every other pass, so that a drift of the device's speed
during the run does not favour the groups that run first. Each case keeps the
pass with the median time and every pass's time (`time_ms_repeats`); the JAX
workers share a persistent compilation cache, which later passes can load from.
Every pass after the first probes the copy bandwidth again; the floors use the
median of the probes.

`--max-seconds` bounds the whole run: each worker gets a share of the time
left in proportion to its number of cases (time it does not use passes to the
next), stops starting cases at the end of its share and is killed
`GRACE_SECONDS` after it. Time left after the last group goes to a second pass
over the cases skipped for time; those still not run are reported as skipped
("time budget"), and `--resume` runs them later into the same JSON. A worker that
crashes loses the case it was running (an error, with its log) and a new
worker goes on with the rest.

Outputs (`--out-dir`, default benchmarks/results/; file stem `--name`, default
the device kind, e.g. nvidia-h100-80gb-hbm3):
`--save` <stem>.json (every measurement with metadata), `--plot`
<stem>-{time,speedup,memory,split}.png, `--report` <stem>.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import cases, metrics, report, worker

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "benchmarks" / "results"
GRACE_SECONDS = 45.0
PROBE_SECONDS = 180.0
RETRY_MIN_SECONDS = 10.0  # the least time left worth a second pass over the cases skipped for time
LOG_TAIL_CHARS = 1500
VERSIONED_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "numpy", "torch", "triton",
                      "fla-core", "lightning-attn", "jax-linear-attention")
SETTINGS = ("warmup", "warmup_seconds", "iters", "case_seconds", "sample_seconds", "compile_threads", "rotate_bytes")


def parse_args(argv=None) -> argparse.Namespace:
  """Command-line options; those left unset take the values of the profile."""
  p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--profile", choices=sorted(cases.PROFILES), default="full",
                 help="defaults for the options below (default: full)")
  p.add_argument("--smoke", action="store_true", help="tiny shapes that run on a CPU in seconds (= --profile smoke)")
  p.add_argument("--shapes", help=f"shape sets {sorted(cases.SHAPE_SETS)} or BxTxHxD[xE], comma-separated")
  p.add_argument("--impls", help=f"implementations or sets {list(cases.IMPL_SETS)}, comma-separated; "
                                 f"names: {', '.join(cases.IMPL_BY_NAME)}")
  p.add_argument("--modes", help="comma-separated from fwd,bwd,fwdbwd")
  p.add_argument("--ops", help="comma-separated from lightning (with the --decay settings), deltanet, "
                               "gated_deltanet, kda (the delta forms), delta (the three forms) (default: lightning)")
  p.add_argument("--decay", help="comma-separated from on (per-head rates), off, token (per-token rates); "
                                 "the lightning op's settings")
  p.add_argument("--segments", help="sequences packed in each row, comma-separated (1: unpacked; 1,8: both)")
  p.add_argument("--sequence-states", action="store_true", default=None,
                 help="packed rows as cu_seqlens over the batch's rows end to end, each sequence with its own "
                      "initial and final state (default: segment ids, no states)")
  p.add_argument("--dtype", choices=sorted(cases.DTYPE_ITEMSIZE))
  p.add_argument("--warmup", type=int, help="warm-up calls per case (after compilation)")
  p.add_argument("--warmup-seconds", type=float,
                 help="seconds of back-to-back calls per case before its samples, discarded (the GPU at its power "
                      "cap's steady clocks)")
  p.add_argument("--iters", type=int, help="most timed samples per case")
  p.add_argument("--case-seconds", type=float, help="most seconds of timed samples per case (at least 3 samples)")
  p.add_argument("--sample-seconds", type=float,
                 help="least seconds of one timed sample of back-to-back calls (at most 10000 calls)")
  p.add_argument("--max-seconds", type=float, help="time budget of the whole run")
  p.add_argument("--repeats", type=int, default=1,
                 help="passes over every case, split evenly from the time budget (default 1)")
  p.add_argument("--compile-threads", type=int, help="threads compiling the functions of a job")
  p.add_argument("--rotate-bytes", type=int, help="rotate input sets until they span this many bytes")
  p.add_argument("--save", action="store_true", help="write <out-dir>/<name>.json")
  p.add_argument("--plot", action="store_true", help="write the PNG plots")
  p.add_argument("--report", action="store_true", help="write the Markdown report")
  p.add_argument("--out-dir", type=pathlib.Path, default=DEFAULT_OUT_DIR)
  p.add_argument("--name", help="file stem of the outputs (default: the device kind)")
  p.add_argument("--git-commit", help="commit to record, for a copy of the repository without .git "
                                     "(default: git rev-parse HEAD, else 'unknown')")
  p.add_argument("--resume", action="store_true",
                 help="keep the results of <out-dir>/<name>.json and run only the cases it lacks or skipped "
                      "for time (complete a budget-limited run with a second one)")
  args = p.parse_args(argv)
  if args.repeats < 1:
    p.error(f"--repeats must be >= 1, got {args.repeats}")
  if args.smoke:
    args.profile = "smoke"
  for key, value in {"ops": "lightning", **cases.PROFILES[args.profile]}.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  return args


@dataclasses.dataclass
class Plan:
  jobs: list
  settings: dict
  description: dict


def make_plan(args) -> Plan:
  impls = cases.parse_impls(args.impls)
  shapes = cases.parse_shapes(args.shapes)
  modes = cases.parse_choices(args.modes, cases.MODES, "--modes")
  ops = cases.parse_ops(args.ops)
  decays = [cases.DECAYS[d] for d in cases.parse_choices(args.decay, cases.DECAYS, "--decay")]
  # The lightning op runs the --decay settings; a delta form is a setting of its own (see `cases`).
  decays = (decays if "lightning" in ops else []) + [op for op in ops if op != "lightning"]
  segments = cases.parse_segments(args.segments)
  states = bool(args.sequence_states)
  jobs = cases.make_jobs(impls, shapes, decays, modes, args.dtype, segments, states=states)
  impls = [i for i in impls if any(j["impl"] == i for j in jobs)]  # not those of an op left out
  settings = {key: getattr(args, key) for key in SETTINGS}
  description = dict(profile=args.profile, impls=impls, shapes=[list(s) for s in shapes], modes=modes,
                     decays=decays, segments=segments, states=states, dtype=args.dtype,
                     max_seconds=args.max_seconds,
                     repeats=args.repeats)
  return Plan(jobs, settings, description)


def worker_env(compilation_cache: pathlib.Path | None = None) -> dict:
  """The workers' environment: the repository on PYTHONPATH; JAX may take 90% of the GPU.

  With `compilation_cache`, JAX workers share that persistent compilation cache.
  """
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
  if compilation_cache is not None:
    env["JAX_COMPILATION_CACHE_DIR"] = str(compilation_cache)
  return env


def _tail(path: pathlib.Path) -> str:
  return path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if path.exists() else ""


def _read_lines(path: pathlib.Path, skip: int) -> list[dict]:
  if not path.exists():
    return []
  lines = path.read_text().split("\n")[:-1]  # complete lines only
  return [json.loads(line) for line in lines[skip:]]


def _progress(r: dict, start: float):
  shape = f"B{r['batch']} T{r['seq_len']} H{r['heads']} D{r['dim_k']}"
  setting = cases.setting_label(r["decay"], r["segments"], cases.states_of(r))
  what = f"{r['time_ms']:10.3f} ms" if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')[:80]}"
  print(f"[{time.time() - start:6.1f}s] {r['impl']:<21} {shape:<24} {setting:<8} {r['mode']:<6} {what}",
        flush=True)


def run_worker(module: str, args: list[str], workdir: pathlib.Path, name: str, kill_at: float,
               lines_path: pathlib.Path | None = None, on_line=None,
               env: dict | None = None) -> tuple[list[dict], int | None, str]:
  """Runs `python -m module args`; returns (output lines, return code or None if killed, log tail).

  The worker's JSON-lines output `lines_path` is read as it grows, and each new
  line passed to `on_line`. The worker is killed at time `kill_at`. `env`
  defaults to `worker_env()`.
  """
  log = workdir / f"{name}.log"
  lines = []

  def read_new():
    new = _read_lines(lines_path, len(lines)) if lines_path else []
    for line in new:
      if on_line:
        on_line(line)
    lines.extend(new)

  with open(log, "w") as log_file:
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env or worker_env(),
                            stdout=log_file, stderr=subprocess.STDOUT)
    while proc.poll() is None and time.time() < kill_at:
      read_new()
      time.sleep(0.2)
    if proc.poll() is None:
      proc.kill()
      proc.wait()
      read_new()
      return lines, None, _tail(log)
  read_new()
  return lines, proc.returncode, _tail(log)


def run_group(group: str, jobs: list[dict], settings: dict, deadline: float, workdir: pathlib.Path,
              start: float, label: str, env: dict | None = None) -> tuple[list[dict], dict]:
  """Runs the jobs of one group until done or out of time; returns (results in job order, worker info)."""
  results, info, pending, attempt = {}, {}, list(jobs), 0
  while pending:
    attempt += 1
    name = f"{label}-{attempt}"
    spec_path, out_path = workdir / f"{name}.json", workdir / f"{name}.jsonl"
    spec_path.write_text(json.dumps({"jobs": pending, "settings": settings, "deadline": deadline}))
    lines, rc, log = run_worker(cases.GROUP_MODULES[group], ["--json-in", str(spec_path), "--json-out",
                                                             str(out_path)], workdir, name,
                                deadline + GRACE_SECONDS, out_path,
                                lambda r: _progress(r, start) if r["type"] == "result" else None, env)
    for line in lines:
      if line["type"] == "info":
        info = {k: v for k, v in line.items() if k != "type"}
      else:
        results[line.pop("job_id"), line["mode"]] = line
        del line["type"]
    pending = [j for j in pending if any((j["id"], m) not in results for m in j["modes"])]
    if not pending:
      break
    if rc is None:
      status, reason, blamed = "skipped", "time budget: the worker was stopped past its share", pending
    else:
      status, reason = "error", f"worker exited with code {rc} before finishing; log tail:\n{log}"
      blamed = pending if not lines else pending[:1]  # died before starting: every job; else the one running
    for job in blamed:
      for mode in job["modes"]:
        results.setdefault((job["id"], mode), worker.result(job, mode, status, reason=reason))
    pending = [j for j in pending if j not in blamed]
  return [results[j["id"], m] for j in jobs for m in j["modes"]], info


def run_probe(workdir: pathlib.Path, kill_at: float, settings: dict, name: str = "probe") -> dict:
  """Device information and copy bandwidth from `benchmarks.jax_impls --probe`, timed like the cases (their
  `settings`' sample length and warm-up seconds)."""
  path = workdir / f"{name}.json"
  timing_args = [str(settings["sample_seconds"]), str(settings["warmup_seconds"])]
  _, rc, log = run_worker("benchmarks.jax_impls", ["--probe", str(path), *timing_args], workdir, name, kill_at)
  if rc == 0 and path.exists():
    return json.loads(path.read_text())
  return {"error": f"probe failed (code {rc}): {log}"}


def combined_copy_bandwidth(probes: list[dict]) -> dict | None:
  """The run's copy-bandwidth record from its probes (one per pass of a repeated run).

  One probe: its record. Several: the median bandwidth of those that measured
  one, with each in pass order (`bandwidth_gbps_probes`) and the bytes a probe
  moves.
  """
  measured = [p["copy_bandwidth"] for p in probes if (p.get("copy_bandwidth") or {}).get("bandwidth_gbps")]
  if len(probes) == 1 or not measured:
    return probes[0].get("copy_bandwidth")
  gbps = [m["bandwidth_gbps"] for m in measured]
  return {"bytes_moved": measured[0]["bytes_moved"], "bandwidth_gbps": statistics.median(gbps),
          "bandwidth_gbps_probes": gbps}


def skipped_for_time(r: dict) -> bool:
  return r["status"] == "skipped" and r.get("reason", "").startswith("time budget")


def run_groups(jobs: list[dict], settings: dict, probe: dict, end: float, workdir: pathlib.Path,
               start: float, label: str = "", reverse: bool = False,
               env: dict | None = None) -> tuple[list[dict], dict]:
  """Runs the jobs until `end`; returns (results in plan order, worker infos).

  A step's share of the time is set before it starts, by its case count; a
  step that compiles or autotunes slowly (the torch peers on a cold machine)
  can run out while later steps leave time unused. A second pass gives that
  time to the cases the first pass skipped for time. `reverse` runs the groups
  of each round in reverse order; `label` prefixes the workers' names.
  """
  results, infos = _run_steps(jobs, settings, probe, end, workdir, start, label, reverse, env)
  retry = still_to_run(jobs, [r for r in results if not skipped_for_time(r)])
  if retry and end - time.time() > RETRY_MIN_SECONDS:
    again, more = _run_steps(retry, settings, probe, end, workdir, start, f"{label}retry-", reverse, env)
    results = merge(jobs, results, again)
    infos = {**more, **infos}
  return results, infos


def _run_steps(jobs: list[dict], settings: dict, probe: dict, end: float, workdir: pathlib.Path,
               start: float, label_prefix: str, reverse: bool, env: dict | None) -> tuple[list[dict], dict]:
  """Every (tier, group) in order, sharing the time left until `end`; returns (results, worker infos)."""
  order = list(cases.GROUP_MODULES)
  if reverse:
    order.reverse()
  steps = sorted({(j["tier"], j["group"]) for j in jobs}, key=lambda s: (s[0], order.index(s[1])))
  units = {step: sum(len(j["modes"]) for j in jobs if (j["tier"], j["group"]) == step) for step in steps}
  results, infos = [], {}
  for i, (tier, group) in enumerate(steps):
    now = time.time()
    share = max(0.0, end - now) * units[tier, group] / sum(units[s] for s in steps[i:])
    step_jobs = [j for j in jobs if (j["tier"], j["group"]) == (tier, group)]
    if group in cases.GPU_ONLY_GROUPS and probe.get("platform") != "gpu":
      reason = f"needs an NVIDIA GPU (the probe found {probe.get('platform')})"
      results += [worker.result(j, m, "skipped", reason=reason) for j in step_jobs for m in j["modes"]]
      continue
    step_results, info = run_group(group, step_jobs, settings, now + share, workdir, start,
                                   f"{label_prefix}{group}-t{tier}", env)
    results += step_results
    infos.setdefault(group, info)
  return results, infos


def run_repeats(jobs: list[dict], settings: dict, probe: dict, end: float, workdir: pathlib.Path, start: float,
                repeats: int) -> tuple[list[dict], dict, list[dict]]:
  """`repeats` passes of `run_groups`, each given an even share of the time left.

  Every pass after the first starts with its own probe, since the copy
  bandwidth drifts with the device's speed like the timings do (see
  `combined_copy_bandwidth`). Returns (results, infos, probes), `probe` first.
  """
  if repeats == 1:
    return (*run_groups(jobs, settings, probe, end, workdir, start), [probe])
  env = worker_env(workdir / "jax-compilation-cache")
  passes, infos, probes = [], {}, [probe]
  for i in range(repeats):
    if i:
      probes.append(run_probe(workdir, min(end, time.time() + PROBE_SECONDS), settings, f"pass{i}-probe"))
    now = time.time()
    pass_end = now + max(0.0, end - now) / (repeats - i)
    results, more = run_groups(jobs, settings, probe, pass_end, workdir, start, f"pass{i}-", i % 2 == 1, env)
    passes.append(results)
    infos = {**more, **infos}
  return combine_repeats(jobs, passes), infos, probes


def combine_repeats(jobs: list[dict], passes: list[list[dict]]) -> list[dict]:
  """One result per case from several passes, in plan order.

  An "ok" case keeps the pass with the median time (the lower one of an even
  count) and gains `time_ms_repeats`, the times of its "ok" passes in pass
  order; its compile time and memory come from the first of them, which
  compiled (later passes may load from the compilation cache). A case no pass
  measured keeps its first pass's result.
  """
  by_key = {}
  for results in passes:
    for r in results:
      by_key.setdefault(cases.case_key(r, r["mode"]), []).append(r)
  combined = []
  for key in (cases.case_key(j, m) for j in jobs for m in j["modes"]):
    found = by_key.get(key, [])
    measured = [r for r in found if r["status"] == "ok"]
    if not measured:
      combined += found[:1]
      continue
    median = sorted(measured, key=lambda r: r["time_ms"])[(len(measured) - 1) // 2]
    first = {k: measured[0][k] for k in ("compile_s", "memory") if k in measured[0]}
    combined.append({**median, **first, "time_ms_repeats": [r["time_ms"] for r in measured]})
  return combined


def previous_run(path: pathlib.Path) -> tuple[list[dict], list[str]]:
  """(results worth keeping, commands) of an earlier run: all but the cases it skipped for time."""
  if not path.exists():
    return [], []
  data = json.loads(path.read_text())
  keep = [r for r in data["results"] if not skipped_for_time(r)]
  meta = data["metadata"]
  return keep, [*meta.get("previous_commands", []), meta["command"]]


def still_to_run(jobs: list[dict], done: list[dict]) -> list[dict]:
  """The jobs, less the modes that `done` already holds."""
  keys = {cases.case_key(r, r["mode"]) for r in done}
  jobs = [{**j, "modes": [m for m in j["modes"] if cases.case_key(j, m) not in keys]} for j in jobs]
  return [j for j in jobs if j["modes"]]


def merge(jobs: list[dict], earlier: list[dict], new: list[dict]) -> list[dict]:
  """Earlier and new results (the new one where both have a case), in the order of the plan."""
  by_key = {cases.case_key(r, r["mode"]): r for r in [*earlier, *new]}
  ordered = [by_key.pop(key) for key in (cases.case_key(j, m) for j in jobs for m in j["modes"]) if key in by_key]
  return ordered + list(by_key.values())


def git(*args) -> str | None:
  try:
    out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip()


def metadata(argv, args, plan: Plan, probe: dict, infos: dict, wall_seconds: float, previous_commands) -> dict:
  """Device, versions, date, git commit and the exact command of the run."""
  commit = args.git_commit or git("rev-parse", "HEAD") or "unknown"
  status = None if args.git_commit else git("status", "--porcelain", "--untracked-files=no")
  versions = {"python": platform.python_version(), **worker.package_versions(VERSIONED_PACKAGES)}
  for info in (probe, *infos.values()):
    versions.update({k: v for k, v in info.get("versions", {}).items() if v})
  device_kind = probe.get("device_kind", "unknown")
  return dict(
      device_kind=device_kind, device_slug=cases.device_slug(device_kind), platform=probe.get("platform"),
      compute_capability=probe.get("compute_capability"), device_count=probe.get("device_count"),
      core_count=probe.get("core_count"), bytes_limit=probe.get("bytes_limit"),
      copy_bandwidth=probe.get("copy_bandwidth"), probe_error=probe.get("error"), versions=versions,
      date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      git_commit=commit, git_dirty=None if status is None else bool(status),
      command=shlex.join(["python", "-m", "benchmarks.run", *argv]), previous_commands=previous_commands,
      python_executable=sys.executable,
      host=platform.node(), wall_seconds=wall_seconds, plan=plan.description, settings=plan.settings,
      workers=infos)


def write_outputs(data: dict, args, stem: str) -> list[pathlib.Path]:
  """Writes the JSON, plots and report asked for; returns their paths."""
  if not (args.save or args.plot or args.report):
    return []
  args.out_dir.mkdir(parents=True, exist_ok=True)
  paths = []
  if args.save:
    paths.append(args.out_dir / f"{stem}.json")
    paths[-1].write_text(json.dumps(data, indent=1) + "\n")
  plots = report.write_plots(data, args.out_dir, stem) if args.plot else {}
  paths += plots.values()
  if args.report:
    paths.append(report.write_report(data, args.out_dir / f"{stem}.md", plots))
  return paths


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  plan = make_plan(args)
  start = time.time()
  with tempfile.TemporaryDirectory(prefix="lightning-jax-bench-") as tmp:
    workdir = pathlib.Path(tmp)
    probe = run_probe(workdir, start + min(PROBE_SECONDS, args.max_seconds), plan.settings)
    stem = args.name or cases.device_slug(probe.get("device_kind", "unknown"))
    earlier, commands = previous_run(args.out_dir / f"{stem}.json") if args.resume else ([], [])
    jobs = still_to_run(plan.jobs, earlier)
    new, infos, probes = run_repeats(jobs, plan.settings, probe, start + args.max_seconds, workdir, start,
                                     args.repeats)
  probe = {**probe, "copy_bandwidth": combined_copy_bandwidth(probes)}
  bandwidth = (probe["copy_bandwidth"] or {}).get("bandwidth_gbps")
  for r in new:  # each result keeps the floor of the run that measured it (see metrics.derive)
    if r["status"] == "ok" and bandwidth:
      r["copy_bandwidth_gbps"] = bandwidth
  data = {"metadata": metadata(argv, args, plan, probe, infos, time.time() - start, commands),
          "results": metrics.derive(merge(plan.jobs, earlier, new), bandwidth)}
  print("\n" + report.summary_table(data) + "\n")
  for path in write_outputs(data, args, stem):
    print(f"wrote {path}")
  return data


if __name__ == "__main__":
  main()
