"""Save hygiene: a run killed with ``kill -9`` in the middle of a save leaves no process behind, and the stale
``iter_*.tmp`` it leaves is removed at start-up or by the next save, never a complete checkpoint."""
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from tests.conftest import REPO

psutil = pytest.importorskip("psutil")

CHILD = textwrap.dedent("""
    import sys, torch
    from megatron_jf import parallel
    from megatron_jf.checkpointing import save_checkpoint
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs


    def main():
        parallel.initialize(1, 1)
        args = ModelArgs(architecture="Qwen2ForCausalLM", vocab_size=16384, hidden_size=512, intermediate_size=1536,
                         num_layers=6, num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                         rope_theta=1e4, max_position_embeddings=512, tie_word_embeddings=False, qkv_bias=True)
        m = build_model(args, params_dtype=torch.float32)
        save_checkpoint(sys.argv[1], 1, m)
        print("saved 1", flush=True)
        it = 2
        while True:  # keep saving until killed
            save_checkpoint(sys.argv[1], it, m)
            it += 1


    if __name__ == "__main__":
        main()
""")


def _marked(mark: str) -> list:
    """Live processes whose environment carries ``mark`` (everything the run started inherits it)."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("JF_TEST_RUN") == mark and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def _writing_weights(ck: str) -> bool:
    """Whether a save's writer workers have started writing weight files (``*.distcp``) into an ``.tmp``."""
    for t in os.listdir(ck):
        d = os.path.join(ck, t)
        try:
            if t.endswith(".tmp") and any(n.endswith(".distcp") and os.path.getsize(os.path.join(d, n)) > 0
                                          for n in os.listdir(d)):
                return True
        except OSError:  # renamed or removed while we looked
            pass
    return False


WAITER = textwrap.dedent("""
    import multiprocessing as mp, sys, time
    from megatron_jf import checkpointing as C


    def writer(q):  # megatron-core's writer: finish the bucket, then count_queue.get(); task_done()
        time.sleep(1.5)
        q.get()
        q.task_done()


    if __name__ == "__main__":
        ctx = mp.get_context("fork")
        q = ctx.JoinableQueue()
        q.put(0)
        with (C._writers_die_with_run() if sys.argv[1] == "guarded" else open("/dev/null")):
            p = ctx.Process(target=writer, args=(q,))
            p.start()
            print(p.pid, flush=True)
            q.join()  # megatron-core's write_preloaded_data_multiproc waits here
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("mode", ["guarded", "unguarded"])
def test_writer_forked_during_a_save_dies_with_the_run(tmp_path, mode):
    """The mechanism alone, deterministic: kill -9 the process while it waits in ``JoinableQueue.join()`` for a
    forked writer. Unguarded, the writer's ``task_done()`` hangs for ever (``notify_all`` waits for the dead waiter);
    inside ``_writers_die_with_run`` the kernel kills it with the run."""
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO), start_new_session=True)
    worker = None
    try:
        worker = int(proc.stdout.readline())
        time.sleep(0.3)  # the run is now in q.join()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        end = time.time() + 5  # the unguarded writer finishes its sleep at 1.5 s, then hangs in task_done()
        while _alive(worker) and time.time() < end:
            time.sleep(0.1)
        if mode == "unguarded" and not _alive(worker):
            pytest.skip("this Python's multiprocessing no longer leaves the writer hanging")
        assert _alive(worker) == (mode == "unguarded")
    finally:
        if worker and _alive(worker):
            os.kill(worker, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_kill_during_save_leaves_no_process_and_stale_tmp_is_cleaned(tmp_path, mp1):
    from megatron_jf import checkpointing as C

    ck = str(tmp_path / "ck")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    mark = uuid.uuid4().hex
    log = open(tmp_path / "child.log", "w")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, JF_TEST_RUN=mark)
    proc = subprocess.Popen([sys.executable, str(script), ck], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        deadline = time.time() + 240
        while "saved 1" not in open(tmp_path / "child.log").read():
            assert proc.poll() is None and time.time() < deadline, open(tmp_path / "child.log").read()[-3000:]
            time.sleep(0.05)
        seen = set()
        while True:  # wait until a later save's forked writers are writing weights, then kill -9 the run (not its
            # group): the run then waits for them in JoinableQueue.join(), where a kill left the last writer hanging
            assert proc.poll() is None and time.time() < deadline, open(tmp_path / "child.log").read()[-3000:]
            if _writing_weights(ck):
                seen = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.005)
        proc.wait(timeout=30)
        end = time.time() + 20  # forked writer workers may take a moment to finish their bucket and exit
        while (_marked(mark) or any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                    for p in seen)) and time.time() < end:
            time.sleep(0.2)
        left = _marked(mark)
        assert not left, [(p.pid, p.cmdline()[:4]) for p in left]
    finally:
        for p in _marked(mark):  # clean up after a failure
            p.kill()
        if proc.poll() is None:
            proc.kill()
        log.close()

    names = os.listdir(ck)
    stale = [n for n in names if n.endswith(".tmp")]
    assert stale, names  # the kill did land mid-save
    done = C.latest_iteration(ck)
    assert done is not None and os.path.isfile(os.path.join(C.iter_dir(ck, done), C.META))
    # start-up cleanup: only .tmp directories go
    removed = C.remove_stale_tmp(ck)
    assert sorted(os.path.basename(p) for p in removed) == sorted(stale)
    assert C.latest_iteration(ck) == done and os.path.isdir(C.iter_dir(ck, done))
    # a later save removes leftovers too
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs

    os.makedirs(os.path.join(ck, "iter_0000077.tmp", "junk"))
    small = ModelArgs(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False)
    C.save_checkpoint(ck, done + 100, build_model(small))
    names = os.listdir(ck)
    assert not [n for n in names if n.endswith(".tmp")], names
    assert C.iter_dir(ck, done).rsplit("/", 1)[1] in names and C.latest_iteration(ck) == done + 100


def test_resaving_an_iteration_replaces_it_by_renames(tmp_path, mp1):
    """Saving an iteration that exists swaps the directories by renames (the old copy is deleted after the new
    one is in place) and leaves no .tmp behind; the loaded weights are the new ones."""
    import torch

    from megatron_jf import checkpointing as C
    from megatron_jf.models.gpt import build_model
    from megatron_jf.models.hf_config import ModelArgs

    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                     max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False)
    ck = str(tmp_path / "ck")
    a, b = build_model(args, params_dtype=torch.float32), build_model(args, params_dtype=torch.float32)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(1.0)
    C.save_checkpoint(ck, 3, a)
    C.save_checkpoint(ck, 3, b)
    assert sorted(os.listdir(ck)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    m, _, _ = C.load_model(ck, params_dtype=torch.float32)
    w = "embedding.word_embeddings.weight"
    assert torch.equal(m.state_dict()[w], b.state_dict()[w]) and not torch.equal(m.state_dict()[w], a.state_dict()[w])
