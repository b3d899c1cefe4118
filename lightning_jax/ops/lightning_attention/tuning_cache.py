"""An optional tuning cache: block configs measured on a device, preferred to the heuristics.

`heuristics.resolve` takes each kernel's config from, in order: the field set in
`config=`, the active tuning cache's entry for the sweep (compute capability,
job, dim_k, dim_v, itemsize), the defaults of `heuristics`. The active cache is
that of the innermost `use_tuning_cache` block, else the file named by
$LIGHTNING_JAX_TUNING_CACHE, else none. Without a compute capability (the CPU,
interpret mode) no entry matches. `python -m lightning_jax.tune --write-cache`
writes a cache from timings on the device at hand.

The cache is consulted when a function is traced: a function already traced
under `jax.jit` keeps the configs it was traced with.

The file (JSON):

    {"format": 1, "entries": [
      {"compute_capability": [9, 0], "job": "forward", "dim_k": 64, "dim_v": 64, "itemsize": 2,
       "chunk_loop": {"chunk_size": 64, "block_e": 64, "num_warps": 4, "num_stages": 4},
       "device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "date": "2026-11-22",
       "command": "python -m lightning_jax.tune ..."}]}

`job` is one of `config.SWEEP_JOBS`, `dim_k` and `dim_v` the sweep's padded
dims (see `heuristics.resolve`), `itemsize` 2 (bf16, f16) or 4 (f32). An entry
holds any of `chunk_loop`, `chunk_output`, `chunk_states` (the fields of their
dataclasses); `device`, `jax`, `date` and `command` say where it was measured
and are optional (lookup ignores them).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import os

from lightning_jax.ops.lightning_attention import config as config_lib

FORMAT = 1
ENV_VAR = "LIGHTNING_JAX_TUNING_CACHE"
KERNELS = {"chunk_loop": config_lib.ChunkLoopConfig, "chunk_output": config_lib.ChunkOutputConfig,
           "chunk_states": config_lib.ChunkStatesConfig}
ITEMSIZES = (2, 4)
METADATA = ("device", "jax", "date", "command")


def _as_value_or_type_error(err: Exception, message: str) -> Exception:
  """A TypeError if `err` is one, else a ValueError (JSON and Unicode errors too), saying `message`."""
  return (TypeError if isinstance(err, TypeError) else ValueError)(message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuningEntry:
  """The kernel configs of one sweep on one kind of device (unset kernels keep the heuristics)."""
  compute_capability: tuple[int, int]
  job: str
  dim_k: int
  dim_v: int
  itemsize: int
  chunk_loop: config_lib.ChunkLoopConfig | None = None
  chunk_output: config_lib.ChunkOutputConfig | None = None
  chunk_states: config_lib.ChunkStatesConfig | None = None
  device: str | None = None
  jax: str | None = None
  date: str | None = None
  command: str | None = None

  def __post_init__(self):
    cc = self.compute_capability
    if not (isinstance(cc, tuple) and len(cc) == 2 and all(config_lib.is_int(c) and c >= 0 for c in cc)):
      raise ValueError(f"compute_capability must be [major, minor], two ints >= 0, got {cc!r}")
    if self.job not in config_lib.SWEEP_JOBS:
      raise ValueError(f"job must be one of {config_lib.SWEEP_JOBS}, got {self.job!r}")
    for name in ("dim_k", "dim_v"):
      dim = getattr(self, name)
      if not config_lib.is_int(dim) or dim != config_lib.padded_dim(dim):  # no other dim is ever looked up
        raise ValueError(f"{name} must be a padded dim (a power of two >= {config_lib.MIN_BLOCK}), got {dim!r}")
    if not config_lib.is_int(self.itemsize) or self.itemsize not in ITEMSIZES:
      raise ValueError(f"itemsize must be one of {ITEMSIZES}, got {self.itemsize!r}")
    for name, cls in KERNELS.items():
      value = getattr(self, name)
      if value is not None and not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__} or None, got {type(value).__name__}")
    if all(getattr(self, name) is None for name in KERNELS):
      raise ValueError(f"an entry needs one of {tuple(KERNELS)}")
    for name in METADATA:
      value = getattr(self, name)
      if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a string or absent, got {value!r}")

  @property
  def key(self) -> tuple:
    return self.compute_capability, self.job, self.dim_k, self.dim_v, self.itemsize

  def to_json(self) -> dict:
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    fields["compute_capability"] = list(self.compute_capability)
    fields.update({name: dataclasses.asdict(fields[name]) for name in KERNELS if fields[name] is not None})
    return {name: value for name, value in fields.items() if value is not None}

  @classmethod
  def from_json(cls, data) -> TuningEntry:
    if not isinstance(data, dict):
      raise TypeError(f"an entry must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := sorted(set(data) - set(fields)):
      raise ValueError(f"unknown keys {unknown}; an entry has keys {sorted(fields)}")
    if missing := [name for name, f in fields.items() if f.default is dataclasses.MISSING and name not in data]:
      raise ValueError(f"missing keys {missing}")
    data = dict(data)
    if isinstance(data["compute_capability"], list):
      data["compute_capability"] = tuple(data["compute_capability"])
    for name, kernel in KERNELS.items():
      if data.get(name) is None:
        continue
      if not isinstance(data[name], dict):
        raise TypeError(f"{name} must be a JSON object of {kernel.__name__} fields, got {data[name]!r}")
      try:
        data[name] = kernel(**data[name])
      except (TypeError, ValueError) as err:
        raise _as_value_or_type_error(err, f"{name}: {err}") from err
    return cls(**data)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuningCache:
  """Tuned kernel configs by sweep: (compute capability, job, dim_k, dim_v, itemsize) -> `TuningEntry`.

  `path` names the file in error messages (None: built in memory).
  """
  entries: tuple[TuningEntry, ...] = ()
  path: str | None = None

  def __post_init__(self):
    if not isinstance(self.entries, tuple) or not all(isinstance(e, TuningEntry) for e in self.entries):
      raise TypeError(f"entries must be a tuple of TuningEntry, got {self.entries!r}")
    first = {}
    for i, entry in enumerate(self.entries):
      if (j := first.setdefault(entry.key, i)) != i:
        raise ValueError(f"entries[{j}] and entries[{i}] share the key {entry.key}")

  @classmethod
  def load(cls, path) -> TuningCache:
    """Reads and checks a cache file; a ValueError or TypeError names the file, the entry and what is wrong."""
    path = os.fspath(path)
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
      return cls.from_json(data, path=path)
    except (TypeError, ValueError) as err:
      raise _as_value_or_type_error(err, f"tuning cache {path}: {err}") from err

  @classmethod
  def from_json(cls, data, *, path: str | None = None) -> TuningCache:
    if not isinstance(data, dict):
      raise TypeError(f'the file must hold a JSON object {{"format": {FORMAT}, "entries": [...]}}, '
                      f"got {type(data).__name__}")
    if data.get("format") != FORMAT:
      raise ValueError(f"format must be {FORMAT}, got {data.get('format')!r}")
    if unknown := sorted(set(data) - {"format", "entries"}):
      raise ValueError(f'unknown keys {unknown}; the file has keys "format" and "entries"')
    if not isinstance(data.get("entries"), list):
      raise TypeError(f"entries must be a JSON list, got {data.get('entries')!r}")
    entries = []
    for i, entry in enumerate(data["entries"]):
      try:
        entries.append(TuningEntry.from_json(entry))
      except (TypeError, ValueError) as err:
        raise _as_value_or_type_error(err, f"entries[{i}]: {err}") from err
    return cls(entries=tuple(entries), path=path)

  def to_json(self) -> dict:
    return {"format": FORMAT, "entries": [entry.to_json() for entry in self.entries]}

  def save(self, path) -> None:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(self.to_json(), f, indent=1)
      f.write("\n")

  def lookup(self, *, compute_capability: tuple[int, int] | None, job: str, dim_k: int, dim_v: int,
             itemsize: int) -> TuningEntry | None:
    """The entry of one sweep (padded dims), or None; None also without a compute capability."""
    if compute_capability is None:
      return None
    key = (tuple(compute_capability), job, dim_k, dim_v, itemsize)
    return next((entry for entry in self.entries if entry.key == key), None)

  def describe(self, entry: TuningEntry) -> str:
    """Where `entry` stands, for error messages: the file, its index and its key."""
    (major, minor), job, dim_k, dim_v, itemsize = entry.key
    return (f"tuning cache {self.path or '(in memory)'}, entries[{self.entries.index(entry)}] (compute capability "
            f"{major}.{minor}, job {job}, dim_k {dim_k}, dim_v {dim_v}, itemsize {itemsize})")


# The innermost `use_tuning_cache` (a TuningCache, or None for none); _NO_CONTEXT outside every block.
_NO_CONTEXT = object()
_ACTIVE = contextvars.ContextVar("lightning_jax_tuning_cache", default=_NO_CONTEXT)


@functools.lru_cache(maxsize=16)
def _load_version(path: str, mtime_ns: int, size: int) -> TuningCache:
  del mtime_ns, size  # keys only: an edited file is read again
  return TuningCache.load(path)


def _load(path) -> TuningCache:
  """`TuningCache.load(path)`, read again only once the file changes (not on every trace)."""
  stat = os.stat(path)
  return _load_version(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@contextlib.contextmanager
def use_tuning_cache(cache: TuningCache | str | os.PathLike | None):
  """Within the block, kernels traced in this thread take their configs from `cache`.

  `cache` is a `TuningCache`, the path of a cache file (loaded, and checked,
  on entering the block) or None: no cache, whatever $LIGHTNING_JAX_TUNING_CACHE
  says. The block overrides the env var and outer blocks, and restores them
  when it ends. Configs are chosen at trace time: a function already traced
  under `jax.jit` keeps its configs.
  """
  if cache is not None and not isinstance(cache, TuningCache):
    cache = _load(cache)
  token = _ACTIVE.set(cache)
  try:
    yield cache
  finally:
    _ACTIVE.reset(token)


def active_tuning_cache() -> TuningCache | None:
  """The cache `heuristics.resolve` consults now: the innermost `use_tuning_cache`, else $LIGHTNING_JAX_TUNING_CACHE."""
  cache = _ACTIVE.get()
  if cache is not _NO_CONTEXT:
    return cache
  path = os.environ.get(ENV_VAR)
  if not path:
    return None
  try:
    return _load(path)
  except (OSError, TypeError, ValueError) as err:
    err.add_note(f"(the tuning cache named by ${ENV_VAR})")
    raise


def fill_from_cache(config: config_lib.LightningConfig, *, compute_capability: tuple[int, int] | None, job: str,
                    dim_k: int, dim_v: int, itemsize: int) -> tuple[config_lib.LightningConfig, dict[str, str]]:
  """`config` with its unset kernel configs taken from the active cache's entry for this sweep, if any.

  Also returns, per kernel, where its config came from ("config." or the
  entry, see `TuningCache.describe`), for the budget check's errors.
  """
  origins = dict.fromkeys(KERNELS, "config.")
  cache = active_tuning_cache()
  entry = None if cache is None else cache.lookup(compute_capability=compute_capability, job=job, dim_k=dim_k,
                                                  dim_v=dim_v, itemsize=itemsize)
  if entry is None:
    return config, origins
  cached = {name: getattr(entry, name) for name in KERNELS
            if getattr(config, name) is None and getattr(entry, name) is not None}
  origins.update(dict.fromkeys(cached, f"{cache.describe(entry)}: "))
  return dataclasses.replace(config, **cached), origins
