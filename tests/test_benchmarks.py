"""The benchmark suite: `python -m benchmarks.run --smoke` (and the per-token decay and packing, and the delta
smoke profiles) end to end on the CPU, and its pure parts."""

import contextlib
import fcntl
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from benchmarks import cases, metrics, report, run, worker
from helpers import end_to_end_env
import lightning_jax as lj
from lightning_jax.tune import timing

ROOT = pathlib.Path(__file__).resolve().parents[1]
STATUSES = {"ok", "oom", "skipped", "error"}


def _run_cli(tmp_path_factory, name: str, *args: str):
  """(output folder, results JSON, stdout) of `python -m benchmarks.run *args` with every output.

  Run once per session: pytest-xdist workers share the folder of the first
  (under a lock), instead of each running it on the same few cores.
  """
  shared = os.environ.get("PYTEST_XDIST_WORKER")
  root = tmp_path_factory.getbasetemp().parent if shared else tmp_path_factory.getbasetemp()
  out, log = root / name, root / f"{name}.stdout"
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not log.exists():
      proc = subprocess.run([sys.executable, "-m", "benchmarks.run", *args, "--save", "--plot", "--report",
                             "--out-dir", str(out)], cwd=ROOT, env=end_to_end_env(), capture_output=True, text=True,
                            timeout=600)
      assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
      log.write_text(proc.stdout)
  (path,) = out.glob("*.json")
  return out, json.loads(path.read_text()), log.read_text()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  return _run_cli(tmp_path_factory, "smoke", "--smoke")


@pytest.fixture(scope="module")
def smoke_token_packed(tmp_path_factory):
  return _run_cli(tmp_path_factory, "smoke-token-packed", "--profile", "smoke-token-packed")


@pytest.fixture(scope="module")
def smoke_delta(tmp_path_factory):
  return _run_cli(tmp_path_factory, "smoke-delta", "--profile", "smoke-delta")


@pytest.mark.slow  # one end-to-end run in a subprocess
def test_smoke_writes_json_plots_and_report(smoke):
  out, data, stdout = smoke
  stem = data["metadata"]["device_slug"]
  assert (out / f"{stem}.json").exists()
  for name in ("time", "memory", "split"):
    assert (out / f"{stem}-{name}.png").stat().st_size > 1000
  md = (out / f"{stem}.md").read_text()
  for heading in ("## Summary", "## Results by shape", "## Memory", "## Scaling with T", "## Where we lose",
                  "## Not measured"):
    assert heading in md
  assert f"![time]({stem}-time.png)" in md
  assert "| shape | T |" in stdout  # the summary table


@pytest.mark.slow  # one end-to-end run in a subprocess
def test_smoke_metadata(smoke):
  _, data, _ = smoke
  md = data["metadata"]
  for key in ("device_kind", "compute_capability", "date_utc", "git_commit", "command", "copy_bandwidth",
              "settings", "plan"):
    assert key in md
  assert md["versions"]["jax"] and md["versions"]["jaxlib"]
  assert md["command"].startswith("python -m benchmarks.run --smoke")
  assert md["copy_bandwidth"]["bandwidth_gbps"] > 0
  assert md["device_slug"] == cases.device_slug(md["device_kind"])


def _check_plan_order(data):
  """The results are the plan's cases, in its order, each with a known status."""
  plan = data["metadata"]["plan"]
  jobs = cases.make_jobs(plan["impls"], [cases.Shape(*s) for s in plan["shapes"]], plan["decays"], plan["modes"],
                         plan["dtype"], plan["segments"])
  results = data["results"]
  assert [(r["impl"], r["seq_len"], r["decay"], r["segments"], r["mode"]) for r in results] == [
      (j["impl"], j["seq_len"], j["decay"], j["segments"], m) for j in jobs for m in j["modes"]]
  assert {r["status"] for r in results} <= STATUSES


@pytest.mark.slow  # one end-to-end run in a subprocess
def test_smoke_results_are_complete_and_consistent(smoke):
  _, data, _ = smoke
  _check_plan_order(data)
  results = data["results"]
  for r in results:
    if r["status"] != "ok":
      assert r["reason"]
      continue
    assert r["time_ms"] > 0 and r["time_ms_min"] <= r["time_ms"] <= r["time_ms_p90"] + 1e-9
    assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq_len"] / (r["time_ms"] / 1e3))
    assert r["floor_ratio"] == pytest.approx(r["time_ms"] / r["floor_ms"])
    assert r["memory"]["footprint_bytes"] > 0
  ok_impls = {r["impl"] for r in results if r["status"] == "ok"}
  assert {"lj-xla", "lj-pallas-auto", "xla-softmax"} <= ok_impls
  if importlib.util.find_spec("torch") is None:
    assert all(r["status"] == "skipped" for r in results if r["impl"].startswith(("fla", "lightning-attn")))


@pytest.mark.slow  # one end-to-end run in a subprocess
def test_smoke_token_decay_and_packing(smoke_token_packed):
  """Per-token decay unpacked and packed: ours measured, the packing ratio derived and reported, the peers that
  cannot take them skipped with the reason."""
  out, data, stdout = smoke_token_packed
  _check_plan_order(data)
  ours = {(r["segments"], r["mode"]): r for r in data["results"] if r["impl"] == "lj-pallas-auto"}
  assert set(ours) == {(n, m) for n in (1, 3) for m in ("fwd", "fwdbwd")}
  assert all(r["status"] == "ok" and r["decay"] == "token" for r in ours.values()), ours
  for mode in ("fwd", "fwdbwd"):
    assert ours[3, mode]["packing_ratio"] == pytest.approx(ours[3, mode]["time_ms"] / ours[1, mode]["time_ms"])
    assert "packing_ratio" not in ours[1, mode]
  la2 = {r["reason"] for r in data["results"] if r["impl"] == "lightning-attn2"}
  assert la2 == {cases.IMPL_BY_NAME["lightning-attn2"].no_token_decay}
  md = (out / f"{data['metadata']['device_slug']}.md").read_text()
  assert "## Packed sequences" in md and "**packed / unpacked, B1 H2 D16, bf16, per-token decay, 3 packed" in md
  assert "| B1 H2 D16, bf16, per-token decay, 3 packed sequences | 64 |" in stdout


