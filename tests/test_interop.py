"""lightning_jax.interop: transformers' MiniMax, Kimi Linear and Qwen3-Next linear attention layers as ours.

The parity tests build transformers' own modules (`MiniMaxLightningAttention`,
`KimiLinearDeltaAttention`, `Qwen3NextGatedDeltaNet`, on its PyTorch paths) from small random configs and
compare float32 outputs, forward and cached decoding, and the state dict's round
trip; they need the `hf` extra (torch, transformers) and skip without it. The
rest (configs as dicts, the checks of the state dict, the layers' new options,
no torch import for numpy weights) runs without.

Measured on a CPU (max |ours - theirs| / max |theirs|): MiniMax <= 4.5e-7
forward and decoding; KDA <= 1e-6 (transformers' own float32 output is 5e-7 from
its float64 one); Gated DeltaNet <= 1.6e-6. With gates 100x stronger than the model's initialisation both
are ~1e-5 from transformers' float64: the block's float32 rounding, not a
difference of computation.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lightning_jax as lj
from lightning_jax import interop
from lightning_jax import linen as lj_linen
from lightning_jax import nnx as lj_nnx
from lightning_jax.interop import kimi_linear, minimax, qwen3_next

# Compiles dominate the run time; the tolerances are far above the ulps this moves.
pytestmark = pytest.mark.usefixtures("unoptimized_compiles")

MINIMAX_TOL = 1e-5
KDA_TOL = 1e-5
B, HIDDEN = 2, 64
MINIMAX_CASES = [  # (heads, head dim, layer_idx, layers); block_size 16 and T = 37: a partial last block
    pytest.param(4, 16, 0, 4, id="first-layer"),
    pytest.param(3, 32, 2, 3, id="last-layer-3-heads"),
]
KDA_CASES = [  # (heads, head dim, conv size, layer_idx); T = 70: past one 64-token chunk
    pytest.param(2, 32, 4, 0, id="h2-d32"),
    pytest.param(4, 16, 3, 2, id="h4-d16-conv3"),
]

GDN_CASES = [  # (q/k heads, value heads, D, E, conv size, layer_idx); T = 70
    pytest.param(2, 4, 16, 8, 4, 0, id="h2-hv4-d16-e8"),
    pytest.param(2, 2, 32, 32, 3, 2, id="h2-d32-conv3"),
]


def _rel_err(ours, theirs) -> float:
  ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
  return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def _minimax_dict(heads=4, head_dim=16, layers=4, **extra):
  """A small MiniMax config (as its dict), every layer a lightning-attention one unless `extra` says."""
  return {**dict(hidden_size=HIDDEN, num_attention_heads=heads, head_dim=head_dim, num_hidden_layers=layers,
                 block_size=16, layer_types=["linear_attention"] * layers), **extra}


def _kimi_dict(heads=2, head_dim=32, conv=4, layers=3, **extra):
  """A small Kimi Linear config (as its dict), every layer a KDA one unless `extra` says."""
  return {**dict(hidden_size=HIDDEN, linear_num_heads=heads, linear_head_dim=head_dim, linear_conv_kernel_dim=conv,
                 num_hidden_layers=layers, layer_types=["linear_attention"] * layers, num_attention_heads=2,
                 num_key_value_heads=2), **extra}


def _qwen_dict(heads=2, v_heads=4, head_dim=16, value_dim=8, conv=4, layers=3, **extra):
  """A small Qwen3-Next config (as its dict), every layer a Gated DeltaNet one unless `extra` says."""
  return {**dict(hidden_size=HIDDEN, linear_num_key_heads=heads, linear_num_value_heads=v_heads,
                 linear_key_head_dim=head_dim, linear_value_head_dim=value_dim, linear_conv_kernel_dim=conv,
                 num_hidden_layers=layers, layer_types=["linear_attention"] * layers, num_attention_heads=2,
                 num_key_value_heads=2), **extra}


def _numpy_state_dict(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return {key: rng.standard_normal(shape).astype(np.float32) for key, shape in shapes.items()}


def _minimax_numpy_state_dict(**config):
  shapes, _ = minimax._state_dict_shapes(minimax.read_config(_minimax_dict(**config)))
  return _numpy_state_dict(shapes)


def _kimi_numpy_state_dict(**config):
  return _numpy_state_dict(kimi_linear._state_dict_shapes(kimi_linear.read_config(_kimi_dict(**config))))


def _qwen_numpy_state_dict(**config):
  return _numpy_state_dict(qwen3_next._state_dict_shapes(qwen3_next.read_config(_qwen_dict(**config))))


# --- transformers' layers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
  """torch and transformers' two modules (skips without the hf extra)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.models.kimi_linear import modeling_kimi_linear
  from transformers.models.minimax import modeling_minimax
  from transformers.models.qwen3_next import modeling_qwen3_next
  return dict(torch=torch, transformers=transformers, minimax=modeling_minimax, kimi=modeling_kimi_linear,
              qwen=modeling_qwen3_next)


