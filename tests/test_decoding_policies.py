"""The engine-independent drafting policies (megatron_jf/decoding, issue 22) on hand-written token sequences:
accepted prefix, the next draft of each decoder, EOS inside a block, trajectories, MR's candidate selection,
pool update, spawning and promotion -- and a model-free reference loop (a next-token function stands in for the
verifier) that checks every decoder emits exactly the greedy AR sequence. No model, no torch."""
import subprocess
import sys

import pytest

from megatron_jf.decoding import (DecodeConfig, MRState, Outcome, accepted_prefix, draft_rng, forward_width,
                                  policy_for)
from megatron_jf.decoding.ngram_pool import NGramPool


def _step(policy, state, context, g, winner=None, cand=None):
    """Greedy verification of one step as an engine does it: emitted = accepted prefix + g[k]; returns the new
    context after ``observe``."""
    draft = cand if cand is not None else state.draft
    k = accepted_prefix(draft, g)
    emitted = draft[:k] + [g[k]]
    context = context + emitted
    policy.observe(state, context, Outcome(predictions=g, emitted=emitted, from_draft=k, winner=winner))
    return context


def test_package_imports_no_torch_numpy_or_megatron_core():
    code = ("import sys, megatron_jf.decoding, megatron_jf.decoding.mr, megatron_jf.decoding.jacobi\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'megatron'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_accepted_prefix():
    assert accepted_prefix([5, 6, 7], [5, 6, 8, 9]) == 2
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 9]) == 3
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 9]) == 0
    assert accepted_prefix([], [4]) == 0


def test_draft_init_context_and_repeat():
    prompt = [11, 12, 13, 14, 15]
    pol = policy_for(DecodeConfig("jacobi", block_size=6))
    a, b = pol.new_state(prompt, 3), pol.new_state(prompt, 3)
    assert a.draft == b.draft and len(a.draft) == 6 and set(a.draft) <= set(prompt)
    # the draws are uniform picks with the request's own generator, seeded by the seed and the prompt
    rnd = draft_rng(prompt, 3)
    assert a.draft == [prompt[rnd.randrange(5)] for _ in range(6)]
    assert pol.new_state(prompt, 4).draft != a.draft or pol.new_state(prompt[::-1], 3).draft != a.draft
    rep = policy_for(DecodeConfig("jacobi", block_size=3, draft_init="repeat")).new_state(prompt, 0)
    assert rep.draft == [15, 15, 15]
    assert policy_for(DecodeConfig("ar")).new_state(prompt, 0).draft == []
    with pytest.raises(ValueError, match="empty"):
        pol.new_state([], 0)
    with pytest.raises(ValueError, match="trajectories are recorded by the 'jacobi' decoder"):
        policy_for(DecodeConfig("mr")).new_state(prompt, 0, record_trajectory=True)


def test_jacobi_next_draft_fixed_point_and_trajectory():
    pol = policy_for(DecodeConfig("jacobi", block_size=4, draft_init="repeat"))
    st = pol.new_state([1, 2, 3], 0, record_trajectory=True)
    assert st.draft == [3, 3, 3, 3] and st.block_end == 4
    ctx = _step(pol, st, [1, 2, 3], [3, 3, 20, 21, 22])  # 2 accepted + correction 20
    assert ctx == [1, 2, 3, 3, 3, 20]
    assert st.draft == [21]  # g[k+1:], only the one unknown position left in the block
    ctx = _step(pol, st, ctx, [21, 30])  # the block is complete: its fixed point
    assert st.block_end == 8 and st.draft == [30, 30, 30]  # the next block: 30 (bonus) known, 3 fresh
    assert st.traj[0] == {"context_len": 3, "drafts": [[3, 3, 3, 3], [3, 3, 20, 21]], "fixed_point": [3, 3, 20, 21]}
    assert st.traj[1] == {"context_len": 7, "drafts": [[30, 30, 30, 30]]}