def test_parse_shapes_and_impls():
  assert cases.parse_shapes("2x1024x4x64,1x8x2x16x32") == [cases.Shape(2, 1024, 4, 64, 64),
                                                          cases.Shape(1, 8, 2, 16, 32)]
  assert len(cases.parse_shapes("la3-long")) == 16
  assert cases.parse_impls("pallas,lj-xla,lj-pallas-auto") == [
      "lj-pallas-chunk_loop", "lj-pallas-parallel", "lj-pallas-warp_specialized", "lj-pallas-auto", "lj-xla"]
  for bad in ("4x1024x32", "la4"):
    with pytest.raises(ValueError):
      cases.parse_shapes(bad)
  with pytest.raises(ValueError):
    cases.parse_impls("flash")


def test_token_and_packed_options_and_profiles():
  assert cases.parse_segments("1, 8,8") == [1, 8]
  for bad in ("0", "1,x", "", "-2"):
    with pytest.raises(ValueError):
      cases.parse_segments(bad)
  with pytest.raises(ValueError):
    run.make_plan(run.parse_args(["--smoke", "--decay", "per-token"]))
  plan = run.make_plan(run.parse_args(["--smoke", "--decay", "off,token", "--segments", "1,4", "--impls", "lj-xla"]))
  assert [(j["seq_len"], j["segments"], j["decay"]) for j in plan.jobs] == [
      (t, n, d) for t in (32, 64) for n in (1, 4) for d in (False, "token")]
  assert plan.description["segments"] == [1, 4] and plan.description["decays"] == [False, "token"]
  # The GPU runs of the targets: per-token decay at the LA3 families, T 8K and 32K; a packed 32K row and the same
  # row unpacked. Other profiles are unpacked.
  token = run.make_plan(run.parse_args(["--profile", "token"]))
  assert {(j["batch"], j["seq_len"], j["heads"], j["dim_k"]) for j in token.jobs} == {
      (b, t, 32, d) for b, d in ((4, 64), (2, 128)) for t in (8192, 32768)}
  assert {j["decay"] for j in token.jobs} == {"token"} and {j["segments"] for j in token.jobs} == {1}
  assert {"lj-pallas-auto", "fla-chunk", "fla-fused_chunk", "jla-mosaic"} <= {j["impl"] for j in token.jobs}
  assert token.description["modes"] == ["fwd", "fwdbwd"]
  packed = run.make_plan(run.parse_args(["--profile", "packed"]))
  assert {cases.job_shape(j) for j in packed.jobs} == {cases.Shape(1, 32768, 32, 128, 128)}
  assert {(j["decay"], j["segments"]) for j in packed.jobs if j["impl"] == "lj-pallas-auto"} == {
      (d, n) for d in (True, "token") for n in (1, 8)}
  assert all(run.make_plan(run.parse_args(["--profile", p])).description["segments"] == [1]
             for p in ("full", "quick", "long", "smoke"))


def test_packed_jobs_and_what_each_implementation_takes():
  """Softmax gets one job per shape and packing; jobs an implementation cannot take are skipped with the reason,
  without asking the backend."""
  jobs = cases.make_jobs(["fla-chunk", "xla-softmax", "lightning-attn2"], [cases.Shape(1, 64, 2, 16, 16)],
                         [True, "token"], ["fwd"], "bf16", [1, 3])
  skipped = [(j["impl"], j["decay"], j["segments"], cases.unsupported(j)) for j in jobs]
  la2 = cases.IMPL_BY_NAME["lightning-attn2"]
  assert skipped == [
      ("fla-chunk", True, 1, None), ("xla-softmax", None, 1, None), ("lightning-attn2", True, 1, None),
      ("fla-chunk", "token", 1, None), ("lightning-attn2", "token", 1, la2.no_token_decay),
      ("fla-chunk", True, 3, None), ("xla-softmax", None, 3, cases.IMPL_BY_NAME["xla-softmax"].no_packing),
      ("lightning-attn2", True, 3, la2.no_packing),
      ("fla-chunk", "token", 3, None), ("lightning-attn2", "token", 3, la2.no_token_decay)]
  (late,) = worker.run_job(_Backend(), jobs[4], {}, deadline=float("inf"))
  assert (late["status"], late["reason"], late["segments"]) == ("skipped", la2.no_token_decay, 1)
  # T = 65 has 63 places for a boundary (1..64, less 64): at most 64 sequences.
  assert cases.make_jobs(["lj-xla"], [cases.Shape(1, 65, 1, 16, 16)], [True], ["fwd"], "bf16", [64])
  with pytest.raises(ValueError, match="cannot hold 65"):
    cases.make_jobs(["lj-xla"], [cases.Shape(1, 65, 1, 16, 16)], [True], ["fwd"], "bf16", [65])


