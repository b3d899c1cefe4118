"""The tuning cache: lookup and precedence in `heuristics.resolve`, loading, and `lightning_jax.tune --write-cache`."""

import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest

import lightning_jax as lj
from lightning_jax import tune
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import tuning_cache

# Interpret-mode kernels against the oracles with tolerances far above float32
# rounding: compiled without LLVM's optimisations on the CPU (see conftest).
pytestmark = pytest.mark.usefixtures("unoptimized_compiles")

CC = (9, 0)
KEY = dict(job="forward", dim_k=64, dim_v=64, itemsize=2)
TUNED = lj.ChunkLoopConfig(chunk_size=32, block_e=32, num_warps=8, num_stages=2)
OTHER = lj.ChunkLoopConfig(chunk_size=16, block_e=16, num_warps=2, num_stages=1)


@pytest.fixture(autouse=True)
def no_env_cache(monkeypatch):
  monkeypatch.delenv(tuning_cache.ENV_VAR, raising=False)


def entry_json(chunk_loop=TUNED, cc=CC, **key):
  return dict(compute_capability=list(cc), **{**KEY, **key}, chunk_loop=dataclasses.asdict(chunk_loop),
              device="test", command="pytest")


def doc(*entries):
  return {"format": 1, "entries": list(entries)}


def write(path, *entries):
  path.write_text(json.dumps(doc(*entries)))
  return path


def resolve(cc=CC, config=None, **key):
  return heuristics.resolve(config, compute_capability=cc, **{**KEY, **key})


def test_entry_changes_its_sweep_only(tmp_path):
  heuristic = resolve()
  assert heuristic.chunk_loop != TUNED
  others = [dict(cc=(8, 0)), dict(cc=None), dict(job="dual"), dict(dim_v=128), dict(dim_k=32), dict(itemsize=4)]
  before = [resolve(**kw) for kw in others]
  with lj.use_tuning_cache(write(tmp_path / "cache.json", entry_json())):
    assert resolve() == dataclasses.replace(heuristic, chunk_loop=TUNED)
    assert [resolve(**kw) for kw in others] == before


def test_explicit_config_beats_the_cache(tmp_path):
  cache = lj.TuningCache.load(write(tmp_path / "cache.json", entry_json()))
  with lj.use_tuning_cache(cache):
    assert resolve(config=lj.LightningConfig(chunk_loop=OTHER)).chunk_loop == OTHER
    out = lj.ChunkOutputConfig(chunk_size=32, block_e=32, num_warps=4, num_stages=1)
    mixed = resolve(config=lj.LightningConfig(chunk_output=out))
    assert (mixed.chunk_loop, mixed.chunk_output) == (TUNED, out)


def test_env_var_and_context(tmp_path, monkeypatch):
  a = write(tmp_path / "a.json", entry_json(TUNED))
  b = write(tmp_path / "b.json", entry_json(OTHER))
  heuristic = resolve().chunk_loop
  monkeypatch.setenv(tuning_cache.ENV_VAR, str(a))
  assert resolve().chunk_loop == TUNED
  with lj.use_tuning_cache(b):
    assert resolve().chunk_loop == OTHER
    with lj.use_tuning_cache(None):
      assert resolve().chunk_loop == heuristic
    assert resolve().chunk_loop == OTHER
  assert resolve().chunk_loop == TUNED
  monkeypatch.setenv(tuning_cache.ENV_VAR, str(b))
  assert resolve().chunk_loop == OTHER
  monkeypatch.delenv(tuning_cache.ENV_VAR)
  assert resolve().chunk_loop == heuristic


def test_file_is_read_once_until_it_changes(tmp_path, monkeypatch):
  path = write(tmp_path / "cache.json", entry_json(TUNED))
  loads = []
  load = tuning_cache.TuningCache.load.__func__
  monkeypatch.setattr(tuning_cache.TuningCache, "load", classmethod(lambda cls, p: loads.append(p) or load(cls, p)))
  monkeypatch.setenv(tuning_cache.ENV_VAR, str(path))
  assert [resolve().chunk_loop for _ in range(3)] == [TUNED] * 3
  assert len(loads) == 1
  write(path, entry_json(OTHER), entry_json(OTHER, job="dual"))
  os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 10**9))
  assert resolve().chunk_loop == OTHER and len(loads) == 2


def test_over_budget_entry_names_the_file(tmp_path):
  big = lj.ChunkLoopConfig(chunk_size=256, block_e=256, num_warps=8, num_stages=4)
  path = write(tmp_path / "big.json", entry_json(), entry_json(big, cc=(12, 0), dim_k=256, dim_v=256, itemsize=4))
  with lj.use_tuning_cache(path):
    with pytest.raises(ValueError, match=re.escape(f"tuning cache {path}, entries[1] (compute capability 12.0, job "
                                                   "forward, dim_k 256, dim_v 256, itemsize 4): chunk_loop=")
                       + ".* over the 101376-byte"):
      resolve(cc=(12, 0), dim_k=256, dim_v=256, itemsize=4)


