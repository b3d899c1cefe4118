"""Shared memory of the delta kernels on every NVIDIA target, measured by Triton's own allocator, without a GPU.

A Triton kernel that asks for more shared memory than the device allows per
block fails to compile (RESOURCE_EXHAUSTED). Which configs fit depends on the
target (sm90 lays dot operands out for wgmma, sm80-class targets for mma), so
this script measures every kernel of `delta_attention`'s Pallas path, forward
and backward, for each target, padded head dim, dtype and form, in the H200's
config and in the target's own `default_config`: JAX lowers the kernels for
CUDA on this machine (no GPU needed), and Triton (the `triton` package, written
against 3.6) runs its passes on that IR up to the shared-memory allocation. On
an H200 this reproduced the one overflow seen there (the float32 D = 256
reverse sweep with 64 value columns: 242,820 bytes here, 242,688 reported by
the device). The allocation does not depend on T (the same at 64 and 4096
tokens), so 64 stands for every length.

    python -m benchmarks.shared_memory --out benchmarks/tuning/delta-shared-memory.json

`pallas_triton.default_config` must pick, for every row, a config whose
kernels all fit; `tests/test_delta_ops.py` checks it against the committed file.
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

from lightning_jax.ops.delta_attention import pallas_triton
from lightning_jax.ops.lightning_attention import config as lightning_config

# Targets by compute capability: sm80 (A100), sm86 (RTX 30, A10), sm89 (RTX 40, L4), sm90 (H100/H200), sm100
# (B200), sm120 (RTX 50).
TARGETS = (80, 86, 89, 90, 100, 120)
FORMS = {"deltanet": None, "gated_deltanet": 3, "kda": 4}  # the rates' ndim
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
DIMS = (16, 32, 64, 128, 256)  # every padded D (the kernels hold all of D); E is 256, past every block_e


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


def kernel_irs(form: str, dtype, dim: int, config: pallas_triton.DeltaConfig) -> dict[str, str]:
  """{"forward/<kernel>" or "backward/<kernel>": Triton IR} with segment starts and states (every operand)."""
  b, t, h, e = 1, 64, 1, 256
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
  irs = {}
  for name, fn in passes.items():
    with captured_triton_ir() as found:
      jax.jit(fn).trace(q, v, beta, decay, state, starts).lower(lowering_platforms=("cuda",))
    irs.update({f"{name}/{kernel}": text for kernel, text in found})
  return irs


def shared_bytes(ir_text: str, capability: int, *, num_warps: int, num_stages: int) -> int:
  """Triton's shared-memory allocation for the kernel on sm<capability> (its passes to the allocation only)."""
  from triton._C.libtriton import ir, nvidia, passes  # noqa: PLC0415
  from triton.backends.compiler import GPUTarget  # noqa: PLC0415
  from triton.backends.nvidia.compiler import CUDABackend, get_ptx_version_from_options  # noqa: PLC0415
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
  stages = {}
  backend.add_stages(stages, options, Language.TRITON)
  metadata = {}
  module = stages["ttgir"](stages["ttir"](module, metadata), metadata)
  pm = ir.pass_manager(module.context)  # the start of make_llir, through the allocation
  passes.ttgpuir.add_combine_tensor_select_and_if(pm)
  passes.ttgpuir.add_allocate_warp_groups(pm)
  passes.convert.add_scf_to_cf(pm)
  passes.gluon.add_inliner(pm)
  nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability, get_ptx_version_from_options(
      options, backend.target.arch))
  pm.run(module, "shared_memory")
  return module.get_int_attr("ttg.shared")


def measure(targets, forms, dtypes, dims, log=print) -> list[dict]:
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
              irs[config] = kernel_irs(form, DTYPES[dtype_name], dim, config)
            kernels = {name: shared_bytes(text, capability, num_warps=config.num_warps,
                                          num_stages=config.num_stages) for name, text in irs[config].items()}
            rows.append(dict(capability=capability, form=form, dtype=dtype_name, dim_k=dim, role=role,
                             config=dataclasses.asdict(config), kernels=kernels, max_bytes=max(kernels.values()),
                             budget=budget))
            log(f"sm{capability} {form:15s} {dtype_name:8s} D{dim:<4d} {role:12s} {dataclasses.asdict(config)} "
                f"max {max(kernels.values())} B of {budget}")
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--targets", default=",".join(map(str, TARGETS)))
  parser.add_argument("--forms", default=",".join(FORMS))
  parser.add_argument("--dtypes", default=",".join(DTYPES))
  parser.add_argument("--dims", default=",".join(map(str, DIMS)))
  args = parser.parse_args(argv)
  import triton  # noqa: PLC0415  (the measuring compiler; not a dependency of the package)

  start = time.time()
  rows = measure([int(x) for x in args.targets.split(",")], args.forms.split(","), args.dtypes.split(","),
                 [int(x) for x in args.dims.split(",")])
  metadata = dict(
      date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
      command="python -m benchmarks.shared_memory " + " ".join(argv if argv is not None else sys.argv[1:]),
      jax=jax.__version__, triton=triton.__version__, python=platform.python_version(), seconds=round(time.time() - start),
      budgets={str(cc[0] * 10 + cc[1]): b for cc, b in lightning_config.SHARED_MEMORY_BUDGET.items()},
      note="Triton's shared-memory allocation per kernel (forward and backward, with segment starts and states) "
           "for the H200's config and each target's default_config.")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(metadata=metadata, rows=rows), f, indent=1)
  print(f"wrote {args.out}: {len(rows)} rows in {metadata['seconds']} s")


if __name__ == "__main__":
  main()