def _hf_minimax(hf, config, layer_idx, seed):
  torch = hf["torch"]
  torch.manual_seed(seed)
  module = hf["minimax"].MiniMaxLightningAttention(config, layer_idx)
  with torch.no_grad():  # a random norm scale too: a wrong [H, D] order of it shows
    module.norm.weight.normal_(1.0, 0.3)
  return module


def _hf_kimi(hf, config, layer_idx, seed):
  torch = hf["torch"]
  torch.manual_seed(seed)
  module = hf["kimi"].KimiLinearDeltaAttention(config, layer_idx)
  gate = module.forget_gate
  with torch.no_grad():  # A_log and dt_bias are left empty by the module: the model's initialisation
    gate.A_log.copy_(torch.empty_like(gate.A_log).uniform_(1.0, 16.0).log())
    dt = torch.empty_like(gate.dt_bias).uniform_(np.log(1e-3), np.log(1e-1)).exp()
    gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    module.o_norm.weight.normal_(1.0, 0.3)
  return module


def _hf_qwen(hf, config, layer_idx, seed):
  torch = hf["torch"]
  torch.manual_seed(seed)
  module = hf["qwen"].Qwen3NextGatedDeltaNet(config, layer_idx)
  with torch.no_grad():  # the module leaves dt_bias and the norm's scale at ones
    module.dt_bias.normal_(0.0, 1.0)
    module.norm.weight.normal_(1.0, 0.3)
  return module


def _pieces(length, prompt):
  """Cached decoding's calls: the prompt, four tokens at once, then one token at a time."""
  bounds = [0, prompt, *range(prompt + 4, length + 1)]
  return [slice(start, end) for start, end in zip(bounds, bounds[1:])]


def _hf_decode(x, prompt, call):
  """transformers' cached decoding (call: one forward with the cache)."""
  return np.concatenate([call(x[:, piece]).detach().numpy() for piece in _pieces(x.shape[1], prompt)], axis=1)


def _our_decode(layer, x, prompt):
  layer.init_cache(batch_size=x.shape[0])
  return np.concatenate([layer(x[:, piece], decode=True) for piece in _pieces(x.shape[1], prompt)], axis=1)


@pytest.mark.parametrize("heads,head_dim,layer_idx,layers", MINIMAX_CASES)
def test_minimax_matches_transformers(hf, heads, head_dim, layer_idx, layers):
  torch = hf["torch"]
  config = hf["transformers"].MiniMaxConfig(**_minimax_dict(heads, head_dim, layers))
  module = _hf_minimax(hf, config, layer_idx, seed=layer_idx)
  x = torch.randn(B, 37, HIDDEN)
  layer = interop.minimax_lightning_attention(config, layer_idx, module.state_dict())
  np.testing.assert_allclose(layer.spec.decay, module.slope_rate.reshape(-1).numpy(), rtol=1.2e-7, atol=0)
  with torch.no_grad():
    theirs = module(x, position_embeddings=None, attention_mask=None)[0].numpy()
    cache = hf["minimax"].MiniMaxCache()
    theirs_decoded = _hf_decode(x, 25, lambda piece: module(piece, None, None, past_key_values=cache)[0])
  xj = jnp.asarray(x.numpy())
  assert _rel_err(layer(xj), theirs) < MINIMAX_TOL
  assert _rel_err(_our_decode(layer, xj, 25), theirs_decoded) < MINIMAX_TOL

  # Back: the same weights in transformers' layout, which a fresh module loads and runs alike.
  state_dict = interop.to_hf_state_dict(layer, as_torch=True)
  for key, value in state_dict.items():
    assert torch.equal(value, module.state_dict()[key]), key
  fresh = hf["minimax"].MiniMaxLightningAttention(config, layer_idx)
  missing, unexpected = fresh.load_state_dict(state_dict, strict=False)
  assert sorted(missing) == sorted(minimax._state_dict_shapes(minimax.read_config(config))[1]) and not unexpected
  with torch.no_grad():
    np.testing.assert_array_equal(fresh(x, None, None)[0].numpy(), theirs)


