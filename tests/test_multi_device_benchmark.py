"""`python -m benchmarks.multi_device --smoke` end to end on 8 host CPU devices."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import end_to_end_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
  """`python -m benchmarks.multi_device *args` on the CPU with 8 host devices."""
  env = end_to_end_env(
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip())
  return subprocess.run([sys.executable, "-m", "benchmarks.multi_device", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # one end-to-end run in a subprocess
def test_smoke_writes_scaling_rows_and_metadata(tmp_path):
  proc = _run("--smoke", "--devices", "4", "--save", "--report", "--out-dir", str(tmp_path))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  data = json.loads((tmp_path / "cpu-x4-multi-device.json").read_text())
  md = data["metadata"]
  for key in ("device_kind", "platform", "date_utc", "git_commit"):
    assert md[key]
  assert (md["device_count"], md["visible_device_count"], md["platform"], md["impl"]) == (4, 8, "cpu", "xla")
  assert all(md["versions"][name] for name in ("jax", "jaxlib", "python"))
  assert md["command"] == f"python -m benchmarks.multi_device --smoke --devices 4 --save --report --out-dir {tmp_path}"

  rows = {(r["case"], r["mode"]): r for r in data["results"]}
  assert list(rows) == [(case, mode) for case in ("sequence", "data") for mode in ("fwd", "fwdbwd")]
  for (case, _), r in rows.items():
    programs = ("one_device", "wrapper_one_device", "n_devices") if case == "sequence" else ("one_device", "n_devices")
    assert set(programs) <= set(r) and ("wrapper_one_device" in r) == (case == "sequence")
    for name in programs:
      p = r[name]
      assert p["status"] == "ok" and p["time_ms"] > 0, p
      assert p["tokens_per_s"] == pytest.approx(p["batch"] * p["seq_len"] / (p["time_ms"] / 1e3))
    one, many = r["one_device"], r["n_devices"]
    assert (one["devices"], many["devices"]) == (1, 4)
    grown = ("seq_len", "batch") if case == "sequence" else ("batch", "seq_len")
    assert (many[grown[0]], many[grown[1]]) == (4 * one[grown[0]], one[grown[1]])
    assert r["scaling"] == pytest.approx(many["tokens_per_s"] / one["tokens_per_s"])
    assert r["efficiency"] == pytest.approx(r["scaling"] / 4)
  assert rows["sequence", "fwd"]["one_device"]["seq_len"] == 256
  for mode in ("fwd", "fwdbwd"):
    r = rows["sequence", mode]
    assert r["wrapper_ratio"] == pytest.approx(r["wrapper_one_device"]["time_ms"] / r["one_device"]["time_ms"])

  report = (tmp_path / "cpu-x4-multi-device.md").read_text()
  assert "| case | mode |" in report and "| sequence | fwdbwd |" in report and md["git_commit"] in report


def test_too_many_devices_is_a_clear_error(tmp_path):
  proc = _run("--smoke", "--devices", "16", "--out-dir", str(tmp_path))
  assert proc.returncode == 2
  assert "--devices 16: this process sees 8 cpu device(s)" in proc.stderr
  assert "xla_force_host_platform_device_count" in proc.stderr
  assert not list(tmp_path.iterdir())


@pytest.mark.usefixtures("unoptimized_compiles")  # in-process compiles: most of its time; 1e-4 is far above ulps
def test_delta_form_programs_split_beta_and_rates_with_the_tokens():
  """A delta form's programs (in this process's 8 host devices): KDA, whose [B, T, H, D] rates are split over T
  like q; the sharded program's result equals the plain op's on the same tokens. (The rows' timing and scaling
  are the smoke run's, above, the same code for every op.)"""
  import jax
  import numpy as np

  from benchmarks import cases, jax_impls, multi_device

  args = multi_device.parse_args(["--smoke", "--devices", "4", "--ops", "lightning,delta"])
  assert (args.ops, args.impl) == (["lightning", "deltanet", "gated_deltanet", "kda"], "xla")
  shape = args.shape._replace(seq_len=4 * args.shape.seq_len)
  job = multi_device._job("kda", shape, "fp32")
  assert (job["decay"], cases.differentiated_inputs(job)) == ("kda", 2)  # the backward takes beta and the rates
  extras = tuple(multi_device._extras("kda", job).values())
  q, k, v, _ = jax_impls.make_inputs(job, 1)[0]
  plain, _, _ = multi_device._program("kda", ("beta", "decay"), None, jax.devices()[:1], "xla")
  sharded, rows, extra_shardings = multi_device._program("kda", ("beta", "decay"), "sequence", jax.devices()[:4],
                                                         "xla")
  assert [s.spec for s in extra_shardings] == [rows.spec, rows.spec]
  np.testing.assert_allclose(jax.jit(sharded)(q, k, v, *extras), jax.jit(plain)(q, k, v, *extras), rtol=1e-4,
                             atol=1e-4)
