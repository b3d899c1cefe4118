"""Markdown report and PNG plots from results JSONs of `benchmarks.run`, and the results manifest.

    python -m benchmarks.report RUN.json [RUN.json ...] [--plot] [--report] [--summary] [--manifest]

For each JSON, `--plot` and `--report` write, next to it (or into --out-dir),
`<stem>.md` and `<stem>-{time,speedup,memory,split}.png`. `--summary` prints
one headline table in Markdown, as for README.md, with the device, date,
commit and versions of each run; several runs of one device (e.g. its fwd
run and its fwdbwd run) make one table. `--manifest` writes `MANIFEST.md`
(one row per run, from the JSONs' metadata) next to the JSONs.
`benchmarks.run --plot --report` calls the same functions.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import textwrap
from typing import NamedTuple

from benchmarks import cases

MIB = 2**20
STATUS_TEXT = {"oom": "OOM", "skipped": "skip", "error": "error"}


# ----------------------------------------------------------------------------- indexing

class Panel(NamedTuple):
  """A group of results over T (a plot panel, a table): a shape family (T = 0), dtype, decay (or delta form) and
  packing."""
  family: cases.Shape
  dtype: str
  decay: object  # a job's decay: True, False, "token", None or a delta form
  segments: int
  states: bool = False

  @classmethod
  def of(cls, r: dict, decay) -> Panel:
    return cls(cases.job_shape(r)._replace(seq_len=0), r["dtype"], decay, cases.segments_of(r), cases.states_of(r))

  def title(self) -> str:
    return ", ".join(x for x in (self.family.family(), self.dtype,
                                 cases.setting_label(self.decay, self.segments, self.states)) if x)


class Index:
  """The results of a run, looked up by (impl, mode, panel, T)."""

  def __init__(self, data: dict):
    self.results = data["results"]
    self.rows = {self.key_of(r): r for r in self.results}
    present = {r["impl"] for r in self.results}
    self.impls = [impl.name for impl in cases.IMPLS if impl.name in present]
    self.modes = [m for m in cases.MODES if any(r["mode"] == m for r in self.results)]
    self.panels = list(dict.fromkeys(Panel.of(r, r["decay"]) for r in self.results if r["decay"] is not None))
    if not self.panels:  # only decay-agnostic implementations were run
      self.panels = list(dict.fromkeys(Panel.of(r, None) for r in self.results))

  @staticmethod
  def _key(impl: str, mode: str, panel: Panel, t: int) -> tuple:
    decay = panel.decay if cases.IMPL_BY_NAME[impl].decay_aware else None
    return impl, mode, panel._replace(decay=decay), t

  @staticmethod
  def key_of(r: dict) -> tuple:
    return Index._key(r["impl"], r["mode"], Panel.of(r, r["decay"]), r["seq_len"])

  def get(self, impl: str, mode: str, panel: Panel, t: int) -> dict | None:
    return self.rows.get(self._key(impl, mode, panel, t))

  def seq_lens(self, panel: Panel) -> list[int]:
    return sorted({r["seq_len"] for r in self.results
                   if cases.job_shape(r)._replace(seq_len=0) == panel.family and r["dtype"] == panel.dtype})

  def ours(self) -> list[str]:
    return [i for i in self.impls if cases.IMPL_BY_NAME[i].kind == "ours"]

  def headline(self, op: str) -> str | None:
    """Of our implementations of `op`, the default (`cases.HEADLINE_IMPLS`) if measured, else the first."""
    ours = [i for i in self.ours() if cases.IMPL_BY_NAME[i].op == op]
    return cases.HEADLINE_IMPLS[op] if cases.HEADLINE_IMPLS[op] in ours else (ours[0] if ours else None)


def ok(r: dict | None) -> bool:
  return r is not None and r["status"] == "ok"


def fmt_t(t: int) -> str:
  return f"{t // 1024}K" if t % 1024 == 0 else str(t)


def fmt_cell(r: dict | None, field: str = "time_ms", fmt: str = "{:.3f}") -> str:
  """A result's `field` formatted, its status if not ok, "" if absent, "–" if the field is."""
  if r is None:
    return ""
  if r["status"] != "ok":
    return STATUS_TEXT[r["status"]]
  value = r.get(field)
  if value is None:
    return "–"
  repeats = r.get("time_ms_repeats", []) if field == "time_ms" else []
  if len(repeats) > 1:  # the median pass, and the range over the passes of a --repeats run
    return f"{fmt.format(value)} [{fmt.format(min(repeats))}-{fmt.format(max(repeats))}]"
  return fmt.format(value)


