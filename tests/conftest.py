import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# measured forward costs (draft_width="auto") go to a directory of this test session, not the user's cache; the
# session that made it removes it (each run used to leave one /tmp/jf-cost-* behind)
if "MEGATRON_JF_COST_CACHE" not in os.environ:
    os.environ["MEGATRON_JF_COST_CACHE"] = _COST_CACHE = tempfile.mkdtemp(prefix="jf-cost-")
    atexit.register(shutil.rmtree, _COST_CACHE, ignore_errors=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def mp1():
    """World size 1 with tensor/pipeline parallel size 1 (gloo), for in-process model tests."""
    from megatron_jf import parallel

    parallel.initialize(1, 1)
    parallel.set_seed(1234)
    yield


def run_torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 300) -> str:
    """Run ``tests/dist/<script>`` under torchrun with ``nproc`` ranks; return stdout (fails the test on error)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(_free_port()), os.path.join(REPO, "tests", "dist", script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


#: ``tools/<name>.py`` -> the :mod:`megatron_jf.commands` module it runs
TOOL_COMMANDS = {"convert_hf": "convert", "evaluate": "evaluate", "generate": "generate",
                 "generate_trajectories": "collect", "run_text_generation_server": "serve",
                 "search_inference_config": "search", "visualize_trajectory": "visualize"}


def load_tool(name: str, prefix: str = "_tool"):
    """The command module ``tools/<name>.py`` runs (its ``main``/``build_parser``), imported without running it."""
    import importlib

    try:
        return importlib.import_module(f"megatron_jf.commands.{TOOL_COMMANDS[name]}")
    except ModuleNotFoundError:  # a tool not moved into megatron_jf/commands yet
        import importlib.util

        spec = importlib.util.spec_from_file_location(f"{prefix}_{name}", os.path.join(REPO, "tools", f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