def test_sequence_states_jobs_run_cu_seqlens_with_states_of_their_own():
  """--sequence-states: packed jobs carry per-sequence states (unpacked ones none), which their key, label and plan
  say; jax-linear-attention is skipped with the reason; ours runs the rows end to end with cu_seqlens, each
  sequence from its own initial state: its output is the oracle's on those inputs, and not the one without them."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from benchmarks import jax_impls  # noqa: PLC0415

  plan = run.make_plan(run.parse_args(["--smoke", "--shapes", "2x64x2x16", "--segments", "1,3", "--sequence-states",
                                       "--impls", "lj-xla,jla-mosaic", "--decay", "on,token"]))
  assert {(j["segments"], j["states"]) for j in plan.jobs} == {(1, False), (3, True)}
  assert plan.description["states"] is True
  (jla,) = [j for j in plan.jobs if j["impl"] == "jla-mosaic" and j["states"] and j["decay"] is True]
  assert cases.unsupported(jla) == cases.IMPL_BY_NAME["jla-mosaic"].no_sequence_states
  (job,) = [j for j in plan.jobs if j["impl"] == "lj-xla" and j["states"] and j["decay"] == "token"]
  assert cases.case_key(job, "fwd") != cases.case_key({**job, "states": False}, "fwd")
  assert cases.setting_label("token", 3, True) == "per-token decay, 3 packed sequences with their own states"
  profile = run.make_plan(run.parse_args(["--profile", "packed-states"]))
  assert {(j["segments"], j["states"]) for j in profile.jobs} == {(1, False), (8, True)}
  assert not any(j["states"] for j in run.make_plan(run.parse_args(["--profile", "packed"])).jobs)
  attn, extras = jax_impls.lightning_or_baseline(job)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (2, 64, 2, 16), jnp.bfloat16) for key in keys)
  o = attn(q, k, v, *extras)
  flat = lambda x: x.reshape(1, 128, *x.shape[2:])  # noqa: E731
  cu, states = jnp.asarray(cases.cu_seqlens(job)), jnp.asarray(cases.sequence_states(job))
  assert cu.shape == (7,) and states.shape == (6, 2, 16, 16)
  rates = flat(jnp.asarray(cases.decay_array(job)))
  want, _ = lj.lightning_attention(flat(q), flat(k), flat(v), rates, cu_seqlens=cu, initial_state=states,
                                   return_final_state=True, impl="reference")
  without = lj.lightning_attention(flat(q), flat(k), flat(v), rates, cu_seqlens=cu, impl="reference")
  err = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
  assert o.shape == v.shape and err(o, want.reshape(v.shape)) < 2e-2 < err(o, without.reshape(v.shape))


def test_segments_and_per_token_rates():
  """Random sequence lengths and per-token rates: deterministic, each implementation's form of the same values."""
  job = cases.make_jobs(["lj-xla"], [cases.Shape(2, 1000, 3, 16, 16)], ["token"], ["fwd"], "bf16", [8])[0]
  starts = cases.segment_starts(job)
  assert starts == cases.segment_starts(job) and starts[0] != starts[1]  # fixed seed; the rows differ
  for row in starts:
    assert len(row) == 8 and row[0] == 0 and row == sorted(set(row)) and row[-1] < 1000
    assert all(s % 64 for s in row[1:])  # every boundary inside a chunk
  ids = cases.segment_ids(job)
  assert ids.shape == (2, 1000) and ids.dtype == "int32"
  for row, row_ids in zip(starts, ids):
    assert [0, *(1 + (row_ids[1:] != row_ids[:-1]).nonzero()[0]).tolist()] == row and row_ids[-1] == 7
  assert cases.cu_seqlens(job) == [*starts[0], *(1000 + s for s in starts[1]), 2000]
  assert cases.segment_ids({**job, "segments": 1}) is None
  rates = cases.decay_array(job)
  per_head = cases.decay_array({**job, "decay": True})
  assert rates.shape == (2, 1000, 3) and rates.dtype == per_head.dtype == "float32"
  assert (rates >= 0.5 * per_head).all() and (rates <= 1.5 * per_head).all() and rates.std() > 0
  assert (rates == cases.decay_array(job)).all()
  assert per_head.tolist() == pytest.approx(cases.decay_rates(3))
  assert cases.decay_array({**job, "decay": False}) is None and cases.decay_array({**job, "decay": None}) is None
  assert cases.differentiated_inputs(job) == 1 and cases.differentiated_inputs({**job, "decay": True}) == 0


@pytest.mark.slow  # one end-to-end run in a subprocess
def test_smoke_delta(smoke_delta):
  """The three delta forms: ours measured (pallas in interpret mode), each over the lightning op's counterpart;
  the peers skipped with the reason; the report's tables by form."""
  out, data, stdout = smoke_delta
  _check_plan_order(data)
  results = data["results"]
  ours = {(r["impl"], r["decay"], r["mode"]): r for r in results if r["impl"].startswith("lj-delta-")}
  assert set(ours) == {("lj-delta-pallas", f, m) for f in cases.DELTA_FORMS for m in ("fwd", "fwdbwd")}
  assert all(r["status"] == "ok" for r in ours.values()), ours
  lightning = {(r["decay"], r["mode"]): r for r in results if r["impl"] == "lj-pallas-auto"}
  assert {r["status"] for r in lightning.values()} == {"ok"} and {d for d, _ in lightning} == {False, "token"}
  for (_, form, mode), r in ours.items():
    base = lightning[cases.LIGHTNING_COUNTERPART[form], mode]
    assert r["lightning_ratio"] == pytest.approx(r["time_ms"] / base["time_ms"])
  peers = [r for r in results if r["impl"] in ("fla-delta-chunk", "jla-delta-mosaic")]
  assert len(peers) == 12 and all(r["status"] == "skipped" and r["reason"] for r in peers)
  if importlib.util.find_spec("jla") is not None:  # installed: its Mosaic GPU kernels need a GPU
    assert {r["reason"] for r in peers if r["impl"] == "jla-delta-mosaic"} == {
        "the jla Mosaic GPU kernels need an NVIDIA Hopper GPU"}
  md = (out / f"{data['metadata']['device_slug']}.md").read_text()
  assert "## Delta forms against the lightning op" in md and "### B1 H2 D16, bf16, Gated DeltaNet, T = 64" in md
  assert "| shape | T | lj-delta-pallas fwd ms |" in stdout and "ours / lightning fwd / fwd+bwd |" in stdout
  assert "| B1 H2 D16, bf16, KDA | 64 |" in stdout and "| B1 H2 D16, bf16, per-token decay | 64 |" in stdout


