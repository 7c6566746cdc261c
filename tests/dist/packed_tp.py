"""Under torchrun x2: 3 training steps on the packed THD path at TP=2, TP=2 with sequence parallelism, and DP=2
(``--mask nc``), and at TP=2 with sequence parallelism for ``--mask nc_ic`` (gathered-key segments).

Usage: torchrun --nproc_per_node 2 tests/dist/packed_tp.py WORKDIR
Prints ``RESULT {"layout", "loss", "grad_norm"}`` lines (JSON) on global rank 0; tests/test_packed_attention.py
compares them with a single-process two-stream run of the same data and weights.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    from megatron_jf import parallel
    from train_fixtures import train_and_report

    work = sys.argv[1]
    for layout, name, tp, sp in (("tp2", "two_stream_kl", 2, False), ("tp2_sp", "two_stream_kl", 2, True),
                                 ("dp2", "two_stream_kl", 1, False), ("tp2_sp_ncic", "dense_ncic_ref", 2, True)):
        train_and_report(work, layout, name, tp=tp, attention_path="packed", sequence_parallel=sp)
    parallel.destroy()


if __name__ == "__main__":
    main()
