"""One Flax NNX decoder for Llama 3 / SmolLM2, Qwen2/2.5 and Qwen3.

Parameter paths mirror HF names (`layers/3/self_attn/q_proj/kernel` for
`model.layers.3.self_attn.q_proj.weight`, transposed), so the weight mapping tables in
`jaxspec.io.weights` stay one line per tensor. `fuse_projections` (opt-in, after loading) replaces
q/k/v and gate/up by one `qkv_proj` and one `gate_up_proj` each; `jaxspec.model.fp8.add_fp8_mlps`
(opt-in) gives the MLPs FP8 copies of their weights, which a pass called with `fp8_mlp=True` uses.

`Transformer.__call__(tokens, positions, cache, plan, backend)` runs T new tokens per sequence:
`positions` [B, T] are their RoPE positions (a chain passes cache.lengths + t; a tree would pass
prefix length + depth), their K/V go into cache slots cache.lengths + t, and it returns the final
hidden states, the cache with the new K/V written (lengths unchanged: the caller decides what to
keep) and the per-layer criticality scores the plan asked for. `logits(hidden)` applies the LM head;
callers pick the rows they need first, so a long prefill never materialises [B, T, vocab].

`Transformer.mesh` is the tensor-parallel mesh its parameters are sharded over (None: one device);
`jaxspec.model.sharding` says what is split how. With a mesh, q/k/v are constrained to whole heads
per device and the outputs of o_proj and down_proj to replicated (one all-reduce each).

With `cfg.nsa` every attention layer is Native Sparse Attention (`jaxspec.model.nsa`): it also
holds the gate projection `g_proj` (hidden -> 3 gates per query head, sigmoid) and the compression
weights `compress_k`, `compress_v` [Hkv, l, D, D], writes the compression blocks a chain call
completes into the cache's compressed K/V, and runs the plan as `attention.as_nsa(plan)`; the
third return value is then None. No trained NSA weights exist here: `init_random` only.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model import kv_cache as kvc
from jaxspec.model import nsa
from jaxspec.model import sharding
from jaxspec.model.attention import NSA, Plan, as_nsa, attend, rope_write, writes_in_kernel
from jaxspec.model.config import ModelConfig
from jaxspec.model.fp8 import has_fp8_mlps, mlp_forward
from jaxspec.model.rope import apply_rope, rope_tables
from jaxspec.model.sharding import HEADS, REPLICATED, constrain


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, *, param_dtype):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (self.weight[...].astype(jnp.float32) * xf).astype(x.dtype)


def _linear(cfg_in, cfg_out, bias, dtype, param_dtype, rngs):
  return nnx.Linear(cfg_in, cfg_out, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                    kernel_init=nnx.initializers.normal(0.02))


def _project(linear: nnx.Linear, x: jax.Array) -> jax.Array:
  """linear(x) for x [..., T, in]. On a GPU a single row runs as two: XLA's GPU compiler turns a
  one-row product of fewer than 10M weights into an elementwise product and a reduction instead
  of a GEMM (its DotStrengthReduction pass), and at some shapes keeps the two apart. A batch-1
  decode step (H200, 8K context) ran 15% faster with two rows at the 1.5B's shapes (so did a
  vegas round), 12.5% at Qwen3-0.6B's and 2.5% at SmolLM2-135M's, and 8% slower at the 0.5B's,
  whose fused reductions beat XLA's two-row GEMMs (RESULTS.md, thirty-ninth session). A two-row
  GEMM reads the weights once, as one row does. XLA:CPU keeps one row: its two-row bfloat16
  GEMMs are the slower (the README's quick start decoded 11.7 tokens/s with them, 15.4 without;
  fortieth session).
  """
  if math.prod(x.shape[:-1]) != 1 or jax.default_backend() == "cpu":
    return linear(x)
  return linear(jnp.concatenate([x, x], axis=-2))[..., :1, :]


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.cfg = cfg
    hd, h = cfg.head_dim, cfg.hidden_size
    self.q_proj = _linear(h, cfg.num_heads * hd, cfg.qkv_bias, dtype, param_dtype, rngs)
    self.k_proj = _linear(h, cfg.num_kv_heads * hd, cfg.qkv_bias, dtype, param_dtype, rngs)
    self.v_proj = _linear(h, cfg.num_kv_heads * hd, cfg.qkv_bias, dtype, param_dtype, rngs)
    self.o_proj = _linear(cfg.num_heads * hd, h, False, dtype, param_dtype, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)
      self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)
    if cfg.nsa is not None:
      self.g_proj = nnx.Linear(h, cfg.num_heads * len(nsa.BRANCHES), use_bias=True, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs,
                               kernel_init=nnx.initializers.normal(0.02))
      shape = (cfg.num_kv_heads, cfg.nsa.compress_block, hd, hd)
      init = nnx.initializers.normal(0.02)
      self.compress_k = nnx.Param(init(rngs.params(), shape, param_dtype))
      self.compress_v = nnx.Param(init(rngs.params(), shape, param_dtype))

  def qkv(self, x, cos, sin, mesh):
    """x [B, T, H] -> q [B, T, Hq, D], k, v [B, T, Hkv, D]: projected, normed (qk_norm), RoPE on q
    and k."""
    cfg = self.cfg
    b, t, _ = x.shape
    if hasattr(self, "qkv_proj"):    # fuse_projections: one GEMM (one device only)
      nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
      q, k, v = jnp.split(_project(self.qkv_proj, x), [nq, nq + nkv], axis=-1)
    else:
      q, k, v = (_project(self.q_proj, x), _project(self.k_proj, x), _project(self.v_proj, x))
    q = constrain(q.reshape(b, t, cfg.num_heads, cfg.head_dim), mesh, HEADS)
    k = constrain(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), mesh, HEADS)
    v = constrain(v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), mesh, HEADS)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def __call__(self, x, cos, sin, slots, k_cache, v_cache, lengths, plan, backend, mesh):
    b, t, _ = x.shape
    cfg = self.cfg
    if hasattr(self, "qkv_proj") and writes_in_kernel(
        plan, backend, mesh, t, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
      # One kernel: RoPE, the cache write at slots lengths + t (the chain's slots,
      # `Transformer.__call__`) and the queries packed for the attention kernel.
      norms = dict(q_norm=self.q_norm.weight[...], k_norm=self.k_norm.weight[...],
                   eps=cfg.rms_norm_eps) if cfg.qk_norm else {}
      q, k_cache, v_cache = rope_write(
          _project(self.qkv_proj, x).reshape(b, t, -1, cfg.head_dim), cos, sin, k_cache, v_cache,
          lengths, backend, num_heads=cfg.num_heads, **norms)
      out, scores = attend(q, None, None, k_cache, v_cache, lengths, plan, backend, mesh)
    else:
      q, k, v = self.qkv(x, cos, sin, mesh)
      k_cache = kvc.write(k_cache, k, slots)
      v_cache = kvc.write(v_cache, v, slots)
      out, scores = attend(q, k, v, k_cache, v_cache, lengths, plan, backend, mesh)
    out = constrain(_project(self.o_proj, out.reshape(b, t, -1)), mesh, REPLICATED)
    return out, k_cache, v_cache, scores

  def nsa_call(self, x, cos, sin, slots, k_cache, v_cache, ck, cv, lengths, plan: NSA,
               indices, backend, mesh):
    """NSA attention: (out, k_cache, v_cache, ck, cv, the selected blocks). `indices`: a reuse
    layer's blocks (None: select). A chain's completed compression blocks go into ck/cv first."""
    cfg = self.cfg
    b, t, _ = x.shape
    q, k, v = self.qkv(x, cos, sin, mesh)
    k_cache = kvc.write(k_cache, k, slots)
    v_cache = kvc.write(v_cache, v, slots)
    wk, wv = self.compress_k[...], self.compress_v[...]
    if plan.tree_bits is None:
      ck, cv = nsa.extend_compressed(ck, cv, k_cache, v_cache, wk, wv, lengths, t, cfg.nsa)
    gates = jax.nn.sigmoid(_project(self.g_proj, x).astype(jnp.float32))
    gates = gates.reshape(b, t, cfg.num_heads, -1)
    inputs = nsa.NSAInputs(gates=gates, ck=ck, cv=cv, wk=wk, wv=wv, indices=indices, cfg=cfg.nsa)
    out, indices = attend(q, k, v, k_cache, v_cache, lengths, plan, backend, mesh, nsa=inputs)
    out = constrain(_project(self.o_proj, out.reshape(b, t, -1)), mesh, REPLICATED)
    return out, k_cache, v_cache, ck, cv, indices


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    h, i = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _linear(h, i, False, dtype, param_dtype, rngs)
    self.up_proj = _linear(h, i, False, dtype, param_dtype, rngs)
    self.down_proj = _linear(i, h, False, dtype, param_dtype, rngs)

  def __call__(self, x, mesh, fp8: bool = False, backend: str = "reference"):
    """fp8: multiply by the weights' FP8 copies (`jaxspec.model.fp8.add_fp8_mlps`); the SwiGLU
    between them runs as a kernel on 'pallas' and 'interpret', as its reference on 'reference'."""
    if fp8:   # one device: nothing to constrain
      return mlp_forward(self.fp8_gate_up, self.fp8_down, x, backend)
    if hasattr(self, "gate_up_proj"):    # fuse_projections
      gate, up = jnp.split(_project(self.gate_up_proj, x), 2, axis=-1)
    else:
      gate, up = _project(self.gate_proj, x), _project(self.up_proj, x)
    return constrain(_project(self.down_proj, jax.nn.silu(gate) * up), mesh, REPLICATED)


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
    self.self_attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
    self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x, cos, sin, slots, k_cache, v_cache, lengths, plan, backend, mesh,
               fp8_mlp=False):
    a, k_cache, v_cache, scores = self.self_attn(
        self.input_layernorm(x), cos, sin, slots, k_cache, v_cache, lengths, plan, backend, mesh)
    x = x + a
    x = x + self.mlp(self.post_attention_layernorm(x), mesh, fp8_mlp, backend)
    return x, k_cache, v_cache, scores

  def nsa_call(self, x, cos, sin, slots, k_cache, v_cache, ck, cv, lengths, plan, indices,
               backend, mesh, fp8_mlp=False):
    a, k_cache, v_cache, ck, cv, indices = self.self_attn.nsa_call(
        self.input_layernorm(x), cos, sin, slots, k_cache, v_cache, ck, cv, lengths, plan,
        indices, backend, mesh)
    x = x + a
    x = x + self.mlp(self.post_attention_layernorm(x), mesh, fp8_mlp, backend)
    return x, k_cache, v_cache, ck, cv, indices


class Transformer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, param_dtype=None, rngs: nnx.Rngs):
    param_dtype = dtype if param_dtype is None else param_dtype
    self.cfg = cfg
    self.mesh = None   # set by jaxspec.model.sharding when the parameters are sharded
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                            for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, False, dtype, param_dtype, rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array, cache: kvc.KVCache, plan: Plan,
               backend: str = "reference", fp8_mlp: bool = False
               ) -> tuple[jax.Array, kvc.KVCache, jax.Array | None]:
    """tokens, positions [B, T] -> (hidden [B, T, H], cache with the new K/V written,
    scores [L, B, ...] | None, L the layers the plan's `ScoreSpec` collects). `backend`: see `jaxspec.model.attention.BACKENDS`. An NSA model
    runs `as_nsa(plan)` and returns no scores; an `NSA(collect=True)` plan, every layer's selected
    blocks [L, B, T, Hkv, n] instead. `fp8_mlp`: the MLPs multiply by their FP8 copies
    (`jaxspec.model.fp8.add_fp8_mlps`; a ValueError without them)."""
    if fp8_mlp and not has_fp8_mlps(self):
      raise ValueError("fp8_mlp=True needs the MLPs' FP8 copies: call "
                       "jaxspec.model.fp8.add_fp8_mlps(model) first")
    if self.cfg.nsa is not None:
      return self._nsa_forward(tokens, positions, cache, as_nsa(plan), backend, fp8_mlp)
    t = tokens.shape[1]
    slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    cos, sin = rope_tables(self.cfg, positions)
    x = self.embed_tokens(tokens)
    ks, vs, scores = [], [], []
    for i, layer in enumerate(self.layers):
      x, k, v, s = layer(x, cos, sin, slots, cache.k[i], cache.v[i], cache.lengths,
                         plan.for_layer(i), backend, self.mesh, fp8_mlp)
      ks.append(k)
      vs.append(v)
      if s is not None:
        scores.append(s)
    cache = cache.replace(k=tuple(ks), v=tuple(vs))
    return self.norm(x), cache, (jnp.stack(scores) if scores else None)

  def _nsa_forward(self, tokens, positions, cache: kvc.KVCache, plan: NSA, backend: str,
                   fp8_mlp: bool):
    """`__call__` of an NSA model: the layers under the plan's refresh/reuse schedule."""
    t = tokens.shape[1]
    slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    cos, sin = rope_tables(self.cfg, positions)
    x = self.embed_tokens(tokens)
    caches = []

    def layer(i, indices):
      nonlocal x
      args = (x, cos, sin, slots, cache.k[i], cache.v[i], cache.ck[i], cache.cv[i], cache.lengths,
              plan)
      if plan.refresh_mask is not None and indices is not None:
        *_, own = self.layers[i].nsa_call(*args, None, backend, self.mesh, fp8_mlp)
        indices = jnp.where(plan.refresh_mask[i], own, indices)
      x, *layer_cache, indices = self.layers[i].nsa_call(*args, indices, backend, self.mesh,
                                                         fp8_mlp)
      caches.append(layer_cache)
      return None, indices

    if plan.refresh_mask is None:
      _, used = nsa.run_schedule(nsa.check_refresh(plan.refresh, self.cfg.num_layers), layer)
    else:
      if plan.refresh is not None or plan.refresh_mask.shape != (self.cfg.num_layers,):
        raise ValueError(f"an NSA plan's refresh_mask is one bool per layer "
                         f"({self.cfg.num_layers}), in place of refresh; got shape "
                         f"{plan.refresh_mask.shape} beside refresh={plan.refresh}")
      used = []   # each layer's blocks: its own where the mask refreshes, else the last ones used
      for i in range(self.cfg.num_layers):
        used.append(layer(i, used[-1] if used else None)[1])
    k, v, ck, cv = (tuple(c) for c in zip(*caches))
    return (self.norm(x), cache.replace(k=k, v=v, ck=ck, cv=cv),
            jnp.stack(used) if plan.collect else None)

  def recompress(self, cache: kvc.KVCache, start: jax.Array, count: int) -> kvc.KVCache:
    """An NSA model's cache with the compression blocks ending in slots start .. start + count - 1
    (start [B]) written again from the raw cache: after a tree's accepted path is compacted into
    those slots (a tree call writes no compressed blocks)."""
    wk = [layer.self_attn.compress_k[...] for layer in self.layers]
    wv = [layer.self_attn.compress_v[...] for layer in self.layers]
    ck, cv = zip(*(nsa.extend_compressed(cache.ck[i], cache.cv[i], cache.k[i], cache.v[i], wk[i],
                                         wv[i], start, count, self.cfg.nsa)
                   for i in range(self.cfg.num_layers)))
    return cache.replace(ck=tuple(ck), cv=tuple(cv))

  def logits(self, hidden: jax.Array, dtype: jnp.dtype | None = jnp.float32) -> jax.Array:
    """LM head: [..., H] -> [..., vocab] in `dtype`; None keeps the head's own (the model's
    dtype) and saves the pass that would convert every row."""
    if self.cfg.tie_word_embeddings:
      out = self.embed_tokens.attend(hidden)
    else:
      out = self.lm_head(hidden)
    return out if dtype is None else out.astype(dtype)


def init_random(cfg: ModelConfig, *, dtype=jnp.float32, seed: int = 0,
                tp: int = 1) -> Transformer:
  """A model with random weights (tests, and the random-weight scale benchmarks). With tp > 1 it
  is drawn under jit, each device drawing only its own shards: the values of tp=1 up to an ulp
  (jax's threefry is partitionable; XLA's fused normal sampler rounds unlike the eager one)."""
  mesh = sharding.make_mesh(tp)
  if mesh is None:
    return Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
  sharding.check_divides(cfg, mesh)
  graphdef, abstract = nnx.split(abstract_model(cfg, dtype=dtype))
  shardings = sharding.state_shardings(nnx.to_pure_dict(abstract), mesh)
  pure = jax.jit(lambda: nnx.to_pure_dict(nnx.split(
      Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))[1]), out_shardings=shardings)()
  nnx.replace_by_pure_dict(abstract, pure)
  model = nnx.merge(graphdef, abstract)
  model.mesh = mesh
  return model