def test_jacobi_eos_inside_a_block_and_bonus_past_the_block_close_the_trajectory():
    pol = policy_for(DecodeConfig("jacobi", block_size=4, draft_init="repeat"))
    st = pol.new_state([1, 2, 3], 0, record_trajectory=True)
    pol.finish(st, [3, 3, 20])  # the engine stopped on EOS 20 (inside the first block): no observe
    assert st.traj == [{"context_len": 3, "drafts": [[3, 3, 3]], "fixed_point": [3, 3, 20]}]
    st = pol.new_state([1, 2, 3], 0, record_trajectory=True)
    ctx = _step(pol, st, [1, 2, 3], [3, 3, 20, 21, 22])
    pol.finish(st, [3, 3, 20, 21, 30])  # the last forward's bonus 30 crossed the block end
    assert st.traj == [{"context_len": 3, "drafts": [[3, 3, 3, 3], [3, 3, 20, 21]], "fixed_point": [3, 3, 20, 21]},
                       {"context_len": 7, "drafts": [[30]], "fixed_point": [30]}]


def test_running_window_refills_to_n():
    pol = policy_for(DecodeConfig("running-window", block_size=4, draft_init="repeat"))
    st = pol.new_state([1, 2, 3], 0)
    st.draft = [5, 6, 7, 8]
    _step(pol, st, [1, 2, 3], [5, 9, 40, 41, 42])  # 1 accepted, correction 9
    assert st.draft == [40, 41, 42, 9]  # g[k+1:], then one fresh token (repeat: the new last token)
    st.draft = [5, 6, 7, 8]
    _step(pol, st, [1, 2, 3], [5, 6, 7, 8, 44])  # all accepted + bonus: the whole window is fresh
    assert st.draft == [44] * 4


def _mr(**kw):
    """MR with a fixed width (the draft is never led by a candidate in the tree layout)."""
    cfg = dict(block_size=4, num_blocks=2, spawn_threshold=0.5, verification_size=3, draft_init="repeat",
               draft_width="fixed")
    return policy_for(DecodeConfig("mr", **{**cfg, **kw}))


def test_mr_pool_update_spawn_and_promotion():
    pol = _mr()
    st = pol.new_state([1, 2, 3], 0)
    assert st.blocks == [4] and st.draft == [3, 3, 3, 3] and pol.propose(st, [1, 2, 3]).candidates == []
    ctx = _step(pol, st, [1, 2, 3], [7, 8, 9, 10, 11])  # nothing accepted: the whole draft is rejected
    # the rejected draft's n-grams, keyed by first token, remembering the token before them (3 = `last`)
    assert st.pool._pool[3] == {(3, 3, 3, 3): 3, (3, 3, 3): 3, (3, 3): 3}
    assert st.draft == [8, 9, 10] and st.blocks == [4]  # Jacobi update shifted past the 1 emitted token
    ctx = _step(pol, st, ctx, [8, 41, 42, 43])  # 1 accepted + correction 41: 3 of the RA block's 4 known
    assert st.pool._pool[9] == {(9, 10): 8}
    # ceil(r*n) = 2 <= 3 accepted: a pseudo-active block spawns, seeded with the prediction past the draft (43)
    assert st.blocks == [4, 8] and st.draft == [42] + [43, 41, 41, 41]
    assert ctx == [1, 2, 3, 7, 8, 41]
    ctx = _step(pol, st, ctx, [42, 43, 44, 45, 46, 47])  # 2 accepted + 44: the RA block is done
    # promotion: block 2 is the RA block now, its carried draft shifted; then it spawns block 3 (2 >= ceil(r*n))
    assert st.blocks == [8, 12] and st.draft == [45, 46] + [47, 44, 44, 44]
    assert st.pool._pool[41] == {(41, 41, 41): 43, (41, 41): 41}


def test_mr_pseudo_active_block_spawns_on_reproduced_tokens():
    pol = _mr(num_blocks=3)
    st = pol.new_state([1, 2, 3], 0)
    st.blocks, st.draft = [4, 8], [5, 6, 7, 60, 61, 62, 63]  # RA: 3 unknown; pseudo-active: 4
    _step(pol, st, [1, 2, 3, 4], [9, 9, 9, 60, 61, 0, 0, 99])  # the model reproduces 60, 61 of the pseudo block
    assert st.blocks == [4, 8, 12] and len(st.draft) == 2 + 4 + 4 and st.draft[:6] == [9, 9, 60, 61, 0, 0]
    assert st.draft[6] == 99  # the new block starts with the prediction just past the draft
    st.blocks, st.draft = [4, 8], [5, 6, 7, 60, 61, 62, 63]
    _step(pol, st, [1, 2, 3, 4], [9, 9, 9, 60, 0, 0, 0, 99])  # only 1 reproduced < ceil(r*n) = 2: no spawn
    assert st.blocks == [4, 8] and st.draft == [9, 9, 60, 0, 0, 0]


