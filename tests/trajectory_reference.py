"""An independent reference for the trajectory collectors (this project's engine, ``--engine vllm``): block-wise Jacobi
decoding (paper Sec. 2.1, :class:`megatron_jf.decoding.JacobiPolicy`) verified by a plain ``transformers`` forward,
one prompt at a time, and the comparison of collected records with it, near-ties of the logits counted.

Runs in every environment (``transformers`` and torch only; no megatron-core, no vLLM): the primary environment checks
this project's collector against it (``tests/test_collect_reference.py``), the vLLM environment checks the vLLM
collector against it (``tests/test_vllm_collect.py``), so the two collectors are each equal to the same
reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_jf.decoding import DecodeConfig, JacobiPolicy, Outcome, accepted_prefix

#: a logit margin (top-1 minus top-2, fp32) below this is a near-tie: two correct fp32 implementations may order
#: the two tokens differently
NEAR_TIE = 1e-3


def tiny_models():
    """The tiny fp32 models every collector test uses (head size 32, as vLLM's CPU attention needs; vocabulary 256,
    EOS 255): ``rand``, a random Llama (drafts are almost never accepted: many states per block); ``cycle``, a Qwen2
    whose greedy continuation walks cycles of 4 consecutive ids (252 -> 253 -> 254 -> 255=EOS: EOS after a few
    tokens); ``peaked``, a Qwen2 that repeats its last token (with ``repeat`` drafts every block is accepted whole in
    one forward: bonus tokens past a block's end, EOS and the length limit inside an accepted draft)."""
    from megatron_jf.models.zoo import peaked_hf_model, tiny_hf_model

    shape = dict(hidden=128, heads=4, kv_heads=2, ffn=192)
    return {"rand": tiny_hf_model("llama", seed=2, scale=0.3, **shape),
            "cycle": peaked_hf_model("qwen2", period=4, seed=4, **shape),
            "peaked": peaked_hf_model("qwen2", period=1, seed=6, **shape)}


def random_prompts(k: int, *, seed: int, vocab: int = 256, lo: int = 2, hi: int = 40) -> list[list[int]]:
    """``k`` random prompts of ``lo``..``hi-1`` tokens (ids 3..vocab-2: no EOS inside a prompt)."""
    import random

    rnd = random.Random(seed)
    return [[rnd.randrange(3, vocab - 1) for _ in range(rnd.randrange(lo, hi))] for _ in range(k)]


def collector_prompts() -> list[list[int]]:
    """The collector tests' 10 prompts (2..39 tokens): prompts 0, 2, 6, 8 end in 252..254 (the ``cycle`` model
    reaches EOS within a few tokens), prompts 4 and 9 in the EOS 255 (the ``peaked`` model emits it at once)."""
    prompts = random_prompts(10, seed=5)
    for i in range(0, len(prompts), 2):
        prompts[i][-1] = 252 + i % 3
    for i in (4, 9):
        prompts[i][-1] = 255
    return prompts


@dataclass
class Reference:
    """One prompt decoded by :func:`reference_decode`.

    Attributes:
        tokens: the response; trajectory: per block ``{"context_len", "drafts", "fixed_point"}``;
        finish_reason: ``eos`` | ``length``; forwards: Jacobi iterations;
        margins: per iteration, the smallest top-1 minus top-2 logit margin over its ``len(draft) + 1`` positions.
    """

    tokens: list[int]
    trajectory: list[dict]
    finish_reason: str
    forwards: int
    margins: list[float] = field(default_factory=list)


def _predict(hf, tokens: list[int], start: int):
    """argmax (first index on ties) and top-1 minus top-2 margin at every position from ``start`` on."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0, start:].float()
    top = logits.topk(2, dim=-1).values
    return logits.numpy().argmax(-1).tolist(), float((top[:, 0] - top[:, 1]).min())


def reference_decode(hf, prompt: list[int], *, block_size: int, seed: int, max_new_tokens: int, eos_ids,
                     draft_init: str = "context") -> Reference:
    """Block-wise Jacobi with trajectory recording, ``transformers`` as the verifier: each iteration forwards
    ``prompt + output + draft`` in full (no KV cache), emits the accepted prefix and one more token, stops after the
    first EOS or at ``max_new_tokens`` (tokens past either dropped), otherwise applies the policy's Jacobi update."""
    policy = JacobiPolicy(DecodeConfig("jacobi", block_size=block_size, draft_init=draft_init))
    st = policy.new_state(list(prompt), seed, record_trajectory=True)
    out: list[int] = []
    margins = []
    while True:
        ctx = list(prompt) + out
        g, margin = _predict(hf, ctx + st.draft, len(ctx) - 1)
        margins.append(margin)
        k = accepted_prefix(st.draft, g)
        emitted = st.draft[:k] + [g[k]]
        stop = next((j for j, t in enumerate(emitted) if t in eos_ids), None)
        if stop is not None:
            emitted = emitted[:stop + 1]
        emitted = emitted[:max_new_tokens - len(out)]
        out += emitted
        if (emitted and emitted[-1] in eos_ids) or len(out) >= max_new_tokens:
            policy.finish(st, out)
            reason = "eos" if out[-1] in eos_ids else "length"
            return Reference(out, st.traj, reason, len(margins), margins)
        policy.observe(st, list(prompt) + out, Outcome(g, emitted, len(emitted) - 1))


def greedy(hf, prompt: list[int], *, max_new_tokens: int, eos_ids) -> tuple[list[int], float]:
    """``transformers`` greedy decoding (``generate``, no sampling): the response up to and including the first
    EOS, and the smallest top-1 minus top-2 logit margin along it."""
    import torch

    with torch.no_grad():
        r = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                        eos_token_id=sorted(eos_ids), pad_token_id=0, output_scores=True,
                        return_dict_in_generate=True)
    toks = r.sequences[0, len(prompt):].tolist()
    stop = next((j for j, t in enumerate(toks) if t in eos_ids), None)
    if stop is not None:
        toks = toks[:stop + 1]
    scores = torch.stack(r.scores[:len(toks)])[:, 0].float()
    top = scores.topk(2, dim=-1).values
    return toks, float((top[:, 0] - top[:, 1]).min())


