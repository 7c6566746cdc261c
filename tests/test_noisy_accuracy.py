"""Noisy-token accuracy by distance (megatron_jf.eval.noisy_accuracy) against the engine's own Jacobi iterations.

A Jacobi trajectory recorded by the engine is its own reference: the draft after a forward is the model's prediction
at every position of the draft before it (the Jacobi update; the final forward of a block turns its last draft into
the fixed point). So for every recorded state ``s`` with first wrong offset ``f``, the measure's prediction at
``j > f`` (a plain causal forward over prompt + earlier fixed points + the state) must be right exactly when the
next recorded state (or the fixed point, after the last) holds the fixed-point token at ``j``."""
import torch

from tests.test_collect import _mcore, _prompts


def _reference(records):
    right, total, runs = {}, {}, []
    for rec in records:
        for b in rec.blocks:
            fp = b.fixed_point
            states = list(b.drafts) + [fp]
            for s in range(b.num_states):
                d = states[s]
                diff = torch.nonzero(d != fp).flatten()
                if not diff.numel() or int(diff[0]) >= fp.shape[0] - 1:
                    continue
                f, nxt = int(diff[0]), states[s + 1]
                run, in_run = 0, True
                for j in range(f + 1, fp.shape[0]):
                    ok = int(nxt[j]) == int(fp[j])
                    total[j - f] = total.get(j - f, 0) + 1
                    right[j - f] = right.get(j - f, 0) + ok
                    in_run = in_run and ok
                    run += in_run
                runs.append(run)
    return right, total, runs


def test_noisy_accuracy_equals_the_engines_jacobi_updates(mp1):
    from megatron_jf.data.collect import build_record
    from megatron_jf.eval.noisy_accuracy import noisy_accuracy
    from megatron_jf.inference.engine import DecodeConfig, Engine
    from megatron_jf.models.zoo import tiny_hf_model

    model = _mcore(tiny_hf_model(seed=7))
    prompts = _prompts(6, seed=4)
    n = 6
    res = Engine(model).generate(prompts, DecodeConfig("jacobi", block_size=n), max_new_tokens=30,
                                 record_trajectory=True)
    recs = [build_record(f"s{i}", p, r, n, frozenset()) for i, (p, r) in enumerate(zip(prompts, res))]
    right, total, runs = _reference(recs)
    assert sum(total.values()) > 50 and 0 < sum(right.values()) < sum(total.values())  # not vacuous
    got = noisy_accuracy(model, recs, max_states_per_block=10 ** 6, batch_rows=5)
    assert got.total == total and got.right == right
    assert got.run_lengths == runs and got.states == len(runs)
    summ = got.summary(distances=(1, 2, 3))
    assert summ["acc_k1"] == round(right[1] / total[1], 4)
    r3 = sum(v for k, v in right.items() if k >= 3)
    assert summ["acc_k3+"] == round(r3 / sum(v for k, v in total.items() if k >= 3), 4)
    # subsampling keeps at most that many states per block, evenly spread
    few = noisy_accuracy(model, recs, max_states_per_block=1)
    assert few.states <= sum(r.num_blocks for r in recs) < got.states