def _pool_with_candidates():
    pool = NGramPool(ngram_len=4, max_per_key=8)
    pool.add_rejected(5, [41, 60, 61, 62])
    pool.add_rejected(8, [41, 70, 71])
    pool.add_rejected(9, [41, 80])
    return pool


def test_mr_candidate_selection():
    """Candidates continue `last` (41): the one recorded after `prev` (8) first, then newest first; cut or padded
    with the draft to the RA block's unknown length; the draft itself is not a candidate; at most v-1."""
    pol = _mr()
    st = MRState(prompt_len=3, draft=[50, 51, 52, 90, 91, 92, 93], rng=draft_rng([1], 0), blocks=[4, 8],
                 pool=_pool_with_candidates(), candidates=[])
    ctx = [1, 2, 8, 41]  # one output token (41): 3 unknown RA positions
    assert pol.candidates(st, ctx) == [[70, 71, 52], [80, 51, 52]]
    p = pol.propose(st, ctx)
    assert p.draft == [50, 51, 52, 90, 91, 92, 93] and p.candidates == [[70, 71, 52], [80, 51, 52]]
    assert _mr(verification_size=4).candidates(st, ctx) == [[70, 71, 52], [80, 51, 52], [60, 61, 62]]
    assert _mr(verification_size=1).candidates(st, ctx) == []
    assert pol.candidates(st, [1, 2, 9, 41]) == [[80, 51, 52], [70, 71, 52]]  # prev 9: (41, 80) matches first
    st.draft = [70, 71, 52, 90]
    assert pol.candidates(st, ctx) == [[80, 71, 52], [60, 61, 62]]  # (70, 71) equals the draft: excluded
    # a winning candidate (tree verification): its tokens are emitted; the main chain's predictions past them
    # still carry over (the Jacobi update of output positions 5.., as without a winner), the rejected draft is pooled
    st.draft = [50, 51, 52, 90, 91, 92, 93]
    assert pol.propose(st, ctx).candidates[0] == [70, 71, 52]
    g = [70, 1, 2, 3, 4, 5, 6, 7]  # the draft matches nothing; candidate 0 matches all 3 tokens, bonus 77
    emitted = [70, 71, 52, 77]
    pol.observe(st, ctx + emitted, Outcome(predictions=g, emitted=emitted, from_draft=3, winner=0))
    assert st.blocks == [8] and st.draft == [4, 5, 6]  # the RA block retired; block 2 promoted, 1 of 4 known
    assert st.pool._pool[50] == {(50, 51, 52, 90): 41}


def test_mr_linear_substitutes_the_best_candidate():
    pol = policy_for(DecodeConfig("mr", block_size=4, num_blocks=2, spawn_threshold=0.5, verification_size=3,
                                  draft_width="fixed"), linear=True)
    st = MRState(prompt_len=3, draft=[50, 51, 52, 90, 91, 92, 93], rng=draft_rng([1], 0), blocks=[4, 8],
                 pool=_pool_with_candidates(), candidates=[])
    p = pol.propose(st, [1, 2, 8, 41])
    assert p.candidates == [] and p.draft == [70, 71, 52, 90, 91, 92, 93] and st.draft is p.draft
    st.pool = NGramPool(ngram_len=4)
    st.draft = [50, 51, 52, 90]
    assert pol.propose(st, [1, 2, 8, 41]).draft == [50, 51, 52, 90]  # an empty pool: the Jacobi draft
    assert policy_for(DecodeConfig("jacobi"), linear=True) is policy_for(DecodeConfig("jacobi"))


def test_forward_width():
    assert forward_width(DecodeConfig("ar")) == 1
    assert forward_width(DecodeConfig("jacobi", block_size=16)) == 17
    assert forward_width(DecodeConfig("mr", block_size=16, num_blocks=2, verification_size=4)) == 1 + 32 + 48


# ------------------------------------------------------------------------------------------ a model-free loop
def _mixing(seq):
    """Next token of a deterministic 'model' over 23 tokens that depends on the last two tokens (drafts rarely
    verify)."""
    return (seq[-1] * 7 + seq[-2] * 3 + 1) % 23 if len(seq) > 1 else 5


