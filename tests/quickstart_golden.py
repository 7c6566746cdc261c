"""Golden figures of a quickstart run: what CI compares the ``--smoke`` run against.

A finished work directory's figures (:func:`run_figures`) -- held-out NLL, greedy distinct-2, Jacobi / MR TPF
and the Jacobi TPF by block size of every model, the trajectory collections' TPF, and the losses the training
rounds logged (``L_pc`` first and last, ``L_AR``, the anchor term) -- are compared with the checked-in values of
``tests/fixtures/quickstart_smoke_golden.json`` within each figure's tolerance (:func:`compare`), so a change in
the losses, masks, packing, noise schedule or decoders that moves what the smoke run learns fails CI.

The fixture is written by this module's command line from a smoke run (``--write``), which keeps the tolerances
already in the file and records the environment and the CPU numerics the run was made under (ATen's CPU capability
and the AVX2 pin of :mod:`megatron_jf.cpu_numerics`; every figure depends on them). The run is made pinned, so that
every x86 CPU computes the same figures; see ``tests/fixtures/README.md``::

    export ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
    python -m recipes.quickstart --smoke --threads 1 --out runs/quickstart-smoke --fresh
    python -m tests.quickstart_golden runs/quickstart-smoke --write tests/fixtures/quickstart_smoke_golden.json

``--compare`` prints both sides' CPU numerics and, when figures are out of tolerance and the code paths differ,
names that as the likely cause.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

from megatron_jf.cpu_numerics import describe, numerics_mismatch
from megatron_jf.fileio import atomic_write_json

__all__ = ["CHECKPOINTS", "run_figures", "run_numerics", "fixture_for", "compare", "default_tolerance", "main"]

#: report label -> checkpoint directory of the quickstart's models
CHECKPOINTS = {"base": "base", "JF round 1": "jf1", "JF round 2": "jf2"}


def _train_records(log_file: Path) -> list[dict]:
    """The ``split == "train"`` records of a trainer ``--log-file`` JSONL, in order."""
    out = []
    for line in log_file.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("split", "train") == "train":
            out.append(rec)
    return out


def run_figures(out: str | Path) -> dict[str, float]:
    """The figures of a finished quickstart work directory (``report/report.json``, the training logs and the
    trajectory manifests), flat ``{"<ckpt>.<figure>": value}``.

    Figures per model (``base``, ``jf1``, ``jf2``): ``nll`` (held-out, nats/token), ``distinct2`` (mean
    per-completion distinct-2 of the greedy outputs), ``jacobi_tpf`` / ``mr_tpf`` (the report's n = ``n2``
    rows), ``tpf_n<k>`` (vanilla Jacobi TPF by block size); ``base.train_loss`` (last logged pretraining loss);
    per JF round ``pc_loss_first`` / ``pc_loss_last`` / ``ar_loss_last`` / ``anchor_loss_last`` (logged train
    steps); per trajectory collection ``traj1.tpf`` / ``traj2.tpf`` (response tokens / recorded drafts).

    Raises:
        FileNotFoundError: the run has no report (it has not finished).
        KeyError: the report lacks a model or decoder row.
    """
    out = Path(out)
    rep = json.loads((out / "report" / "report.json").read_text(encoding="utf-8"))
    rows = {(r["model"], r["decoder"].split(" ")[0]): r for r in rep["rows"]}
    stats = rep.get("output_stats") or {}
    fig: dict[str, float] = {}
    for label, ck in CHECKPOINTS.items():
        if (label, "AR") not in rows:
            continue
        fig[f"{ck}.nll"] = rows[(label, "AR")]["nll"]
        fig[f"{ck}.distinct2"] = stats[label]["distinct_2"]
        fig[f"{ck}.jacobi_tpf"] = rows[(label, "Jacobi")]["tpf"]
        fig[f"{ck}.mr_tpf"] = rows[(label, "MR")]["tpf"]
        for k, v in rep["tpf_by_block_size"][label].items():
            fig[f"{ck}.tpf_n{k}"] = v
        if label in (rep.get("fit_tpf") or {}):
            fig[f"{ck}.fit_tpf"] = rep["fit_tpf"][label]
        log = out / f"{ck}_log.jsonl"
        recs = _train_records(log) if log.is_file() else []
        if ck == "base" and recs:
            fig["base.train_loss"] = recs[-1]["loss"]
        elif recs:
            fig[f"{ck}.pc_loss_first"] = recs[0]["pc_loss"]
            fig[f"{ck}.pc_loss_last"] = recs[-1]["pc_loss"]
            fig[f"{ck}.ar_loss_last"] = recs[-1]["ar_loss"]
            if "anchor_loss" in recs[-1]:
                fig[f"{ck}.anchor_loss_last"] = recs[-1]["anchor_loss"]
    for traj in ("traj1", "traj2"):
        man = out / traj / "manifest.json"
        if man.is_file():
            counts = json.loads(man.read_text(encoding="utf-8"))["counts"]
            fig[f"{traj}.tpf"] = counts["response_tokens"] / counts["states"]
    return {k: float(v) for k, v in sorted(fig.items())}


def run_numerics(out: str | Path) -> dict | None:
    """The CPU numerics (:func:`megatron_jf.cpu_numerics.cpu_numerics`) a quickstart work directory's stages ran
    under, from their ``<stage>.done`` markers; None when no marker records them (a run made before they did).

    Raises:
        ValueError: the stages ran under different ones (a run resumed on another CPU or with another pin): its
            figures mix two code paths and match no fixture.
    """
    seen = []
    for marker in sorted(Path(out).glob("*.done")):
        rec = json.loads(marker.read_text(encoding="utf-8")).get("cpu_numerics")
        if rec is not None:
            key = {k: rec.get(k) for k in ("capability", "pin", "vendor")}
            if key not in [{k: s.get(k) for k in ("capability", "pin", "vendor")} for _, s in seen]:
                seen.append((marker.stem, rec))
    if len(seen) > 1:
        raise ValueError("its stages ran under different CPU numerics: "
                         + "; ".join(f"{stage}: {describe(rec)}" for stage, rec in seen))
    return seen[0][1] if seen else None


def fixture_for(path: str | Path, numerics: dict | None) -> Path | None:
    """The fixture to compare a run made under ``numerics`` with: ``path`` itself when it was made on the run's CPU
    vendor (or either side names none), else ``path`` with the vendor before its suffix
    (``quickstart_smoke_golden.GenuineIntel.json``) when that file exists, else None (no figures were made on this
    vendor's CPUs; under the same AVX2 pin Intel's and AMD's kernels still round differently:
    :func:`megatron_jf.cpu_numerics.cpu_vendor`).

    Raises:
        OSError, ValueError: ``path`` cannot be read as JSON.
    """
    path = Path(path)
    made = (json.loads(path.read_text(encoding="utf-8")).get("numerics") or {}).get("vendor")
    vendor = (numerics or {}).get("vendor")
    if not made or not vendor or made == vendor:
        return path
    other = _vendor_path(path, vendor)
    return other if other.is_file() else None


def _vendor_path(path: Path, vendor: str) -> Path:
    """``path`` with ``vendor`` before its suffix: the fixture of figures made on that vendor's CPUs."""
    return path.with_name(f"{path.stem}.{vendor}{path.suffix}")


