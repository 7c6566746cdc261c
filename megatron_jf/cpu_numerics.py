"""Which CPU code paths a process's floating-point results come from, and the pin that makes them the same on every
x86 CPU of one vendor these machines have.

torch picks its CPU kernels by instruction set at run time: ATen's vectorised kernels (softmax, reductions,
element-wise ops) by ``torch.backends.cpu.get_cpu_capability()`` (``AVX512`` where the CPU has it, else ``AVX2``),
MKL its GEMMs by the CPU it finds, oneDNN its JIT kernels likewise. Each path rounds differently, so a greedy
near-tie can fall the other way and, after a few hundred training steps, two runs of the same code part: the smoke
quickstart's figures made on an AVX2-only CPU are off by 0.065 TPF on an AVX-512 one
(``tests/fixtures/README.md``).

:data:`ISA_PIN` selects the AVX2 path of all three libraries, which every x86 CPU here has; under it an AVX-512
machine computes what an AVX2-only one of the same vendor does (an Intel Xeon under the pin still parts from an AMD
EPYC after a few hundred steps: :func:`cpu_vendor`). The variables are read when each library first runs a kernel, so they
must be in the environment before the process starts (or at least before its first torch operation): set them on
the command line, or let a parent process pass them to its children (the quickstart's stages inherit them).

Usage::

    ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 python -m recipes.quickstart --smoke
"""

from __future__ import annotations

import os

__all__ = ["ISA_PIN", "pin_command", "pinned_env", "cpu_numerics", "cpu_vendor", "describe", "numerics_mismatch"]

#: Environment that pins ATen's kernels, MKL's (conditional numerical reproducibility) and oneDNN's to AVX2: the
#: code path CI's golden figures are made under (``tests/fixtures/README.md``).
ISA_PIN: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

#: ``/proc/cpuinfo`` flags worth naming next to a figure (vector width, native bf16, AMX)
_REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def pin_command() -> str:
    """The pin as shell assignments to put before a command, e.g. ``ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ...``."""
    return " ".join(f"{k}={v}" for k, v in ISA_PIN.items())


def pinned_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) with :data:`ISA_PIN` set, for a child process."""
    return {**(os.environ if env is None else env), **ISA_PIN}


def _cpuinfo(key_names: tuple[str, ...]) -> str | None:
    """The first ``/proc/cpuinfo`` value of one of ``key_names``, or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in key_names:
                    return value.strip()
    except OSError:
        pass
    return None


def _cpu_flags() -> list[str]:
    have = set((_cpuinfo(("flags", "Features")) or "").split())
    return [fl for fl in _REPORTED_FLAGS if fl in have]


def cpu_vendor() -> str | None:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``; None where ``/proc/cpuinfo`` does not say). Under the
    same AVX2 pin, Intel's and AMD's CPUs still round differently (MKL and oneDNN pick kernels by vendor as well as
    by instruction set): the smoke quickstart's figures on an Intel Xeon left those made on an AMD EPYC after the
    first JF round (``tests/fixtures/README.md``), so golden figures are kept per vendor."""
    return _cpuinfo(("vendor_id",))


def cpu_numerics() -> dict:
    """What this process's CPU floating-point results depend on.

    Returns:
        ``{"capability": str, "pin": {var: value or None}, "pinned": bool, "cpu_flags": [str], "vendor": str or
        None}``: torch's ATen CPU capability (``"AVX2"``, ``"AVX512"``, ``"DEFAULT"``; read from torch, so it
        reflects ``ATEN_CPU_CAPABILITY``), the values of :data:`ISA_PIN`'s variables in this process's environment,
        whether all three equal the pin, the CPU's flags among avx2 / avx512f / avx512_bf16 / amx, and its vendor
        (:func:`cpu_vendor`).
    """
    import torch

    pin = {k: os.environ.get(k) for k in ISA_PIN}
    return {"capability": str(torch.backends.cpu.get_cpu_capability()), "pin": pin,
            "pinned": all(pin[k] == v for k, v in ISA_PIN.items()), "cpu_flags": _cpu_flags(),
            "vendor": cpu_vendor()}


def describe(numerics: dict | None) -> str:
    """One line naming a :func:`cpu_numerics` record, e.g. ``ATen AVX2, pinned (ATEN_CPU_CAPABILITY=avx2 ...);
    CPU avx2 avx512f avx512_bf16``; ``unknown`` for None."""
    if not numerics:
        return "unknown (not recorded)"
    pin = numerics.get("pin") or {}
    how = (f"pinned ({pin_command()})" if numerics.get("pinned")
           else "not pinned" + (" (" + " ".join(f"{k}={v}" for k, v in pin.items() if v) + ")"
                                if any(pin.values()) else ""))
    flags = " ".join(numerics.get("cpu_flags") or []) or "none of avx2/avx512f/avx512_bf16/amx"
    vendor = f"{numerics['vendor']} " if numerics.get("vendor") else ""
    return f"ATen {numerics.get('capability', '?')}, {how}; CPU {vendor}{flags}"


def numerics_mismatch(made_under: dict | None, run_under: dict | None) -> str | None:
    """Why two runs' floating-point results may differ by code path alone, or None when they took the same one.

    Two records agree when their ATen capability and pin variables are equal (the CPU flags may differ: that is
    what the pin is for) and so are their CPU vendors where both name one (the pin does not make Intel's and AMD's
    kernels round alike: :func:`cpu_vendor`). Returns a readable sentence naming both sides and what to do.
    """
    if not made_under or not run_under:
        return None
    keys = ("capability", "pin")
    same_path = all(made_under.get(k) == run_under.get(k) for k in keys)
    a, b = made_under.get("vendor"), run_under.get("vendor")
    if same_path and a and b and a != b:
        return (f"the figures were made on a {a} CPU ({describe(made_under)}), this run on a {b} one "
                f"({describe(run_under)}): the two vendors' kernels round differently even under the AVX2 pin; "
                f"compare with figures made on a {b} CPU (tests/fixtures/README.md)")
    if same_path:
        return None
    return (f"the figures were made under {describe(made_under)}, this run under {describe(run_under)}: different "
            f"CPU kernels round differently and greedy near-ties fall the other way; rerun with "
            f"`{pin_command()}` set before the command")