def _cycle(seq):
    """Next token of a 'model' that repeats a 5-token cycle whatever came before the last token."""
    return {10: 11, 11: 12, 12: 13, 13: 14, 14: 10}.get(seq[-1], 10)


def _decode(cfg, prompt, f, max_new, eos=(), linear=False, seed=0, record=False):
    """An engine in a few lines: tree verification of draft + candidates against ``f``, EOS and length stops."""
    pol = policy_for(cfg, linear)
    st = pol.new_state(prompt, seed, record_trajectory=record)
    ctx, forwards = list(prompt), 0
    while True:
        prop = pol.propose(st, ctx)
        g = [f(ctx + prop.draft[:j]) for j in range(len(prop.draft) + 1)]
        k = accepted_prefix(prop.draft, g)
        emitted, winner = prop.draft[:k] + [g[k]], None
        for i, c in enumerate(prop.candidates):
            gc = [f(ctx + c[:j]) for j in range(len(c) + 1)]
            kc = accepted_prefix(c, gc)
            if kc > len(emitted) - 1:
                emitted, winner = c[:kc] + [gc[kc]], i
        forwards += 1
        done = False
        for j, t in enumerate(emitted):
            if t in eos:
                emitted, done = emitted[: j + 1], True
                break
        room = max_new - (len(ctx) - len(prompt))
        if len(emitted) >= room:
            emitted, done = emitted[:room], True
        ctx = ctx + emitted
        if done:
            pol.finish(st, ctx[len(prompt):])
            return ctx[len(prompt):], forwards, st
        pol.observe(st, ctx, Outcome(g, emitted, len(emitted) - 1, winner))


CONFIGS = ([DecodeConfig("jacobi", block_size=n) for n in (1, 3, 8)]
           + [DecodeConfig("jacobi", block_size=5, draft_init="repeat")]
           + [DecodeConfig("running-window", block_size=n) for n in (1, 4)]
           + [DecodeConfig("mr", block_size=n, num_blocks=K, spawn_threshold=r, verification_size=v)
              for n, K, r, v in [(1, 1, 1.0, 1), (3, 2, 0.5, 2), (8, 2, 0.85, 4), (4, 3, 0.3, 3)]])


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.decoder}-n{c.block_size}-K{c.num_blocks}-{c.draft_init}")
def test_every_policy_reproduces_greedy_ar_in_a_model_free_loop(cfg):
    for f in (_mixing, _cycle):
        for prompt in ([4], [10, 3, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9]):
            ar, fw, _ = _decode(DecodeConfig("ar"), prompt, f, 37)
            assert fw == 37 and len(ar) == 37
            for linear in (False, True):
                out, _, _ = _decode(cfg, prompt, f, 37, linear=linear)
                assert out == ar, (f.__name__, prompt, linear)
            eos = ar[11]  # EOS inside a block: stop at its first occurrence, nothing after it
            out, _, _ = _decode(cfg, prompt, f, 37, eos={eos})
            assert out == ar[: ar.index(eos) + 1]


def test_recycling_and_blocks_pay_off_on_a_cycle():
    """On a cyclic 'model' the n-gram pool holds the cycle after a few rejections: MR needs far fewer forwards than
    plain Jacobi (also as one linear draft); Jacobi with trajectories records fixed points that concatenate to the
    output."""
    prompt, mr = [3, 1, 4], DecodeConfig("mr", block_size=8, num_blocks=2, verification_size=4)
    _, fw_jac, st = _decode(DecodeConfig("jacobi", block_size=8), prompt, _cycle, 200, record=True)
    _, fw_mr, _ = _decode(mr, prompt, _cycle, 200)
    _, fw_lin, _ = _decode(mr, prompt, _cycle, 200, linear=True)
    out, _, _ = _decode(DecodeConfig("ar"), prompt, _cycle, 200)
    assert fw_mr < 0.75 * fw_jac and fw_lin < 0.9 * fw_jac, (fw_mr, fw_lin, fw_jac)  # measured 135, 162, 194
    assert [t for b in st.traj for t in b["fixed_point"]] == out
    assert all(len(d) == len(b["fixed_point"]) for b in st.traj for d in b["drafts"])


