"""Per-kernel device time of the CLI's cases, from a `jax.profiler` trace (PERFORMANCE.md's per-kernel numbers).

    python -m benchmarks.kernel_times --ops deltanet,gated_deltanet --impls lj-delta-pallas,jla-delta-mosaic \
        --shapes 2x8192x32x128 --modes fwd,fwdbwd [--calls 3] [--top 12] [--launches] [--back-to-back] [--timed]

Each case is built as `benchmarks.run` builds it (the same functions, inputs
and gates: `jax_impls`, `peers.jla`), compiled and run once; then `--calls`
calls run under the profiler. Every device event's duration is summed by its
name and divided by the calls: a kernel's time per call. With `--launches`,
the last call's launches instead, in order and each apart: XLA gives one name
to a kernel compiled once and launched twice (the backward's dv and dk sweeps),
which the sums add up. Each case's first line gives their sum, the device's
busy time per call (the gaps between kernels, and so launch latency, left out:
the CLI's times include them). With `--timed`, each case is also timed as the
CLI times it (its input sets rotated over the GPU profiles' 256 MiB, samples
of 20 ms of back-to-back calls, the median), in this process: what the CLI's
time adds to the kernels' (launch gaps, and the inputs' trips from HBM where
the traced calls find them in L2). Nsight Compute segfaulted on the lent H200's
image; the profiler's device activity needs no ncu. One process, one case at a
time: compare kernels within one run. On a CPU there are no device events (XLA
runs on the host), and a case says so.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import pathlib
import tempfile

from benchmarks import cases


def _device_events(trace: dict) -> dict:
  """{device process name: [complete events]} of a Perfetto trace, GPU processes only (host events left out)."""
  events = trace["traceEvents"]
  names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  found = collections.defaultdict(list)
  for e in events:
    process = names.get(e.get("pid"), "")
    if e.get("ph") == "X" and "GPU" in process:
      found[process].append(e)
  return found


def kernel_times(trace: dict, calls: int) -> dict:
  """{device process name: {kernel: ms per call}} from a Perfetto trace of `calls` calls (GPU processes only),
  largest first."""
  found = {}
  for process, events in _device_events(trace).items():
    times = collections.defaultdict(float)
    for e in events:
      times[e["name"]] += e["dur"] / 1e3 / calls  # microseconds in the trace
    found[process] = dict(sorted(times.items(), key=lambda kv: -kv[1]))
  return found


def launches(trace: dict, calls: int) -> dict:
  """{device process name: [(kernel, ms, idle ms), ...]}: the last of `calls` calls' kernels in launch order (GPU
  processes only), each launch apart: kernels of one name (XLA names a kernel compiled once and launched twice
  alike, as the dv and dk sweeps of the backward) stay apart. Idle: the device's time between the previous kernel's
  end (the previous call's last, for the first) and this one's start."""
  found = {}
  for process, events in _device_events(trace).items():
    events = sorted(events, key=lambda e: e["ts"])
    first = len(events) - len(events) // calls
    found[process] = [(e["name"], e["dur"] / 1e3,
                       (e["ts"] - events[i - 1]["ts"] - events[i - 1]["dur"]) / 1e3 if i else 0.0)
                      for i, e in enumerate(events) if i >= first]
  return found


def trace_calls(fn, args, calls: int, folder: pathlib.Path | None = None, *, back_to_back: bool = False) -> dict:
  """The Perfetto trace (`jax.profiler`) of `calls` calls of fn(*args), each waited for (back_to_back: enqueued
  back to back, as the CLI's samples are, and the last waited for); written under `folder` (None: a temporary
  one)."""
  import jax  # noqa: PLC0415

  with contextlib.ExitStack() as stack:
    if folder is None:
      folder = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
      for _ in range(calls):
        out = fn(*args)
        if not back_to_back:
          jax.block_until_ready(out)
      jax.block_until_ready(out)
    (path,) = folder.glob("**/perfetto_trace.json.gz")
    with gzip.open(path) as f:
      return json.load(f)


def _attention(job: dict):
  from benchmarks import jax_impls  # noqa: PLC0415 -- imports JAX

  if job["impl"].startswith("jla-"):
    from benchmarks.peers import jla  # noqa: PLC0415 -- the package is optional
    return jla.make_attention(job)
  return jax_impls.lightning_or_baseline(job)


def unavailable(job: dict) -> str | None:
  """Why the job cannot run here (as the CLI reports it skipped), else None."""
  from benchmarks import jax_impls  # noqa: PLC0415

  reason = cases.unsupported(job)
  if reason is None and job["impl"].startswith("jla-"):
    from benchmarks import worker  # noqa: PLC0415
    from benchmarks.peers import jla  # noqa: PLC0415
    reason = worker.missing_module({"jla.ops": "jax-linear-attention"}) or jla.unavailable(job)
  return reason if reason is not None else jax_impls.lightning_unavailable(job)


def case_kernel_times(job: dict, mode: str, calls: int, *, by_launch: bool = False, timed: bool = False,
                      back_to_back: bool = False):
  """(`kernel_times` (by_launch: `launches`) of one job's mode ("fwd" or "fwdbwd"), on the CLI's function and first
  input set (back_to_back: `trace_calls`'); with timed, `timing.measure`'s result of the function timed as the CLI
  times it, else None)."""
  import jax  # noqa: PLC0415

  from benchmarks import jax_impls  # noqa: PLC0415
  from lightning_jax.tune import timing  # noqa: PLC0415

  attn, extras = _attention(job)
  fns = jax_impls.mode_functions(attn, cases.differentiated_inputs(job))
  settings = cases.PROFILES["full"]
  n_sets = timing.rotation_sets(cases.input_set_bytes(job), settings["rotate_bytes"]) if timed else 1
  sets = [(*x[:3], *extras) if mode == "fwd" else (*x, *extras) for x in jax_impls.make_inputs(job, n_sets)]
  fn = jax.jit(fns[mode])
  jax.block_until_ready(fn(*sets[0]))  # compiled and warm before the trace
  trace = trace_calls(fn, sets[0], calls, back_to_back=back_to_back)
  found = launches(trace, calls) if by_launch else kernel_times(trace, calls)
  if not timed:
    return found, None
  return found, timing.measure(lambda i: fn(*sets[i]), jax.block_until_ready, n_sets=n_sets,
                               warmup=settings["warmup"], max_iters=settings["iters"],
                               max_seconds=settings["case_seconds"], min_sample_seconds=settings["sample_seconds"],
                               warmup_seconds=settings["warmup_seconds"])


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--ops", default="deltanet,gated_deltanet", help="as benchmarks.run's --ops")
  p.add_argument("--impls", default="lj-delta-pallas", help="as benchmarks.run's --impls")
  p.add_argument("--shapes", default="2x8192x32x128", help="BxTxHxD[xE], comma-separated")
  p.add_argument("--modes", default="fwd,fwdbwd", help="fwd and/or fwdbwd")
  p.add_argument("--decay", default="on", help="the lightning op's decay settings, as benchmarks.run's")
  p.add_argument("--dtype", default="bf16")
  p.add_argument("--segments", default="1", help="sequences packed in each row, as benchmarks.run's")
  p.add_argument("--calls", type=int, default=3, help="calls traced per case")
  p.add_argument("--top", type=int, default=12, help="kernels listed per case")
  p.add_argument("--launches", action="store_true",
                 help="list the last call's kernel launches in order, each apart and with the device's idle time "
                      "before it, instead of sums by name")
  p.add_argument("--back-to-back", action="store_true",
                 help="enqueue the traced calls back to back (as the CLI's samples), not each waited for")
  p.add_argument("--timed", action="store_true",
                 help="also time each case as the CLI does (input sets rotated, 20 ms samples), in this process")
  args = p.parse_args(argv)
  if args.calls < 1:
    p.error(f"--calls must be >= 1, got {args.calls}")
  return args


def main(argv=None):
  args = parse_args(argv)
  modes = cases.parse_choices(args.modes, ("fwd", "fwdbwd"), "--modes")
  ops = cases.parse_ops(args.ops)
  decays = [cases.DECAYS[d] for d in cases.parse_choices(args.decay, cases.DECAYS, "--decay")]
  decays = (decays if "lightning" in ops else []) + [op for op in ops if op != "lightning"]
  segments = cases.parse_segments(args.segments)
  jobs = cases.make_jobs(cases.parse_impls(args.impls), cases.parse_shapes(args.shapes), decays, modes, args.dtype,
                         segments=segments)
  for job in jobs:
    b, t, h, d, e = cases.job_shape(job)
    for mode in modes:
      label = f"{job['impl']} B{b} T{t} H{h} D{d} E{e} {cases.setting_label(job['decay'], job['segments'])} {mode}"
      reason = unavailable(job)
      if reason is not None:
        print(f"== {label}: skipped ({reason})", flush=True)
        continue
      found, stats = case_kernel_times(job, mode, args.calls, by_launch=args.launches, timed=args.timed,
                                       back_to_back=args.back_to_back)
      if not found:
        print(f"== {label}: no GPU events (XLA ran on the host)", flush=True)
      for process, kernels in found.items():
        rows = kernels if args.launches else list(kernels.items())[:args.top]
        total = sum(row[1] for row in kernels) if args.launches else sum(kernels.values())
        idle = f", {sum(row[2] for row in kernels):.3f} ms idle between them" if args.launches else ""
        print(f"== {label}, {process}: {total:.3f} ms of kernels per call{idle}", flush=True)
        for i, (name, ms, *gap) in enumerate(rows):
          after = f" (after {gap[0]:.3f} ms idle)" if gap else ""
          print(f"   {f'{i:3d}.' if args.launches else ''}{ms:8.3f} ms{after}  {name[:100]}", flush=True)
      if stats is not None:
        print(f"   {stats['time_ms']:8.3f} ms  a call timed as the CLI times it ({stats['n_sets']} input sets rotated)",
              flush=True)


if __name__ == "__main__":
  main()