def _check_delta_layer(hf, config, module, convert, prefix):
  """A delta layer converted from transformers' `module` (convert: state_dict -> ours) equals it, forward and
  decoding with the model's cache, and converts back to its state dict."""
  torch = hf["torch"]
  x = torch.randn(B, 70, HIDDEN)
  layer = convert(module.state_dict())
  with torch.no_grad():
    theirs = module(x).numpy()
    cache = hf["transformers"].DynamicCache(config=config)
    # The cache positionally: transformers 5.24 renamed the argument (cache_params -> cache).
    theirs_decoded = _hf_decode(x[:, :58], 50, lambda piece: module(piece, cache))
  xj = jnp.asarray(x.numpy())
  assert _rel_err(layer(xj), theirs) < KDA_TOL
  assert _rel_err(_our_decode(layer, xj[:, :58], 50), theirs_decoded) < KDA_TOL

  state_dict = interop.to_hf_state_dict(layer, prefix=prefix, as_torch=True)
  assert sorted(state_dict) == sorted(prefix + key for key in module.state_dict())
  for key, value in module.state_dict().items():
    assert torch.equal(state_dict[prefix + key], value), key


@pytest.mark.parametrize("heads,head_dim,conv,layer_idx", KDA_CASES)
def test_kda_matches_transformers(hf, heads, head_dim, conv, layer_idx):
  config = hf["transformers"].KimiLinearConfig(**_kimi_dict(heads, head_dim, conv))
  module = _hf_kimi(hf, config, layer_idx, seed=layer_idx)
  _check_delta_layer(hf, config, module, lambda weights: interop.kimi_delta_attention(config, layer_idx, weights),
                     "model.layers.0.self_attn.")


@pytest.mark.parametrize("heads,v_heads,head_dim,value_dim,conv,layer_idx", GDN_CASES)
def test_gated_deltanet_matches_transformers(hf, heads, v_heads, head_dim, value_dim, conv, layer_idx):
  config = hf["transformers"].Qwen3NextConfig(**_qwen_dict(heads, v_heads, head_dim, value_dim, conv))
  module = _hf_qwen(hf, config, layer_idx, seed=layer_idx)
  _check_delta_layer(hf, config, module, lambda weights: interop.qwen3_next_gated_delta_net(config, layer_idx, weights),
                     "model.layers.0.linear_attn.")


def test_minimax_slope_rates_equal_transformers_for_every_layer(hf):
  for heads in (1, 3, 4, 6, 8):
    config = hf["transformers"].MiniMaxConfig(**_minimax_dict(heads, 8, layers=5))
    for layer_idx in range(5):
      module = hf["minimax"].MiniMaxLightningAttention(config, layer_idx)
      # Equal to the float32 ulp (torch's pow rounds in its own way).
      np.testing.assert_allclose(minimax.slope_rates(heads, layer_idx, 5), module.slope_rate.reshape(-1).numpy(),
                                 rtol=1.2e-7, atol=0)


def test_configs_read_alike_as_objects_and_dicts(hf):
  minimax_config = hf["transformers"].MiniMaxConfig(**_minimax_dict(3, 16, layers=6))
  assert minimax.read_config(minimax_config) == minimax.read_config(minimax_config.to_dict())
  # Fields a dict leaves out take transformers' defaults (here layer_types and head_dim).
  partial = dict(hidden_size=96, num_attention_heads=3, num_hidden_layers=6)
  assert minimax.read_config(partial) == minimax.read_config(hf["transformers"].MiniMaxConfig(**partial))
  # A Kimi checkpoint's config.json keeps the KDA sizes and layer kinds in linear_attn_config.
  checkpoint = dict(hidden_size=HIDDEN, num_hidden_layers=4, rms_norm_eps=1e-6, linear_attn_config=dict(
      num_heads=2, head_dim=16, short_conv_kernel_size=3, kda_layers=[1, 2, 3], full_attn_layers=[4]))
  sizes = kimi_linear.read_config(checkpoint)
  assert sizes == kimi_linear.read_config(hf["transformers"].KimiLinearConfig(**checkpoint))
  assert (sizes.num_heads, sizes.head_dim, sizes.conv_size, sizes.norm_eps) == (2, 16, 3, 1e-6)
  assert sizes.layer_types == ("linear_attention",) * 3 + ("full_attention",)
  qwen_config = hf["transformers"].Qwen3NextConfig(**_qwen_dict(layers=6, layer_types=None))
  assert qwen3_next.read_config(qwen_config) == qwen3_next.read_config(qwen_config.to_dict())
  partial = dict(hidden_size=96, linear_num_key_heads=3, linear_num_value_heads=6, num_hidden_layers=6)
  assert qwen3_next.read_config(partial) == qwen3_next.read_config(hf["transformers"].Qwen3NextConfig(**partial))


