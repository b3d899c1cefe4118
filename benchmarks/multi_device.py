"""Scaling over several devices: sequence and data parallelism against the same program on one device.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.multi_device --smoke --save --report
    python -m benchmarks.multi_device --devices 8 --save --report        # a host with 8 GPUs

Ops (`--ops`): `lightning_attention` with per-head decay (the ALiBi slopes),
and the delta forms of `delta_attention` ("deltanet", "gated_deltanet", "kda",
or "delta" for the three; beta and rates as in `benchmarks.run`). Cases for
each, in modes fwd and fwdbwd (`jax_impls.mode_functions`: o, and the VJP of
q, k, v and a delta form's beta and rates for a cotangent):

* sequence: `--shape` BxTxHxD on one device through the plain op, against T N
  tokens over a mesh ("sp",) of N devices through its sharded wrapper
  (`sharded_lightning_attention`, `sharded_delta_attention`) with
  `sequence_axis="sp"`, so that every device holds T tokens; the wrapper also
  runs over a mesh of one device, its overhead over the plain op
  (`wrapper_ratio`: its time / the plain op's);
* data: `--dp-shape` on one device through the plain op, against B N rows
  over a mesh ("data",) of N devices (`batch_axes="data"`).

Every program is compiled on inputs already laid out on its mesh and timed by
`jax_impls.measure_mode` (`lightning_jax.tune.timing`: warm-up calls, then the
median of block_until_ready samples). tokens/s = B T / time; scaling = tokens/s
on N devices / tokens/s on one; efficiency = scaling / N. `--repeats R` times
the programs of a row R times, in alternating order, keeping each one's median.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shlex
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lightning_jax
from benchmarks import cases, jax_impls, report, run, worker
from lightning_jax.tune import timing

MODES = ("fwd", "fwdbwd")
MESH_AXES = {"sequence": "sp", "data": "data"}
PROFILES = {  # shapes and timing settings (those of benchmarks.run) of a full run and of --smoke
    "default": dict(shape="1x32768x32x128", dp_shape="4x32768x32x64", iters=20,
                    settings=dict(warmup=2, case_seconds=1.0, rotate_bytes=256 << 20)),  # rotated per device
    "smoke": dict(shape="1x256x2x16", dp_shape="2x128x2x16", iters=3,
                  settings=dict(warmup=1, case_seconds=0.2, rotate_bytes=0)),
}


def parse_args(argv) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m benchmarks.multi_device", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--devices", type=int, help="devices N of the sharded runs (default: every visible device)")
  default = PROFILES["default"]
  p.add_argument("--shape", help=f"one-device shape BxTxHxD of the sequence case (default {default['shape']})")
  p.add_argument("--dp-shape", help=f"one-device shape BxTxHxD of the data case (default {default['dp_shape']})")
  p.add_argument("--ops", default="lightning",
                 help="comma-separated from lightning and the delta forms (deltanet, gated_deltanet, kda; "
                      "delta: the three) (default lightning)")
  p.add_argument("--modes", default=",".join(MODES), help="comma-separated from fwd,fwdbwd")
  p.add_argument("--dtype", default="bf16", choices=sorted(jax_impls.DTYPES))
  p.add_argument("--iters", type=int, help="most timed samples per measurement (default 20; --smoke 3)")
  p.add_argument("--repeats", type=int, default=1, help="measurements per program, alternating order (default 1)")
  p.add_argument("--smoke", action="store_true", help="tiny shapes, seconds on a CPU with host devices")
  p.add_argument("--save", action="store_true", help="write <out-dir>/<name>.json")
  p.add_argument("--report", action="store_true", help="write <out-dir>/<name>.md")
  # Not benchmarks/results/, whose files are benchmarks.run's runs (tests/test_results_manifest.py).
  p.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("."), help="default: the current folder")
  p.add_argument("--name", help="file stem of the outputs (default: <device kind>-x<N>-multi-device)")
  p.add_argument("--git-commit", help="commit to record, for a copy of the repository without .git")
  args = p.parse_args(argv)
  profile = PROFILES["smoke" if args.smoke else "default"]
  args.shape = args.shape or profile["shape"]
  args.dp_shape = args.dp_shape or profile["dp_shape"]
  args.iters = args.iters or profile["iters"]
  visible = jax.device_count()
  args.devices = visible if args.devices is None else args.devices
  if not 1 <= args.devices <= visible:
    p.error(f"--devices {args.devices}: this process sees {visible} {jax.devices()[0].device_kind} device(s); "
            "give 1 to that many (on the CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N set before "
            "starting gives N host devices)")
  if args.repeats < 1:
    p.error(f"--repeats must be >= 1, got {args.repeats}")
  try:
    args.modes = cases.parse_choices(args.modes, MODES, "--modes")
    args.ops = cases.parse_ops(args.ops)
    args.shape, args.dp_shape = (_one_shape(text) for text in (args.shape, args.dp_shape))
  except ValueError as err:
    p.error(str(err))
  # On the CPU the smoke run takes the chunked jnp path explicitly; "auto" picks the kernels on a GPU.
  args.impl = "xla" if args.smoke and jax.default_backend() == "cpu" else "auto"
  on_gpu = jax.default_backend() == "gpu"
  args.settings = dict(profile["settings"], iters=args.iters,
                       sample_seconds=timing.GPU_SAMPLE_SECONDS if on_gpu else 1e-3,
                       warmup_seconds=timing.GPU_WARMUP_SECONDS if on_gpu else 0.0)
  return args


def _one_shape(text: str) -> cases.Shape:
  shapes = cases.parse_shapes(text)
  if len(shapes) != 1 or shapes[0].dim_v != shapes[0].dim_k:
    raise ValueError(f"bad shape {text!r}: give one BxTxHxD")
  return shapes[0]


def _job(op: str, shape: cases.Shape, dtype: str) -> dict:
  """The `benchmarks.cases` job of an op (its `decay` setting: per-head rates, or the delta form)."""
  return dict(shape._asdict(), dtype=dtype, decay=True if op == "lightning" else op)


def _extras(op: str, job: dict) -> dict:
  """The op's inputs after q, k, v by name: the per-head rates [H], or a delta form's beta and rates."""
  if op == "lightning":
    return {"decay": np.asarray(lightning_jax.alibi_slopes(job["heads"]), np.float32)}
  return cases.delta_gates(job)


def _program(op: str, names: tuple, split: str | None, devices: list, impl: str):
  """(attn(q, k, v, *extras) -> o, sharding of q, k, v, shardings of the extras `names`).

  split None: the plain op on devices[0]; "sequence" / "data": the sharded
  wrapper (`sharded_lightning_attention`, `sharded_delta_attention`) over a
  mesh of `devices` splitting T / B.
  """
  if split is None:
    plain = lightning_jax.lightning_attention if op == "lightning" else lightning_jax.delta_attention
    device = jax.sharding.SingleDeviceSharding(devices[0])
    return ((lambda q, k, v, *extras: plain(q, k, v, **dict(zip(names, extras)), impl=impl)), device,
            (device,) * len(names))
  axis = MESH_AXES[split]
  mesh = jax.sharding.Mesh(np.array(devices), (axis,))
  wrapper = lightning_jax.sharded_lightning_attention if op == "lightning" else lightning_jax.sharded_delta_attention
  split_kwargs = dict(sequence_axis=axis) if split == "sequence" else dict(batch_axes=axis)
  rows = P(None, axis) if split == "sequence" else P(axis)

  def attn(q, k, v, *extras):
    return wrapper(q, k, v, **dict(zip(names, extras)), mesh=mesh, impl=impl, **split_kwargs)

  # The lightning op's [H] rates are replicated; the delta forms' beta and rates are per token, split like q.
  extra_sharding = NamedSharding(mesh, P() if op == "lightning" else rows)
  return attn, NamedSharding(mesh, rows), (extra_sharding,) * len(names)


def open_program(op: str, shape: cases.Shape, split: str | None, devices: list, mode: str,
                 args) -> jax_impls.JaxCase:
  """The program compiled for `mode` on inputs laid out as it takes them, with its rotated input sets."""
  job = _job(op, shape, args.dtype)
  extras = _extras(op, job)
  attn, rows, extra_shardings = _program(op, tuple(extras), split, devices, args.impl)
  n_sets = timing.rotation_sets(cases.input_set_bytes(job) // len(devices), args.settings["rotate_bytes"])
  sets = [tuple(jax.device_put(x, rows) for x in s) for s in jax_impls.make_inputs(job, n_sets)]
  extras = tuple(jax.device_put(x, sharding) for x, sharding in zip(extras.values(), extra_shardings))
  fn = jax_impls.mode_functions(attn, cases.differentiated_inputs(job))[mode]
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*(sets[0] if mode == "fwdbwd" else sets[0][:3]), *extras).compile()
  return jax_impls.JaxCase(args.settings, {mode: (compiled, time.perf_counter() - start)}, sets, extras)


def _shape_fields(shape: cases.Shape, devices: int) -> dict:
  return dict(batch=shape.batch, seq_len=shape.seq_len, heads=shape.heads, dim_k=shape.dim_k, devices=devices)


def measure_row(op: str, case: str, mode: str, args) -> dict:
  """One (op, case, mode): each program's median measurement, and the scaling of N devices over one."""
  n, all_devices = args.devices, jax.devices()[:args.devices]
  if case == "sequence":
    shape = args.shape
    programs = {"one_device": (shape, None, all_devices[:1]),
                "wrapper_one_device": (shape, "sequence", all_devices[:1]),
                "n_devices": (shape._replace(seq_len=shape.seq_len * n), "sequence", all_devices)}
  else:
    shape = args.dp_shape
    programs = {"one_device": (shape, None, all_devices[:1]),
                "n_devices": (shape._replace(batch=shape.batch * n), "data", all_devices)}
  row = dict(op=op, case=case, mode=mode, dtype=args.dtype, decay="per-head" if op == "lightning" else op,
             impl=args.impl)
  opened, passes = {}, {name: [] for name in programs}
  for name, (program_shape, split, devices) in programs.items():
    row[name] = _shape_fields(program_shape, len(devices))
    try:
      opened[name] = open_program(op, program_shape, split, devices, mode, args)
    except Exception as exc:  # noqa: BLE001 -- a program that cannot compile is a result
      row[name].update(zip(("status", "reason"), worker.classify(exc)))
  for i in range(args.repeats):
    for name in (list(opened) if i % 2 == 0 else list(opened)[::-1]):
      try:
        passes[name].append(jax_impls.measure_mode(opened[name], mode))
      except Exception as exc:  # noqa: BLE001 -- a failed measurement is a result
        row[name].update(zip(("status", "reason"), worker.classify(exc)))
  for name, measured in passes.items():
    if len(measured) == args.repeats:
      median = sorted(measured, key=lambda m: m["time_ms"])[(args.repeats - 1) // 2]
      fields = row[name]
      fields.update(status="ok", **median, time_ms_repeats=[m["time_ms"] for m in measured])
      fields["tokens_per_s"] = fields["batch"] * fields["seq_len"] / (fields["time_ms"] / 1e3)
  one, many, wrapper = row["one_device"], row["n_devices"], row.get("wrapper_one_device")
  if one.get("status") == many.get("status") == "ok":
    row["scaling"] = many["tokens_per_s"] / one["tokens_per_s"]
    row["efficiency"] = row["scaling"] / n
  if wrapper and one.get("status") == wrapper.get("status") == "ok":
    row["wrapper_ratio"] = wrapper["time_ms"] / one["time_ms"]
  return row


def metadata(argv, args, wall_seconds: float) -> dict:
  """Device, device count used, versions, date, git commit and the exact command of the run."""
  info = jax_impls.device_info()
  status = None if args.git_commit else run.git("status", "--porcelain", "--untracked-files=no")
  return dict(
      device_kind=info["device_kind"], device_slug=cases.device_slug(info["device_kind"]), platform=info["platform"],
      device_count=args.devices, visible_device_count=info["device_count"],
      versions=dict(info["versions"], python=info["python"]),
      date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      git_commit=args.git_commit or run.git("rev-parse", "HEAD") or "unknown",
      git_dirty=None if status is None else bool(status),
      command=shlex.join(["python", "-m", "benchmarks.multi_device", *argv]), wall_seconds=wall_seconds,
      impl=args.impl, shape=list(args.shape[:4]), dp_shape=list(args.dp_shape[:4]), ops=args.ops, modes=args.modes,
      dtype=args.dtype, repeats=args.repeats, settings=args.settings)


def _shape_label(fields: dict) -> str:
  return f"B{fields['batch']} T{fields['seq_len']} H{fields['heads']} D{fields['dim_k']}"


def _op_label(row: dict) -> str:
  op = row.get("op", "lightning")  # runs before --ops measured the lightning op alone
  return "lightning" if op == "lightning" else cases.DELTA_FORMS[op]


def _number(fields: dict, key: str, fmt: str) -> str:
  return fmt.format(fields[key]) if key in fields else fields.get("status", "-")


def markdown(data: dict) -> str:
  """The run's metadata and one table row per (case, mode), one device and N devices side by side."""
  md = data["metadata"]
  n = md["device_count"]
  versions = ", ".join(f"{k} {v}" for k, v in md["versions"].items() if v)
  header = ["op", "case", "mode", "1-device shape", f"{n}-device shape", "1 device ms", f"{n} devices ms",
            "1 device tok/s", f"{n} devices tok/s", "scaling", "efficiency", "wrapper on 1 device ms (x plain op)"]
  lines = []
  for r in data["results"]:
    one, many, wrapper = r["one_device"], r["n_devices"], r.get("wrapper_one_device")
    wrapper_cell = "-" if wrapper is None else _number(wrapper, "time_ms", "{:.3f}") + (
        f" ({r['wrapper_ratio']:.2f}x)" if "wrapper_ratio" in r else "")
    lines.append([_op_label(r), r["case"], r["mode"], _shape_label(one), _shape_label(many),
                  _number(one, "time_ms", "{:.3f}"), _number(many, "time_ms", "{:.3f}"),
                  _number(one, "tokens_per_s", "{:.3g}"), _number(many, "tokens_per_s", "{:.3g}"),
                  _number(r, "scaling", "{:.2f}x"), _number(r, "efficiency", "{:.0%}"), wrapper_cell])
  failures = [f"- {_op_label(r)} {r['case']} {r['mode']} {name}: {r[name]['status']}: {r[name]['reason']}"
              for r in data["results"] for name in ("one_device", "wrapper_one_device", "n_devices")
              if name in r and r[name].get("status") != "ok"]
  return "\n".join([
      f"# Several devices: {md['device_kind']}, {n} of {md['visible_device_count']} devices", "",
      f"- Platform {md['platform']}; {md['dtype']}, impl=\"{md['impl']}\"; lightning with per-head decay, the "
      "delta forms with beta and rates as in benchmarks.run; "
      f"{md['repeats']} measurement(s) per program, the median kept",
      f"- Date (UTC): {md['date_utc']}; git commit `{md['git_commit']}`"
      f"{' (with uncommitted changes)' if md['git_dirty'] else ''}",
      f"- Command: `{md['command']}` ({md['wall_seconds']:.0f} s)", f"- Versions: {versions}",
      "- sequence: T split over a mesh (\"sp\",) (sequence_axis); data: B split over a mesh (\"data\",). "
      f"scaling = tokens/s on {n} devices / tokens/s on one; efficiency = scaling / {n}. Median ms "
      "(benchmarks/multi_device.py).", "",
      report.md_table(header, lines), *([""] + failures if failures else []), ""])


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  start = time.time()
  results = [measure_row(op, case, mode, args) for op in args.ops for case in MESH_AXES for mode in args.modes]
  data = {"metadata": metadata(argv, args, time.time() - start), "results": results}
  text = markdown(data)
  print(text)
  stem = args.name or f"{data['metadata']['device_slug']}-x{args.devices}-multi-device"
  if args.save or args.report:
    args.out_dir.mkdir(parents=True, exist_ok=True)
  if args.save:
    (args.out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out_dir / f'{stem}.json'}")
  if args.report:
    (args.out_dir / f"{stem}.md").write_text(text)
    print(f"wrote {args.out_dir / f'{stem}.md'}")
  return data


if __name__ == "__main__":
  main()