def default_tolerance(name: str, value: float) -> float:
    """The absolute tolerance a new figure gets in the fixture (edit the file to tighten or widen one): TPF 0.05,
    distinct-2 0.03, losses and NLL 1% of the value (TPF and distinct-2 leave room for one greedy near-tie decided
    the other way on another CPU's kernels). Sized from a rerun at two torch threads (another reduction
    order, standing in for another CPU's kernels), which moved losses by ~1e-6 relative and no TPF; a run without
    the consistency loss moves Jacobi TPF on the training prompts by 0.18 (tests/fixtures/README.md)."""
    if "tpf" in name:
        return 0.05
    if "distinct2" in name:
        return 0.03
    return round(0.01 * abs(value), 4)


def compare(figures: dict[str, float], golden: dict) -> list[str]:
    """Mismatches of ``figures`` against a fixture's ``{"figures": {name: {"value", "tol"}}}``, one readable line
    each (``[]``: all within tolerance). A golden figure the run lacks is a mismatch; extra figures are not."""
    bad = []
    for name, g in golden["figures"].items():
        got = figures.get(name)
        if got is None or not math.isfinite(got):
            bad.append(f"{name}: missing from the run (golden {g['value']:.4g})")
        elif abs(got - g["value"]) > g["tol"]:
            bad.append(f"{name}: {got:.4g}, golden {g['value']:.4g} +- {g['tol']:.3g} (off by {got - g['value']:+.4g})")
    return bad


def _environment() -> dict:
    import torch

    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # noqa: BLE001 - informational only
        mcore = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__, "megatron_core": mcore,
            "machine": platform.machine(), "cpu": _cpu_name()}


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    """CLI: print a finished run's figures, compare them with a fixture, or write the fixture."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="finished quickstart work directory")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--compare", metavar="FIXTURE", help="compare with this fixture; exit 1 on a mismatch")
    g.add_argument("--write", metavar="FIXTURE", help="write the run's figures into this fixture (tolerances kept)")
    a = ap.parse_args(argv)
    try:
        fig = run_figures(a.run)
    except (OSError, KeyError, ValueError) as e:
        raise SystemExit(f"error: {a.run}: not a finished quickstart run ({e})") from None
    try:
        numerics = run_numerics(a.run)
    except ValueError as e:
        raise SystemExit(f"error: {a.run}: {e}") from None
    if a.compare:
        path = fixture_for(a.compare, numerics)
        if path is None:
            print(f"no golden figures made on a {numerics['vendor']} CPU next to {a.compare}: make them with "
                  f"--write {_vendor_path(Path(a.compare), numerics['vendor'])}")
            return 1
        if str(path) != str(a.compare):
            print(f"comparing with {path} (the figures made on a {numerics['vendor']} CPU)")
        fixture = json.loads(path.read_text(encoding="utf-8"))
        print(f"golden figures made under: {describe(fixture.get('numerics'))}")
        print(f"this run made under:       {describe(numerics)}")
        bad = compare(fig, fixture)
        print("\n".join(bad) if bad else f"all {len(fig)} figures within tolerance of {path}")
        why = numerics_mismatch(fixture.get("numerics"), numerics)
        if bad and why:
            print(f"likely cause: {why}")
        return 1 if bad else 0
    if a.write:
        path = Path(a.write)
        old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        tols = {k: v["tol"] for k, v in (old.get("figures") or {}).items()}
        doc = {k: v for k, v in old.items() if k not in ("figures", "environment", "numerics")}
        doc["environment"] = _environment()
        doc["numerics"] = numerics
        doc["figures"] = {k: {"value": round(v, 5), "tol": tols.get(k, default_tolerance(k, v))}
                          for k, v in fig.items()}
        atomic_write_json(path, doc, indent=1)
        print(f"wrote {len(fig)} figures to {path}")
        return 0
    print(f"figures made under: {describe(numerics)}", file=sys.stderr)
    json.dump(fig, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
