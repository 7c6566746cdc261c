#!/usr/bin/env python
"""fp32 product kernels of the lean forward on this CPU, as a decode step reads them: one weight after another from
memory, a few rows at a time.

    python -m bench.cpu_products                              # SmolLM2-135M's shapes, 1-16 rows, ~2 min
    python -m bench.cpu_products --shapes 3072x576 --rows 1,4,8,16 --mb 300

For each weight shape ``OUTxIN``, ``--mb`` megabytes of random weights of that shape (several copies: more than the
caches hold, so each product streams its weight from memory as a forward of a larger model does) are multiplied in
turn by ``r`` random rows, through the kernels of :data:`~megatron_jf.inference.lean_forward.PRODUCT_KERNELS` that
need no oneDNN: ``skinny`` (this project's C kernel, :meth:`~megatron_jf.inference.cpu_glue.Glue.skinny_mm`, where
the C glue builds; up to :data:`~megatron_jf.inference.lean_forward.SKINNY_MAX_ROWS` rows a pass), ``linear``
(``F.linear``, MKL) and ``transposed`` (``x @ W_t`` on an ``[in, out]`` copy, MKL).
Prints microseconds per product (the median of ``--repeats`` passes, kernels interleaved) and each kernel's time over
its own one-row time, with the CPU's flags; asserts every kernel's result equals ``F.linear``'s up to rounding. One
thread (``torch.set_num_threads(1)``), as the decode benches run. The choice the engine makes from such timings is
:func:`megatron_jf.inference.cost_model.calibrate_products` (timed on the model's own weights).
"""

from __future__ import annotations

import argparse
import statistics
import time

SMOLLM2 = ("960x576", "576x576", "3072x576", "576x1536", "49152x576")


def _shapes(text: str) -> list[tuple[int, int]]:
    """``"960x576,3072x576"`` -> ``[(960, 576), (3072, 576)]``; argparse's error naming the bad entry otherwise."""
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise argparse.ArgumentTypeError(f"a weight shape is OUTxIN with positive integers, got {item!r}")
        out.append((int(parts[0]), int(parts[1])))
    return out


def _rows(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (positive integers); argparse's error naming the bad entry otherwise."""
    out = []
    for item in text.split(","):
        if not item.strip().isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(f"rows are positive integers, got {item!r}")
        out.append(int(item))
    return out


def build_parser():
    """The command line (torch-free)."""
    from megatron_jf import cli

    from bench import common

    p = common.parser(__doc__)
    p.add_argument("--shapes", type=_shapes, default=_shapes(",".join(SMOLLM2)),
                   help="weight shapes OUTxIN, comma-separated (default: SmolLM2-135M's)")
    p.add_argument("--rows", type=_rows, default=_rows("1,2,3,4,6,8,12,16"), help="product rows, comma-separated")
    p.add_argument("--mb", type=cli.positive_int, default=600, help="megabytes of weight copies per shape")
    common.REPEATS.add(p, default=3, help="passes per point, kernels interleaved (the median is printed)")
    return p


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    import torch
    import torch.nn.functional as F

    from bench.common import cpu_flags
    from megatron_jf.inference import cpu_glue

    torch.set_num_threads(1)
    glue = cpu_glue.load()
    rows = a.rows
    print(f"CPU: {cpu_flags()}; torch {torch.__version__}, 1 thread; skinny: "
          + ("none (no C glue here)" if glue is None else f"{glue.path} (fused multiply-adds: {glue.fused})"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, k in a.shapes:
            shape = f"{n}x{k}"
            copies = max(1, int(a.mb * 1e6 / (n * k * 4)))
            ws = [torch.randn(n, k, generator=gen) for _ in range(copies)]
            kernels = {"linear": [(lambda x, w=w: F.linear(x, w)) for w in ws]}
            wts = [w.t().contiguous() for w in ws]
            kernels["transposed"] = [(lambda x, wt=wt: x @ wt) for wt in wts]
            if glue is not None:
                pans = [glue.pack_panels(w) for w in ws]
                kernels["skinny"] = [(lambda x, p=p, w=w: glue.skinny_mm(x, p, w)) for p, w in zip(pans, ws)]
            table = {}
            for r in rows:
                x = torch.randn(r, k, generator=gen)
                ref = F.linear(x, ws[0])
                for name, fns in kernels.items():
                    torch.testing.assert_close(fns[0](x), ref, rtol=1e-4, atol=k * 1e-5)
                t = {name: [] for name in kernels}
                for _ in range(a.repeats):
                    for name, fns in kernels.items():
                        t0 = time.perf_counter()
                        for f in fns:
                            f(x)
                        t[name].append((time.perf_counter() - t0) / len(fns))
                table[r] = {name: statistics.median(v) * 1e6 for name, v in t.items()}
            print(f"\n{shape} ({copies} copies, {copies * n * k * 4 / 1e6:.0f} MB), us per product "
                  "(x its one-row time):")
            print("| kernel | " + " | ".join(f"{r} rows" for r in rows) + " |")
            print("|---|" + "---|" * len(rows))
            for name in kernels:
                one = table[rows[0]][name]
                print(f"| {name} | " + " | ".join(f"{table[r][name]:.0f} ({table[r][name] / one:.2f})" for r in rows)
                      + " |")


if __name__ == "__main__":
    main()
