"""A lean inference forward over a megatron-core ``GPTModel``'s own parameters (no copies).

Training runs megatron-core's modules. Decoding at batch 1 is dominated by small matmuls, and
megatron's per-layer machinery around them (autograd ``Function`` wrappers for linear layers even
under ``no_grad``, tensor-parallel region copies, ``MakeViewlessTensor``, ``[s, b, h]`` transposes,
per-call RoPE ``cos``/``sin``) costs more per token than the arithmetic of a 135M model on CPU.
:class:`LeanForward` computes the same function with plain tensor ops, reading the very
``Parameter`` objects of the model, so training, checkpoint loading and ``model.to(...)`` keep it in
step automatically.

Per layer (local spec: RMSNorm, fused QKV, SwiGLU MLP; shapes on this TP rank, batch-first)::

    x [b, s, h] -> rms_norm -> linear_qkv [b, s, ng, (qpg+2)*hd] -> q [b, nh, s, hd], k/v [b, ng, s, hd]
      -> RoPE(q, k) by position id -> SDPA (causal / explicit mask / KV cache) -> linear_proj
      -> all-reduce(TP) -> + residual -> rms_norm -> linear_fc1 -> silu(gate) * up -> linear_fc2
      -> all-reduce(TP) -> + residual

then the final RMSNorm and the (possibly tied) vocab-parallel output layer, gathered over TP, only
for the positions the caller reads. Tensor parallelism follows megatron exactly: column-parallel
shards (QKV by whole query groups, FC1 as ``[gate_r; up_r]``), row-parallel shards followed by an
all-reduce over the TP group, a vocab-parallel embedding (masked lookup + all-reduce).

Used by :func:`megatron_jf.inference.forward.forward_logits` whenever :func:`supports` says the model is
the plain local spec (no Transformer Engine modules, no sequence parallelism, no dropout).
``MEGATRON_JF_LEAN_FORWARD=0`` turns it off (megatron's forward is then used);
``MEGATRON_JF_LEAN_GEMV=all|out|none`` picks the weights with CPU copies (transposed for one-row products,
oneDNN-packed for multi-row ones; :meth:`LeanForward._gemv_policy`), ``MEGATRON_JF_LEAN_PACKED=0`` turns the packed
copies off; all are read in :mod:`megatron_jf.inference.options`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron_jf.inference import options
from megatron_jf.inference.cpu_glue import ATTN_MAX_HD
from megatron_jf.models.kv_cache import KVCache


def supports(model) -> bool:
    """True if ``model`` (an unwrapped ``JFGPTModel``) is a layout :class:`LeanForward` reproduces exactly.

    Requires: one pipeline stage holding both embedding and output layer, the local layer spec
    (``torch.nn.RMSNorm`` norms, megatron ``ColumnParallelLinear``/``RowParallelLinear``, identity
    q/k norms), SwiGLU, no dropout, no sequence parallelism, no linear biases other than QKV.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_jf.platform import is_absent_submodule

    cfg = model.config
    if not (model.pre_process and model.post_process):
        return False
    if cfg.sequence_parallel or cfg.hidden_dropout or cfg.attention_dropout or not cfg.gated_linear_unit:
        return False
    if cfg.activation_func is not F.silu or cfg.add_bias_linear or cfg.normalization != "RMSNorm":
        return False
    if getattr(model, "position_embedding_type", "rope") != "rope" or getattr(cfg, "multi_latent_attention", False):
        return False
    for layer in model.decoder.layers:
        att = layer.self_attention
        if not (isinstance(layer.input_layernorm, torch.nn.RMSNorm) and isinstance(layer.pre_mlp_layernorm, torch.nn.RMSNorm)):
            return False
        if not (isinstance(att.linear_qkv, ColumnParallelLinear) and isinstance(att.linear_proj, RowParallelLinear)):
            return False
        if not (isinstance(layer.mlp.linear_fc1, ColumnParallelLinear) and isinstance(layer.mlp.linear_fc2, RowParallelLinear)):
            return False
        if not (is_absent_submodule(att.q_layernorm) and is_absent_submodule(att.k_layernorm)):
            return False
        if not isinstance(layer.cross_attention, IdentityOp):
            return False
    return isinstance(model.decoder.final_layernorm, torch.nn.RMSNorm)