def states_of(record) -> list[list[int]]:
    """A record's (or a reference trajectory's) drafts in decoding order: block by block, state by state."""
    if hasattr(record, "blocks"):
        return [row for b in record.blocks for row in b.drafts.tolist()]
    return [list(row) for b in record for row in b["drafts"]]


@dataclass
class Comparison:
    """Records against references: ``equal`` ids; ``near_ties`` ids that differ first where the reference's
    margin was below :data:`NEAR_TIE` (id -> margin); ``different`` ids that differ anyway (id -> what)."""

    equal: list = field(default_factory=list)
    near_ties: dict = field(default_factory=dict)
    different: dict = field(default_factory=dict)

    def summary(self) -> str:
        return (f"{len(self.equal)} equal, {len(self.near_ties)} differ at a near-tie {self.near_ties}, "
                f"{len(self.different)} differ otherwise {self.different}")


def compare(records: dict, refs: dict[str, Reference], block_size: int) -> Comparison:
    """Compare collected records (id -> :class:`~megatron_jf.data.trajectory.TrajectoryRecord`) with references
    (id -> :class:`Reference`): block layout (context lengths), every state, the fixed points, ``eos_reached``.

    A record that differs is a near-tie when the reference's smallest margin over the iterations up to the first
    differing state (iteration ``j`` produced state ``j``; all iterations when only fixed points differ) is below
    :data:`NEAR_TIE`; the initial draft (state 0) differing is never a near-tie (it depends on no logits).
    """
    cmp = Comparison()
    for sid in sorted(refs):
        ref, rec = refs[sid], records.get(sid)
        if rec is None:
            cmp.different[sid] = "missing"
            continue
        a, b = states_of(rec), states_of(ref.trajectory)
        layout = ([blk.context_len for blk in rec.blocks], [blk["context_len"] for blk in ref.trajectory])
        fixed = (rec.response_ids().tolist(), ref.tokens)
        same = (a == b and layout[0] == layout[1] and fixed[0] == fixed[1]
                and rec.eos_reached == (ref.finish_reason == "eos") and rec.block_size == block_size)
        if same:
            cmp.equal.append(sid)
            continue
        j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j == 0:
            cmp.different[sid] = "initial draft"
            continue
        margin = min(ref.margins[: j] if j is not None else ref.margins)
        if margin < NEAR_TIE:
            cmp.near_ties[sid] = margin
        else:
            cmp.different[sid] = f"state {j} (reference margin {margin:.3g})"
    return cmp
