"""The package's structure: no import cycle, kernel policy in `heuristics`, the arrays' device."""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp

import lightning_jax as lj
from lightning_jax.ops.lightning_attention import heuristics

PACKAGE = pathlib.Path(lj.__file__).parent


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
  """module -> the package's modules it imports (at any depth of its code), parent packages left out."""
  modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  graph = {}
  for name, path in modules.items():
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # `from pkg import sub` imports the module pkg.sub where there is one.
        targets.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                       for alias in node.names)
    graph[name] = {t for t in targets if t in modules and not name.startswith(t + ".") and t != name}
  return graph


def test_import_graph_has_no_cycle():
  graph = _import_graph()
  assert "lightning_jax.ops.lightning_attention.heuristics" in graph
  visiting, done = [], set()

  def visit(module):
    if module in done:
      return
    assert module not in visiting, "import cycle: " + " -> ".join(visiting[visiting.index(module):] + [module])
    visiting.append(module)
    for target in sorted(graph[module]):
      visit(target)
    visiting.pop()
    done.add(module)

  for module in sorted(graph):
    visit(module)


def test_config_imports_nothing_of_the_package():
  assert _import_graph()["lightning_jax.ops.lightning_attention.config"] == set()


def test_backend_imports_stay_in_their_modules():
  """Triton's imports live in ops/triton_lowering.py, Mosaic GPU's in pallas_mosaic_gpu.py."""
  for path in PACKAGE.rglob("*.py"):
    text = path.read_text()
    assert ("pallas import triton" in text) == (path.relative_to(PACKAGE).as_posix() == "ops/triton_lowering.py"), path
    assert ("pallas import mosaic_gpu" in text) == (path.name == "pallas_mosaic_gpu.py"), path


def test_device_of_concrete_and_traced_arrays():
  x = jnp.ones(3)
  assert heuristics.device_of(None, x) == x.devices().pop()
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    assert jax.jit(lambda y: jnp.asarray(heuristics.device_of(y) == cpu))(x)
  assert heuristics.compute_capability(cpu) is None and not heuristics.supported_gpu(None)


def test_the_kernels_run_on_the_device_of_q():
  """On a second device (of two host devices), the op runs and its output stays there."""
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp
      import lightning_jax as lj
      from lightning_jax.ops.lightning_attention import heuristics
      second = jax.devices()[1]
      q = jax.device_put(jnp.ones((1, 70, 2, 16)), second)
      assert heuristics.device_of(q) == second
      for impl in ("pallas", "xla"):
        o = lj.lightning_attention(q, q, q, jnp.array([0.1, 0.2]), impl=impl)
        assert o.devices() == {second}, (impl, o.devices())
      print("ok")
  """)
  # The suite's XLA flags (conftest) but two host devices (the later flag wins), and XLA's optimisations off: the
  # eager ops' compiles are most of its time.
  env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  env.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