#: Multi-row products with fewer multiply-adds (rows x out x in) than this skip the oneDNN-packed weight copy: its
#: call costs ~10-15 us more than MKL's sgemm, which is more than it saves on a small product (one thread, AVX-512
#: EPYC, cache-resident weights: a 2-token product through a 384 x 256 weight took 23 us packed and 9 us through the
#: transposed copy; 1 M multiply-adds and up, packed was as fast or faster at every shape measured).
PACKED_MIN_MACS = 1 << 19

#: The ways a product runs on CPU (``LeanForward.kernels``): ``transposed`` -- ``x @ W_t`` through a ``[in, out]``
#: copy (MKL's sgemm), ``packed`` -- oneDNN's linear on a copy packed for it, ``linear`` -- ``F.linear`` on the weight
#: itself (MKL, no copy), ``skinny`` -- this project's kernel for a few rows on a copy in 32-column panels
#: (:meth:`megatron_jf.inference.cpu_glue.Glue.skinny_mm`; fp32 forwards with the C glue, else ``linear``).
PRODUCT_KERNELS = ("transposed", "packed", "linear", "skinny")
#: The most rows the ``skinny`` kernel takes in one pass over a weight (``MAX_ROWS`` in ``csrc/glue.c``): a product of
#: more runs another pass, so past it a ``skinny`` choice gives way to :meth:`LeanForward.default_kernel` (SmolLM2-135M,
#: Intel Xeon: a 9-token forward took 84 ms against 58 ms at 8 when the 8-row choice, ``skinny``, ran two passes of
#: a kernel then capped at 8 rows).
SKINNY_MAX_ROWS = 16

#: Decode steps of at most this many tokens a row attend in the C glue (:meth:`LeanForward._decode_attention`); wider
#: forwards (a prefill) take SDPA's kernels. On an Intel Xeon (one thread, the quickstart's 4-layer 256-hidden model,
#: 150 cached tokens) SDPA took 29 us a layer for one token and 41 for four; the whole forward with the glue's
#: attention against SDPA's, same process: 1.20x as fast at 1 token, 1.18x at 8, 1.07x at 16, level at 32.
DECODE_ATTN_MAX_TOKENS = 32


def measured_kernel(table, rows: int, default):
    """The kernel a measured choice ``((from_rows, kernel), ...)`` (ascending from 1 row) gives a product of ``rows``
    rows: the last entry at or below ``rows``; a ``skinny`` one only up to :data:`SKINNY_MAX_ROWS` rows, past them
    ``default()`` (:meth:`LeanForward.default_kernel` for the weight). A name from :data:`PRODUCT_KERNELS`; raises
    nothing (an empty table is the caller's: :meth:`LeanForward.kernel` takes the default then). Not from the paper:
    the CPU engine's product kernels."""
    kind = table[0][1]
    for first, k in table:
        if first > rows:
            break
        kind = k
    return default() if kind == "skinny" and rows > SKINNY_MAX_ROWS else kind

#: fp32 one-row products through weights of at least this many elements take the packed copy until measured: oneDNN
#: reads a large packed weight faster than ``x @ W_t`` (SmolLM2-135M's 49,152 x 960 output layer at one row: 4.9 ms
#: packed, 7.9 ms transposed, 11.0 ms ``F.linear``; its 1.5-4.9 M-element layer weights: equal within 5 %; a
#: 256-hidden model's weights, under a million elements: the transposed copy is 2x faster; one thread, AVX-512 EPYC).
PACKED_ONE_ROW_MIN = 1 << 20


class _Layer:
    __slots__ = ("ln1", "eps1", "qkv_w", "qkv_b", "proj_w", "ln2", "eps2", "fc1_w", "fc2_w", "names")