def test_kimi_checkpoint_names_load_the_same_layer():
  """The original checkpoints' names (separate convolutions, the gate's weights outside forget_gate)."""
  weights = _kimi_numpy_state_dict()
  width = 2 * 32  # _kimi_dict's heads * head_dim
  checkpoint = {key.removeprefix("forget_gate."): value for key, value in weights.items()}
  conv = checkpoint.pop("conv1d.weight")
  for i, name in enumerate("qkv"):
    checkpoint[f"{name}_conv1d.weight"] = conv[i * width:(i + 1) * width]
  prefix = "model.layers.0.self_attn."
  ours = interop.kimi_delta_attention(_kimi_dict(), 0, weights)
  from_checkpoint = interop.kimi_delta_attention(_kimi_dict(), 0, {prefix + k: v for k, v in checkpoint.items()},
                                                 prefix=prefix)
  same = jax.tree.map(np.array_equal, nnx.to_pure_dict(nnx.state(ours, nnx.Param)),
                      nnx.to_pure_dict(nnx.state(from_checkpoint, nnx.Param)))
  assert all(jax.tree.leaves(same))


# --- without torch: checks, round trips of numpy weights, the layers' options ----------------------


def test_round_trip_of_numpy_state_dicts():
  for weights, make in (
      (_minimax_numpy_state_dict(), lambda w: interop.minimax_lightning_attention(_minimax_dict(), 1, w)),
      (_kimi_numpy_state_dict(), lambda w: interop.kimi_delta_attention(_kimi_dict(), 0, w)),
      (_qwen_numpy_state_dict(), lambda w: interop.qwen3_next_gated_delta_net(_qwen_dict(), 0, w))):
    back = interop.to_hf_state_dict(make(weights))
    assert sorted(back) == sorted(weights)
    for key in weights:
      np.testing.assert_array_equal(back[key], weights[key], err_msg=key)