# The file's text, the error and what its message says after "tuning cache PATH: ".
MALFORMED = {
    "not_json": ("{", ValueError, "Expecting property name"),
    "a_list": ("[]", TypeError, "the file must hold a JSON object"),
    "format_2": ({"format": 2, "entries": []}, ValueError, "format must be 1, got 2"),
    "no_entries": ({"format": 1}, TypeError, "entries must be a JSON list"),
    "unknown_top_key": ({**doc(), "device": "x"}, ValueError, r"unknown keys \['device'\]"),
    "missing_job": (doc({k: v for k, v in entry_json().items() if k != "job"}), ValueError,
                    r"entries\[0\]: missing keys \['job'\]"),
    "unknown_job": (doc(entry_json(job="backward")), ValueError, r"entries\[0\]: job must be one of"),
    "unpadded_dim": (doc(entry_json(dim_k=40)), ValueError, r"entries\[0\]: dim_k must be a padded dim"),
    "bad_itemsize": (doc(entry_json(itemsize=3)), ValueError, r"entries\[0\]: itemsize must be one of"),
    "bad_cc": (doc(entry_json(cc=(9,))), ValueError, r"entries\[0\]: compute_capability must be \[major, minor\]"),
    "typo_key": (doc({**entry_json(), "chunk_lop": {}}), ValueError, r"entries\[0\]: unknown keys \['chunk_lop'\]"),
    "bad_field": (doc({**entry_json(), "chunk_loop": {**dataclasses.asdict(TUNED), "chunk_sise": 64}}), TypeError,
                  r"entries\[0\]: chunk_loop: .*chunk_sise"),
    "bad_value": (doc({**entry_json(), "chunk_loop": {**dataclasses.asdict(TUNED), "chunk_size": 48}}), ValueError,
                  r"entries\[0\]: chunk_loop: chunk_size must be a power of two"),
    "no_config": (doc({**entry_json(), "chunk_loop": None}), ValueError, r"entries\[0\]: an entry needs one of"),
    "duplicate": (doc(entry_json(), entry_json(OTHER)), ValueError, r"entries\[0\] and entries\[1\] share the key"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_file_raises_clearly(name, tmp_path, monkeypatch):
  content, error, match = MALFORMED[name]
  path = tmp_path / f"{name}.json"
  path.write_text(content if isinstance(content, str) else json.dumps(content))
  with pytest.raises(error, match=re.escape(f"tuning cache {path}: ") + match):
    with lj.use_tuning_cache(path):
      pass
  # Named by the env var, it fails at the first trace, and says where the path came from.
  monkeypatch.setenv(tuning_cache.ENV_VAR, str(path))
  with pytest.raises(error, match=match) as info:
    resolve()
  assert tuning_cache.ENV_VAR in "".join(getattr(info.value, "__notes__", []))


def test_missing_env_var_file_raises(tmp_path, monkeypatch):
  monkeypatch.setenv(tuning_cache.ENV_VAR, str(tmp_path / "nowhere.json"))
  with pytest.raises(FileNotFoundError, match="nowhere.json"):
    resolve()


# --- lightning_jax.tune --write-cache ------------------------------------------

SHAPE = [1, 64, 2, 40, 24]  # forward and dual sweeps on padded dims (64, 32), the tangent sweep on (32, 64)


def row(job, variant, decay, cfg, time_ms, status="ok", shape=SHAPE):
  kernel = tune.KERNEL_OF_VARIANT[variant]
  config = None if cfg is None else dataclasses.asdict(lj.LightningConfig(**{kernel: cfg}))
  return dict(shape=shape, job=job, decay=decay, variant=variant, config=config, default=cfg is None,
              status=status, time_ms=time_ms)


def loop(c, be=16, warps=4, stages=1):
  return lj.ChunkLoopConfig(chunk_size=c, block_e=be, num_warps=warps, num_stages=stages)


def heuristic(job, kernel, dim_k=64, dim_v=32):
  return getattr(resolve(job=job, dim_k=dim_k, dim_v=dim_v, itemsize=4), kernel)


def test_pick_configs_takes_the_fastest_ok_config_over_the_decays():
  fwd = lambda decay, cfg, t, status="ok": row("forward", "chunk_loop", decay, cfg, t, status)  # noqa: E731
  out = lambda c: lj.ChunkOutputConfig(chunk_size=c, block_e=32, num_warps=4, num_stages=1)  # noqa: E731
  par = lambda decay, cfg, t: row("forward", "parallel", decay, cfg, t)  # noqa: E731
  tangent = lambda cfg, t, status="ok": row("tangent", "chunk_loop", True, cfg, t, status)  # noqa: E731
  rows = [
      # forward chunk_loop: the total over both decays decides; failed rows do not count.
      fwd(True, None, 10.0), fwd(False, None, 10.0),
      fwd(True, loop(16), 5.5), fwd(False, loop(16), 11.0),  # 16.5: fastest with a decay only
      fwd(True, loop(32), 9.0), fwd(False, loop(32), 6.0),  # 15: the pick
      fwd(True, loop(64, stages=2), 1.0, "wrong"), fwd(False, loop(64, stages=2), 1.0),
      fwd(True, loop(64, stages=3), 1.0), fwd(False, loop(64, stages=3), 1.0, "compile_error"),
      # forward parallel: 3% under the heuristics' best time (its candidate twin's) is a tie.
      par(True, None, 10.0), par(True, heuristic("forward", "chunk_output"), 9.0), par(True, out(32), 8.8),
      # tangent: the heuristics fail, the one config that runs wins.
      tangent(None, 0.0, "compile_error"), tangent(loop(16), 3.0),
      # dual: nothing runs, nothing is said.
      row("dual", "chunk_loop", True, None, 0.0, "compile_error"),
  ]
  assert heuristic("forward", "chunk_output") != out(32)
  picks = tune.pick_configs(rows, compute_capability=CC, itemsize=4, min_gain=0.05)
  assert picks == {("forward", 64, 32, "chunk_loop"): loop(32), ("forward", 64, 32, "chunk_output"): None,
                   ("tangent", 32, 64, "chunk_loop"): loop(16)}
  assert tune.pick_configs(rows, compute_capability=CC, itemsize=4, min_gain=0.0)[
      "forward", 64, 32, "chunk_output"] == out(32)


def test_written_cache_round_trips_and_merges(tmp_path):
  kept = lj.TuningEntry(compute_capability=(8, 0), job="forward", dim_k=64, dim_v=32, itemsize=4, chunk_loop=OTHER,
                        device="an A100")
  beaten = lj.TuningEntry(compute_capability=CC, job="dual", dim_k=64, dim_v=32, itemsize=4, chunk_loop=OTHER)
  out = lj.ChunkOutputConfig(chunk_size=32, block_e=32, num_warps=4, num_stages=1)
  mixed = lj.TuningEntry(compute_capability=CC, job="forward", dim_k=64, dim_v=32, itemsize=4, chunk_output=out)
  path = tmp_path / "cache.json"
  lj.TuningCache(entries=(mixed, kept, beaten)).save(path)
  picks = {("forward", 64, 32, "chunk_loop"): TUNED, ("dual", 64, 32, "chunk_loop"): None,
           ("tangent", 32, 64, "chunk_loop"): None}
  metadata = dict(device="an H100", jax=jax.__version__, date="2026-01-01", command="python -m lightning_jax.tune")
  merged = tune.merge_picks(lj.TuningCache.load(path), picks, compute_capability=CC, itemsize=4, **metadata)
  merged.save(path)
  loaded = lj.TuningCache.load(path)
  assert loaded.entries == merged.entries
  assert loaded.entries == (kept, dataclasses.replace(mixed, chunk_loop=TUNED, **metadata))
  with lj.use_tuning_cache(path):
    configs = resolve(job="forward", dim_k=64, dim_v=32, itemsize=4)
  assert (configs.chunk_loop, configs.chunk_output) == (TUNED, out)


def test_write_cache_refuses_on_the_cpu(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(heuristics, "compute_capability", lambda device: None)
  path = tmp_path / "cache.json"
  with pytest.raises(SystemExit):
    tune.main(["--shapes", "1x20x1x16x16", "--write-cache", str(path)])
  assert "--write-cache needs an NVIDIA GPU" in capsys.readouterr().err and not path.exists()


# --- end to end -----------------------------------------------------------------

def test_pallas_with_a_cache_matches_the_reference(tmp_path, monkeypatch):
  """A cache entry for this call's sweep is used, and the kernels still compute the right thing."""
  b, t, h, d, e = 1, 77, 2, 40, 24
  key = dict(job="forward", dim_k=64, dim_v=32, itemsize=4)
  tuned = dict(chunk_loop=loop(16, stages=2), chunk_output=lj.ChunkOutputConfig(chunk_size=32, block_e=16,
                                                                                 num_warps=4, num_stages=1),
               chunk_states=lj.ChunkStatesConfig(block_d=32, block_e=16, num_warps=4, num_stages=1))
  assert all(getattr(resolve(**key), name) != cfg for name, cfg in tuned.items())
  cache = lj.TuningCache(entries=(lj.TuningEntry(compute_capability=CC, **key, **tuned),))
  monkeypatch.setattr(heuristics, "compute_capability", lambda device: CC)
  resolved = []
  original_resolve = heuristics.resolve

  def recording_resolve(*args, **kwargs):
    resolved.append(original_resolve(*args, **kwargs))
    return resolved[-1]

  monkeypatch.setattr(heuristics, "resolve", recording_resolve)

  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k = (jax.random.normal(key, (b, t, h, d)) for key in ks[:2])
  v = jax.random.normal(ks[2], (b, t, h, e))
  decay = jax.random.uniform(ks[3], (h,), minval=0.01, maxval=0.5)
  want = np.asarray(lj.lightning_attention(q, k, v, decay, impl="reference"))
  with lj.use_tuning_cache(cache):
    for variant in ("chunk_loop", "parallel"):
      got = np.asarray(lj.lightning_attention(q, k, v, decay, impl="pallas", variant=variant, interpret=True))
      assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4, variant
  assert resolved and all(
      (r.chunk_loop, r.chunk_output, r.chunk_states) == tuple(tuned.values()) for r in resolved)
