"""Where a quickstart run's time went: seconds per stage and samples per second of collection and training.

Read from the stages' ``<stage>.done`` markers (each records its wall ``seconds``): trajectory stages count the
prompts decoded (records kept + filtered, from the collection manifest), training stages ``steps x micro-batch``
samples. Rates are end to end per stage (model load and checkpoint saves included), on whatever else the machine
was running at the time.
"""

from __future__ import annotations

import json

__all__ = ["cpu_seconds", "stage_costs", "stage_cpu_seconds", "costs_markdown"]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished subprocesses (on a machine shared with other
    jobs, wall seconds say how busy the machine was; CPU seconds what the stage cost)."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def _decoded(info: dict) -> int | None:
    man = info.get("manifest") or {}
    counts = man.get("counts") or {}
    kept = counts.get("records", man.get("records"))
    if kept is None:
        return None
    filtered = counts.get("filtered") or man.get("filtered") or {}
    extra = sum(filtered.values()) if isinstance(filtered, dict) else int(filtered or 0)
    return int(kept) + extra


def stage_costs(pipe) -> list[dict]:
    """``[{"stage", "seconds", "samples", "samples_per_s"}]`` for every finished stage except ``report``
    (``samples`` is None for stages without a sample count)."""
    from recipes.quickstart.presets import STAGES

    out = []
    for st in STAGES:
        f = pipe.path(f"{st}.done")
        if st == "report" or not f.is_file():
            continue
        info = json.loads(f.read_text())
        secs = float(info.get("seconds", 0.0))
        samples = None
        if st.startswith("traj"):
            samples = _decoded(info)
        elif st.startswith("jf") and "steps" in info:
            samples = int(info["steps"]) * pipe.p.jf_mbs
        out.append({"stage": st, "seconds": secs, "samples": samples,
                    "samples_per_s": samples / secs if samples and secs > 0 else None})
    return out


def stage_cpu_seconds(pipe) -> dict[str, float]:
    """``{stage: CPU seconds}`` of the finished stages whose marker records them (``cpu_seconds``: the pipeline
    process and its subprocesses, user + system)."""
    from recipes.quickstart.presets import STAGES

    out = {}
    for st in STAGES:
        f = pipe.path(f"{st}.done")
        if f.is_file() and "cpu_seconds" in (info := json.loads(f.read_text())):
            out[st] = float(info["cpu_seconds"])
    return out


def costs_markdown(costs: list[dict], report_seconds: float | None = None, cpu: dict | None = None) -> str:
    """The report's "where the time went" table (with a CPU-seconds column when ``cpu`` maps stages to them)."""
    lines = ["", "Where the time went (wall seconds per stage; samples/s end to end, loads and saves included"
             + ("; CPU seconds of the stage's processes, which other jobs on the machine do not inflate" if cpu
                else "") + "):", "",
             "| Stage | seconds | samples | samples/s |" + (" CPU seconds |" if cpu else ""),
             "|---|---|---|---|" + ("---|" if cpu else "")]
    for c in costs:
        rate = "-" if c["samples_per_s"] is None else f"{c['samples_per_s']:.3f}"
        lines.append(f"| {c['stage']} | {c['seconds']:.0f} | {c['samples'] if c['samples'] is not None else '-'} "
                     f"| {rate} |" + (f" {cpu[c['stage']]:.0f} |" if cpu and c["stage"] in cpu else
                                      " - |" if cpu else ""))
    if report_seconds is not None:
        lines.append(f"| report | {report_seconds:.0f} | - | - |")
    return "\n".join(lines) + "\n"