def test_param_dtype_converts_the_weights():
  layer = interop.minimax_lightning_attention(_minimax_dict(), 1, _minimax_numpy_state_dict(),
                                              param_dtype=jnp.bfloat16, impl="xla")
  assert {p.dtype for p in jax.tree.leaves(nnx.state(layer, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
  assert layer.spec.impl == "xla"
  assert interop.to_hf_state_dict(layer)["qkv_proj.weight"].dtype == jnp.bfloat16


def test_numpy_weights_do_not_import_torch():
  code = textwrap.dedent("""
      import sys
      import numpy as np
      from lightning_jax import interop
      weights = {"qkv_proj.weight": np.zeros((96, 32), np.float32), "norm.weight": np.ones(32, np.float32),
                 "output_gate.weight": np.zeros((32, 32), np.float32),
                 "out_proj.weight": np.zeros((32, 32), np.float32)}
      config = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, layer_types=["linear_attention"] * 2)
      interop.to_hf_state_dict(interop.minimax_lightning_attention(config, 0, weights))
      print("torch" in sys.modules)
  """)
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr[-3000:]


@pytest.mark.parametrize("change,error,match", [
    (lambda w: w.pop("norm.weight"), ValueError, "lacks 'norm.weight'"),
    (lambda w: w.update({"out_proj.weight": np.zeros((64, 63), np.float32)}), ValueError,
     r"'out_proj.weight'\] has shape \[64, 63\], expected \[64, 64\]"),
    (lambda w: w.update({"q_proj.weight": np.zeros((64, 64), np.float32)}), ValueError, "unexpected key.*'q_proj"),
    (lambda w: w.update({"norm.weight": "ones"}), TypeError, r"state_dict\['norm.weight'\] must be"),
    (lambda w: w.update({"norm.weight": np.ones(64, np.int32)}), TypeError, "floating point"),
    (lambda w: w.update({"slope_rate": np.ones((4, 1, 1), np.float32)}), ValueError, "slope_rate.*layer_idx=1"),
])
def test_minimax_state_dict_errors_name_the_key(change, error, match):
  weights = _minimax_numpy_state_dict()
  change(weights)
  with pytest.raises(error, match=match):
    interop.minimax_lightning_attention(_minimax_dict(), 1, weights)


def test_kimi_state_dict_errors_name_the_key():
  weights = _kimi_numpy_state_dict()
  weights["forget_gate.A_log"] = weights["forget_gate.A_log"].reshape(2)
  with pytest.raises(ValueError, match=r"'p.forget_gate.A_log'\] has shape \[2\], expected \[1, 1, 2, 1\]"):
    interop.kimi_delta_attention(_kimi_dict(), 0, {"p." + k: v for k, v in weights.items()}, prefix="p.")


@pytest.mark.parametrize("call,error,match", [
    (lambda: interop.minimax_lightning_attention(_minimax_dict(layer_types=None), 0, {}), ValueError,
     "'full_attention' layer"),
    (lambda: interop.minimax_lightning_attention(_minimax_dict(), 4, {}), ValueError, "layer_idx"),
    (lambda: interop.minimax_lightning_attention(_minimax_dict(hidden_act="gelu"), 0, {}), ValueError, "hidden_act"),
    (lambda: interop.minimax_lightning_attention(_minimax_dict(), 0, _minimax_numpy_state_dict(), scale=2.0),
     TypeError, "'scale'"),
    (lambda: interop.minimax_lightning_attention([1], 0, {}), TypeError, "hf_config"),
    (lambda: interop.minimax_lightning_attention(_minimax_dict(), 0, [1]), TypeError, "state_dict"),
    (lambda: interop.kimi_delta_attention(_kimi_dict(linear_head_dim=0), 0, {}), ValueError, "linear_head_dim"),
    (lambda: interop.kimi_delta_attention(_kimi_dict(layers=5, layer_types=None), 4, {}), ValueError,
     "'full_attention' layer"),
    (lambda: interop.to_hf_state_dict(lj_nnx.LightningAttention(2, 8, rngs=nnx.Rngs(0))), ValueError,
     "feature_map == value_feature_map.*scale=1.0.*use_bias=False"),
    (lambda: interop.to_hf_state_dict(lj_nnx.DeltaAttention(2, 8, gate=None, rngs=nnx.Rngs(0))), ValueError,
     "gate='kda'"),
    (lambda: interop.to_hf_state_dict(lj_nnx.DeltaAttention(2, 8, gate="scalar", rngs=nnx.Rngs(0))), ValueError,
     "Qwen3NextGatedDeltaNet.*full_rank_output_gate=True with output_gate_activation='silu'"),
    (lambda: interop.qwen3_next_gated_delta_net(_qwen_dict(v_heads=3), 0, {}), ValueError,
     r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads \(2\)"),
    (lambda: interop.qwen3_next_gated_delta_net(_qwen_dict(layers=4, layer_types=None), 3, {}), ValueError,
     "'full_attention' layer"),
    (lambda: interop.qwen3_next_gated_delta_net(_qwen_dict(), 0, {**_qwen_numpy_state_dict(), "A_log": np.ones(
        (1, 4), np.float32)}), ValueError, r"'A_log'\] has shape \[1, 4\], expected \[4\]"),
    (lambda: interop.to_hf_state_dict(nnx.Linear(2, 2, rngs=nnx.Rngs(0))), TypeError, "layer must be"),
])
def test_bad_arguments(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_value_feature_map_and_norm_eps():
  """LightningAttention's options for MiniMax: an activation on v and the norm's epsilon."""
  heads, dim = 2, 4
  layer = lj_nnx.LightningAttention(heads, 8, value_feature_map="silu", norm_eps=0.5, output_gate=False, decay=None,
                                    use_bias=False, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 8)), jnp.float32)
  proj = lambda name: jnp.einsum("btf,fhd->bthd", x, getattr(layer, name).kernel[...])
  o, _ = lj.lightning_attention_recurrent(jax.nn.silu(proj("query")), jax.nn.silu(proj("key")),
                                          jax.nn.silu(proj("value")), None, scale=dim ** -0.5)
  o = o / jnp.sqrt(jnp.mean(o * o, axis=(-2, -1), keepdims=True) + 0.5)
  expected = jnp.einsum("bthd,hdo->bto", o, layer.out.kernel[...])
  np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)
  linen_layer = lj_linen.LightningAttention(heads, 8, value_feature_map="silu", norm_eps=0.5, output_gate=False,
                                            decay=None, use_bias=False)
  params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
  np.testing.assert_allclose(linen_layer.apply({"params": params}, x), expected, rtol=1e-5, atol=1e-5)
  for kwargs, match in ((dict(value_feature_map="tanh"), "value_feature_map"), (dict(norm_eps=0), "norm_eps")):
    with pytest.raises(ValueError, match=match):
      lj_nnx.LightningAttention(heads, 8, **kwargs, rngs=nnx.Rngs(0))