def overlap(a: dict, b: dict) -> bool | None:
  """Whether the time ranges over the repeats of two results overlap; None without repeats."""
  ra, rb = a.get("time_ms_repeats", []), b.get("time_ms_repeats", [])
  if len(ra) < 2 or len(rb) < 2:
    return None
  return min(ra) <= max(rb) and min(rb) <= max(ra)


def fmt_bytes(n: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", MIB), ("KiB", 1024)):
    if n >= size:
      return f"{n / size:,.1f} {unit}"
  return f"{n:.0f} B"


def memory_cell(r: dict | None, key: str) -> str:
  if not ok(r):
    return fmt_cell(r)
  value = r.get("memory", {}).get(key)
  return "–" if value is None else f"{value / MIB:,.{1 if value < 100 * MIB else 0}f}"


def field_of(r: dict, field: str):
  """A result's field; "memory.x" reads r["memory"]["x"]."""
  if field.startswith("memory."):
    return r.get("memory", {}).get(field.removeprefix("memory."))
  return r.get(field)


def md_table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  return "\n".join(lines)


# ----------------------------------------------------------------------------- markdown sections

def _fastest(index: Index, impls, mode, panel: Panel, t: int) -> dict | None:
  rows = [r for r in (index.get(i, mode, panel, t) for i in impls) if ok(r)]
  return min(rows, key=lambda r: r["time_ms"], default=None)


def _peer_ratio(mine: dict | None, peer: dict | None) -> str:
  """The fastest peer's time over ours ("†" where the ranges over the passes overlap), or "–"."""
  if not (ok(mine) and ok(peer)):
    return "–"
  ratio = peer["time_ms"] / mine["time_ms"]
  digits = 3 if abs(ratio - 1) < 0.005 else 2  # so that a loss never reads 1.00x
  return f"{ratio:.{digits}f}x" + ("†" if overlap(mine, peer) else "")


_EMPTY_CELLS = {"", "–", "– / –"}


def summary_table(data: dict, drop_empty: bool = False) -> str:
  """Headline tables, one per op measured: our default implementation against cuDNN and the fastest peer of the
  same op (and delta form), per shape; the delta op's also gives its time over the lightning op's.

  `drop_empty` leaves out the columns with no value in any row (e.g. cuDNN's
  when it was not run).
  """
  index = Index(data)
  tables = [_summary_table(index, op, drop_empty) for op in ("lightning", "delta") if index.headline(op)]
  return "\n\n".join(tables) or "No lightning_jax implementation was measured."


def _summary_table(index: Index, op: str, drop_empty: bool) -> str:
  ours = index.headline(op)
  peers = [i for i in index.impls if cases.IMPL_BY_NAME[i].kind == "peer"]
  header = ["shape", "T", f"{ours} fwd ms", f"{ours} fwd+bwd ms", "cuDNN fwd ms", "cuDNN fwd+bwd ms",
            "fastest peer fwd (ms)", "fastest peer fwd+bwd (ms)", "speedup vs cuDNN fwd / fwd+bwd",
            "x HBM floor fwd / fwd+bwd", "fastest peer / ours fwd / fwd+bwd"]
  if op == "delta":
    header.append("ours / lightning fwd / fwd+bwd")
  rows = []
  for panel in (p for p in index.panels if cases.op_of(p.decay) == op):
    for t in index.seq_lens(panel):
      mine = {m: index.get(ours, m, panel, t) for m in ("fwd", "fwdbwd")}
      cudnn = {m: index.get(cases.BASELINE_IMPL, m, panel, t) for m in ("fwd", "fwdbwd")}
      peer = {m: _fastest(index, peers, m, panel, t) for m in ("fwd", "fwdbwd")}
      both = lambda field, fmt: " / ".join(fmt_cell(mine[m], field, fmt) or "–" for m in mine)  # noqa: E731
      rows.append([panel.title(), fmt_t(t), fmt_cell(mine["fwd"]), fmt_cell(mine["fwdbwd"]),
                   fmt_cell(cudnn["fwd"]), fmt_cell(cudnn["fwdbwd"]),
                   *(f"{peer[m]['impl']} ({fmt_cell(peer[m])})" if peer[m] else "–" for m in ("fwd", "fwdbwd")),
                   both("speedup_vs_cudnn", "{:.2f}x"), both("floor_ratio", "{:.2f}"),
                   " / ".join(_peer_ratio(mine[m], peer[m]) for m in ("fwd", "fwdbwd")),
                   *([both("lightning_ratio", "{:.2f}x")] if op == "delta" else [])])
  if drop_empty:
    keep = [i for i in range(len(header)) if any(row[i] not in _EMPTY_CELLS for row in rows)]
    header, rows = [header[i] for i in keep], [[row[i] for i in keep] for row in rows]
  return md_table(header, rows)


def merge_runs(runs: list[dict], *, supersede: bool = False) -> dict:
  """Several runs of one device (e.g. its fwd run and its fwdbwd run) as one, for the summary table.

  Each result keeps its own floors. A case measured by two of the runs is an
  error, unless `supersede`: then the later run's (in the order given) replaces
  the earlier's, as where one mode was re-run at a newer commit; a later run
  that skipped the case (its budget spent) measured nothing, and leaves the
  earlier measurement.
  """
  kinds = {run["metadata"].get("device_kind") for run in runs}
  if len(kinds) > 1:
    raise ValueError(f"the runs of one summary must share a device, got {sorted(map(str, kinds))}")
  merged = {}
  for run in runs:
    keys = set()
    for r in run["results"]:
      key = Index.key_of(r)
      if key in merged and (key in keys or not supersede):
        raise ValueError(f"two of the runs measured the same case {key}")
      keys.add(key)
      if key not in merged or r.get("status") == "ok" or merged[key].get("status") != "ok":
        merged[key] = r
  return {"metadata": runs[0]["metadata"], "results": list(merged.values())}


_VERSIONS_SHOWN = ("jax", "jaxlib", "torch", "triton", "fla-core", "lightning-attn", "jax-linear-attention")


def _modes_label(md: dict) -> str:
  return ", ".join(m.replace("fwdbwd", "fwd+bwd") for m in md.get("plan", {}).get("modes", []))


def _versions_label(md: dict) -> str:
  versions = md.get("versions", {})
  return ", ".join(f"{k} {versions[k]}" for k in _VERSIONS_SHOWN if versions.get(k))


def _run_label(md: dict) -> str:
  repeats = md.get("plan", {}).get("repeats", 1)
  passes = f", {repeats} passes" if repeats > 1 else ""
  return f"{md.get('date_utc', '')[:10]}, commit {str(md.get('git_commit'))[:10]}{passes}"


def summary_with_provenance(*runs: dict, supersede: bool = False) -> str:
  """The headline table of one or several runs of one device, under a line saying where, when and with
  what each was measured (`merge_runs`' supersede: a later run's case replaces an earlier's)."""
  mds = [run["metadata"] for run in runs]
  if len(runs) == 1:
    head = f"{mds[0].get('device_kind')}, {_run_label(mds[0])}; {_versions_label(mds[0])}; median ms"
  else:
    versions = {_versions_label(md) for md in mds}
    head = f"{mds[0].get('device_kind')}; " + "; ".join(
        f"{_modes_label(md)}: {_run_label(md)}" + ("" if len(versions) == 1 else f", {_versions_label(md)}")
        for md in mds) + (f"; {versions.pop()}" if len(versions) == 1 else "") + "; median ms"
  if any(md.get("plan", {}).get("repeats", 1) > 1 for md in mds):
    head += " [min-max over the passes]"
  table = summary_table(merge_runs(list(runs), supersede=supersede), drop_empty=True)
  note = ("\n\nfastest peer / ours: above 1, ours is faster; † the ranges over the passes overlap."
          if "fastest peer / ours" in table.partition("\n")[0] else "")
  return f"{head}.\n\n{table}{note}"


def _floor_note(data: dict) -> str:
  """Where the results were measured by several runs (`--resume`), each run's copy bandwidth."""
  runs = sorted({round(r["copy_bandwidth_gbps"]) for r in data["results"] if r.get("copy_bandwidth_gbps")})
  if len(runs) < 2:
    return ""
  return (" in the last run; the floors use the bandwidth of the run that measured each result ("
          + ", ".join(f"{bw} GB/s" for bw in runs) + ")")


def _warmup_seconds_note(settings: dict) -> str:
  """The back-to-back warm-up before a case's samples, where the run had one (runs before the setting had none)."""
  seconds = settings.get("warmup_seconds") or 0
  return f" and {seconds:g} s of back-to-back calls (the GPU at its power cap's steady clocks)" if seconds else ""


def _probes_note(bw: dict) -> str:
  probes = bw.get("bandwidth_gbps_probes")
  if not probes:
    return ""
  return f" (the median of {len(probes)} probes, one per pass: {', '.join(f'{g:.0f}' for g in probes)} GB/s)"


def _metadata_section(data: dict) -> str:
  md = data["metadata"]
  versions = ", ".join(f"{k} {v}" for k, v in md.get("versions", {}).items() if v)
  bw = md.get("copy_bandwidth") or {}
  settings = md.get("settings", {})
  repeats = md.get("plan", {}).get("repeats", 1)
  lines = [
      f"- Device: **{md.get('device_kind')}** ({md.get('platform')}, compute capability "
      f"{md.get('compute_capability') or 'n/a'}), {md.get('device_count')} device(s) visible, one used",
      f"- Date (UTC): {md.get('date_utc')}; git commit `{md.get('git_commit')}`"
      f"{' (with uncommitted changes)' if md.get('git_dirty') else ''}",
      f"- Command: `{md.get('command')}` ({md.get('wall_seconds', 0):.0f} s)",
      f"- Versions: {versions}",
      f"- Copy bandwidth (y = x + 1 in float32, {fmt_bytes(bw.get('bytes_moved', 0))} read + written): "
      f"{bw.get('bandwidth_gbps', float('nan')):.0f} GB/s{_probes_note(bw)}{_floor_note(data)}",
      f"- Timing: up to {settings.get('warmup')} warm-up calls{_warmup_seconds_note(settings)}, then the median of "
      f"up to {settings.get('iters')} device-synchronised samples in {settings.get('case_seconds')} s (at least 3; "
      # Runs before the setting existed used 1 ms.
      f"each of at least {1e3 * settings.get('sample_seconds', 1e-3):g} ms of back-to-back calls; "
      f"compilation and autotuning excluded; input sets rotated over {fmt_bytes(settings.get('rotate_bytes', 0))}). "
      "See benchmarks/README.md.",
  ]
  if repeats > 1:
    lines.append(f"- Repeats: {repeats} passes over every case, the order of the groups reversed on every other "
                 "pass; a time is the median pass, [min-max] over the passes.")
  if md.get("note"):
    lines.append(f"- Note: {md['note']}")
  return "\n".join(lines)


def by_shape_tables(data: dict) -> str:
  """One table per shape: implementations x modes, median ms (or the status)."""
  index = Index(data)
  parts = []
  for panel in index.panels:
    for t in index.seq_lens(panel):
      found = {impl: [index.get(impl, m, panel, t) for m in index.modes] for impl in index.impls}
      rows = [[impl, *map(fmt_cell, rs)] for impl, rs in found.items()
              if any(r is not None and r["status"] != "skipped" for r in rs)]
      if rows:
        parts.append(f"### {panel.title()}, T = {t}\n\n"
                     + md_table(["implementation", *(f"{m} ms" for m in index.modes)], rows))
  return "\n\n".join(parts) or "Nothing was measured."


def _per_t_tables(index: Index, title, field: str, cell, impls=None) -> str:
  """One table per panel and mode: rows implementations (those with a `field` value), columns T."""
  parts = []
  for panel in index.panels:
    ts = index.seq_lens(panel)
    for mode in index.modes:
      found = {impl: [index.get(impl, mode, panel, t) for t in ts] for impl in impls or index.impls}
      rows = [[impl, *map(cell, rs)] for impl, rs in found.items() if any(ok(r) and field_of(r, field) for r in rs)]
      if rows:
        parts.append(f"**{title}, {panel.title()}, {mode}**\n\n"
                     + md_table(["implementation", *(f"T={fmt_t(t)}" for t in ts)], rows))
  return "\n\n".join(parts) or "Not measured in this run."


def where_we_lose(data: dict) -> str:
  """The cases where another implementation beat the fastest lightning_jax one."""
  index = Index(data)
  ours = index.ours()
  others = [i for i in index.impls if i not in ours]
  rows = []
  for panel in index.panels:
    for t in index.seq_lens(panel):
      for mode in index.modes:
        best = _fastest(index, ours, mode, panel, t)
        for impl in others:
          r = index.get(impl, mode, panel, t)
          if best and ok(r) and r["time_ms"] < best["time_ms"]:
            spread = {True: "yes", False: "no", None: "–"}[overlap(best, r)]
            rows.append([panel.title(), fmt_t(t), mode, f"{best['impl']} {fmt_cell(best)}",
                         f"{impl} {fmt_cell(r)}", f"{best['time_ms'] / r['time_ms']:.2f}x", spread])
  if not rows:
    return "No measured implementation beat the fastest lightning_jax implementation on any case."
  return md_table(["shape", "T", "mode", "fastest lightning_jax (ms)", "faster (ms)", "their speedup",
                   "ranges over repeats overlap"], rows)


def _not_measured_section(index: Index) -> str:
  counts = collections.Counter((r["impl"], r["status"], r.get("reason", "")) for r in index.results
                               if r["status"] != "ok")
  if not counts:
    return "Every case ran."
  rows = [[impl, status, str(n), reason.replace("|", "/").replace("\n", " ")[:300]]
          for (impl, status, reason), n in sorted(counts.items())]
  return md_table(["implementation", "status", "cases", "reason"], rows)


def markdown(data: dict, plots: dict | None = None) -> str:
  """The full report; `plots` maps plot names to paths relative to the report."""
  index = Index(data)
  ours = index.ours()
  md = data["metadata"]
  sections = [
      f"# Lightning Attention benchmark: {md.get('device_kind')}",
      _metadata_section(data),
      "## Implementations\n\n" + "\n".join(f"- `{i}`: {cases.IMPL_BY_NAME[i].label}" for i in index.impls),
      "## Summary\n\n" + summary_table(data),
      "## Plots\n\n" + "".join(f"![{name}]({path})\n" for name, path in (plots or {}).items()),
      "## Results by shape (median ms)\n\n" + by_shape_tables(data),
      "## Speedup against cuDNN FlashAttention\n\ncuDNN time / time (above 1: faster than cuDNN).\n\n"
      + _per_t_tables(index, "speedup vs cuDNN", "speedup_vs_cudnn",
                      lambda r: fmt_cell(r, "speedup_vs_cudnn", "{:.2f}"),
                      impls=[i for i in index.impls if i != cases.BASELINE_IMPL]),
      "## Memory\n\nFootprint in MiB: for JAX, XLA's compiled memory analysis of the timed function "
      "(argument + output + temp - alias bytes); for torch, the call's peak allocation above what was "
      "live plus its explicit inputs. JSON has the components and the device's peak bytes in use.\n\n"
      + _per_t_tables(index, "footprint MiB", "memory.footprint_bytes",
                      lambda r: memory_cell(r, "footprint_bytes")),
      "## Scaling with T\n\nTime at T / time at T/2: 2 is linear, 4 quadratic.\n\n"
      + _per_t_tables(index, "scaling ratio", "scaling_ratio", lambda r: fmt_cell(r, "scaling_ratio", "{:.2f}")),
      *(["## Packed sequences\n\nTime of a row of packed sequences / time of the same row unpacked (1: packing "
         "costs nothing).\n\n" + _per_t_tables(index, "packed / unpacked", "packing_ratio",
                                                 lambda r: fmt_cell(r, "packing_ratio", "{:.3f}"))]
        if any(panel.segments > 1 for panel in index.panels) else []),
      *(["## Delta forms against the lightning op\n\nTime / the time of our lightning op on the same shape and "
         "mode, without decay for DeltaNet and with per-token decay for Gated DeltaNet and KDA (the target: at most "
         "2).\n\n" + _per_t_tables(index, "time / lightning op's", "lightning_ratio",
                                     lambda r: fmt_cell(r, "lightning_ratio", "{:.2f}"))]
        if any(cases.op_of(panel.decay) == "delta" for panel in index.panels) else []),
      "## Distance to the HBM floor\n\nTime / (bytes that must move at the measured copy bandwidth): "
      "fwd moves q, k, v, o; bwd q, k, v, do, dq, dk, dv; fwd+bwd both.\n\n"
      + _per_t_tables(index, "x HBM floor", "floor_ratio", lambda r: fmt_cell(r, "floor_ratio", "{:.2f}"),
                      impls=ours),
      "## Where we lose\n\nCases where another implementation beat the fastest lightning_jax one.\n\n"
      + where_we_lose(data),
      "## Not measured\n\n" + _not_measured_section(index),
  ]
  return "\n\n".join(sections) + "\n"


# ----------------------------------------------------------------------------- plots

def _color(impl: str):
  """tab10's colours for the first ten implementations, their lighter tab20 shades for the next ten."""
  import matplotlib  # noqa: PLC0415

  i = list(cases.IMPL_BY_NAME).index(impl)
  return matplotlib.colormaps["tab20"]((2 * i + i // 10) % 20)


def _fit(title: str) -> str:
  """A panel title in lines that fit its width (packed settings make long ones)."""
  return textwrap.fill(title, 50)


def _grid(plt, index: Index, rows: int):
  cols = max(1, len(index.panels))
  fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows + 0.8), squeeze=False)
  return fig, axes


def _series(index: Index, impl, mode, panel: Panel, value):
  points = [(t, value(r)) for t in index.seq_lens(panel) if ok(r := index.get(impl, mode, panel, t))]
  return [p for p in points if p[1] is not None]


def _line_plot(plt, index: Index, value, ylabel: str):
  """Log-log lines of value(result) against T: rows modes, columns panels, one line per implementation."""
  fig, axes = _grid(plt, index, len(index.modes))
  handles = {}
  for row, mode in enumerate(index.modes):
    for col, panel in enumerate(index.panels):
      ax = axes[row][col]
      for impl in index.impls:
        points = _series(index, impl, mode, panel, value)
        if points:
          handles[impl], = ax.plot(*zip(*points), marker="o", ms=3, color=_color(impl), label=impl)
      ts = index.seq_lens(panel)
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xticks(ts, [fmt_t(t) for t in ts], fontsize=7)
      ax.set_xticks([], minor=True)
      ax.set_title(_fit(f"{panel.title()}: {mode}"), fontsize=9)
      ax.set_xlabel("T")
      ax.set_ylabel(ylabel)
      ax.grid(True, alpha=0.3)
  fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(5, max(1, len(handles))),
             fontsize=8)
  fig.tight_layout(rect=(0, 0.6 / fig.get_figheight(), 1, 1))
  return fig