def test_delta_options_jobs_and_gates():
  """--ops picks the lightning settings and the delta forms; each implementation gets the settings of its op."""
  assert cases.parse_ops("delta") == list(cases.DELTA_FORMS)
  assert cases.parse_ops("kda,lightning") == ["kda", "lightning"]
  with pytest.raises(ValueError):
    cases.parse_ops("mamba")
  plan = run.make_plan(run.parse_args(["--smoke", "--ops", "lightning,kda", "--decay", "token",
                                       "--impls", "lj-xla,lj-delta-xla,xla-softmax,fla-chunk,jla-delta-mosaic"]))
  assert [(j["impl"], j["decay"]) for j in plan.jobs if j["seq_len"] == 32] == [
      ("lj-xla", "token"), ("xla-softmax", None), ("fla-chunk", "token"), ("lj-delta-xla", "kda"),
      ("jla-delta-mosaic", "kda")]
  assert run.make_plan(run.parse_args(["--smoke", "--impls", "all"])).description["impls"] == [
      i for i in cases.IMPL_SETS["all"] if cases.IMPL_BY_NAME[i].op == "lightning"]  # no job, not in the plan
  # The GPU run of the targets: the shapes, the three forms, the lightning counterparts and cuDNN.
  delta = run.make_plan(run.parse_args(["--profile", "delta"]))
  assert {cases.job_shape(j) for j in delta.jobs} == {
      *(cases.Shape(b, t, 32, d, d) for b, d in ((4, 64), (2, 128)) for t in (2048, 8192, 32768)),
      cases.Shape(1, 65536, 32, 128, 128)}
  assert {(j["impl"], j["decay"]) for j in delta.jobs} == {
      ("cudnn-flash", None), *(("lj-pallas-auto", d) for d in (False, "token")),
      *((i, f) for i in ("lj-delta-pallas", "fla-delta-chunk", "jla-delta-mosaic") for f in cases.DELTA_FORMS)}
  assert delta.description["modes"] == ["fwd", "fwdbwd"] and delta.description["dtype"] == "bf16"
  # Few (batch, head) pairs: 8 to 64 programs of 64 value columns (the sequence split's territory).
  few = run.make_plan(run.parse_args(["--profile", "delta-long"]))
  assert {s.batch * s.heads * s.dim_v // 64 for s in map(cases.job_shape, few.jobs)} == {8, 16, 32, 64}
  assert {(j["impl"], j["decay"]) for j in few.jobs} == {
      (i, f) for i in ("lj-delta-pallas", "fla-delta-chunk", "jla-delta-mosaic") for f in cases.DELTA_FORMS}
  job = cases.make_jobs(["lj-delta-xla"], [cases.Shape(2, 100, 3, 8, 4)], ["kda"], ["fwd"], "bf16")[0]
  gates = cases.delta_gates(job)
  assert gates["beta"].shape == (2, 100, 3) and gates["decay"].shape == (2, 100, 3, 8)
  assert all(x.dtype == "float32" for x in gates.values()) and (gates["decay"] == cases.delta_gates(job)["decay"]).all()
  assert 0 < gates["beta"].min() < gates["beta"].max() < 1
  assert 0.01 <= gates["decay"].min() < gates["decay"].max() <= 0.1
  assert cases.delta_gates({**job, "decay": "gated_deltanet"})["decay"].shape == (2, 100, 3)
  assert set(cases.delta_gates({**job, "decay": "deltanet"})) == {"beta"}
  assert [cases.differentiated_inputs({**job, "decay": f}) for f in cases.DELTA_FORMS] == [1, 2, 2]
  # The HBM floor reads the gates (and bwd writes their gradients): beta, and the rates per token or per channel.
  floors = {f: metrics.floor_bytes({**job, "decay": f, "mode": "fwd"}) for f in (False, *cases.DELTA_FORMS)}
  assert [floors[f] - floors[False] for f in cases.DELTA_FORMS] == [2 * 100 * 3 * 4 * n for n in (1, 2, 9)]


def test_report_of_the_delta_forms():
  """Delta rows are grouped by form: the fastest peer of the same form, the ratio to the lightning op."""
  results = [_result("lj-pallas-auto", 1024, 1.0, decay="token"), _result("fla-chunk", 1024, 0.5, decay="token"),
             _result("lj-delta-pallas", 1024, 1.5, decay="gated_deltanet"),
             _result("fla-delta-chunk", 1024, 3.0, decay="gated_deltanet"),
             _result("jla-delta-mosaic", 1024, 1.2, decay="kda"), _result("lj-delta-pallas", 1024, 2.4, decay="kda")]
  data = {"metadata": {"device_kind": "test"}, "results": metrics.derive(results, None)}
  assert [r.get("lightning_ratio") for r in results] == [None, None, 1.5, 3.0, 1.2, 2.4]
  lightning, delta = report.summary_table(data, drop_empty=True).split("\n\n")
  assert "| B2 H4 D64 E32, bf16, per-token decay | 1K | 1.000 | fla-chunk (0.500) | – / 0.50x |" in lightning
  assert delta.startswith("| shape | T | lj-delta-pallas fwd+bwd ms | fastest peer fwd+bwd (ms) |")
  assert ("| B2 H4 D64 E32, bf16, Gated DeltaNet | 1K | 1.500 | fla-delta-chunk (3.000) | – / 2.00x | – / 1.50x |"
          in delta)
  assert "| B2 H4 D64 E32, bf16, KDA | 1K | 2.400 | jla-delta-mosaic (1.200) | – / 0.50x | – / 2.40x |" in delta
  md = report.markdown(data)
  assert "**time / lightning op's, B2 H4 D64 E32, bf16, KDA, fwdbwd**" in md
  assert "| B2 H4 D64 E32, bf16, KDA | 1K | fwdbwd | lj-delta-pallas 2.400 | jla-delta-mosaic 1.200 | 2.00x |" in md


def test_peer_refusals_are_skipped():
  """A peer's refusal (`worker.Refused`, e.g. fla's Triton-version check in a backward) skips the case."""
  assert worker.classify(worker.Refused("RuntimeError: no")) == ("skipped", "RuntimeError: no")

  class Refusing(_Backend):
    def measure(self, ctx, mode):
      if mode == "fwdbwd":
        raise worker.Refused("RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")
      return {"time_ms": 1.0}

  job = cases.make_jobs(["fla-delta-chunk"], [cases.Shape(1, 8, 1, 16, 16)], ["kda"], ["fwd", "fwdbwd"], "bf16")[0]
  fwd, fwdbwd = worker.run_job(Refusing(), job, {}, deadline=float("inf"))
  assert fwd["status"] == "ok" and fwdbwd["status"] == "skipped" and "incorrect results" in fwdbwd["reason"]


def test_make_jobs_orders_by_t_and_runs_softmax_once_per_shape():
  shapes = [cases.Shape(1, 64, 2, 16, 16), cases.Shape(1, 32768, 2, 16, 16)]
  jobs = cases.make_jobs(["lj-xla", "xla-softmax"], shapes[::-1], [True, False], ["fwd"], "bf16")
  assert [(j["impl"], j["seq_len"], j["decay"], j["tier"]) for j in jobs] == [
      ("lj-xla", 64, True, 0), ("xla-softmax", 64, None, 0), ("lj-xla", 64, False, 0),
      ("lj-xla", 32768, True, 1), ("xla-softmax", 32768, None, 1), ("lj-xla", 32768, False, 1)]


def test_device_slug():
  assert cases.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
  assert cases.device_slug("cpu") == "cpu"


def _result(impl, t, ms, mode="fwdbwd", decay=True):
  return dict(impl=impl, mode=mode, batch=2, seq_len=t, heads=4, dim_k=64, dim_v=32, dtype="bf16",
              decay=decay if cases.IMPL_BY_NAME[impl].decay_aware else None, status="ok", time_ms=ms)


def test_derived_metrics():
  results = [_result("lj-xla", 1024, 2.0), _result("lj-xla", 2048, 3.0), _result("cudnn-flash", 2048, 6.0),
             _result("lj-xla", 2048, 9.0, decay=False)]
  metrics.derive(results, copy_bandwidth_gbps=1000.0)
  fwd = 2 * 64 + 2 * 32
  bwd = (2 * 64 + 2 * 32) + (2 * 64 + 32)
  assert results[0]["floor_bytes"] == 2 * 2 * 1024 * 4 * (fwd + bwd)
  assert results[0]["floor_ms"] == pytest.approx(results[0]["floor_bytes"] / 1e12 * 1e3)
  assert "scaling_ratio" not in results[0]
  assert results[1]["scaling_ratio"] == pytest.approx(1.5)
  assert results[1]["speedup_vs_cudnn"] == pytest.approx(2.0)
  assert results[3]["speedup_vs_cudnn"] == pytest.approx(6.0 / 9.0)  # cuDNN has no decay setting
  assert "scaling_ratio" not in results[3]


def test_floor_of_the_run_that_measured_a_result():
  """A --resume run re-probes the copy bandwidth; results of the earlier run keep their own floor."""
  earlier, new = _result("lj-xla", 1024, 2.0), _result("fla-chunk", 1024, 1.0)
  earlier["copy_bandwidth_gbps"] = 2000.0
  data = {"metadata": {"device_kind": "test", "copy_bandwidth": {"bandwidth_gbps": 1000.0}},
          "results": metrics.derive([earlier, new], copy_bandwidth_gbps=1000.0)}
  assert earlier["floor_ms"] == pytest.approx(earlier["floor_bytes"] / 2e12 * 1e3)
  assert new["floor_ms"] == pytest.approx(new["floor_bytes"] / 1e12 * 1e3)
  new["copy_bandwidth_gbps"] = 1000.0
  assert "(1000 GB/s, 2000 GB/s)" in report.markdown(data)


def test_report_where_we_lose_and_summary():
  results = [_result("lj-pallas-auto", 1024, 2.0), _result("fla-chunk", 1024, 1.0),
             _result("cudnn-flash", 1024, 4.0), _result("jla-mosaic", 1024, 0.7, mode="fwd")]
  data = {"metadata": {"device_kind": "test"}, "results": metrics.derive(results, None)}
  md = report.markdown(data)
  assert "| B2 H4 D64 E32, bf16, decay | 1K | fwdbwd | lj-pallas-auto 2.000 | fla-chunk 1.000 | 2.00x |" in md
  # Columns: ours fwd, fwd+bwd; cuDNN fwd, fwd+bwd; fastest peer fwd, fwd+bwd; speedups; floor ratios
  # (no copy bandwidth here, so none).
  assert ("| B2 H4 D64 E32, bf16, decay | 1K |  | 2.000 |  | 4.000 | jla-mosaic (0.700) | fla-chunk (1.000) "
          "| – / 2.00x | – / – |") in md


def test_report_of_packed_and_per_token_results_beside_older_ones():
  """Results written before packing (no `segments`) read as unpacked rows; packed rows get their ratio to them."""
  older = _result("lj-pallas-auto", 1024, 2.0)
  packed = {**_result("lj-pallas-auto", 1024, 2.1), "segments": 8}
  token = {**_result("lj-pallas-auto", 1024, 3.0, decay="token"), "segments": 1}
  token_packed = {**_result("lj-pallas-auto", 1024, 3.3, decay="token"), "segments": 8}
  peer = {**_result("fla-chunk", 1024, 3.6, decay="token"), "segments": 1}
  data = {"metadata": {"device_kind": "test"},
          "results": metrics.derive([older, packed, token, token_packed, peer], None)}
  assert packed["packing_ratio"] == pytest.approx(1.05) and token_packed["packing_ratio"] == pytest.approx(1.1)
  assert "packing_ratio" not in older and "packing_ratio" not in token
  assert token["floor_bytes"] - older["floor_bytes"] == 2 * 1024 * 4 * 12  # rates read twice, gradient written
  md = report.markdown(data)
  assert "**packed / unpacked, B2 H4 D64 E32, bf16, per-token decay, 8 packed sequences, fwdbwd**" in md
  assert "| lj-pallas-auto | 1.050 |" in md and "| lj-pallas-auto | 1.100 |" in md
  summary = report.summary_table(data, drop_empty=True)
  assert "| B2 H4 D64 E32, bf16, decay, 8 packed sequences | 1K | 2.100 | – | – / – |" in summary
  assert "| B2 H4 D64 E32, bf16, per-token decay | 1K | 3.000 | fla-chunk (3.600) | – / 1.20x |" in summary
  with pytest.raises(ValueError, match="same case"):  # an older result and a new unpacked one are one case
    report.merge_runs([{"metadata": {}, "results": [older]}, {"metadata": {}, "results": [{**older, "segments": 1}]}])
  rerun = {**older, "segments": 1, "time_ms": 1.5}
  merged = report.merge_runs([{"metadata": {}, "results": [older, token]}, {"metadata": {}, "results": [rerun]}],
                             supersede=True)
  assert merged["results"] == [rerun, token]  # the later run's measurement of the case replaces the earlier's
  skipped = {**token, "status": "skipped", "reason": "time budget (--max-seconds) spent", "time_ms": None}
  merged = report.merge_runs([{"metadata": {}, "results": [older, token]}, {"metadata": {}, "results": [skipped]}],
                             supersede=True)
  assert merged["results"] == [older, token]  # a later run's skip measured nothing: the measurement stands
  with pytest.raises(ValueError, match="same case"):  # one run measuring a case twice is still an error
    report.merge_runs([{"metadata": {}, "results": [older, rerun]}], supersede=True)
  plan = {"shapes": [[1, 32768, 32, 128, 128]], "dtype": "bf16", "decays": [True, "token"], "segments": [1, 8]}
  assert report._shapes_label({"plan": plan}) == (
      "B1 H32 D128: T 32K; bf16; decay and per-token decay; unpacked and 8 packed sequences")


@pytest.mark.usefixtures("unoptimized_compiles")  # in-process compiles: most of its time
def test_per_token_rates_are_differentiated():
  """fwd+bwd and bwd differentiate the first extra argument where asked (per-token rates), not the others."""
  import jax.numpy as jnp  # noqa: PLC0415

  from benchmarks import jax_impls  # noqa: PLC0415 -- imports JAX

  def attn(q, k, v, rates, ids):
    return (q + k + v) * rates[..., None] * ids[..., None, None]

  x, rates, ids = jnp.ones((1, 4, 2, 3)), jnp.full((1, 4, 2), 2.0), jnp.ones((1, 4), jnp.int32)
  _, grads = jax_impls.mode_functions(attn, 1)["fwdbwd"](x, x, x, x, rates, ids)
  assert len(grads) == 4 and (grads[3] == 9.0).all()
  assert len(jax_impls.mode_functions(attn)["fwdbwd"](x, x, x, x, rates, ids)[1]) == 3


def test_sample_seconds_of_the_profiles():
  assert run.make_plan(run.parse_args(["--sample-seconds", "0.05"])).settings["sample_seconds"] == 0.05
  assert run.make_plan(run.parse_args([])).settings["sample_seconds"] == cases.GPU_SAMPLE_SECONDS
  assert run.make_plan(run.parse_args(["--smoke"])).settings["sample_seconds"] == 0.001
  # The GPU profiles sample as long as the autotuner does, after as long a warm-up as the timing module's.
  assert cases.GPU_SAMPLE_SECONDS == timing.GPU_SAMPLE_SECONDS == 0.02
  assert cases.GPU_WARMUP_SECONDS == timing.GPU_WARMUP_SECONDS == 0.5
  assert run.make_plan(run.parse_args([])).settings["warmup_seconds"] == cases.GPU_WARMUP_SECONDS
  assert run.make_plan(run.parse_args(["--smoke"])).settings["warmup_seconds"] == 0.0
  assert run.make_plan(run.parse_args(["--warmup-seconds", "2"])).settings["warmup_seconds"] == 2.0


class _Backend(worker.Backend):
  @contextlib.contextmanager
  def open_job(self, job, settings):
    yield None

  def measure(self, ctx, mode):
    if mode == "bwd":
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    if mode == "fwdbwd":
      raise ValueError("unsupported")
    return {"time_ms": 1.0}


def test_worker_reports_each_mode_and_the_time_budget():
  job = cases.make_jobs(["lj-xla"], [cases.Shape(1, 8, 1, 16, 16)], [True], list(cases.MODES), "bf16")[0]
  statuses = [(r["mode"], r["status"]) for r in worker.run_job(_Backend(), job, {}, deadline=float("inf"))]
  assert statuses == [("fwd", "ok"), ("bwd", "oom"), ("fwdbwd", "error")]
  late = list(worker.run_job(_Backend(), job, {}, deadline=0.0))
  assert {r["status"] for r in late} == {"skipped"} and "time budget" in late[0]["reason"]


def test_resume_runs_only_missing_modes_and_merges_in_plan_order():
  jobs = cases.make_jobs(["lj-xla"], [cases.Shape(1, 8, 1, 16, 16), cases.Shape(1, 16, 1, 16, 16)], [True],
                         ["fwd", "bwd"], "bf16")
  earlier = [worker.result(jobs[1], "fwd", "ok", time_ms=1.0), worker.result(jobs[0], "bwd", "oom", reason="x")]
  todo = run.still_to_run(jobs, earlier)
  assert [(j["seq_len"], j["modes"]) for j in todo] == [(8, ["fwd"]), (16, ["bwd"])]
  older = [{k: v for k, v in r.items() if k != "segments"} for r in earlier]  # a JSON from before packing
  assert run.still_to_run(jobs, older) == todo
  new = [worker.result(j, m, "ok", time_ms=2.0) for j in todo for m in j["modes"]]
  merged = run.merge(jobs, earlier, new)
  assert [(r["seq_len"], r["mode"], r["status"]) for r in merged] == [
      (8, "fwd", "ok"), (8, "bwd", "oom"), (16, "fwd", "ok"), (16, "bwd", "ok")]


def test_time_left_goes_to_the_cases_skipped_for_time(monkeypatch, tmp_path):
  """A group that runs out of its share gets a second pass with the time the later groups left unused."""
  jobs = cases.make_jobs(["fla-chunk", "lj-xla"], [cases.Shape(1, 8, 1, 16, 16)], [True], ["fwd", "fwdbwd"],
                         "bf16")
  calls = []

  def fake_run_group(group, step_jobs, settings, deadline, workdir, start, label, env=None):
    calls.append((label, [(j["impl"], m) for j in step_jobs for m in j["modes"]]))
    if label.startswith("fla"):  # the first pass: one case, then out of time
      j = step_jobs[0]
      return [worker.result(j, "fwd", "ok", time_ms=1.0),
              worker.result(j, "fwdbwd", "skipped", reason=worker.TIME_BUDGET)], {}
    return [worker.result(j, m, "ok", time_ms=2.0) for j in step_jobs for m in j["modes"]], {}

  monkeypatch.setattr(run, "run_group", fake_run_group)
  results, _ = run.run_groups(jobs, {}, {"platform": "cpu"}, time.time() + 3600, tmp_path, time.time())
  assert calls == [("fla-t0", [("fla-chunk", "fwd"), ("fla-chunk", "fwdbwd")]),
                   ("lj-xla-t0", [("lj-xla", "fwd"), ("lj-xla", "fwdbwd")]),
                   ("retry-fla-t0", [("fla-chunk", "fwdbwd")])]
  assert [(r["impl"], r["mode"], r["status"]) for r in results] == [
      ("fla-chunk", "fwd", "ok"), ("fla-chunk", "fwdbwd", "ok"), ("lj-xla", "fwd", "ok"), ("lj-xla", "fwdbwd", "ok")]
  calls.clear()  # no time left: no second pass, the skipped case stays skipped
  results, _ = run.run_groups(jobs, {}, {"platform": "cpu"}, time.time() + 1, tmp_path, time.time())
  assert [c[0] for c in calls] == ["fla-t0", "lj-xla-t0"]
  assert run.skipped_for_time(results[1])


def test_repeats_alternate_the_group_order_and_keep_the_median_pass(monkeypatch, tmp_path):
  """`--repeats 3`: three passes, the middle one in reverse group order; each case keeps its median pass."""
  jobs = cases.make_jobs(["fla-chunk", "lj-xla"], [cases.Shape(1, 8, 1, 16, 16)], [True], ["fwd"], "bf16")
  times = {"fla": [3.0, 1.0, 2.0], "lj-xla": [5.0, 7.0, 6.0]}  # per pass; lj-xla's second pass fails
  calls, envs = [], []
  timing_settings = {"sample_seconds": 0.02, "warmup_seconds": 0.5}

  def fake_run_group(group, step_jobs, settings, deadline, workdir, start, label, env=None):
    calls.append(label)
    envs.append(env["JAX_COMPILATION_CACHE_DIR"])
    i = int(label[len("pass")])
    status = "error" if (group, i) == ("lj-xla", 1) else "ok"
    return [worker.result(j, "fwd", status, time_ms=times[group][i], compile_s=10.0 - i, memory={"pass": i})
            for j in step_jobs], {}

  def fake_run_probe(workdir, kill_at, settings, name="probe"):
    assert settings == timing_settings  # the probe's samples last as long as the cases', after as long a warm-up
    calls.append(name)
    if name != "pass1-probe":
      return {"error": "probe failed"}
    return {"copy_bandwidth": {"bandwidth_gbps": 2000.0, "bytes_moved": 4, "time_ms": 2.0}}

  monkeypatch.setattr(run, "run_group", fake_run_group)
  monkeypatch.setattr(run, "run_probe", fake_run_probe)
  first = {"platform": "cpu", "copy_bandwidth": {"bandwidth_gbps": 3000.0, "bytes_moved": 4, "time_ms": 1.0}}
  results, _, probes = run.run_repeats(jobs, timing_settings, first, time.time() + 3600, tmp_path,
                                       time.time(), 3)
  assert calls == ["pass0-fla-t0", "pass0-lj-xla-t0", "pass1-probe", "pass1-lj-xla-t0", "pass1-fla-t0",
                   "pass2-probe", "pass2-fla-t0", "pass2-lj-xla-t0"]
  # The floors use the median of the probes that measured (the third failed); the record keeps each.
  assert run.combined_copy_bandwidth(probes) == {"bandwidth_gbps": 2500.0, "bytes_moved": 4,
                                                 "bandwidth_gbps_probes": [3000.0, 2000.0]}
  assert run.combined_copy_bandwidth(probes[:1]) == first["copy_bandwidth"]
  note = report._metadata_section({"metadata": {"copy_bandwidth": run.combined_copy_bandwidth(probes)},
                                   "results": []})
  assert "2500 GB/s (the median of 2 probes, one per pass: 3000, 2000 GB/s)" in note
  assert set(envs) == {str(tmp_path / "jax-compilation-cache")}
  fla, xla = results
  assert (fla["impl"], fla["time_ms"], fla["time_ms_repeats"]) == ("fla-chunk", 2.0, [3.0, 1.0, 2.0])
  assert (fla["compile_s"], fla["memory"]) == (10.0, {"pass": 0})  # from the pass that compiled
  assert (xla["time_ms"], xla["time_ms_repeats"]) == (5.0, [5.0, 6.0])  # even count: the lower median
  assert report.fmt_cell(fla) == "2.000 [1.000-3.000]"
  assert report.overlap(fla, xla) is False and report.overlap(fla, fla) is True
  assert report.overlap(fla, worker.result(jobs[0], "fwd", "ok", time_ms=2.0)) is None
  loses = report.where_we_lose({"metadata": {}, "results": [fla, {**xla, "time_ms": 9.0}]})
  assert "fla-chunk 2.000 [1.000-3.000]" in loses and "| no |" in loses


@pytest.mark.usefixtures("unoptimized_compiles")  # in-process compiles: most of its time
def test_pieces_times_every_piece_of_per_token_rates(capsys):
  """`benchmarks.pieces` on a tiny shape (interpret mode): a positive time for each piece of the per-token rows."""
  from benchmarks import pieces  # noqa: PLC0415

  pieces.main(["--shapes", "1x80x1x8", "--kinds", "token,token-fixed"])
  rows = {line.split()[1]: line.split()[2:] for line in capsys.readouterr().out.splitlines()
          if line.startswith("1x80x1x8 ") and "vjp" not in line}
  times = {kind: dict(zip(["fwd", *pieces.COLUMNS[1:]], cells)) for kind, cells in rows.items()}
  assert {k: [c for c, v in t.items() if v != "-"] for k, t in times.items()} == {
      "token": ["fwd", "qkvg", "g"], "token-fixed": ["qkv", "q", "k", "v"]}
  assert all(float(v) > 0 for t in times.values() for v in t.values() if v != "-")


def test_kernel_profile_splits_ncu_csv_by_case(tmp_path, capsys):
  """`benchmarks.kernel_profile --summarize`: kernels after each marker, in launch order, in microseconds."""
  from benchmarks import kernel_profile  # noqa: PLC0415

  header = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
  rows = [("0", "case_separator", "ns", "1,024"), ("1", "lightning_chunk_loop", "ns", "403,104"),
          ("2", "loop_pad_fusion", "us", "2.5"), ("3", "case_separator", "ns", "900"),
          ("4", "lightning_chunk_states", "ms", "0.125")]
  text = ["==PROF== Connected to process 1", header] + [
      ",".join(f'"{c}"' for c in (i, name, "gpu__time_duration.sum", unit, value)) for i, name, unit, value in rows]
  assert kernel_profile.summarize(text) == [[("lightning_chunk_loop", 403.104), ("loop_pad_fusion", 2.5)],
                                             [("lightning_chunk_states", 125.0)]]
  path = tmp_path / "ncu.csv"
  path.write_text("\n".join(text))
  kernel_profile.main(["--summarize", str(path), "--cases", "1x64x2x16:head,1x64x2x16:token:3"])
  out = capsys.readouterr().out
  assert "== 1x64x2x16:head: 405.6 us in 2 kernels" in out and "(1 kernels under 3.0 us)" in out
  assert kernel_profile.parse_case("2x8192x32x128:token:8") == ((2, 8192, 32, 128), "token", 8)
  assert kernel_profile.parse_case("2x8192x32x128:kda") == ((2, 8192, 32, 128), "kda", 1)
  for bad in ("1x64x2:head", "1x64x2x16:alibi", "1x64x2x16"):
    with pytest.raises(ValueError, match="BxTxHxD:decay"):
      kernel_profile.parse_case(bad)


@pytest.mark.usefixtures("unoptimized_compiles")  # in-process compiles: most of its time
def test_kernel_profile_runs_its_cases_without_a_profiler(capsys):
  """`benchmarks.kernel_profile --no-profiler` on tiny packed cases of the lightning op (per-token rates) and the
  delta op (Gated DeltaNet), interpret mode."""
  from benchmarks import kernel_profile  # noqa: PLC0415

  kernel_profile.main(["--cases", "1x48x1x8:token:2,1x40x2x8:gated_deltanet:2", "--no-profiler"])
  assert capsys.readouterr().out.split() == ["profiled", "1x48x1x8:token:2", "profiled", "1x40x2x8:gated_deltanet:2"]


@pytest.mark.usefixtures("unoptimized_compiles")  # in-process compiles: most of its time
def test_kernel_times_runs_the_cli_cases(capsys):
  """`python -m benchmarks.kernel_times` builds and traces the CLI's cases: on a GPU each case's kernels, on the CPU
  (XLA on the host) a line saying it found no GPU events."""
  import jax  # noqa: PLC0415

  from benchmarks import kernel_times  # noqa: PLC0415

  kernel_times.main(["--impls", "lj-delta-xla", "--ops", "gated_deltanet", "--shapes", "1x40x2x8", "--calls", "1",
                     "--segments", "2", "--timed"])
  out = capsys.readouterr().out.splitlines()
  labels = [f"== lj-delta-xla B1 T40 H2 D8 E8 Gated DeltaNet, 2 packed sequences {mode}" for mode in ("fwd", "fwdbwd")]
  timed = [line for line in out if line.endswith("a call timed as the CLI times it (8 input sets rotated)")]
  assert len(timed) == 2 and all(float(line.split()[0]) > 0 for line in timed)  # tiny sets: the most rotated
  out = [line for line in out if line not in timed]
  if jax.devices()[0].platform == "gpu":
    heads = [line for line in out if line.startswith("==")]
    assert [line.split(",")[0] for line in heads] == labels and all("ms of kernels per call" in h for h in heads)
  else:
    assert out == [f"{label}: no GPU events (XLA ran on the host)" for label in labels]
  with pytest.raises(SystemExit):
    kernel_times.main(["--calls", "0"])


@pytest.mark.usefixtures("unoptimized_compiles")  # in-process compiles: most of its time (it checks no values)
def test_sequence_states_times_each_path(capsys):
  """`benchmarks.sequence_states` on a tiny row of 3 sequences (the jnp path): one line per case and path, with
  both times; an unknown path is refused."""
  from benchmarks import sequence_states  # noqa: PLC0415

  sequence_states.main(["--cases", "50x2x8x3", "--paths", "xla", "--calls", "1"])
  sequence_states.main(["--op", "lightning", "--decay", "token", "--cases", "50x2x8x3", "--paths", "xla", "--calls",
                        "1"])
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 4 and lines[2].endswith("lightning, token rates")
  for line in (lines[1], lines[3]):
    assert line.split()[:3] == ["50x2x8x3", "xla", "fwd"] and "fwd+bwd" in line
  with pytest.raises(SystemExit, match="unknown --paths"):
    sequence_states.main(["--paths", "xla,triton"])
  with pytest.raises(SystemExit, match="unknown --paths"):  # the delta op's alone
    sequence_states.main(["--op", "lightning", "--paths", "pallas-triton"])


@pytest.mark.usefixtures("unoptimized_compiles")  # in-process compiles: most of its time (it checks no values)
def test_sequence_pieces_times_one_sequence_parallel_device():
  """`benchmarks.sequence_pieces` on a tiny shape (interpret mode): every program timed with each states config."""
  from benchmarks import sequence_pieces  # noqa: PLC0415

  times = sequence_pieces.main(["--shape", "1x40x1x8", "--states-blocks", "16x16x4x1"])
  pieces = ("fwd", "fwdbwd", "prefix_fwd", "prefix_fwdbwd", "states", "states_reverse")
  assert sorted(times) == sorted(f"{p}[16x16x4x1]" for p in pieces)
  assert all(ms > 0 for ms in times.values())
  assert sequence_pieces._states_config("default") is None  # noqa: SLF001
  assert sequence_pieces._states_config("128x64x8x3").chunk_states == lj.ChunkStatesConfig(  # noqa: SLF001
      block_d=128, block_e=64, num_warps=8, num_stages=3)


def test_kernel_times_per_device_from_a_perfetto_trace():
  """Kernel time per call, per GPU process (host events left out), largest first (`benchmarks.kernel_times`, which
  `sequence_pieces --trace-devices` uses too)."""
  from benchmarks import kernel_times  # noqa: PLC0415

  meta = lambda pid, name: {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}  # noqa: E731
  event = lambda pid, name, dur: {"ph": "X", "pid": pid, "tid": 1, "ts": 0.0, "dur": dur, "name": name}  # noqa: E731
  trace = {"traceEvents": [meta(1, "/host:CPU"), meta(2, "/device:GPU:0"), meta(3, "/device:GPU:1"),
                           event(1, "PjitFunction", 9000.0), event(2, "states", 1000.0), event(2, "loop", 3000.0),
                           event(2, "states", 1000.0), event(3, "all-gather", 500.0)]}
  found = kernel_times.kernel_times(trace, calls=2)
  assert found == {"/device:GPU:0": {"loop": 1.5, "states": 1.0}, "/device:GPU:1": {"all-gather": 0.25}}
  assert list(found["/device:GPU:0"]) == ["loop", "states"]


def test_kernel_launches_of_the_last_call_in_order():
  """`--launches`: the last call's kernels in launch order, two launches of one name apart, per GPU process, each with
  the device's idle time before it (the first: since the previous call's last kernel)."""
  from benchmarks import kernel_times  # noqa: PLC0415

  meta = lambda pid, name: {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}  # noqa: E731
  event = lambda pid, name, ts, dur: {"ph": "X", "pid": pid, "tid": 1, "ts": ts, "dur": dur, "name": name}  # noqa: E731
  first = [event(2, "states", 0.0, 900.0), event(2, "loop", 1000.0, 3000.0), event(2, "loop", 4000.0, 2500.0)]
  second = [event(2, "states", 7000.0, 1000.0), event(2, "loop", 8000.0, 3100.0), event(2, "loop", 11200.0, 2400.0)]
  trace = {"traceEvents": [meta(1, "/host:CPU"), meta(2, "/device:GPU:0"), event(1, "PjitFunction", 0.0, 9e3),
                           *second[::-1], *first]}
  found = kernel_times.launches(trace, calls=2)
  assert list(found) == ["/device:GPU:0"]
  assert [(name, ms) for name, ms, _ in found["/device:GPU:0"]] == [("states", 1.0), ("loop", 3.1), ("loop", 2.4)]
  assert [idle for *_, idle in found["/device:GPU:0"]] == pytest.approx([0.5, 0.0, 0.1])
