#!/usr/bin/env python
"""Per-GPU training memory planner for Jacobi Forcing on megatron-core (weights, gradients, optimizer
state, activations, logits and loss temporaries), with a verdict against an H200's 141 GB.

The activation term is MEASURED, not typed in: a small model of the same architecture (the target's
hidden and FFN sizes divided by a factor ``k``, a small head dimension, same head counts, same layer spec,
sizes chosen so that no two tensor kinds have the same width) runs one
training forward on CPU for each recompute mode, with megatron-core ``TransformerConfig``
``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers`` set directly, and every tensor
autograd saves for the backward is recorded with ``torch.autograd.graph.saved_tensors_hooks`` (parameters
excluded, each storage counted once). Differencing two layer counts and two sequence lengths gives the
saved elements per token per layer with constant terms removed. Each saved tensor is classed by its
per-token width, which decides how it scales to the target and splits over tensor parallelism:

* ``hidden`` (``h``: norm inputs, residuals, column-parallel inputs): x ``h / h_small``; split by TP only
  with sequence parallelism;
* ``scalar`` (one value per token: RMSNorm's reciprocal RMS): not scaled; split like ``hidden``;
* ``rope`` (``head_dim``: RoPE cos/sin): x ``head_dim / head_dim_small``; replicated on every TP rank;
* ``per_head`` (one value per head: softmax log-sum-exp, fp32 in the kernels): not scaled; / TP;
* ``attn`` (a multiple of ``head_dim``: q, k, v, attention output): x ``head_dim / head_dim_small``; / TP;
* ``ffn`` (``ffn`` or ``2 ffn``: gated-MLP intermediates): x ``ffn / ffn_small``; / TP;
* ``other`` (none expected; reported): x ``h / h_small``, not split.

Projection for one GPU (TP ``t``, PP ``p``, DP ``d``)::

    weights      = 2 B x params_local                          (bf16)
    gradients    = 4 B x params_local                          (megatron DDP grad buffer, fp32)
    optimizer    = 12 B x params_local / (d if --use-distributed-optimizer else 1)  (fp32 main + Adam m, v)
    activations  = tokens x L_stage x bytes/token/layer(mode)  (+ one recomputed chunk in the backward)
                   x min(p, microbatches)                      (1F1B: microbatches in flight on stage 0)
    logits+loss  = output layer + loss temporaries of one microbatch (``losses.loss_temporary_bytes``)

``tokens`` per microbatch = 2 streams x micro-batch x ``--seq-length`` (the two-stream / packed layout:
each stream is prompt + response <= ``--seq-length``; worst case, every stream full).

Examples::

    python -m bench.train_memory --model qwen2.5-7b --tp 2 --seq-length 16384 --recompute-granularity full \\
        --recompute-method uniform --recompute-num-layers 1 --use-distributed-optimizer --dp 8
    python -m bench.train_memory --script examples/train_jf_qwen7b_h200.sh     # the launch script's settings
    python -m bench.train_memory --contrast                                      # script + no-recompute contrast

Limits (stated, not hidden): the measurement uses the local layer spec with SDPA's flash kernel (O(s)
memory); TE's fused norm+linear saves slightly different tensors. The dense-mask path (O(L^2) scores) is
not planned. Allocator fragmentation and NCCL buffers are covered by the 120 GiB target's headroom, not
modelled.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import sys
import warnings


# megatron-core's config warnings about CUDA graphs / TE core_attn recompute do not apply to this CPU run
warnings.filterwarnings("ignore", message=".*(cuda_graph_scope|core_attn is from transformer_engine).*")

GiB = 1024 ** 3
H200_BYTES = 141 * 10 ** 9  # H200: 141 GB of HBM3e
DEFAULT_TARGET_GIB = 120.0
MODES = ("none", "selective", "full")
CLASSES = ("hidden", "scalar", "rope", "per_head", "attn", "ffn", "other")

#: Architectures the planner knows by name (:mod:`megatron_jf.models.shapes`: the Qwen2.5 sizes, defined once).
PRESETS = ("qwen2.5-7b", "qwen2.5-1.5b", "qwen2.5-0.5b")


# ----------------------------------------------------------------------------- architecture
def params(arch, tp: int = 1, pp: int = 1) -> dict[str, int]:
    """Parameter counts of :class:`~megatron_jf.models.hf_config.ModelArgs` ``arch`` on one rank: ``layers`` (this
    stage's decoder layers, TP-split where megatron splits them), ``embedding`` and ``output`` (vocabulary padded to a
    multiple of ``tp``, split by TP; on the first / last stage)."""
    h, f, nh, ng, d = arch.hidden_size, arch.intermediate_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    qkv = h * (nh + 2 * ng) * d + ((nh + 2 * ng) * d if arch.qkv_bias else 0)
    per_layer_split = qkv + nh * d * h + 3 * h * f  # qkv, proj, fc1 (gate+up), fc2
    per_layer_repl = 2 * h  # two RMSNorm weights
    layers = math.ceil(arch.num_layers / pp)
    v_pad = math.ceil(arch.vocab_size / tp) * tp
    emb = v_pad * h // tp
    return {"layers": layers * (per_layer_split // tp + per_layer_repl), "embedding": emb,
            "output": 0 if arch.tie_word_embeddings else emb, "final_norm": h}


def total_params(arch) -> int:
    """All parameters of ``arch`` (one rank, no parallelism)."""
    return sum(params(arch).values())


def load_arch(name_or_path: str):
    """A :class:`~megatron_jf.models.hf_config.ModelArgs`: a shape name (:data:`PRESETS`,
    :mod:`megatron_jf.models.shapes`) or a Hugging Face model directory / ``config.json``.

    Raises:
        ValueError: unknown name and not a readable config.
    """
    import json

    from megatron_jf.models import shapes
    from megatron_jf.models.hf_config import ModelArgs

    if name_or_path.lower() in shapes.names():
        return shapes.get(name_or_path)
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if not os.path.isfile(path):
        raise ValueError(f"--model {name_or_path!r}: not one of {sorted(PRESETS)} and no config.json there")
    with open(path) as f:
        return ModelArgs.from_hf_dict(json.load(f))


def _widths(a) -> dict[str, set[int]]:
    nh, ng, d = a.num_heads, a.num_kv_heads, a.head_dim
    return {"hidden": {a.hidden_size}, "scalar": {1}, "rope": {d}, "per_head": {nh, ng},
            "attn": {nh * d, ng * d, 2 * ng * d, (nh + 2 * ng) * d, (nh + ng) * d},
            "ffn": {a.intermediate_size, 2 * a.intermediate_size}}


def small_twin(arch, max_factor: int = 8) -> tuple[object, int]:
    """The measurement model: hidden and FFN sizes divided by the largest ``k <= max_factor`` dividing both,
    the same head counts, the smallest head dimension (>= 8, even) that keeps every tensor kind's width
    distinct (:func:`_widths`), 1 layer, vocabulary 256.

    Raises:
        ValueError: no such head dimension up to the target's.
    """
    k = next(f for f in range(max_factor, 0, -1) if arch.hidden_size % f == 0 and arch.intermediate_size % f == 0)
    base = dataclasses.replace(arch, vocab_size=256, hidden_size=arch.hidden_size // k,
                               intermediate_size=arch.intermediate_size // k, num_layers=1)
    for d in range(min(8, arch.head_dim), arch.head_dim + 1, 2):
        small = dataclasses.replace(base, head_dim=d)
        w = _widths(small)
        kinds = list(w.values())
        if all(not (kinds[i] & kinds[j]) for i in range(len(kinds)) for j in range(i + 1, len(kinds))):
            return small, k
    raise ValueError(f"no small head dimension separates the tensor kinds of {arch}")


# ----------------------------------------------------------------------------- measurement
def _build_small_model(small, layers: int, mode: str, seed: int = 0):
    """A JFGPTModel (this repo's layer spec) with recompute set directly on its TransformerConfig."""
    import torch

    from megatron_jf import parallel
    from megatron_jf.models.gpt import JFGPTModel, layer_spec, transformer_config

    args = dataclasses.replace(small, architecture="Qwen2ForCausalLM", num_layers=layers, rms_norm_eps=1e-6,
                               rope_theta=1e6, max_position_embeddings=4096, eos_token_ids=[], bos_token_id=None,
                               pad_token_id=None, extra={})
    cfg = transformer_config(args, params_dtype=torch.float32)
    rc = {"none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None),
          "selective": dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None),
          "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}[mode]
    cfg = dataclasses.replace(cfg, **rc)
    parallel.set_seed(seed)
    model = JFGPTModel(config=cfg, transformer_layer_spec=layer_spec(args), vocab_size=args.vocab_size,
                       max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                       share_embeddings_and_output_weights=args.tie_word_embeddings,
                       position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(args.rope_theta))
    return model.train()


def saved_tensor_census(model, tokens, position_ids) -> list[tuple[int, str, int]]:
    """Tensors autograd saves during one training forward of ``model.decoder``.

    Returns:
        ``[(elements, dtype name, element bytes)]``, one entry per distinct storage, parameters excluded.
    """
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, str, int]] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in params and ptr not in seen and st.nbytes() > 0:
                seen[ptr] = (st.nbytes() // t.element_size(), str(t.dtype).replace("torch.", ""), t.element_size())
        return t

    with torch.no_grad():
        pre = model._preprocess(tokens, position_ids)
    x = pre[0].detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.decoder(hidden_states=x, attention_mask=None, rotary_pos_emb=pre[1])
    del out
    return list(seen.values())


def _classify(elements: int, tokens: int, small) -> str:
    per_token = elements / tokens
    for name, widths in _widths(small).items():
        if per_token in widths:
            return name
    return "other"


def measure_activations(arch, modes=MODES, *, seqs=(64, 128), layers=(1, 3), rows: int = 2
                        ) -> tuple[dict[str, dict[str, float]], object, int]:
    """Measured saved activation elements per token per layer of ``arch``'s small twin, per mode and class.

    Runs ``len(modes) x 4`` CPU forwards (``layers`` x ``seqs``, ``rows`` causal rows). Needs
    :func:`megatron_jf.parallel.initialize` (world size 1 is enough).

    Returns:
        ``({mode: {class: elements per token per layer (small model), "bytes_fp32": ...}}, small, k)``.
    """
    import torch

    small, k = small_twin(arch)
    out: dict[str, dict[str, float]] = {}
    for mode in modes:
        grid = {}
        for L in layers:
            model = _build_small_model(small, L, mode)
            for s in seqs:
                g = torch.Generator().manual_seed(s)
                tok = torch.randint(0, small.vocab_size, (rows, s), generator=g)
                pos = torch.arange(s).expand(rows, s)
                cls = dict.fromkeys(CLASSES, 0.0)
                for n, _, _ in saved_tensor_census(model, tok, pos):
                    cls[_classify(n, rows * s, small)] += n
                grid[(L, s)] = cls
        (l1, l2), (s1, s2) = layers, seqs
        dl, ds = l2 - l1, rows * (s2 - s1)
        res = {c: (grid[(l2, s2)][c] - grid[(l1, s2)][c] - grid[(l2, s1)][c] + grid[(l1, s1)][c]) / (dl * ds)
               for c in CLASSES}
        res["bytes_fp32"] = 4 * sum(res.values())
        # per token, independent of the layer count (the final norm): hidden-sized
        res["const"] = sum((grid[(l1, s2)][c] - grid[(l1, s1)][c]) / ds - l1 * res[c] for c in CLASSES)
        out[mode] = res
    return out, small, k


# ----------------------------------------------------------------------------- projection
@dataclasses.dataclass
class Plan:
    """Per-GPU bytes by component, and the inputs that produced them."""

    components: dict[str, int]
    notes: list[str]
    tokens_per_micro: int
    act_bytes_per_token_layer: float

    @property
    def total(self) -> int:
        return sum(self.components.values())


def act_bytes_per_token_layer(meas: dict[str, float], arch, small, tp: int, sequence_parallel: bool,
                              dtype_bytes: int = 2) -> float:
    """Target-model (``arch``) saved bytes per token per layer on one TP rank, from the small twin's
    measurement (elements per token per layer by class), in ``dtype_bytes`` (log-sum-exp in fp32)."""
    rh = arch.hidden_size / small.hidden_size
    rd = arch.head_dim / small.head_dim
    rf = arch.intermediate_size / small.intermediate_size
    hidden = (meas["hidden"] * rh + meas["scalar"]) / (tp if sequence_parallel else 1)
    rope = meas["rope"] * rd
    sharded = (meas["attn"] * rd + meas["ffn"] * rf) / tp
    other = meas["other"] * rh
    return dtype_bytes * (hidden + rope + sharded + other) + 4 * meas["per_head"] / tp


def loss_bytes(arch, tp: int, rows_loss: int, rows_model: int, *, loss_rows_head: bool,
               chunk: int | None, dtype_bytes: int = 2) -> tuple[int, str]:
    """Output layer + loss temporaries of one microbatch on one rank.

    ``loss_rows_head``: the output layer runs on the ``rows_loss`` loss rows only, in chunks
    (:func:`megatron_jf.training.losses.loss_temporary_bytes` when present; else the same formula here:
    5 fp32 ``[chunk, V_local]`` buffers + the fp32 output-weight gradient + the gathered rows).
    Otherwise (today's path): bf16 logits over all ``rows_model`` rows plus six fp32 ``[rows_loss / 3,
    V_local]`` temporaries of the vocab-parallel KL / CE (issue 12 item 3).
    """
    v_local = math.ceil(arch.vocab_size / tp)
    h = arch.hidden_size
    if loss_rows_head:
        try:
            from megatron_jf.training.losses import loss_temporary_bytes
            src = "losses.loss_temporary_bytes"
        except ImportError:
            def loss_temporary_bytes(rows, v, c, *, hidden, dtype_bytes):
                c = rows if not c else min(rows, c)
                return 5 * c * v * 4 + v * hidden * 4 + rows * hidden * dtype_bytes
            src = "planner formula (5 fp32 [chunk, V_local] + fp32 dW + rows)"
        return int(loss_temporary_bytes(rows_loss, v_local, chunk, hidden=h, dtype_bytes=dtype_bytes)), src
    pairs = rows_loss // 3
    return rows_model * v_local * dtype_bytes + 6 * pairs * v_local * 4, "all-row logits + 6 fp32 [C, V_local]"


def plan(arch, meas: dict[str, dict[str, float]], small, *, tp: int = 1, pp: int = 1, dp: int = 1,
         seq_length: int, micro_batch_size: int = 1, num_microbatches: int = 1,
         recompute_granularity: str | None = None, recompute_method: str | None = None,
         recompute_num_layers: int | None = None, sequence_parallel: bool = False,
         use_distributed_optimizer: bool = False, loss_rows_head: bool = True, loss_chunk: int | None = 1024,
         prompt_len: int = 0) -> Plan:
    """Project per-GPU bytes for ``arch`` from the measured activations (see the module docstring).

    Raises:
        ValueError: inconsistent recompute settings or sizes.
    """
    if tp < 1 or pp < 1 or dp < 1 or seq_length < 1 or micro_batch_size < 1:
        raise ValueError("tp, pp, dp, seq_length and micro_batch_size must be >= 1")
    mode = recompute_granularity or "none"
    if mode not in MODES:
        raise ValueError(f"recompute granularity {recompute_granularity!r} not in full/selective")
    if mode == "full" and (recompute_method not in ("uniform", "block") or not recompute_num_layers):
        raise ValueError("--recompute-granularity full needs --recompute-method uniform|block and "
                         "--recompute-num-layers N")
    notes = []
    p = params(arch, tp, pp)
    local = p["layers"] + p["embedding"] + p["output"] + p["final_norm"]  # first==last stage when pp == 1
    if pp > 1:
        local = p["layers"] + max(p["embedding"], p["output"] + p["final_norm"])
        notes.append("PP > 1: parameters of the heavier end stage (embedding or output layer)")
    comp = {
        "weights (bf16)": 2 * local,
        "gradients (fp32 DDP buffer)": 4 * local,
        "optimizer (fp32 main + Adam m, v)": 12 * local // (dp if use_distributed_optimizer else 1),
    }
    if use_distributed_optimizer:
        notes.append(f"distributed optimizer: fp32 main params and Adam moments sharded over DP={dp}")
    tokens = 2 * micro_batch_size * seq_length
    L = math.ceil(arch.num_layers / pp)
    per_none = act_bytes_per_token_layer(meas["none"], arch, small, tp, sequence_parallel)
    per_mode = act_bytes_per_token_layer(meas[mode], arch, small, tp, sequence_parallel)
    if meas[mode]["other"]:
        notes.append(f"{meas[mode]['other']:.0f} saved elements per token per layer of unknown kind (not split)")
    if mode == "full":
        n = min(recompute_num_layers, L)
        if recompute_method == "uniform":
            # chunk inputs kept for every chunk; one chunk's full activations live during its backward
            act = tokens * (math.ceil(L / n) * per_mode + n * per_none)
        else:  # block: the first n layers recomputed, the rest keep everything (+1 layer rerun in the backward)
            act = tokens * (n * per_mode + (L - n) * per_none + (per_none if n else 0))
    else:
        act = tokens * L * per_mode
    act += tokens * 2 * meas[mode]["const"] * arch.hidden_size / small.hidden_size / (tp if sequence_parallel else 1)
    in_flight = min(pp, num_microbatches) if pp > 1 else 1
    comp["activations"] = int(act * in_flight)
    rows_loss = 3 * micro_batch_size * max(seq_length - prompt_len, 1)  # student + teacher + AR rows
    lb, src = loss_bytes(arch, tp, rows_loss, tokens, loss_rows_head=loss_rows_head, chunk=loss_chunk)
    comp["logits + loss temporaries"] = lb
    notes.append(f"loss: {src}; {rows_loss} loss rows per microbatch")
    if mode == "selective":
        notes.append("selective recomputes core attention only; with a flash-style kernel its inputs (q, k, v) "
                     "and output stay saved by the neighbouring ops, so it frees only the softmax statistics")
    return Plan(comp, notes, tokens, per_mode)


# ----------------------------------------------------------------------------- launch script settings
def settings_from_script(path: str, world_size: int | None = None) -> dict:
    """The training flags of a launch script (``--tp "$TP"`` with ``TP=${TP:-2}`` resolves to 2).

    Reads ``--tp/--pp/--seq-length/--micro-batch-size/--recompute-*/--sequence-parallel/
    --use-distributed-optimizer/--loss-chunk-size/--attention-path``; DP = world / (TP x PP) with the
    script's ``NNODES x GPUS_PER_NODE`` defaults unless ``world_size`` is given.
    """
    text = open(path).read()
    env: dict[str, str] = {}
    for m in re.finditer(r"^\s*(?:export\s+)?([A-Z_][A-Z0-9_]*)=(\S+)", text, re.M):
        name, val = m.group(1), m.group(2)
        d = re.fullmatch(r"\$\{\w+:-([^}]*)\}", val.strip('"'))
        env.setdefault(name, d.group(1) if d else val.strip('"'))

    def resolve(tok: str) -> str:
        for _ in range(5):
            m = re.fullmatch(r'"?\$\{?(\w+)\}?"?', tok)
            if not m or m.group(1) not in env:
                break
            tok = env[m.group(1)]
        return tok

    words = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        try:
            words += shlex.split(line, posix=False)
        except ValueError:
            continue
    flags: dict[str, str | bool] = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else ""
            flags[w] = True if (not nxt or nxt.startswith("--") or nxt in (")", "\\")) else resolve(nxt)

    def num(*names, default=None):
        for n in names:
            if n in flags and flags[n] is not True:
                try:
                    return int(str(flags[n]))
                except ValueError:
                    pass
        return default

    tp = num("--tp", "--tensor-model-parallel-size", default=1)
    pp = num("--pp", "--pipeline-model-parallel-size", default=1)
    if world_size is None:
        nn, g = env.get("NNODES", "1"), env.get("GPUS_PER_NODE", "8")
        world_size = (int(nn) if nn.isdigit() else 1) * (int(g) if g.isdigit() else 8)
    dp = max(1, world_size // (tp * pp))
    mbs = num("--micro-batch-size", default=1)
    gbs = num("--global-batch-size", default=None)
    rg = flags.get("--recompute-granularity")
    return dict(
        tp=tp, pp=pp, dp=dp, seq_length=num("--seq-length", default=16384), micro_batch_size=mbs,
        num_microbatches=max(1, (gbs or dp * mbs) // (dp * mbs)),
        recompute_granularity=rg if isinstance(rg, str) else None,
        recompute_method=flags.get("--recompute-method") if isinstance(flags.get("--recompute-method"), str) else None,
        recompute_num_layers=num("--recompute-num-layers"),
        sequence_parallel="--sequence-parallel" in flags,
        use_distributed_optimizer="--use-distributed-optimizer" in flags,
        loss_chunk=num("--loss-chunk-size", default=1024),
        attention_path=flags.get("--attention-path") if isinstance(flags.get("--attention-path"), str) else None,
    )


# ----------------------------------------------------------------------------- CLI
def _fmt(b: float) -> str:
    return f"{b / GiB:8.2f} GiB"


def report(title: str, pl: Plan, target_gib: float) -> str:
    lines = [title, f"  tokens per microbatch: {pl.tokens_per_micro} (2 streams x micro-batch x seq-length); "
                    f"activations {pl.act_bytes_per_token_layer / 1024:.1f} KiB per token per layer on this rank"]
    for name, b in pl.components.items():
        lines.append(f"  {name:<36s}{_fmt(b)}")
    total = pl.total
    lines.append(f"  {'TOTAL per GPU':<36s}{_fmt(total)}   ({total / 1e9:.1f} GB)")
    fits = total <= H200_BYTES
    lines.append(f"  verdict: {'fits' if fits else 'DOES NOT FIT'} an H200 (141 GB = {H200_BYTES / GiB:.1f} GiB); "
                 f"{'within' if total <= target_gib * GiB else 'ABOVE'} the {target_gib:g} GiB target")
    lines += [f"  note: {n}" for n in pl.notes]
    return "\n".join(lines)


#: The ``pretrain_jf.py`` flags the planner takes (their ``TrainConfig`` definitions).
TRAIN_FLAGS = ("tp", "pp", "sequence_parallel", "use_distributed_optimizer", "recompute_granularity",
               "recompute_method", "recompute_num_layers", "seq_length", "micro_batch_size", "loss_chunk_size")


def build_parser() -> argparse.ArgumentParser:
    """The planner's command line (torch-free). The training settings are ``pretrain_jf.py``'s own flags (the
    ``TrainConfig`` fields: same spellings, types and choices; defaults for a 7B long-context plan)."""
    from megatron_jf import cli
    from megatron_jf.training.config import TrainConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-7b", help=f"shape {sorted(PRESETS)} or an HF model directory")
    p.add_argument("--script", help="take the parallel / recompute / sequence settings from this launch script")
    p.add_argument("--contrast", action="store_true",
                   help="print examples/train_jf_qwen7b_h200.sh's settings and today's settings without recompute")
    p.add_argument("--world-size", type=int, help="GPUs in the job (with --script; default: the script's)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size")
    p.add_argument("--num-microbatches", type=int, default=1, help="microbatches per step (1F1B in flight)")
    cli.add_dataclass_arguments(p, TrainConfig, only=TRAIN_FLAGS, defaults={"seq_length": 16384},
                                helps={"seq_length": "tokens per stream (prompt + response)"})
    p.add_argument("--all-row-logits", action="store_true",
                   help="today's loss path: output layer over all rows, unchunked loss")
    p.add_argument("--target-gib", type=float, default=DEFAULT_TARGET_GIB)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from megatron_jf import parallel

    torch.set_num_threads(1)
    try:
        arch = load_arch(a.model)
    except ValueError as e:
        print(f"train_memory.py: error: {e}", file=sys.stderr)
        return 1
    parallel.initialize(1, 1)
    meas, small, k = measure_activations(arch)
    print(f"model {a.model}: {total_params(arch) / 1e9:.2f} B parameters, h={arch.hidden_size}, "
          f"{arch.num_layers} layers, vocab {arch.vocab_size}")
    print(f"measured on CPU: small twin h={small.hidden_size} ffn={small.intermediate_size} heads "
          f"{small.num_heads}/{small.num_kv_heads} x {small.head_dim}; saved elements per token per layer:")
    for mode, m in meas.items():
        tot = sum(m[c] for c in CLASSES)
        print(f"  {mode:<9s} {tot:9.1f} = {tot / small.hidden_size:5.2f} h_small  ("
              + ", ".join(f"{c} {m[c]:.1f}" for c in CLASSES) + ")")
    runs = []
    if a.script or a.contrast:
        script = a.script or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                          "examples", "train_jf_qwen7b_h200.sh")
        s = settings_from_script(script, a.world_size)
        path = s.pop("attention_path")
        if path == "dense":
            print("note: the script uses --attention-path dense: O(L^2) mask/scores are not planned")
        runs.append((f"{os.path.relpath(script)} settings: " + ", ".join(f"{k_}={v}" for k_, v in s.items()), s,
                     not a.all_row_logits))
        if a.contrast:
            today = dict(s, recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                         sequence_parallel=False, loss_chunk=None)
            runs.append(("today's settings without recomputation (all-row logits, unchunked loss): "
                         + ", ".join(f"{k_}={v}" for k_, v in today.items()), today, False))
    else:
        s = dict(tp=a.tp, pp=a.pp, dp=a.dp, seq_length=a.seq_length, micro_batch_size=a.micro_batch_size,
                 num_microbatches=a.num_microbatches, recompute_granularity=a.recompute_granularity,
                 recompute_method=a.recompute_method, recompute_num_layers=a.recompute_num_layers,
                 sequence_parallel=a.sequence_parallel, use_distributed_optimizer=a.use_distributed_optimizer,
                 loss_chunk=a.loss_chunk_size)
        runs.append(("settings: " + ", ".join(f"{k_}={v}" for k_, v in s.items()), s, not a.all_row_logits))
    for title, s, head in runs:
        try:
            pl = plan(arch, meas, small, loss_rows_head=head, **s)
        except ValueError as e:
            print(f"train_memory.py: error: {e}", file=sys.stderr)
            return 1
        print()
        print(report(title, pl, a.target_gib))
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