def _split_plot(plt, index: Index):
  """Stacked fwd / bwd bars per implementation at the largest T of each panel that has both."""
  fig, axes = _grid(plt, index, 1)
  for col, panel in enumerate(index.panels):
    ax = axes[0][col]
    bars = []
    for t in reversed(index.seq_lens(panel)):
      pairs = [(i, index.get(i, "fwd", panel, t), index.get(i, "bwd", panel, t)) for i in index.impls]
      bars = [(i, f["time_ms"], b["time_ms"]) for i, f, b in pairs if ok(f) and ok(b)]
      if bars:
        break
    if not bars:
      ax.set_visible(False)
      continue
    names, fwd, bwd = zip(*bars)
    ax.barh(names, fwd, label="fwd")
    ax.barh(names, bwd, left=fwd, label="bwd")
    ax.set_title(_fit(f"{panel.title()}, T={fmt_t(t)}"), fontsize=9)
    ax.set_xlabel("ms")
    ax.legend(fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
  fig.tight_layout()
  return fig


def _footprint_mib(r: dict) -> float | None:
  footprint = r.get("memory", {}).get("footprint_bytes")
  return footprint / MIB if footprint else None


# <stem>-<name>.png: name -> f(plt, index) -> figure.
_PLOTS = {
    "time": lambda plt, index: _line_plot(plt, index, lambda r: r["time_ms"], "ms"),
    "speedup": lambda plt, index: _line_plot(plt, index, lambda r: r.get("speedup_vs_cudnn"), "speedup vs cuDNN"),
    "memory": lambda plt, index: _line_plot(plt, index, _footprint_mib, "footprint MiB"),
    "split": lambda plt, index: _split_plot(plt, index),
}
PLOT_NAMES = tuple(_PLOTS)


def write_plots(data: dict, out_dir, stem: str) -> dict:
  """Writes the PNG plots; returns {name: path}.

  The speedup plot needs cuDNN, the split plot a case measured in both fwd and bwd.
  """
  import matplotlib  # noqa: PLC0415 -- only for plots

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  index = Index(data)
  skip = set()
  if not any("speedup_vs_cudnn" in r for r in index.results):
    skip.add("speedup")
  if not any(ok(r) and r["mode"] == "bwd" for r in index.results):
    skip.add("split")
  paths = {}
  for name, make in _PLOTS.items():
    if name in skip:
      continue
    fig = make(plt, index)
    paths[name] = pathlib.Path(out_dir) / f"{stem}-{name}.png"
    fig.savefig(paths[name], dpi=110)
    plt.close(fig)
  return paths


def write_report(data: dict, path, plots: dict | None = None) -> pathlib.Path:
  """Writes the markdown report; plot paths are made relative to it."""
  path = pathlib.Path(path)
  rel = {name: pathlib.Path(p).resolve().relative_to(path.parent.resolve()).as_posix()
         for name, p in (plots or {}).items()}
  path.write_text(markdown(data, rel))
  return path


# ----------------------------------------------------------------------------- manifest

MANIFEST_NAME = "MANIFEST.md"


def _shapes_label(md: dict) -> str:
  """The plan's shapes by family, dtype, decay and packing settings: "B4 H32 D64: T 2K-32K (4); bf16; decay"."""
  plan = md.get("plan", {})
  families = {}
  for shape in plan.get("shapes", []):
    shape = cases.Shape(*shape)
    families.setdefault(shape._replace(seq_len=0).family(), []).append(shape.seq_len)
  segments = plan.get("segments", [1])  # runs before packing have none
  own_states = " with their own states" if plan.get("states") else ""
  packing = " and ".join(f"{n} packed sequences{own_states}" if n > 1 else "unpacked" for n in segments)
  return "; ".join([*(f"{name}: T {fmt_t(min(ts))}-{fmt_t(max(ts))} ({len(ts)})" if len(ts) > 1
                      else f"{name}: T {fmt_t(ts[0])}" for name, ts in families.items()),
                    str(plan.get("dtype")), " and ".join(cases.DECAY_LABELS[d] for d in plan.get("decays", [])),
                    *([packing] if segments != [1] else [])])


def manifest(runs: dict[str, dict]) -> str:
  """`MANIFEST.md` of a results folder: one row per run (stem -> its JSON's data), from the metadata alone."""
  rows, details = [], []
  for stem, data in sorted(runs.items()):
    md = data["metadata"]
    plan = md.get("plan", {})
    bw = (md.get("copy_bandwidth") or {}).get("bandwidth_gbps")
    cc = md.get("compute_capability")
    rows.append([f"[{stem}]({stem}.md)", f"{md.get('device_kind')}" + (f" (sm{cc.replace('.', '')})" if cc else ""),
                 _modes_label(md), ", ".join(plan.get("impls", [])), _shapes_label(md),
                 md.get("date_utc", "")[:10], f"`{str(md.get('git_commit'))[:10]}`",
                 str(plan.get("repeats", 1)), "–" if bw is None else f"{bw:.0f} GB/s"])
    versions = ", ".join(f"{k} {v}" for k, v in md.get("versions", {}).items() if v)
    details.append("\n".join([
        f"- `{stem}`: `{md.get('command')}`",
        *(f"  - earlier command (`--resume`): `{c}`" for c in md.get("previous_commands", [])),
        f"  - versions: {versions}",
        *([f"  - note: {md['note']}"] if md.get("note") else [])]))
  header = ["run (report)", "device", "modes", "implementations", "shapes", "date (UTC)", "commit", "repeats",
            "copy bandwidth"]
  return "\n\n".join([
      "# Benchmark results",
      "The current run per device and mode, each as `<run>.json` (metadata and every result), `<run>.md` "
      "(the report) and `<run>-*.png` (plots). Superseded runs are in git history. This file is generated "
      "from the JSONs' metadata: `python -m benchmarks.report --manifest benchmarks/results/*.json` "
      "(`tests/test_results_manifest.py` checks that it is current).",
      md_table(header, rows) if rows else "No runs.",
      "## Commands and versions",
      "\n".join(details) if details else "No runs."]) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description="Plots, reports, the summary table and the manifest "
                                               "from benchmarks.run JSONs.")
  parser.add_argument("json", nargs="+", help="results JSONs; for --summary, runs of one device")
  parser.add_argument("--out-dir", help="default: each JSON's folder")
  parser.add_argument("--plot", action="store_true")
  parser.add_argument("--report", action="store_true")
  parser.add_argument("--summary", action="store_true", help="print the headline table of the runs")
  parser.add_argument("--supersede", action="store_true",
                      help="for --summary: a later JSON's measurement of a case replaces an earlier JSON's")
  parser.add_argument("--manifest", action="store_true",
                      help=f"write {MANIFEST_NAME}, one row per JSON, into their folder (or --out-dir)")
  args = parser.parse_args(argv)
  sources = [pathlib.Path(p) for p in args.json]
  runs = {src: json.loads(src.read_text()) for src in sources}
  for src, data in runs.items():
    out = pathlib.Path(args.out_dir or src.parent)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(data, out, src.stem) if args.plot else None
    if args.report:
      print(write_report(data, out / f"{src.stem}.md", plots))
    for p in (plots or {}).values():
      print(p)
  if args.manifest:
    folders = {src.parent.resolve() for src in sources}
    if len(folders) > 1 and not args.out_dir:
      parser.error("--manifest needs the JSONs of one folder (or --out-dir)")
    path = pathlib.Path(args.out_dir or sources[0].parent) / MANIFEST_NAME
    path.write_text(manifest({src.stem: data for src, data in runs.items()}))
    print(path)
  if args.summary:
    print(summary_with_provenance(*runs.values(), supersede=args.supersede))


if __name__ == "__main__":
  main()
