"""``bash bench/gpu/check.sh --dry-run`` (issue 21): the one-GPU check runs end to end on CPU at tiny sizes and prints
its summary table with every row, none failed. The GPU figures themselves come only from a GPU machine."""
import os
import subprocess
import sys

from tests.conftest import REPO

ROWS = (["versions", "sdpa bool mask + GQA", "dist-opt overlap"]
        + [f"train {p}/{r}" for p, r in (("two_stream", "none"), ("two_stream", "full"), ("packed", "none"),
                                          ("dense", "none"), ("two_stream", "selective"), ("packed", "full"),
                                          ("dense", "full"), ("packed", "selective"), ("dense", "selective"))]
        + ["train packed/none/nc_ic", "train dense/none/nc_ic", "cpu fp32 reference", "decode 7B ar",
           "decode 7B jacobi", "decode 7B mr", "decode 7B ar fp32", "decode 7B jacobi fp32", "decode 7B mr fp32",
           "decode 7B logits", "decode 7B memory", "save -> resume"])


def test_gpu_check_dry_run_prints_every_row(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    proc = subprocess.run(["bash", os.path.join(REPO, "bench", "gpu", "check.sh"), "--dry-run", "--work", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=850)
    out = proc.stdout
    assert "== gpu_check summary: DRY RUN on CPU" in out, (out[-3000:], proc.stderr[-3000:])
    table = out[out.index("== gpu_check summary"):out.index("== end of summary ==")].splitlines()[2:]
    status = {}
    for line in table:
        name = max((r for r in ROWS if line.startswith(r + " ")), key=len, default=None)
        assert name is not None, f"unexpected row: {line}"
        status[name] = line[len(name):].split()[0]
    assert list(status) == ROWS, table
    assert all(s in ("ok", "info", "skip", "WARN") for s in status.values()), table
    # the rows that compare two runs really compared them (on CPU: same numbers exactly)
    for name in ("dist-opt overlap", "save -> resume", "cpu fp32 reference", "decode 7B ar", "decode 7B jacobi",
                 "decode 7B mr", "decode 7B ar fp32", "decode 7B jacobi fp32", "decode 7B mr fp32", "decode 7B logits",
                 "train two_stream/none", "train dense/none/nc_ic"):
        assert status[name] == "ok", (name, table)
    assert "rel diff 0.0e+00" in next(line for line in table if line.startswith("save -> resume"))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_gpu_check_sections_rerun_some_rows(tmp_path):
    """``--sections`` (a rerun inside a short lease): the named rows run, the others say 'not selected', an unknown
    section is refused by name."""
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    script = os.path.join(REPO, "bench", "gpu", "check.sh")
    proc = subprocess.run(["bash", script, "--dry-run", "--work", str(tmp_path),
                           "--sections", "resume,train:dense/none"], env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, (out[-3000:], proc.stderr[-3000:])
    table = out[out.index("== gpu_check summary"):out.index("== end of summary ==")].splitlines()[2:]
    row = {name: next(line for line in table if line.startswith(name + " "))[len(name):].split(None, 1)
           for name in ("save -> resume", "train dense/none", "cpu fp32 reference", "train packed/none",
                        "decode 7B ar", "dist-opt overlap")}
    assert row["save -> resume"][0] == "ok" and "rel diff 0.0e+00" in row["save -> resume"][1]
    assert row["train dense/none"][0] == "ok" and row["cpu fp32 reference"][0] == "ok"
    for name in ("train packed/none", "decode 7B ar", "dist-opt overlap"):
        assert row[name] == ["skip", "not selected (--sections)"], (name, row[name])
    bad = subprocess.run(["bash", script, "--dry-run", "--work", str(tmp_path), "--sections", "resume,decoed"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown ['decoed']" in bad.stderr, bad.stderr[-2000:]
