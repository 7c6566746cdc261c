"""CPU numerics records and the choice of golden figures: under the same AVX2 pin an Intel and an AMD CPU still
round differently (the smoke quickstart's figures parted after the first JF round), so golden figures are kept per
CPU vendor and a run is compared with its own vendor's (megatron_jf/cpu_numerics.py, tests/quickstart_golden.py)."""
import json

from megatron_jf.cpu_numerics import ISA_PIN, cpu_numerics, cpu_vendor, numerics_mismatch
from tests.quickstart_golden import fixture_for


def _rec(vendor, capability="AVX2"):
    return {"capability": capability, "pin": dict(ISA_PIN), "pinned": True, "cpu_flags": ["avx2"], "vendor": vendor}


def test_this_process_names_its_vendor():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        want = next((l.split(":", 1)[1].strip() for l in f if l.startswith("vendor_id")), None)
    assert cpu_vendor() == want and cpu_numerics()["vendor"] == want


def test_the_same_pin_on_two_vendors_is_a_mismatch():
    amd, intel = _rec("AuthenticAMD"), _rec("GenuineIntel")
    assert numerics_mismatch(amd, dict(amd)) is None
    why = numerics_mismatch(amd, intel)
    assert why and "AuthenticAMD" in why and "GenuineIntel" in why and "figures made on a GenuineIntel CPU" in why
    old = {k: v for k, v in amd.items() if k != "vendor"}  # a record made before vendors were recorded
    assert numerics_mismatch(old, intel) is None
    assert "AVX512" in numerics_mismatch(amd, _rec("AuthenticAMD", "AVX512"))  # the code path still counts


def test_fixture_for_picks_the_runs_vendor(tmp_path):
    main = tmp_path / "golden.json"
    main.write_text(json.dumps({"numerics": _rec("AuthenticAMD"), "figures": {}}))
    assert fixture_for(main, _rec("AuthenticAMD")) == main
    assert fixture_for(main, {"capability": "AVX2"}) == main  # no vendor recorded: the one file there is
    assert fixture_for(main, _rec("GenuineIntel")) is None  # none made on Intel yet
    intel = tmp_path / "golden.GenuineIntel.json"
    intel.write_text(json.dumps({"numerics": _rec("GenuineIntel"), "figures": {}}))
    assert fixture_for(main, _rec("GenuineIntel")) == intel