class LeanForward:
    """The inference forward of a megatron ``GPTModel`` (see module docstring).

    Args:
        model: an unwrapped :class:`~megatron_jf.models.gpt.JFGPTModel` for which :func:`supports` holds.
        gemv: ``all``, ``out`` or ``none`` (see :meth:`_gemv_policy`); None or ``auto``: ``MEGATRON_JF_LEAN_GEMV``,
            else by size.

    Raises:
        ValueError: the model layout is not supported, or a bad ``gemv``.
    """

    def __init__(self, model, gemv: str | None = None):
        if not supports(model):
            raise ValueError("LeanForward needs the local layer spec on a single pipeline stage (see supports())")
        from megatron.core import parallel_state as ps

        self.model = model
        cfg = model.config
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.hd = cfg.kv_channels
        self.nh = cfg.num_attention_heads // self.tp
        self.ng = (cfg.num_query_groups or cfg.num_attention_heads) // self.tp
        self.qpg = self.nh // self.ng
        self.scale = model.decoder.layers[0].self_attention.core_attention.softmax_scale
        emb = model.embedding.word_embeddings
        self.emb = emb
        self.vocab_start = int(getattr(emb, "vocab_start_index", 0))
        self.vocab_end = int(getattr(emb, "vocab_end_index", emb.weight.shape[0]))
        self.layers = []
        for layer in model.decoder.layers:
            att, mlp = layer.self_attention, layer.mlp
            L = _Layer()
            L.ln1, L.eps1 = layer.input_layernorm.weight, layer.input_layernorm.eps
            L.qkv_w, L.qkv_b = att.linear_qkv.weight, att.linear_qkv.bias
            L.proj_w = att.linear_proj.weight
            L.ln2, L.eps2 = layer.pre_mlp_layernorm.weight, layer.pre_mlp_layernorm.eps
            L.fc1_w, L.fc2_w = mlp.linear_fc1.weight, mlp.linear_fc2.weight
            i = len(self.layers)
            L.names = (f"qkv{i}", f"proj{i}", f"fc1{i}", f"fc2{i}")
            self.layers.append(L)
        self.final_ln = model.decoder.final_layernorm
        self._cos = self._sin = None
        self.gemv_transposed: set[str] = self._gemv_policy(gemv)
        self._wt: dict[str, tuple] = {}
        self.packed = bool(self.gemv_transposed) and options.lean_packed_on() and _onednn_packing_works()
        #: the fp32 product kernel by weight shape and product rows, as measured on this machine
        #: (:func:`megatron_jf.inference.cost_model.calibrate_products`): ``{(out, in): ((from_rows, kernel), ...)}``
        #: ascending from 1 row; a shape not in it follows :meth:`default_kernel`. Output is the same whichever runs,
        #: up to the products' rounding.
        self.kernels: dict[tuple[int, int], tuple[tuple[int, str], ...]] = {}
        self._wp: dict[str, tuple] = {}
        self._wk: dict[str, tuple] = {}  # panel copies for the skinny kernel
        #: the C glue for fp32 CPU forwards (:mod:`megatron_jf.inference.cpu_glue`): False until first needed, then
        #: the loaded library or None (off, or no compiler)
        self.glue = False

    def set_packed(self, on: bool) -> None:
        """Multi-row products through the oneDNN-packed copies (``on``, where there are transposed copies and torch's
        oneDNN packing works) or ``F.linear``; output is the same either way, up to the products' rounding."""
        self.packed = bool(on) and bool(self.gemv_transposed) and _onednn_packing_works()

    def _gemv_policy(self, mode: str | None = None) -> set[str]:
        """Weights whose single-row products use a transposed copy (``mode``, else ``MEGATRON_JF_LEAN_GEMV``).

        On CPU, ``x[1, K] @ W^T`` with ``W`` stored ``[N, K]`` runs MKL's sgemm at about half the
        memory bandwidth that ``x @ W_t`` reaches with ``W_t`` stored ``[K, N]`` (measured 1.7x on
        SmolLM2's 49k x 576 output layer at batch 1), and a batch-1 decode step is one such product per
        weight. So for one-row forwards (AR steps) a ``[K, N]`` copy of each weight is kept, made on first
        use and remade whenever the weight changes (``Parameter._version`` / storage). Costs one extra
        copy of the weights in host memory; ``all`` is the default on CPU for models up to 4 GiB of
        weights, else ``out`` (output layer only).

        Multi-row products (a draft of several tokens, a batch) of the same weights run oneDNN's linear on a
        copy packed for it (:func:`_onednn_packing_works`; ``MEGATRON_JF_LEAN_PACKED=0``: ``F.linear``): MKL's
        sgemm reads ``W`` slowly for a few rows, so a 2-8 token forward of SmolLM2-135M took 1.8-2.6x a one-token
        one; packed, 1.05-1.3x (AVX-512 EPYC, one thread), and batch-16 AR steps take 0.65x the time. A second
        extra copy of those weights. Which way (:data:`PRODUCT_KERNELS`: ``transposed``, ``packed``, or ``linear``,
        ``F.linear`` on the weight itself) an fp32 product takes is measured on the machine per weight shape and
        row count (:attr:`kernels`, :func:`~megatron_jf.inference.cost_model.calibrate_products`), since the
        fastest differs by CPU and shape: on an Intel Xeon with AMX a 256-hidden model's multi-row products were
        faster transposed (a 16-token forward 2.2 ms against 2.9 packed), SmolLM2-135M's one-token forward faster
        with its output layer transposed (7.5 ms against 9.6 packed, cold cache), its 1,536-input MLP weight
        faster through ``F.linear`` at one row (188 against 213 us transposed) and its 2-row QKV product through
        ``F.linear`` (122 us against 133 packed, 143 transposed). Until measured, :meth:`default_kernel` (the
        fastest on an AVX-512 EPYC: oneDNN's call costs ~10-15 us more than MKL's, so products below
        :data:`PACKED_MIN_MACS` multiply-adds stay transposed). bf16 weights always take the packed copy:
        oneDNN's native bf16 kernels (AVX-512 BF16) read half the bytes, where a bf16 ``x @ W_t`` is slower than
        fp32's (SmolLM2-135M's products at one row: 2.8 ms packed bf16 against 8.0 ms fp32 per layer's set of
        weights with the output layer; a 256-hidden model's at 1-4 rows: 12-20 us packed, 15-33 us through a bf16
        transposed copy; one thread).
        """
        if self.emb.weight.device.type != "cpu":
            return set()
        mode = options.gemv_mode(mode)
        if not mode:
            nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
            mode = "all" if nbytes <= 4 << 30 else "out"
        if mode == "none":
            return set()
        names = {"out"}
        if mode == "all":
            names |= {f"{k}{i}" for k in ("qkv", "proj", "fc1", "fc2") for i in range(len(self.layers))}
        return names

    @staticmethod
    def default_kernel(w: torch.Tensor, rows: int) -> str:
        """The fp32 product kernel for ``rows`` rows through ``w`` until :attr:`kernels` measures it: ``packed`` for
        multi-row products of :data:`PACKED_MIN_MACS` multiply-adds or more and for one-row products through
        weights of :data:`PACKED_ONE_ROW_MIN` elements or more, else ``transposed``."""
        if rows > 1:
            return "packed" if rows * w.numel() >= PACKED_MIN_MACS else "transposed"
        return "packed" if w.numel() >= PACKED_ONE_ROW_MIN else "transposed"

    def kernel(self, w: torch.Tensor, rows: int) -> str:
        """How a product of ``rows`` rows through ``w`` runs (one of :data:`PRODUCT_KERNELS`): bf16 weights always
        ``packed`` (oneDNN's native bf16 kernels); fp32 ones as :attr:`kernels` measured for their shape (``skinny``
        up to :data:`SKINNY_MAX_ROWS` rows), else :meth:`default_kernel`."""
        if w.dtype == torch.bfloat16:
            return "packed"
        table = self.kernels.get((w.shape[0], w.shape[-1])) if w.dtype == torch.float32 else None
        if not table:
            return self.default_kernel(w, rows)
        return measured_kernel(table, rows, lambda: self.default_kernel(w, rows))

    def _linear(self, x, w, name: str, bias=None, kind: str | None = None):
        if name not in self.gemv_transposed:
            return F.linear(x, w, bias)
        kind = kind or self.kernel(w, x.numel() // x.shape[-1])
        # the bias is added after the product whatever the kernel (but bf16's one packed kernel, fused), so a row's
        # value does not hang on the kernel its row count took: under bf16 autocast F.linear's fused bias rounds the
        # sum to bf16 where ``x @ W_t + bias`` adds the fp32 bias to the bf16 product, and a draft's rows would
        # part from the AR step's at near-ties
        if kind == "linear":
            y = F.linear(x, w)
        elif kind == "skinny":
            glue = self._glue_for(x)
            if glue is None or w.dtype != torch.float32:
                y = F.linear(x, w)
            else:
                key = (w._version, w.data_ptr(), w.dtype)
                hit = self._wk.get(name)
                if hit is None or hit[0] != key:
                    hit = (key, glue.pack_panels(w.detach()))
                    self._wk[name] = hit
                y = glue.skinny_mm(x.contiguous(), hit[1], w)
        elif kind == "packed":  # see _gemv_policy
            if not self.packed or x.dtype != w.dtype or torch.is_autocast_enabled("cpu"):
                y = F.linear(x, w)
            else:
                key = (w._version, w.data_ptr(), w.dtype)
                hit = self._wp.get(name)
                if hit is None or hit[0] != key:
                    hit = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64))
                    self._wp[name] = hit
                if w.dtype == torch.bfloat16:
                    return torch.ops.mkldnn._linear_pointwise(x, hit[1], bias, "none", [], "")
                y = torch.ops.mkldnn._linear_pointwise(x, hit[1], None, "none", [], "")
        else:
            key = (w._version, w.data_ptr(), w.dtype)
            hit = self._wt.get(name)
            if hit is None or hit[0] != key:
                hit = (key, w.detach().t().contiguous())
                self._wt[name] = hit
            y = x @ hit[1]
        return y if bias is None else y + bias

    def products(self) -> dict[tuple[int, int], list[tuple[str, torch.Tensor]]]:
        """The products that have CPU weight copies, by weight shape: ``{(out, in): [(name, weight), ...]}``
        (for :func:`~megatron_jf.inference.cost_model.calibrate_products`)."""
        named = [(n, w) for L in self.layers for n, w in zip(L.names, (L.qkv_w, L.proj_w, L.fc1_w, L.fc2_w))]
        named.append(("out", self._output_weight()))
        out: dict[tuple[int, int], list] = {}
        for n, w in named:
            if n in self.gemv_transposed:
                out.setdefault((w.shape[0], w.shape[-1]), []).append((n, w))
        return out

    def make_copies(self) -> None:
        """Make now the weight copies the measured kernels (:attr:`kernels`) use, each by one product through it;
        otherwise each is made at its first product -- for SmolLM2-135M's packed copies about a second, at the first
        forward wide enough to take them, in the middle of a generation. Costs one extra copy of each such weight in
        host memory, as the first product would.

        Raises:
            nothing of its own; an error of a product propagates."""
        with torch.no_grad():
            for shape, named in self.products().items():
                if named[0][1].dtype != torch.float32:
                    continue
                for kind in {k for _, k in self.kernels.get(shape, ())} - {"linear"}:
                    for n, w in named:
                        self._linear(w.new_zeros(1, w.shape[-1]), w, n, kind=kind)

    def drop_unused_copies(self) -> None:
        """Free the transposed and packed copies of fp32 weights whose measured kernels (:attr:`kernels`) never use
        them (measuring makes every copy)."""
        for shape, named in self.products().items():
            used = {k for _, k in self.kernels.get(shape, ())}
            if not used or named[0][1].dtype != torch.float32:
                continue
            for n, _ in named:
                if "transposed" not in used:
                    self._wt.pop(n, None)
                if "packed" not in used:
                    self._wp.pop(n, None)
                if "skinny" not in used:
                    self._wk.pop(n, None)

    # ------------------------------------------------------------------ pieces
    def _rope(self, position_ids: torch.Tensor, dtype):
        """cos/sin ``[b, 1, s, d]`` for ``position_ids`` (tables grown on demand, as megatron computes them)."""
        needed = int(position_ids.max()) + 1
        if self._cos is None or self._cos.shape[0] < needed or self._cos.dtype != dtype:
            size = max(needed, 2 * (self._cos.shape[0] if self._cos is not None else 0), 256)
            freqs = self.model.rotary_pos_emb(size)[:, 0, 0, :]  # [size, d] angles, fp32
            self._cos, self._sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
        return self._cos[position_ids].unsqueeze(1), self._sin[position_ids].unsqueeze(1)

    def _all_reduce(self, x):
        if self.tp > 1:
            torch.distributed.all_reduce(x, group=self.tp_group)
        return x

    def _embed(self, tokens):
        w = self.emb.weight
        if self.tp == 1:
            return F.embedding(tokens, w)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill_(outside, 0)
        x = F.embedding(local, w).masked_fill_(outside.unsqueeze(-1), 0.0)  # no host sync (graph-capturable)
        return self._all_reduce(x)

    def _output_weight(self):
        m = self.model
        if m.share_embeddings_and_output_weights:
            return m.shared_embedding_or_output_weight()
        return m.output_layer.weight

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, position_ids: torch.Tensor, *, mask: torch.Tensor | None = None,
                 kv_cache: KVCache | None = None, logit_positions: slice | torch.Tensor | None = None,
                 return_logits: bool = True) -> torch.Tensor | None:
        """Logits ``[b, s', V_padded]`` (dtype of the weights) for ``tokens`` ``[b, s]`` at ``position_ids`` ``[b, s]``.

        Args:
            mask: without a cache, optional bool ``[b|1, 1, s, s]`` in megatron's convention (True =
                masked out); None = causal.
            kv_cache: a :class:`KVCache` on which ``begin()`` has been called for this forward.
            logit_positions: which positions get logits (a slice or int64 index over ``s``); default all.
            return_logits: False skips the final norm and output layer and returns None (prefill).
        """
        cache_attn = None
        if kv_cache is not None:
            def cache_attn(slot, q, k, v):
                k, v, allow = kv_cache.update(slot, k, v)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=allow, is_causal=kv_cache.step_is_causal,
                                                      scale=self.scale, enable_gqa=self.ng != self.nh)
        x = self.hidden(tokens, position_ids, mask=mask, attend=cache_attn, cache=kv_cache)
        if not return_logits:
            return None
        if logit_positions is not None:
            x = x[:, logit_positions]
        return self.head(x)

    def hidden(self, tokens: torch.Tensor, position_ids: torch.Tensor, *, mask: torch.Tensor | None = None,
               attend=None, rope: tuple | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """Hidden states ``[b, s, h]`` after the last layer (before the final norm).

        ``attend(slot, q [b, nh, s, hd], k/v [b, ng, s, hd]) -> [b, nh, s, hd]`` replaces the attention (a
        KV cache; the static-shape path of :mod:`megatron_jf.inference.static_decode`); without it,
        attention is causal or follows ``mask`` (megatron convention, True = masked out). ``rope`` gives
        precomputed ``(cos, sin)`` ``[b, 1, s, d]`` (no host sync, for CUDA-graph capture). ``cache``: the KV cache
        ``attend`` goes through, for the C glue's decode attention (:meth:`_decode_attention`), which takes a
        causal decode step over it in place of ``attend``.
        """
        b, s = tokens.shape
        x = self._embed(tokens)  # [b, s, h]
        cos, sin = rope if rope is not None else self._rope(position_ids, x.dtype)
        hd, nh, ng, qpg = self.hd, self.nh, self.ng, self.qpg
        gqa = ng != nh
        sdpa_mask, causal = None, False
        if attend is None:
            if mask is None:
                causal = True
            else:
                sdpa_mask = ~mask
            attend = functools.partial(_sdpa, mask=sdpa_mask, causal=causal, scale=self.scale, gqa=gqa)
        glue = self._glue_for(x)
        if glue is not None:
            return self._hidden_glue(glue, x, cos, sin, attend, cache)
        for slot, L in enumerate(self.layers):
            h = F.rms_norm(x, L.ln1.shape, L.ln1, L.eps1)
            qkv = self._linear(h, L.qkv_w, L.names[0], L.qkv_b).view(b, s, ng, (qpg + 2) * hd)
            q, k, v = torch.split(qkv, [qpg * hd, hd, hd], dim=3)
            q = q.reshape(b, s, nh, hd).transpose(1, 2)  # [b, nh, s, hd]
            k = k.transpose(1, 2)  # [b, ng, s, hd]
            v = v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = attend(slot, q, k, v).transpose(1, 2).reshape(b, s, nh * hd)
            x = x + self._all_reduce(self._linear(o, L.proj_w, L.names[1]))
            h = F.rms_norm(x, L.ln2.shape, L.ln2, L.eps2)
            gate, up = torch.chunk(self._linear(h, L.fc1_w, L.names[2]), 2, dim=-1)
            x = x + self._all_reduce(self._linear(F.silu(gate) * up, L.fc2_w, L.names[3]))
        return x

    def _glue_for(self, x: torch.Tensor):
        """The C glue (:mod:`megatron_jf.inference.cpu_glue`) where this forward can take it: fp32 weights and
        activations on CPU, outside autograd and autocast, and the library built (:attr:`glue`, loaded once)."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
            return None
        if self.layers[0].qkv_w.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
            return None
        if self.glue is False:
            from megatron_jf.inference import cpu_glue

            self.glue = cpu_glue.load()
        return self.glue

    def _decode_attention(self, cache: KVCache | None, b: int, s: int) -> int | None:
        """The committed length ``start`` where this forward's attention runs in the C glue (:meth:`Glue.decode_attn
        <megatron_jf.inference.cpu_glue.Glue.decode_attn>`), else None: a causal step over ``cache``
        (:meth:`KVCache.causal_start`) of at most :data:`DECODE_ATTN_MAX_TOKENS` tokens a row, an fp32 CPU cache,
        a head dim the kernel takes, and one torch thread or at most 16 query tokens in all (the kernel runs on
        one core, where SDPA would share a batch's attention among the threads)."""
        if cache is None or s > DECODE_ATTN_MAX_TOKENS or (b * s > 16 and torch.get_num_threads() > 1):
            return None
        if self.hd % 16 or self.hd > ATTN_MAX_HD or cache.k.dtype != torch.float32 or cache.k.device.type != "cpu":
            return None
        return cache.causal_start()

    def _hidden_glue(self, glue, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend,
                     cache: KVCache | None = None) -> torch.Tensor:
        """:meth:`hidden`'s layers with the C glue: each layer is its four products, attention and three glue calls
        on buffers allocated once per forward; the residual stream ``x`` is updated in place. A decode step over
        ``cache`` (:meth:`_decode_attention`) writes each layer's keys and values into the cache and attends in
        the glue (the same values as ``attend`` up to rounding, each token's the same whatever the step's width)."""
        b, s, hid = x.shape
        hd, nh, ng, qpg = self.hd, self.nh, self.ng, self.qpg
        cos = cos.reshape(b, s, hd).contiguous()  # [b, 1, s, hd] tables, one row per token
        sin = sin.reshape(b, s, hd).contiguous()
        h = torch.empty_like(x)
        start = self._decode_attention(cache, b, s)
        q = x.new_empty(b, nh, s, hd)
        if start is None:
            k, v = x.new_empty(b, ng, s, hd), x.new_empty(b, ng, s, hd)
        else:
            o, scratch = x.new_empty(b, s, nh * hd), x.new_empty(glue.attn_scratch(s, qpg, hd, start))
        act, r = None, None
        for slot, L in enumerate(self.layers):
            glue.add_rmsnorm(x, r, L.ln1, h, _norm_eps(L.eps1))
            qkv = self._linear(h, L.qkv_w, L.names[0], L.qkv_b)
            if start is None:
                glue.rope_split_qkv(qkv, cos, sin, q, k, v, ng, qpg, hd)
                o = attend(slot, q, k, v).transpose(1, 2).reshape(b, s, nh * hd)
            else:
                kc, vc = cache.k[slot], cache.v[slot]
                glue.rope_split_qkv_to_cache(qkv, cos, sin, q, kc, vc, start, ng, qpg, hd)
                glue.decode_attn(q, kc, vc, o, scratch, start, qpg, self.scale)
            glue.add_rmsnorm(x, self._all_reduce(self._linear(o, L.proj_w, L.names[1])), L.ln2, h,
                             _norm_eps(L.eps2))
            gu = self._linear(h, L.fc1_w, L.names[2])
            if act is None:
                act = gu.new_empty(b, s, gu.shape[-1] // 2)
            glue.silu_mul(gu, act)
            r = self._all_reduce(self._linear(act, L.fc2_w, L.names[3]))
        if r is not None:
            glue.add(x, r)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and (vocab-parallel, gathered) output layer: ``[b, s, h]`` -> logits ``[b, s, V_padded]``.
        The norm runs in the C glue where the layers do (:meth:`_glue_for`)."""
        glue = self._glue_for(x)
        if glue is not None:
            ln, x = self.final_ln, x.contiguous()
            h = torch.empty_like(x)
            glue.add_rmsnorm(x, None, ln.weight, h, _norm_eps(ln.eps))
            x = h
        else:
            x = self.final_ln(x)
        logits = self._linear(x, self._output_weight(), "out")
        if self.tp > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp)]
            torch.distributed.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits

    def rope_table(self, size: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` tables ``[>= size, d]`` (grown now, so a later capture needs no growth)."""
        self._rope(torch.tensor([[max(size - 1, 0)]], device=self.emb.weight.device), dtype)
        return self._cos, self._sin


_PACKING: bool | None = None


def _onednn_packing_works() -> bool:
    """Whether this torch build runs oneDNN's linear on packed weights (``torch.ops.mkldnn._reorder_linear_weight``
    and ``_linear_pointwise``) and gets ``F.linear``'s result; checked once per process on a small product."""
    global _PACKING
    if _PACKING is None:
        try:
            w, x = torch.randn(24, 16), torch.randn(3, 16)
            y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 64), None, "none",
                                                   [], "")
            _PACKING = bool(torch.backends.mkldnn.is_available() and torch.allclose(y, F.linear(x, w), atol=1e-5))
        except (AttributeError, RuntimeError, NotImplementedError):
            _PACKING = False
    return _PACKING


def _sdpa(slot, q, k, v, *, mask, causal, scale, gqa):
    """Attention without a KV cache: causal, or ``mask`` (True = attend); q ``[b, nh, s, hd]``, k/v ``[b, ng, s,
    hd]``."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


def _norm_eps(eps: float | None) -> float:
    """An RMSNorm's epsilon as the C glue takes it: ``torch.nn.RMSNorm``'s ``eps=None`` is fp32's machine epsilon."""
    return torch.finfo(torch.float32).eps if eps is None else eps


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def lean_forward_for(model) -> LeanForward | None:
    """The model's cached :class:`LeanForward`, built on first use; None when unsupported or switched off."""
    if not options.lean_forward_on():
        return None
    lf = getattr(model, "_jf_lean_forward", None)
    if lf is None:
        if getattr(model, "_jf_lean_unsupported", False) or not supports(model):
            model._jf_lean_unsupported = True
            return None
        lf = LeanForward(model)
        model._jf_lean_forward = lf
    return lf
