"""Test-only fault injection: run an entry point with a crash hook installed (the project's modules carry none).

    python tests/fault_injection.py SCRIPT [ARGS...]

runs ``SCRIPT`` as ``python SCRIPT ARGS...`` would, after installing the hooks the environment asks for:

``MEGATRON_JF_FAULT_KILL_AT_STEP=N``
    ``pretrain_jf.py``: SIGKILL the process right after optimizer step ``N`` is logged (``--log-interval`` must divide
    ``N``), before any validation or save of that step -- a crash between checkpoints.
``MEGATRON_JF_COLLECT_CRASH_AFTER_RECORDS=N``
    ``tools/generate_trajectories.py``: SIGKILL a rank right after its shard writer holds ``N`` records -- a crash
    mid-shard, leaving a partial file.
"""
import os
import runpy
import signal
import sys

KILL_AT_STEP = "MEGATRON_JF_FAULT_KILL_AT_STEP"
CRASH_AFTER_RECORDS = "MEGATRON_JF_COLLECT_CRASH_AFTER_RECORDS"


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def install_hooks(env=os.environ) -> None:
    """Patch the training loop and the shard writer as ``env`` asks (nothing when neither variable is set)."""
    step = int(env.get(KILL_AT_STEP) or 0)
    if step:
        from megatron_jf.training.trainer import Trainer

        log_event = Trainer._log_event

        def _log_event_then_kill(self, split, m):
            log_event(self, split, m)
            if split == "train" and m["iteration"] == step:
                _kill()

        Trainer._log_event = _log_event_then_kill
    records = int(env.get(CRASH_AFTER_RECORDS) or 0)
    if records:
        from megatron_jf.data.shards import TrajectoryShardWriter

        write = TrajectoryShardWriter.write

        def _write_then_kill(self, rec):
            out = write(self, rec)
            if self.num_records >= records:
                _kill()
            return out

        TrajectoryShardWriter.write = _write_then_kill


def main(argv) -> None:
    script, args = argv[0], argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    install_hooks()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
