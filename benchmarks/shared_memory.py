"""Shared memory of the Pallas Triton kernels on every NVIDIA target, measured by Triton's allocator, without a GPU.

A Triton kernel that asks for more shared memory than the device allows per
block fails to compile (RESOURCE_EXHAUSTED). Which blocks fit depends on the
target (sm90 lays dot operands out for wgmma, sm80-class targets for mma), so
this script lowers the kernels for CUDA on this machine (JAX needs no GPU for
that) and has Triton (the `triton` package, written against 3.6 and JAX 0.10.2)
run its passes on their IR up to the shared-memory allocation, for sm80, sm86,
sm89, sm90, sm100 and sm120:

- `--op delta`: every kernel of `delta_attention`'s Pallas path, forward and
  backward (E = 256, and for the split backward also E = 128, where W, U_v and
  T come by whole tiles), per form, dtype and padded D, in the H200's config
  and in each target's own `default_config`;
- `--op lightning`: every kernel `lightning_attention` lowers (the chunk_loop
  and parallel variants, forward and gradients) in the blocks its heuristics
  pick on each target.

On an H200 this reproduced the one overflow seen there (the delta op's float32
D = 256 reverse sweep with 64 value columns: 242,820 bytes here, 242,688
reported by the device). The allocation does not depend on T once every
kernel's loop runs several chunks (the same at 256 and 4096 tokens), so a
short sequence stands for every length; a loop of one chunk does not pipeline
(a KDA sweep at 64-token chunks took 73,728 bytes at 64 tokens, 173,576 at
256), so the delta kernels run `DELTA_TOKENS` = 4 chunks of the largest.

    python -m benchmarks.shared_memory --op delta --out benchmarks/tuning/delta-shared-memory.json
    python -m benchmarks.shared_memory --op lightning --out benchmarks/tuning/lightning-shared-memory.json

`tests/test_delta_ops.py` and `tests/test_api.py` hold the configs to the
committed files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import lightning_jax as lj
from lightning_jax.ops.delta_attention import pallas_triton
from lightning_jax.ops.lightning_attention import config as lightning_config
from lightning_jax.ops.lightning_attention import heuristics

# Four chunks of 64 tokens, the largest chunk of any `default_config` (see the module docstring).
DELTA_TOKENS = 256

# Targets by compute capability: sm80 (A100), sm86 (RTX 30, A10), sm89 (RTX 40, L4), sm90 (H100/H200), sm100
# (B200), sm120 (RTX 50).
TARGETS = (80, 86, 89, 90, 100, 120)
FORMS = {"deltanet": None, "gated_deltanet": 3, "kda": 4}  # the rates' ndim
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
DIMS = (16, 32, 64, 128, 256)  # every padded D (the kernels hold all of D); E is 256, past every block_e
# The lightning op: both Triton variants, forward and every gradient, in two calls that between them run every
# kernel and operand: one (batch, head) pair over 4K tokens (the sequence split, a per-head decay, states) and
# 128 pairs over 256 tokens (no split; per-token rates, segment ids, states). D = E.
LIGHTNING_CASES = {"split-head-decay": (1, 4096, 1, "head"), "rows-token-decay-packed": (4, 256, 32, "token")}
LIGHTNING_VARIANTS = ("chunk_loop", "parallel")
LIGHTNING_DTYPES = ("bfloat16", "float32")
LIGHTNING_DIMS = (64, 128, 256)


@contextlib.contextmanager
def captured_triton_ir():
  """Collects (kernel name, Triton IR text) of every pallas_call lowered inside (a hook on JAX's lowering)."""
  from jax._src.pallas.triton import pallas_call_registration as registration  # noqa: PLC0415
  lower = registration.lowering.lower_jaxpr_to_triton_module
  found = []

  def capture(*args, **kwargs):
    result = lower(*args, **kwargs)
    text = result.module.operation.get_asm(enable_debug_info=False)
    found.append((re.search(r"module @(\w+)", text).group(1), text))
    return result

  registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    yield found
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower


def _custom_calls(op, found):
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        if inner.operation.name == "stablehlo.custom_call" and "mhlo.backend_config" in inner.attributes:
          found.append(inner.attributes["mhlo.backend_config"])
        _custom_calls(inner.operation, found)
  return found


def lowered_kernels(fn, *args) -> list[dict]:
  """Every Triton kernel of `fn(*args)` lowered for CUDA: its name, Triton IR, num_warps and num_stages."""
  with captured_triton_ir() as found:
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  configs = _custom_calls(lowered.compiler_ir("stablehlo").operation, [])
  if [c["name"].value for c in configs] != [name for name, _ in found]:
    raise RuntimeError("the lowered custom calls do not match the captured kernels (another jax version?)")
  return [dict(name=name, ir=text, num_warps=c["num_warps"].value, num_stages=c["num_stages"].value)
          for (name, text), c in zip(found, configs)]


def delta_kernels(form: str, dtype, dim: int, config: pallas_triton.DeltaConfig) -> dict[str, dict]:
  """{"forward/<kernel>" or "backward/<kernel>": `lowered_kernels` entry}, with segment starts and states."""
  b, t, h, e = 1, DELTA_TOKENS, 1, 256
  q = jnp.zeros((b, t, h, dim), dtype)
  v = jnp.zeros((b, t, h, e), dtype)
  beta = jnp.zeros((b, t, h), jnp.float32)
  ndim = FORMS[form]
  decay = None if ndim is None else jnp.zeros((b, t, h, dim)[:ndim], jnp.float32)
  state = jnp.zeros((b, h, dim, e), jnp.float32)
  starts = jnp.zeros((b, t), bool)
  kwargs = dict(scale=0.1, config=config, interpret=False)
  passes = {
      "forward": lambda q, v, beta, decay, state, starts: pallas_triton.forward(
          q, q, v, beta, decay, starts, state, with_final_state=True, **kwargs),
      "backward": lambda q, v, beta, decay, state, starts: pallas_triton.backward(
          q, q, v, beta, decay, starts, state, v, state, **kwargs),
  }
  if config.splits_backward(per_channel_gate=ndim == 4) and dim <= 128:
    # E = 128: the split backward's W, U_v and T by whole tiles (`prepare_by_tiles`, D and E <= 128).
    passes["backward_e128"] = lambda q, v, beta, decay, state, starts: pallas_triton.backward(
        q, q, v[..., :128], beta, decay, starts, state[..., :128], v[..., :128], state[..., :128], **kwargs)
  return {f"{name}/{kernel['name']}": kernel for name, fn in passes.items()
          for kernel in lowered_kernels(fn, q, v, beta, decay, state, starts)}


def triton_gpu_module(ir_text: str, capability: int, *, num_warps: int, num_stages: int):
  """The kernel's Triton IR through Triton's own passes to TritonGPU IR for sm<capability>.

  Returns (module, stages, metadata, backend, options): `stages` holds the
  later ones ("llir", "ptx", ...), each taking (module, metadata).
  """
  from triton._C.libtriton import ir  # noqa: PLC0415
  from triton.backends.compiler import GPUTarget  # noqa: PLC0415
  from triton.backends.nvidia.compiler import CUDABackend  # noqa: PLC0415
  from triton.compiler.compiler import Language  # noqa: PLC0415

  backend = CUDABackend(GPUTarget("cuda", capability, 32))
  options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
  context = ir.context()
  ir.load_dialects(context)
  backend.load_dialects(context)
  with tempfile.NamedTemporaryFile("w", suffix=".ttir") as f:
    f.write(ir_text)
    f.flush()
    module = ir.parse_mlir_module(f.name, context)
  module.context = context
  stages, metadata = {}, {}
  backend.add_stages(stages, options, Language.TRITON)
  module = stages["ttgir"](stages["ttir"](module, metadata), metadata)
  return module, stages, metadata, backend, options


def shared_bytes(ir_text: str, capability: int, *, num_warps: int, num_stages: int) -> int:
  """Triton's shared-memory allocation for the kernel on sm<capability> (its passes to the allocation only)."""
  from triton._C.libtriton import ir, nvidia, passes  # noqa: PLC0415
  from triton.backends.nvidia.compiler import get_ptx_version_from_options  # noqa: PLC0415

  module, _, _, backend, options = triton_gpu_module(ir_text, capability, num_warps=num_warps, num_stages=num_stages)
  pm = ir.pass_manager(module.context)  # the start of make_llir, through the allocation
  passes.ttgpuir.add_combine_tensor_select_and_if(pm)
  passes.ttgpuir.add_allocate_warp_groups(pm)
  passes.convert.add_scf_to_cf(pm)
  passes.gluon.add_inliner(pm)
  nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability, get_ptx_version_from_options(
      options, backend.target.arch))
  pm.run(module, "shared_memory")
  return module.get_int_attr("ttg.shared")


