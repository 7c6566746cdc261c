"""MR verification of recycled candidates (paper Sec. 3.2, rejection recycling; walk-through Sec. 3.4.6).

Each MR forward verifies the real-active (RA) block's Jacobi draft ``d`` and up to ``v - 1`` candidates
``c`` from the n-gram pool, all continuations of the newest known token ``last``. The branch with the most
greedily-matching tokens wins (the Jacobi draft on ties); its accepted prefix is emitted. Two ways to run
it, with the same emitted tokens:

``tree``    one forward over ``[last] + draft + c_1 + ... + c_{v-1}``, every candidate a branch that sees
            ``last`` and itself under a tree mask (:func:`tree_mask`), sharing the prefix KV. Right where
            extra tokens are nearly free: a GPU at small batch runs 65 tokens about as fast as 17 (the
            paper sizes n x v to the roofline knee), and a second pass would read all weights again.
``pruned``  the main chain ``[last] + draft`` first; then a second pass over only the candidate rows
            that can still be accepted (:func:`live_candidates`): a candidate can beat the draft only if
            it shares exactly the draft's accepted prefix (``k`` tokens) and continues with the greedy
            prediction ``g[k]`` there -- otherwise its greedy match is at most ``k``. Its first ``k`` rows
            are the main chain's rows (same tokens, same context: their keys/values and logits are reused,
            not recomputed), and live candidates that share more tokens share those rows too (a trie).
            Right where compute is the cost (a CPU): most forwards have no live candidate and cost one
            Jacobi forward. Rows of ``draft_width="auto"`` (the default) run no second pass: their candidates
            are checked against the main chain's predictions only (their statistics,
            :meth:`~megatron_jf.decoding.mr.MRPolicy.record`), and the best one leads the next step's draft
            where it is expected to accept most. A second pass costs a whole forward on a CPU, and a live
            candidate's tokens mostly come back as the next draft's head: the quickstart JF model at batch 1
            (16 held-out problems, Intel Xeon, one thread) ran 1.23x AR without second passes against 1.14-1.15x
            with them (TPF 1.63 against 1.79, the same run); SmolLM2-135M on HumanEval prompts ran the same
            (TPF 1.75 against 1.86). Fixed-width rows (the paper's MR) keep it.

``auto`` (the default) picks ``pruned`` on CPU and ``tree`` on CUDA; ``MEGATRON_JF_MR_VERIFY`` or
``Engine(options=InferenceOptions(mr_verify=...))`` overrides it (:mod:`megatron_jf.inference.options`). Sampling is
unaffected: the winner is chosen from greedy match lengths, which the pruning preserves, and then verified with the
speculative rule on its own logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_jf.decoding.base import accepted_prefix
from megatron_jf.inference.forward import forward_logits
from megatron_jf.inference.sampling import argmax_list

@dataclass
class Branch:
    """The winning recycled candidate of one row.

    Attributes:
        tokens: the candidate ``c`` (draft tokens after ``last``).
        logits: float ``[len(c) + 1, V]``; row ``j`` predicts ``c[j]`` (row ``len(c)``: the token after it).
        slots: ``len(c) + 1`` KV slots of this forward's block: ``last``, then ``c[0]``, ``c[1]``, ... (the
            engine commits the first ``len(emitted)`` of them).
        matched: its greedy match length (> the Jacobi draft's).
        next_token: the greedy prediction after ``tokens[:matched]`` (what greedy decoding emits next).
    """

    tokens: list[int]
    logits: torch.Tensor
    slots: list[int]
    matched: int
    next_token: int


matches = accepted_prefix  # the longest prefix of ``draft`` equal to the greedy predictions ``g``


def tree_mask(n_main: int, cand_lens: list[int], s: int) -> torch.Tensor:
    """Bool ``[s, s]`` visibility for the ``tree`` layout: causal main chain ``[0, n_main)``, then one branch per
    candidate (``cand_lens``, back to back) that sees new token 0 (``last``) and itself, causally; padding rows
    past the branches see everything before them (never read)."""
    tree = torch.ones(s, s, dtype=torch.bool).tril_()
    off = n_main
    for n in cand_lens:
        tree[off:off + n, 1:off] = False
        tree[off + n:, off:off + n] = False
        off += n
    return tree


def best_in_tree(main_logits: torch.Tensor, g: list[int], k_main: int, logits: torch.Tensor,
                 cands: list[list[int]], n_main: int) -> Branch | None:
    """The winning candidate of a ``tree`` forward, or None when the Jacobi draft wins.

    Args:
        main_logits: ``[n_main, V]`` rows of ``[last] + draft``; ``g`` their argmax; ``k_main`` the draft's match.
        logits: float ``[s, V]`` the whole row (candidates at ``n_main``, back to back).
        cands: the candidates in layout order.

    Returns:
        the candidate with the longest greedy match if it beats ``k_main`` (first such on ties), its logits and
        slots in this forward's block; else None. Paper Sec. 3.2 (rejection recycling: the best-matching draft wins).
    """
    if not cands:
        return None
    total = sum(len(c) for c in cands)
    gc = argmax_list(logits[n_main:n_main + total])
    best, best_k, off = None, k_main, 0
    for c in cands:
        k = 0
        if c and c[0] == g[0]:  # row 0 of the candidate is `last`'s row of the main chain
            k = 1
            while k < len(c) and c[k] == gc[off + k - 1]:
                k += 1
        if k > best_k:
            best_k, best = k, (c, off)
        off += len(c)
    if best is None:
        return None
    c, off = best
    o = n_main + off
    lg = torch.cat([main_logits[:1], logits[o:o + len(c)]], 0)
    return Branch(c, lg, [0] + list(range(o, o + len(c))), best_k, gc[off + best_k - 1])


def live_candidates(draft: list[int], g: list[int], k_main: int, cands: list[list[int]]) -> list[list[int]]:
    """The candidates that can win against a Jacobi draft that matched ``k_main`` tokens: those equal to the draft
    on exactly its first ``k_main`` tokens and then equal to the greedy prediction ``g[k_main]``. (Sharing fewer
    draft tokens, a candidate breaks inside the accepted prefix; sharing more, it carries the draft's rejected
    token: either way its greedy match is at most ``k_main``.)"""
    k = k_main
    if k >= len(g):
        return []
    out = []
    for c in cands:
        if len(c) > k and c[k] == g[k] and c[:k] == draft[:k]:
            out.append(c)
    return out


def _trie(suffixes: list[list[int]]):
    """Prefix trie of token lists: ``(tokens, parents, depths, paths)``, nodes in first-seen order, ``paths[i]``
    the node index of each token of ``suffixes[i]``."""
    tokens, parents, depths, paths = [], [], [], []
    index: dict[tuple[int, int], int] = {}
    for suf in suffixes:
        node, path = -1, []
        for t in suf:
            nxt = index.get((node, t))
            if nxt is None:
                nxt = len(tokens)
                index[(node, t)] = nxt
                tokens.append(t)
                parents.append(node)
                depths.append(0 if node < 0 else depths[node] + 1)
            path.append(nxt)
            node = nxt
        paths.append(path)
    return tokens, parents, depths, paths


def pruned_second_pass(model, cache, *, base: int, block: int, main_logits: torch.Tensor, g: list[int],
                       k_main: int, live: list[list[int]], impl: str = "auto") -> tuple[Branch | None, int]:
    """Verify the live candidates of one row after its main-chain forward (``pruned`` mode).

    The main chain ``[last] + draft`` was just forwarded into ``cache`` (one row, uncommitted, ``block`` new slots,
    ``last`` at position ``base``). The live candidates' tokens after the shared ``k_main`` draft tokens are
    forwarded as one trie into the slots after the block: each sees ``last``, the shared draft tokens and its
    trie ancestors. Nothing is committed.

    Args:
        model: the model; cache: a one-row :class:`~megatron_jf.models.kv_cache.KVCache` (or row view).
        base: position of ``last``; block: new slots the main-chain forward used (its width, padding included).
        main_logits: ``[1 + len(draft), V]``; g: their argmax; k_main: the draft's greedy match.
        live: candidates from :func:`live_candidates` (non-empty).

    Returns:
        ``(winner, tokens forwarded)``; the winner always beats the draft (live candidates match >= k_main + 1).

    Raises:
        ValueError: the trie does not fit in the cache after the block (``KVCache.begin``: overflow).
    """
    k = k_main
    toks, parents, depths, paths = _trie([c[k:] for c in live])
    s2 = len(toks)
    region = block + s2
    mask = torch.zeros(1, s2, region, dtype=torch.bool)
    mask[0, :, :k + 1] = True  # `last` and the shared draft tokens
    for i, p in enumerate(parents):
        if p >= 0:
            mask[0, i, block:block + s2] = mask[0, p, block:block + s2]
        mask[0, i, block + i] = True
    pos = torch.tensor([[base + 1 + k + d for d in depths]])
    lg2 = forward_logits(model, torch.tensor([toks]), pos, kv_cache=cache, new_mask=mask,
                         slots=torch.arange(block, region), region=region, impl=impl)[0]
    g2 = argmax_list(lg2)
    best, best_k = None, k_main
    for c, path in zip(live, paths):
        m = k + 1  # c[:k] is the accepted draft prefix, c[k] == g[k]
        while m < len(c) and c[m] == g2[path[m - k - 1]]:
            m += 1
        if m > best_k:
            best_k, best = m, (c, path)
    c, path = best
    idx = torch.tensor(path)
    lg = torch.cat([main_logits[:k + 1], lg2[idx]], 0)
    slots = list(range(k + 1)) + [block + j for j in path]
    return Branch(c, lg, slots, best_k, g2[path[best_k - k - 1]]), s2
