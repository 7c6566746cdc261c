"""The quickstart's command line, ``python -m recipes.quickstart`` (``bash examples/quickstart.sh`` runs it); the stages
are :mod:`recipes.quickstart.pipeline`'s."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import MISSING, asdict, fields, replace
from pathlib import Path

from megatron_jf import cli
from megatron_jf.cpu_numerics import pin_command
from megatron_jf.fileio import atomic_write_json
from megatron_jf.training.config import TrainConfig
from recipes.quickstart import pipeline
from recipes.quickstart.presets import (LATE_RECIPE, LEGACY_NAMES, PRESETS, RECIPE, SAME_AS_PRETRAIN, UNTIL, Preset,
                                        named_preset)
from recipes.quickstart.pipeline import REPO, Pipeline


def _check_resume(out: Path, preset: Preset) -> None:
    """Refuse a work directory made with other settings (its finished stages would be skipped and mixed with these),
    except round-2 knobs (:data:`LATE_RECIPE`) whose stage has not started there.

    Raises:
        SystemExit: the settings differ (names them, and the stage directory to delete where one was started).
    """
    prev = json.loads((out / "preset.json").read_text())
    prev["name"] = LEGACY_NAMES.get(prev.get("name"), prev.get("name"))  # a preset renamed since is the same one
    now = json.loads(json.dumps(asdict(preset)))
    # a setting added after the directory was made counts as its default (the value the run then used)
    defaults = json.loads(json.dumps({f.name: f.default for f in fields(Preset) if f.default is not MISSING}))
    changed = sorted(k for k in set(prev) | set(now) if k != "threads" and prev.get(k, defaults.get(k)) != now.get(k))
    late = [k for k in changed if k in LATE_RECIPE and not (out / f"{LATE_RECIPE[k]}.done").exists()]
    started = sorted({LATE_RECIPE[k] for k in late if (out / LATE_RECIPE[k]).exists()})
    if started:
        raise SystemExit(f"error: {out} has a started {', '.join(started)} stage made with other settings "
                         f"({', '.join(late)}); delete {', '.join(str(out / s) for s in started)} to run it with "
                         "the new ones")
    refused = [k for k in changed if k not in late]
    if refused:
        raise SystemExit(f"error: {out} was made with other preset settings ({', '.join(refused)}); "
                         "re-run with --fresh to start over, or pass another --out")
    for k in late:
        print(f"{k}: {prev.get(k, defaults.get(k))} -> {now.get(k)} (stage {LATE_RECIPE[k]} not run yet)", flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``bash examples/quickstart.sh`` (``python -m recipes.quickstart``)."""
    ap = argparse.ArgumentParser(
        prog="python -m recipes.quickstart", description=pipeline.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"CI's figures: CI runs `--smoke --threads 1` with the CPU kernels pinned to AVX2 ({pin_command()}, "
               "megatron_jf/cpu_numerics.py) and compares them with tests/fixtures/quickstart_smoke_golden.json "
               "(AMD CPUs) or quickstart_smoke_golden.GenuineIntel.json (Intel CPUs: the two vendors' kernels round "
               "differently even pinned). To reproduce them on an x86 CPU of either vendor: "
               f"`{pin_command()} bash examples/quickstart.sh --smoke --threads 1 --out runs/smoke`, then "
               "`python -m tests.quickstart_golden runs/smoke --compare tests/fixtures/quickstart_smoke_golden.json` "
               "(it picks the file of the CPU's vendor). "
               "Unpinned, an AVX-512 CPU takes other kernels and its figures can differ by a greedy near-tie.")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--smoke", action="store_true",
                   help="tiny sizes, ~8 min on one core (CI runs it pinned to AVX2 kernels and compares its figures "
                        "with golden values: see the end of this help)")
    g.add_argument("--real", action="store_true", help="model B: SmolLM2-135M-Instruct (~2 h on 2 idle cores)")
    g.add_argument("--math", action="store_true",
                   help="the default (model A: GSM-Symbolic word problems); the name it had before it was the default")
    g.add_argument("--code", action="store_true",
                   help="the code domain, the default until 2026-12: a 4-layer model on the source of nine pinned "
                        "pure-Python packages, two Jacobi Forcing rounds (docs/results.md, \"Quickstart, code domain\")")
    ap.add_argument("--out", dest="work_dir", default=None, help="work directory (default runs/quickstart-<preset>)")
    cli.THREADS.add(ap, help="torch threads per process (default 2)")
    UNTIL.add(ap)
    ap.add_argument("--fresh", action="store_true", help="delete the work directory first")
    ap.add_argument("--jf2-from", metavar="SWEEP_RUN", default=None,
                    help="use a finished round-2 sweep run's checkpoints as the jf2 stage instead of training it again "
                         "(python -m recipes.quickstart.sweep; give the run's recipe flags too: sweep.md prints "
                         "the whole command)")
    k = ap.add_argument_group("recipe (default: the preset's; a work directory resumes only with the same values, "
                              "except that the round-2 ones may change while round 2 has not started)")
    for field_name, (flag, typ, help_text) in RECIPE.items():
        if typ == SAME_AS_PRETRAIN:  # pretrain_jf.py's definition of the concept; the preset's value by default
            made = cli.add_dataclass_arguments(k, TrainConfig, only=[field_name], defaults={field_name: None},
                                               helps={field_name: help_text})
            assert flag in made[field_name].option_strings, (flag, field_name)
            continue
        kind = {"choices": typ} if isinstance(typ, tuple) else {"type": typ}
        k.add_argument(flag, dest=field_name, help=help_text, metavar=flag[2:].upper().replace("-", "_"), **kind)
    return ap