@contextlib.contextmanager
def device_capability(capability: int):
  """The lightning op's heuristics see a device of this compute capability (its blocks follow the device)."""
  original = heuristics.compute_capability
  heuristics.compute_capability = lambda device: divmod(capability, 10)
  try:
    yield
  finally:
    heuristics.compute_capability = original


def lightning_kernels(dtype, dim: int, variant: str, case: str, capability: int) -> list[dict]:
  """`lowered_kernels` of `lightning_attention`'s forward and gradients (q, k, v, the decay, the initial state)."""
  b, t, h, decay_kind = LIGHTNING_CASES[case]
  q = jnp.zeros((b, t, h, dim), dtype)
  decay = jnp.full((h,) if decay_kind == "head" else (b, t, h), 0.1)
  state = jnp.zeros((b, h, dim, dim), jnp.float32)
  ids = None if decay_kind == "head" else jnp.zeros((b, t), jnp.int32)

  def loss(q, k, v, decay, state):
    o, final = lj.lightning_attention(q, k, v, decay, initial_state=state, return_final_state=True, segment_ids=ids,
                                      impl="pallas", interpret=False, variant=variant)
    return o.astype(jnp.float32).sum() + final.sum()

  with device_capability(capability):
    return lowered_kernels(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), q, q, q, decay, state)