# ------------------------------------------------------------------------------------------ context n-grams
def test_context_ngrams_found_and_ranked():
    """Prompt lookup: what followed earlier occurrences of the newest token (3), longer matches of the tokens before
    it first, the earliest occurrence first among equal matches; duplicates and the draft left out; the index
    grows with the text."""
    from megatron_jf.decoding import ContextNGrams

    #          0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    context = [5, 1, 2, 3, 9, 9, 8, 2, 3, 7, 6, 3, 4, 1, 2, 3]
    idx = ContextNGrams(min_match=1, max_match=4)
    # occurrences of 3 at 3 (preceded by 5 1 2: matches 1 2 3 -> 3 tokens), 8 (8 2 3 -> 2), 11 (6 3 -> 1)
    assert idx.candidates(context, 3, 4) == [([9, 9, 8, 2], 3), ([7, 6, 3, 4], 2), ([4, 1, 2, 3], 1)]
    assert idx.candidates(context, 2, 2) == [([9, 9], 3), ([7, 6], 2)]
    assert ContextNGrams(min_match=2, max_match=2).candidates(context, 5, 3) == [([9, 9, 8], 2), ([7, 6, 3], 2)]
    assert idx.candidates(context, 3, 4, exclude=(9, 9, 8, 2)) == [([7, 6, 3, 4], 2), ([4, 1, 2, 3], 1)]
    grown = context + [4, 1, 9, 3]  # the index extends; now the last tokens are 9 3
    fresh = ContextNGrams(min_match=1, max_match=4).candidates(grown, 4, 3)
    assert idx.candidates(grown, 4, 3) == fresh == [([9, 9, 8], 1), ([7, 6, 3], 1), ([4, 1, 2], 1), ([4, 1, 9], 1)]
    assert idx.candidates([7], 3, 4) == []  # no earlier occurrence
    # a continuation that runs into the newest tokens copies on with the pattern's period (it stopped at the end of
    # the context: 4 of 8 tokens for a cycle of 4, so MR's first draft on a repeating prompt was half Jacobi guesses)
    cyc = [1, 2, 3, 4] * 2 + [1]
    assert ContextNGrams(min_match=1, max_match=4).candidates(cyc, 1, 8) == [([2, 3, 4, 1, 2, 3, 4, 1], 4)]
    assert ContextNGrams().candidates([5, 5], 1, 3) == [([5, 5, 5], 1)]
    with pytest.raises(ValueError, match="min_match <= max_match"):
        ContextNGrams(min_match=3, max_match=2)


def test_mr_ranks_context_ngrams_with_recycled_ones_and_lets_the_best_lead():
    pol = policy_for(DecodeConfig("mr", block_size=4, num_blocks=2, spawn_threshold=0.5, verification_size=4,
                                  draft_init="repeat", prompt_lookup_max=4))
    prompt = [11, 12, 41, 60, 61, 62, 63, 64, 70, 12, 41, 80, 81]
    st = pol.new_state(prompt, 0)
    ctx = prompt + [8, 12, 41]  # the output so far ends "12 41": 41 occurs at 2 (after 12: match 2) and 10 (match 2)
    st.blocks, st.draft = [4, 8], [50, 51, 90, 91, 92, 93]  # 3 output tokens: 1 unknown RA position
    st.pool.add_rejected(12, [41, 99, 98])  # recycled: 41 99 98 recorded after 12 (match 2), and 99 98 after 41
    ranked = pol.ranked(st, ctx)
    # match 2 each; context first (earliest occurrence first), then the recycled one
    # (the second runs into the newest tokens and copies on with its period, 5)
    assert ranked == [([60, 61, 62, 63, 64, 70, 12, 41], "context2"), ([80, 81, 8, 12, 41, 80, 81, 8], "context2"),
                      ([99, 98], "pool")]
    assert pol.candidates(st, ctx) == [[60], [80], [99]]  # tree branches: cut to the RA block's 1 unknown token
    # auto: the context n-gram (prior 0.45 a token) is expected to accept more than the Jacobi draft (0.15): it
    # leads the draft, up to K*n = 8 tokens, and the displaced Jacobi guess becomes a candidate
    p = pol.propose(st, ctx)
    assert p.draft == [60, 61, 62, 63, 64, 70, 12, 41] and st.segments == [("context2", 8)]
    assert p.candidates == [[80], [99], [50]] and st.cand_segments[2] == [("draft", 1)]
    assert pol.draft_probs(st) == [0.45] * 8
    # the model rejects context n-grams of this kind a few times: the Jacobi draft leads again
    for _ in range(6):
        st.stats.record("context2", 3, 0)
    st.draft = [50, 51, 90, 91, 92, 93]
    assert pol.propose(st, ctx).draft == [50, 51, 90, 91, 92, 93] and st.segments == [("draft", 6)]
    # fixed width: the draft as it is, context n-grams and recycled ones as branches
    fixed = policy_for(DecodeConfig("mr", block_size=4, num_blocks=2, spawn_threshold=0.5, verification_size=4,
                                    draft_width="fixed"))
    st2 = fixed.new_state(prompt, 0)
    st2.blocks, st2.draft, st2.pool = [4, 8], [50, 51, 90, 91, 92, 93], st.pool
    assert fixed.propose(st2, ctx).draft == [50, 51, 90, 91, 92, 93]
    assert st2.candidates == [[60], [80], [99]]
    # prompt lookup off: only the recycled n-gram
    off = policy_for(DecodeConfig("mr", block_size=4, verification_size=4, prompt_lookup_max=0))
    st3 = off.new_state(prompt, 0)
    st3.blocks, st3.draft, st3.pool = [4, 8], [50, 51, 90, 91, 92, 93], st.pool
    assert off.ranked(st3, ctx) == [([99, 98], "pool")]


