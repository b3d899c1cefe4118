"""The torch side of the peers: inputs, modes, timing and memory of a torch attention function.

Imported only by the peer worker modules, in their own subprocess; torch is
imported when a backend is made (as JAX is, through the timing module), after checking that the packages exist.

Timing uses `lightning_jax.tune.timing.measure` with `torch.cuda.synchronize` as the
sync, like the JAX workers with `block_until_ready`. Triton kernels compile and
autotune in their first call, a warm-up call. Modes:

* fwd:    o = f(q, k, v) under `torch.no_grad()`;
* bwd:    `torch.autograd.grad(o, (q, k, v), do, retain_graph=True)` on an `o`
          computed before the timed region;
* fwdbwd: o = f(q, k, v) and its gradients.

The delta forms' q and k are L2-normalised over D (the delta rule needs |k| <= 1).
An exception whose message holds one of the peer's `refusals` (its own checks
of the case, e.g. fla's Triton-version check in a backward) is the peer
refusing the case: it is reported skipped, with the message.

Memory: after `torch.cuda.reset_peak_memory_stats()`, one call;
`max_memory_allocated() - memory_allocated() before the call` is what the call
allocated on top of what was live (outputs, temporaries). Its footprint adds
the bytes of the call's explicit inputs (q, k, v, and do for the backward
modes), to compare with XLA's argument + output + temp bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform

from benchmarks import cases, worker

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _dims(job: dict, layout: str, last: str) -> tuple:
  b, t, h, d, e = cases.job_shape(job)
  dim = d if last == "k" else e
  return (b, t, h, dim) if layout == "bthd" else (b, h, t, dim)


@dataclasses.dataclass
class TorchCase:
  """An open job: the attention function and the input sets."""
  settings: dict
  fn: object  # f(q, k, v) -> o
  inputs: list  # (q, k, v, do) sets


class TorchBackend(worker.Backend):
  """Worker backend for `make_attention(job, torch) -> f(q, k, v) -> o` on inputs in `layout`."""

  def __init__(self, make_attention, layout: str, packages: list[str], refusals: tuple[str, ...] = ()):
    import torch  # noqa: PLC0415 -- only in peer subprocesses

    # Imported here, not at the top: it imports JAX, which a worker whose peer is missing skips (seconds).
    from lightning_jax.tune import timing  # noqa: PLC0415

    self.torch, self.timing = torch, timing
    self.make_attention = make_attention
    self.layout = layout
    self.packages = packages
    self.refusals = refusals

  def info(self) -> dict:
    torch = self.torch
    props = torch.cuda.get_device_properties(0)
    return dict(platform="gpu", device_kind=props.name, compute_capability=f"{props.major}.{props.minor}",
                python=platform.python_version(),
                versions={"torch": torch.__version__, **worker.package_versions(["triton", *self.packages])})

  def _inputs(self, job: dict, n_sets: int) -> list:
    torch = self.torch
    dtype = getattr(torch, TORCH_DTYPES[job["dtype"]])
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = (_dims(job, self.layout, "k"),) * 2 + (_dims(job, self.layout, "v"),) * 2
    normalize = cases.is_delta(job)

    def make(i, shape):
      x = torch.randn(shape, dtype=dtype, device="cuda", generator=gen)
      if normalize and i < 2:
        x = torch.nn.functional.normalize(x.float(), dim=-1).to(dtype)
      return x.requires_grad_(i < 3)

    return [tuple(make(i, s) for i, s in enumerate(shapes)) for _ in range(n_sets)]

  @contextlib.contextmanager
  def open_job(self, job: dict, settings: dict):
    n_sets = self.timing.rotation_sets(cases.input_set_bytes(job), settings["rotate_bytes"])
    try:
      yield TorchCase(settings, self.make_attention(job, self.torch), self._inputs(job, n_sets))
    finally:
      self.torch.cuda.empty_cache()

  def _call(self, case: TorchCase, mode: str):
    """call(i) for `mode` on input set i (the bwd graph is built here, before timing)."""
    torch, fn = self.torch, case.fn
    if mode == "fwd":
      def fwd(i):
        with torch.no_grad():
          return fn(*case.inputs[i][:3])
      return fwd
    if mode == "fwdbwd":
      def fwdbwd(i):
        q, k, v, do = case.inputs[i]
        o = fn(q, k, v)
        return o, torch.autograd.grad(o, (q, k, v), do)
      return fwdbwd
    outputs = [fn(*x[:3]) for x in case.inputs]
    return lambda i: torch.autograd.grad(outputs[i], case.inputs[i][:3], case.inputs[i][3], retain_graph=True)

  def _memory(self, call, case: TorchCase, mode: str) -> dict:
    torch = self.torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = call(0)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    del out
    explicit = case.inputs[0][:3] if mode == "fwd" else case.inputs[0]
    argument = sum(x.numel() * x.element_size() for x in explicit)
    return dict(argument_bytes=argument, torch_extra_bytes=extra, footprint_bytes=argument + extra)

  def measure(self, ctx: TorchCase, mode: str) -> dict:
    try:
      call = self._call(ctx, mode)
      s = ctx.settings
      stats = self.timing.measure(call, lambda _: self.torch.cuda.synchronize(), n_sets=len(ctx.inputs),
                             warmup=s["warmup"], max_iters=s["iters"], max_seconds=s["case_seconds"],
                             min_sample_seconds=s["sample_seconds"], warmup_seconds=s["warmup_seconds"])
    except Exception as exc:
      message = f"{type(exc).__name__}: {exc}"
      if any(fragment in message for fragment in self.refusals):
        raise worker.Refused(message) from exc
      raise
    return dict(**stats, memory=self._memory(call, ctx, mode))


def make_backend(make_attention, layout: str, modules: dict, refusals: tuple[str, ...] = ()) -> worker.Backend:
  """A TorchBackend, or `worker.Unavailable` when a package or the CUDA device is missing.

  `modules` maps the peer's modules (imported here) to their pip names; `refusals` are fragments of the messages
  of the peer's refusals.
  """
  reason = worker.missing_module({"torch": "torch", "triton": "triton", **modules})
  if reason is None:
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
      reason = "torch sees no CUDA device"
  if reason is not None:
    return worker.Unavailable(reason)
  return TorchBackend(make_attention, layout, list(modules.values()), refusals)