def preset_name(a: argparse.Namespace) -> str:
    """The preset a parsed command line asks for: ``smoke``, ``real``, ``code`` or ``default`` (also ``--math``)."""
    return next((name for name in ("smoke", "real", "code") if getattr(a, name)), "default")


def main(argv=None):
    """CLI entry point: ``python -m recipes.quickstart [--smoke|--real|--math]``."""
    a = build_parser().parse_args(argv)
    preset = PRESETS[preset_name(a)]
    if a.threads:
        preset = replace(preset, threads=a.threads)
    knobs = tuple(RECIPE)
    preset = replace(preset, **{f: getattr(a, f) for f in knobs if getattr(a, f) is not None})
    if "bf16" in (preset.precision, preset.collect_precision):
        from megatron_jf.precision import require_cpu_bf16

        try:
            require_cpu_bf16()
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    out = Path(a.work_dir or REPO / "runs" / f"quickstart-{preset.name}")
    if a.fresh and out.exists():
        if any(out.iterdir()) and not (out / "preset.json").is_file():
            raise SystemExit(f"error: --fresh refuses to delete {out}: it is not a quickstart work directory "
                             "(no preset.json)")
        shutil.rmtree(out)
    if preset.real:
        print("model B (SmolLM2-135M-Instruct, 30 layers, vocab 49k; 256 + 96 training samples, 12 HumanEval "
              "problems for speed and 40 for pass@1) on 2 CPU cores: about 1 h 57 min on an idle machine, as measured "
              "on a fresh clone (trajectories n=16 24 min and n=32 14 min, training 24 + 9 min, report with the "
              "learning curve 43 min; docs/quickstart_real/). A loaded machine takes proportionally longer.",
              flush=True)
    elif preset.name == "default":
        print("default preset: model A (GSM-Symbolic word problems) end to end, about 44 minutes on 2 idle cores of an "
              "Intel Xeon with AMX (pretraining 13, trajectories 8 in bf16, Jacobi Forcing 15, report 8; "
              "docs/quickstart_default/); longer on a CPU without native bf16, where training and the trajectory "
              "collection run in fp32.",
              flush=True)
    changed = {f: getattr(preset, f) for f in knobs if getattr(preset, f) != getattr(named_preset(preset.name), f)}
    if changed:
        print(f"recipe changed from the preset ({', '.join(f'{k}={v}' for k, v in changed.items())}): the time above "
              "is the preset's", flush=True)
    if (out / "preset.json").is_file():
        _check_resume(out, preset)
    pipe = Pipeline(out, preset)
    atomic_write_json(out / "preset.json", asdict(preset))
    if a.jf2_from:
        from recipes.quickstart.sweep import adopt_round2

        try:
            adopt_round2(Path(a.jf2_from), out, preset)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    try:
        pipe.execute(a.until)
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None



if __name__ == "__main__":
    main()