def test_mr_keeps_the_jacobi_drafts_statistics_apart_where_the_text_copies():
    """Where an earlier occurrence matches the last COPY_MATCH (3) committed tokens, the Jacobi draft's segments are
    ``draft@context`` (it leads or stands as a candidate next to the copy), elsewhere ``draft``: the credit it earns
    agreeing with a copy does not price it where nothing is copied."""
    from megatron_jf.decoding.mr import COPY_MATCH

    assert COPY_MATCH == 3
    pol = policy_for(DecodeConfig("mr", block_size=4, num_blocks=2, spawn_threshold=0.5, verification_size=4,
                                  draft_init="repeat", prompt_lookup_max=4))
    prompt = [11, 12, 41, 60, 61, 62, 63, 64, 70, 12, 41, 80, 81]
    jac = [50, 51, 90, 91, 92, 93]
    for tail, copying in (([8, 12, 41], False), ([8, 11, 12, 41], True), ([8, 99], False)):
        st = pol.new_state(prompt, 0)
        ctx = prompt + tail  # "12 41" recurs (match 2); "11 12 41" recurs (match 3); 99 never occurred
        st.draft = list(jac)
        st.blocks = [len(tail) + 1, len(tail) + 5]  # one unknown RA position, then a pseudo-active block
        p = pol.propose(st, ctx)
        own = "draft@context" if copying else "draft"
        assert st.copying == copying
        sources = {src for segs in [st.segments] + st.cand_segments for src, _ in segs}
        assert own in sources and ({"draft", "draft@context"} - {own}).isdisjoint(sources), (tail, sources)
        if tail == [8, 99]:  # no context n-gram: the Jacobi draft leads, priced by the 'draft' statistics alone
            st.stats.record("draft@context", 4, 4)
            assert p.draft == jac and pol.draft_probs(st) == st.stats.probs("draft", 6) == [0.15] * 6


def test_context_ngrams_pay_off_on_text_that_repeats_itself():
    """On a 'model' that copies earlier text, MR with context n-grams needs far fewer forwards than without, with the
    same output (the model-free loop above)."""
    def copying(seq):  # continue the earliest earlier occurrence of the last two tokens, else a mixing rule
        for i in range(len(seq) - 2):
            if seq[i] == seq[-2] and seq[i + 1] == seq[-1]:
                return seq[i + 2]
        return (seq[-1] * 5 + 3) % 31

    prompt = [(7 * i) % 29 for i in range(40)] + [0, 7]
    out, _, _ = _decode(DecodeConfig("ar"), prompt, copying, 60)
    on, fw_on, _ = _decode(DecodeConfig("mr", block_size=8), prompt, copying, 60)
    off, fw_off, _ = _decode(DecodeConfig("mr", block_size=8, prompt_lookup_max=0), prompt, copying, 60)
    assert on == off == out
    assert fw_on <= 0.4 * fw_off, (fw_on, fw_off)