def _fused_linear(parts: Sequence[nnx.Linear]) -> nnx.Linear:
  """One nnx.Linear for several of one input: their kernels (and biases) concatenated along the
  outputs. Built abstract, then given the concatenated parameters (no random init)."""
  kernel = jnp.concatenate([p.kernel[...] for p in parts], axis=-1)
  first = parts[0]
  fused = nnx.eval_shape(lambda: nnx.Linear(
      kernel.shape[0], kernel.shape[1], use_bias=first.use_bias, dtype=first.dtype,
      param_dtype=kernel.dtype, rngs=_OneKey()))
  fused.kernel = nnx.Param(kernel)
  if first.use_bias:
    fused.bias = nnx.Param(jnp.concatenate([p.bias[...] for p in parts]))
  return fused


def fuse_projections(model: Transformer) -> Transformer:
  """Fuse each layer's q/k/v projections into one GEMM (`qkv_proj`) and gate/up into one
  (`gate_up_proj`), in place; returns the model. It computes the same function (the same
  products, one kernel each instead of three and two), and a decode step at 64-448 rows spends
  less time in them (benchmarks/RESULTS.md, twentieth session). The parameter paths then no
  longer mirror HF names, so convert or save a model before fusing it. Idempotent. One device
  only: a tensor-parallel model splits q/k/v by heads and keeps them apart (a ValueError)."""
  if model.mesh is not None:
    raise ValueError("fuse_projections runs on a one-device model; a tensor-parallel model keeps "
                     "its projections apart (its q/k/v shards are whole heads)")
  for layer in model.layers:
    attn, mlp = layer.self_attn, layer.mlp
    if not hasattr(attn, "qkv_proj"):
      attn.qkv_proj = _fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
      del attn.q_proj, attn.k_proj, attn.v_proj
    if not hasattr(mlp, "gate_up_proj"):
      mlp.gate_up_proj = _fused_linear([mlp.gate_proj, mlp.up_proj])
      del mlp.gate_proj, mlp.up_proj
  return model


class _OneKey:
  """Stands in for `nnx.Rngs` where only the parameters' shapes are wanted: every draw is the
  same key. Each draw from an `nnx.Rngs` being traced updates its counter through a check that
  formats an error message by walking every equation traced so far (flax 0.12), so tracing a
  model's construction took time quadratic in its parameters (the 1.5B's: 1.9-2.9 s, and
  0.5-0.7 s with one key, on a 2-core CPU)."""

  def __init__(self):
    self.key = jax.random.key(0)

  def params(self) -> jax.Array:
    return self.key


def abstract_model(cfg: ModelConfig, *, dtype=jnp.bfloat16) -> Transformer:
  """The model's structure with no memory behind it, to be filled by a weight loader."""
  return nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=_OneKey()))