def lightning_configs(capability: int, dtype, dim: int) -> dict:
  """The blocks the heuristics pick on this target for each sweep job (`heuristics.resolve`, no tuning cache)."""
  return {job: dataclasses.asdict(heuristics.resolve(None, dim_k=dim, dim_v=dim, itemsize=jnp.dtype(dtype).itemsize,
                                                     compute_capability=divmod(capability, 10), job=job))
          for job in lightning_config.SWEEP_JOBS}


def measure_lightning(targets, log=print) -> list[dict]:
  """One row per target, dtype, D, variant and case: every kernel's blocks and shared bytes, and the largest."""
  rows = []
  for capability in targets:
    budget = lightning_config.shared_memory_budget(divmod(capability, 10))
    for dtype_name in LIGHTNING_DTYPES:
      for dim in LIGHTNING_DIMS:
        for variant in LIGHTNING_VARIANTS:
          for case in LIGHTNING_CASES:
            kernels = [dict(name=k["name"], num_warps=k["num_warps"], num_stages=k["num_stages"],
                            bytes=shared_bytes(k["ir"], capability, num_warps=k["num_warps"],
                                               num_stages=k["num_stages"]))
                       for k in lightning_kernels(DTYPES[dtype_name], dim, variant, case, capability)]
            largest = max(k["bytes"] for k in kernels)
            rows.append(dict(capability=capability, dtype=dtype_name, dim=dim, variant=variant, case=case,
                             configs=lightning_configs(capability, DTYPES[dtype_name], dim), kernels=kernels,
                             max_bytes=largest, budget=budget))
            log(f"sm{capability} {dtype_name:8s} D{dim:<4d} {variant:10s} {case:24s} max {largest} B of {budget}")
  return rows


def measure_delta(targets, forms, dtypes, dims, log=print) -> list[dict]:
  """Rows of each kernel's shared bytes and their largest, per target, form, dtype and padded D, for two configs:
  the H200's (role "h200": `pallas_triton.default_config` for sm90) and the target's own ("default")."""
  rows = []
  for form in forms:
    for dtype_name in dtypes:
      for dim in dims:
        def choose(capability, form=form, dtype_name=dtype_name, dim=dim):
          return pallas_triton.default_config(per_channel_gate=FORMS[form] == 4, dtype=DTYPES[dtype_name],
                                              dim_k=dim, compute_capability=capability)

        h200, irs = choose((9, 0)), {}
        for capability in targets:
          own = choose(divmod(capability, 10))
          budget = lightning_config.shared_memory_budget(divmod(capability, 10))
          for role, config in ((("h200", h200), ("default", own)) if own != h200 else (("h200,default", own),)):
            if config not in irs:
              irs[config] = delta_kernels(form, DTYPES[dtype_name], dim, config)
            kernels = {name: shared_bytes(k["ir"], capability, num_warps=k["num_warps"], num_stages=k["num_stages"])
                       for name, k in irs[config].items()}
            rows.append(dict(capability=capability, form=form, dtype=dtype_name, dim_k=dim, role=role,
                             config=dataclasses.asdict(config), kernels=kernels, max_bytes=max(kernels.values()),
                             budget=budget))
            log(f"sm{capability} {form:15s} {dtype_name:8s} D{dim:<4d} {role:12s} {dataclasses.asdict(config)} "
                f"max {max(kernels.values())} B of {budget}")
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--op", choices=("delta", "lightning"), default="delta")
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--targets", default=",".join(map(str, TARGETS)))
  parser.add_argument("--forms", default=",".join(FORMS))
  parser.add_argument("--dtypes", default=",".join(DTYPES))
  parser.add_argument("--dims", default=",".join(map(str, DIMS)))
  args = parser.parse_args(argv)
  import triton  # noqa: PLC0415  (the measuring compiler; not a dependency of the package)

  start = time.time()
  targets = [int(x) for x in args.targets.split(",")]
  rows = (measure_delta(targets, args.forms.split(","), args.dtypes.split(","), [int(x) for x in args.dims.split(",")])
          if args.op == "delta" else measure_lightning(targets))
  metadata = dict(
      date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
      command="python -m benchmarks.shared_memory " + " ".join(argv if argv is not None else sys.argv[1:]),
      jax=jax.__version__, triton=triton.__version__, python=platform.python_version(),
      seconds=round(time.time() - start),
      budgets={str(cc[0] * 10 + cc[1]): b for cc, b in lightning_config.SHARED_MEMORY_BUDGET.items()},
      **(dict(tokens=DELTA_TOKENS) if args.op == "delta" else {}),
      note=("Triton's shared-memory allocation per kernel (forward and backward, with segment starts and states) "
            + ("for the H200's config and each target's default_config." if args.op == "delta" else
               "for the blocks the lightning op's heuristics pick on each target.")))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(metadata=metadata, rows=rows), f, indent=1)
  print(f"wrote {args.out}: {len(rows)} rows in {metadata['seconds']} s")


if __name__ == "__main__":
  main()
