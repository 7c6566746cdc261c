"""Checkpoints: megatron-core distributed checkpoints (``torch_dist``), saved atomically, loadable at any TP/PP,
in Megatron-LM's format both ways.

Directory layout (Megatron-LM's)::

    CKPT/
      latest_checkpointed_iteration.txt     # "120" (or "release"): the newest complete checkpoint
      iter_0000120/                         # dist_checkpointing files: .metadata, *.distcp, metadata.json (+ common.pt up to mcore 0.16)
        jf_meta.json                        # this project's extra file (model args as JSON, training state)
      release/                              # what a "release" pointer names (Megatron-LM's converted models)
      tokenizer/                            # tokenizer files copied from the HF checkpoint

Megatron-LM interop. The model's sharded keys are ``GPTModel.sharded_state_dict()`` keys with no prefix
(``embedding.word_embeddings.weight``, ``decoder.layers.self_attention.linear_qkv.weight``, ...) under the
state-dict entry ``model``, as Megatron-LM's ``generate_state_dict`` saves them, and the common state carries
``args`` (an ``argparse.Namespace`` with Megatron-LM's argument names, :func:`megatron_lm_args`),
``iteration`` and ``checkpoint_version`` (3.0), which Megatron-LM's ``load_args_from_checkpoint`` and
``load_checkpoint`` read. (megatron-core 0.16 keeps the common state in ``common.pt``; newer releases keep it
as a ``common_state`` object inside the torch DCP files; ``dist_checkpointing.load_common_state_dict`` reads
both.) A checkpoint without ``jf_meta.json`` (one Megatron-LM wrote) is read from the common state instead
(:func:`model_args_from_megatron_lm`). Checkpoints of this project saved before the
change (model keys prefixed ``model.``, no ``model_key_prefix`` in ``jf_meta.json``) still load.
Megatron-LM reads the model weights of our checkpoints (``--finetune`` / ``--no-load-optim
--no-load-rng``); optimizer and RNG state are in this project's own layout.

Saves. A save writes ``iter_XXXXXXX.tmp`` and renames it into place, then rewrites the ``latest`` file
through a temporary name, so a crash mid-save leaves the previous checkpoint loadable; the next save (or
:func:`remove_stale_tmp` at start-up) deletes such ``.tmp`` leftovers and never a complete checkpoint. A
save starts no helper process that could outlive a killed run (see :func:`_sync_results_queue` and
:func:`_writers_die_with_run`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import sys
import warnings

import torch

from megatron_jf import parallel
from megatron_jf.fileio import atomic_write_text
from megatron_jf.load_errors import CheckpointFileError
from megatron_jf.models.hf_config import ModelArgs
from megatron_jf.tokenizer import TOKENIZER_FILES, copy_tokenizer_files

META = "jf_meta.json"
LATEST = "latest_checkpointed_iteration.txt"
RELEASE = "release"
FORMAT = "megatron-jf/1"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version (query/key/value ordering of mcore models)
MODEL_KEY_PREFIX = ""  # sharded-key prefix of the model in new checkpoints (Megatron-LM's)
OLD_MODEL_KEY_PREFIX = "model."  # this project's checkpoints before Megatron-LM interop
_STALE = re.compile(r"^(iter_\d{7}|release|tokenizer)(\.replaced)?\.tmp$")


def iter_dir(ckpt_dir: str, iteration: int) -> str:
    """The directory of one iteration: ``CKPT/iter_0000042``."""
    return os.path.join(ckpt_dir, f"iter_{iteration:07d}")


def _is_complete(path: str) -> bool:
    """A finished checkpoint directory: ours (``jf_meta.json``, written last) or Megatron-LM's
    (dist_checkpointing's ``metadata.json`` plus torch DCP's ``.metadata``, written when the save finishes,
    or a legacy ``common.pt``)."""
    return os.path.isfile(os.path.join(path, META)) or (
        os.path.isfile(os.path.join(path, "metadata.json"))
        and any(os.path.isfile(os.path.join(path, n)) for n in (".metadata", "common.pt")))


def _read_pointer(ckpt_dir: str) -> tuple[int, str] | None:
    """``(iteration, directory)`` named by the ``latest`` file (``release`` is iteration 0), or None.

    Raises:
        ValueError: the file holds neither a number nor ``release``, or names a missing/incomplete directory.
    """
    path = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointFileError(f"{path}: unreadable checkpoint pointer ({type(e).__name__}: {e})") from None
    if text == RELEASE:
        it, d = 0, os.path.join(ckpt_dir, RELEASE)
    elif text.isdigit():
        it, d = int(text), iter_dir(ckpt_dir, int(text))
    else:
        raise CheckpointFileError(f"{path}: corrupt checkpoint pointer {text[:40]!r} (expected an iteration number "
                                  f"or '{RELEASE}')")
    if not os.path.isdir(d):
        raise CheckpointFileError(f"{path} names {text!r} but {d} is missing (complete iterations there: "
                                  f"{_complete_iterations(ckpt_dir) or 'none'})")
    if not _is_complete(d):
        raise CheckpointFileError(f"{path} names {text!r} but {d} is incomplete (neither {META} nor "
                                  f"a finished dist_checkpointing save: metadata.json + .metadata)")
    return it, d


def _complete_iterations(ckpt_dir: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(ckpt_dir)
                  if n.startswith("iter_") and n[5:].isdigit() and _is_complete(os.path.join(ckpt_dir, n)))


def latest_iteration(ckpt_dir: str) -> int | None:
    """The newest complete iteration in ``ckpt_dir`` (0 for a ``release`` checkpoint), or None if none.

    Raises:
        ValueError: the ``latest`` file is corrupt or points to a missing or incomplete directory.
    """
    got = _read_pointer(ckpt_dir)
    return None if got is None else got[0]


def checkpoint_path(ckpt_dir: str, iteration: int | None = None) -> str:
    """The directory holding ``iteration`` (default: the latest; ``release/`` when the pointer says so).

    Raises:
        FileNotFoundError: no checkpoint, or no such iteration (lists the available ones).
        ValueError: see :func:`latest_iteration`.
    """
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory not found: {ckpt_dir}")
    got = _read_pointer(ckpt_dir)
    if iteration is None:
        if got is None:
            raise FileNotFoundError(f"no checkpoint in {ckpt_dir} (missing {LATEST})")
        return got[1]
    d = iter_dir(ckpt_dir, iteration)
    if _is_complete(d):
        return d
    if got is not None and got[0] == iteration:
        return got[1]
    raise FileNotFoundError(f"{ckpt_dir} has no iteration {iteration}; available: "
                            f"{_complete_iterations(ckpt_dir) or 'none'}")


def read_meta(ckpt_dir: str, iteration: int | None = None, *, verify: bool = False) -> dict:
    """Metadata of a checkpoint: ``model_args``, ``iteration``, ``tp``, ``pp``, ``common``, ``path``.

    From ``jf_meta.json``, or for a Megatron-LM checkpoint (none there) from the ``args`` in its common state.
    ``verify``: also check the weight files (:func:`verify_checkpoint_files`; loading always does), so a tool
    stops on a damaged checkpoint before any other work.

    Raises:
        FileNotFoundError: no checkpoint in ``ckpt_dir`` or no such iteration.
        CheckpointFileError: a corrupt pointer file; with ``verify`` (or a Megatron-LM checkpoint, whose metadata
            is read from the weight files), a missing, truncated or foreign checkpoint file, naming it.
        ValueError: unknown format, corrupt metadata, or Megatron-LM arguments of an unsupported model.
    """
    d = checkpoint_path(ckpt_dir, iteration)
    path = os.path.join(d, META)
    if verify or not os.path.isfile(path):
        verify_checkpoint_files(d)
    if not os.path.isfile(path):
        return _meta_from_megatron_lm(d)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFileError(f"{path}: corrupt checkpoint metadata ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointFileError(f"{path}: unknown checkpoint format "
                                  f"{meta.get('format') if isinstance(meta, dict) else type(meta).__name__!r}, "
                                  f"expected {FORMAT!r}")
    meta["path"] = d
    meta.setdefault("model_key_prefix", OLD_MODEL_KEY_PREFIX)
    return meta


# ---------------------------------------------------------------------------------- Megatron-LM arguments
def megatron_lm_args(args: ModelArgs, *, tp: int, pp: int, iteration: int, params_dtype: torch.dtype,
                     consumed_train_samples: int = 0, tokenizer_model: str | None = None) -> argparse.Namespace:
    """The ``args`` Namespace stored in the common state (``common.pt``), with Megatron-LM's argument names and meanings.

    Holds what Megatron-LM's ``load_args_from_checkpoint`` (``--use-checkpoint-args``) and
    ``check_checkpoint_args`` read: the architecture (``num_layers``, ``hidden_size``, ``ffn_hidden_size``,
    ``num_attention_heads``, ``group_query_attention``, ``num_query_groups``, ``kv_channels``, RoPE,
    SwiGLU, RMSNorm, biases, tied embeddings, ``padded_vocab_size`` = embedding rows), the parallel layout
    and the checkpoint format. The normalisation epsilon is given under both names Megatron-LM has used
    (``norm_epsilon``, ``layernorm_epsilon``).
    """
    rows = args.padded_vocab_size(tp, divisible_by=1)
    theta = int(args.rope_theta) if float(args.rope_theta).is_integer() else args.rope_theta
    return argparse.Namespace(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.intermediate_size,
        num_attention_heads=args.num_heads, group_query_attention=args.num_kv_heads != args.num_heads,
        num_query_groups=args.num_kv_heads, kv_channels=args.head_dim,
        max_position_embeddings=args.max_position_embeddings, seq_length=args.max_position_embeddings,
        position_embedding_type="rope", add_position_embedding=False, use_rotary_position_embeddings=True,
        rotary_base=theta, rotary_percent=1.0, rotary_interleaved=False,
        normalization="RMSNorm", norm_epsilon=args.rms_norm_eps, layernorm_epsilon=args.rms_norm_eps,
        apply_layernorm_1p=False, swiglu=True, squared_relu=False, add_bias_linear=False,
        add_qkv_bias=args.qkv_bias, untie_embeddings_and_output_weights=not args.tie_word_embeddings,
        apply_query_key_layer_scaling=False, attention_dropout=0.0, hidden_dropout=0.0,
        padded_vocab_size=rows, make_vocab_size_divisible_by=128, num_experts=None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
        ckpt_format="torch_dist", use_dist_ckpt=True, iteration=iteration,
        consumed_train_samples=consumed_train_samples, consumed_valid_samples=0, skipped_train_samples=0,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_model,
        data_parallel_random_init=False, phase_transition_iterations=None,
    )


def model_args_from_megatron_lm(a, *, eos_token_ids: list[int] | None = None) -> ModelArgs:
    """:class:`ModelArgs` from a Megatron-LM ``args`` Namespace (the common state).

    ``vocab_size`` is ``padded_vocab_size`` (the embedding's rows); the architecture is Qwen2 when q/k/v
    have biases, else Llama.

    Raises:
        ValueError: a model this project does not run (not RoPE + SwiGLU + RMSNorm, linear biases, MoE,
            learned positions), naming the argument.
    """
    def get(name, *old, default=None):
        for n in (name, *old):
            v = getattr(a, n, None)
            if v is not None:
                return v
        return default

    for name, want in (("position_embedding_type", "rope"), ("normalization", "RMSNorm"), ("swiglu", True)):
        if get(name) != want:
            raise ValueError(f"Megatron-LM checkpoint has {name}={get(name)!r}; only {want!r} is supported "
                             "(Qwen2/Llama architectures)")
    if get("add_bias_linear", default=False) or get("num_experts"):
        raise ValueError("Megatron-LM checkpoint has linear biases or experts (add_bias_linear / num_experts); "
                         "only Qwen2/Llama architectures are supported")
    heads, hidden = int(get("num_attention_heads")), int(get("hidden_size"))
    groups = int(get("num_query_groups")) if get("group_query_attention", default=False) else heads
    qkv_bias = bool(get("add_qkv_bias", default=False))
    rows = get("padded_vocab_size")
    if rows is None:
        raise ValueError("Megatron-LM checkpoint args give no padded_vocab_size")
    return ModelArgs(
        architecture="Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM",
        vocab_size=int(rows), hidden_size=hidden, intermediate_size=int(get("ffn_hidden_size")),
        num_layers=int(get("num_layers")), num_heads=heads, num_kv_heads=groups,
        head_dim=int(get("kv_channels", default=hidden // heads)),
        rms_norm_eps=float(get("norm_epsilon", "layernorm_epsilon", default=1e-5)),
        rope_theta=float(get("rotary_base", default=10000)),
        max_position_embeddings=int(get("max_position_embeddings", "seq_length")),
        tie_word_embeddings=not get("untie_embeddings_and_output_weights", default=False),
        qkv_bias=qkv_bias, eos_token_ids=list(eos_token_ids or []),
    )


def _meta_from_megatron_lm(d: str) -> dict:
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        common = dist_checkpointing.load_common_state_dict(d)
    except (Exception, CheckpointException) as e:  # CheckpointingException, unpickling errors, DCP (mcore >= 0.17)
        raise CheckpointFileError(f"{d} has no {META} and its common state cannot be read ({type(e).__name__}: "
                                  f"{_first_line(e)}); not a checkpoint of this project or of Megatron-LM") from None
    a = common.get("args") if isinstance(common, dict) else None
    if a is None:
        raise ValueError(f"{d} has no {META} and its common state carries no 'args' (the model arguments "
                         "Megatron-LM saves): cannot tell the architecture")
    if not any(k == "model" for k in common) and any(re.fullmatch(r"model\d+", str(k)) for k in common):
        raise ValueError(f"{d} holds virtual-pipeline model chunks (model0, model1, ...): not supported")
    eos = []  # stop tokens from the tokenizer: CKPT/tokenizer, else the HF tokenizer folder args.tokenizer_model
    for tok in (os.path.join(os.path.dirname(d), "tokenizer"), getattr(a, "tokenizer_model", None)):
        if isinstance(tok, str) and os.path.isdir(tok):
            from megatron_jf.tokenizer import tokenizer_eos_ids

            eos = tokenizer_eos_ids(tok)
            break
    it = common.get("iteration", 0)
    return {
        "format": "megatron-lm", "iteration": int(it) if it is not None else 0,
        "release": os.path.basename(d.rstrip("/")) == RELEASE,
        "model_args": model_args_from_megatron_lm(a, eos_token_ids=eos).to_dict(),
        "tp": getattr(a, "tensor_model_parallel_size", 1), "pp": getattr(a, "pipeline_model_parallel_size", 1),
        "checkpoint_version": common.get("checkpoint_version", 0), "common": {}, "path": d,
        "model_key_prefix": MODEL_KEY_PREFIX,
    }


# ---------------------------------------------------------------------------------- file checks
#: dist_checkpointing's format file, torch DCP's index and (megatron-core <= 0.16) the common state.
DIST_CONFIG, DCP_INDEX, COMMON_PT = "metadata.json", ".metadata", "common.pt"


def verify_checkpoint_files(d: str) -> None:
    """Check the files of one saved iteration ``d`` (``iter_*`` or ``release``) before megatron-core reads them,
    so a damaged checkpoint stops every tool with one line naming the file instead of a traceback from inside
    megatron-core or torch DCP.

    Checks, cheapest first (nothing but the small index is read):

    * ``metadata.json`` exists and is dist_checkpointing's format file (JSON with ``sharded_backend``);
    * ``.metadata`` exists and is torch DCP's index (a pickled ``Metadata``);
    * every file the index points into exists and holds at least the bytes indexed in it (a truncated ``.distcp``);
    * ``common.pt`` exists and is a ``torch.save`` archive, unless the index holds the common state
      (``common_state``: megatron-core >= 0.17 writes it inside the DCP files and no ``common.pt``).

    Raises:
        CheckpointFileError: ``"<file>: <what is wrong>"``.
    """
    import zipfile

    cfg_path = os.path.join(d, DIST_CONFIG)
    if not os.path.isfile(cfg_path):
        raise CheckpointFileError(f"{cfg_path}: missing (dist_checkpointing's format file; {d} is not a complete "
                                  "megatron checkpoint)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFileError(f"{cfg_path}: not dist_checkpointing's format file ({type(e).__name__}: {e})") \
            from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("sharded_backend"), str):
        raise CheckpointFileError(f"{cfg_path}: not dist_checkpointing's format file (no 'sharded_backend')")
    index = _read_dcp_index(d)
    need: dict[str, int] = {}
    for info in index.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, n in sorted(need.items()):
        path = os.path.join(d, rel)
        if not os.path.isfile(path):
            raise CheckpointFileError(f"{path}: missing (the checkpoint's index {DCP_INDEX} has weights in it)")
        size = os.path.getsize(path)
        if size < n:
            raise CheckpointFileError(f"{path}: truncated: {size} bytes, the checkpoint's index {DCP_INDEX} has "
                                      f"data up to byte {n}")
    if not any(k == "common_state" or str(k).startswith("common_state/") for k in index.state_dict_metadata):
        path = os.path.join(d, COMMON_PT)
        if not os.path.isfile(path):
            raise CheckpointFileError(f"{path}: missing (the common state: Megatron-LM arguments, iteration; "
                                      "megatron-core <= 0.16 keeps it there)")
        if not zipfile.is_zipfile(path):
            raise CheckpointFileError(f"{path}: not a torch.save archive ({os.path.getsize(path)} bytes)")


def _read_dcp_index(d: str):
    """torch DCP's ``Metadata`` from ``d/.metadata``.

    Raises:
        CheckpointFileError: missing, unreadable, or not DCP's index.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(d, DCP_INDEX)
    if not os.path.isfile(path):
        raise CheckpointFileError(f"{path}: missing (torch distributed checkpoint index; the save did not finish)")
    try:
        index = FileSystemReader(d).read_metadata()
    except Exception as e:  # noqa: BLE001 -- unpickling garbage raises anything (EOFError, UnpicklingError, ...)
        raise CheckpointFileError(f"{path}: not a torch distributed checkpoint index ({type(e).__name__}: "
                                  f"{_first_line(e)})") from None
    if not isinstance(index, Metadata):
        raise CheckpointFileError(f"{path}: not a torch distributed checkpoint index (holds a "
                                  f"{type(index).__name__})")
    return index


def _first_line(e: BaseException, limit: int = 240) -> str:
    """The first line of ``str(e)``, cut to ``limit`` characters (torch's messages run to paragraphs)."""
    text = str(e).strip()
    text = text.splitlines()[0] if text else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _load_sharded(state: dict, path: str) -> dict:
    """``dist_checkpointing.load(state, path)``; a failure inside megatron-core or torch DCP (a file that passed
    :func:`verify_checkpoint_files` but cannot be decoded, keys the checkpoint lacks) becomes one line.

    Raises:
        CheckpointFileError: ``"<path>: cannot load ... (<cause>)"``, the first failing rank's exception.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # known warnings inside megatron-core's torch_dist loader (0.16, 0.19)
            warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning,
                                    module=r"megatron\.core\.dist_checkpointing\.")
            warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating "
                                    "ShardedTensor", category=FutureWarning, module=r"torch\.distributed\.checkpoint\.")
            # 0.19's loader calls torch DCP's load without a process group (one process) and positionally
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                    category=UserWarning, module=r"torch\.distributed\.checkpoint\.")
            warnings.filterwarnings("ignore", message="The argument order of load has been changed",
                                    category=UserWarning, module=r"torch\.distributed\.checkpoint\.")
            return dist_checkpointing.load(state, path)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        cause = e
        if isinstance(e, CheckpointException) and e.failures:
            cause = next(iter(e.failures.values()))[0]
        raise CheckpointFileError(f"{path}: cannot load the distributed checkpoint ({type(cause).__name__}: "
                                  f"{_first_line(cause)})") from e


# ---------------------------------------------------------------------------------- save / load
def remove_stale_tmp(ckpt_dir: str) -> list[str]:
    """Delete the ``iter_*.tmp`` (and ``release.tmp`` / ``tokenizer.tmp``) directories a killed save left.

    Complete checkpoints are never touched: only names ending in ``.tmp``, which a save renames away
    when it finishes. Call on rank 0 only (no other process may be saving into ``ckpt_dir``).

    Returns:
        The removed paths.
    """
    removed = []
    if os.path.isdir(ckpt_dir):
        for n in sorted(os.listdir(ckpt_dir)):
            p = os.path.join(ckpt_dir, n)
            if _STALE.match(n) and os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


@contextlib.contextmanager
def _sync_results_queue():
    """Run a synchronous dist_checkpointing save without its multiprocessing manager.

    megatron-core's ``FileSystemWriterAsync`` (used by the ``torch_dist`` strategy even for synchronous
    saves) fetches a results queue from ``filesystem_async._get_write_results_queue()``, which starts a
    spawn-context ``multiprocessing.Manager`` server process on the first save. That server does not watch
    its parent: a ``kill -9`` of the training process left it running as an orphan (~275 MB RSS). In a
    synchronous save the queue is only written and read by this process (the forked writer workers report
    through their own local queue), so a plain ``queue.Queue`` is all it needs; we install one for the
    duration of the save. No manager process, and no spawn re-import of ``__main__``.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        yield
        return
    if not hasattr(fa, "_results_queue"):
        yield
        return
    prev = fa._results_queue
    fa._results_queue = queue.Queue()
    try:
        yield
    finally:
        fa._results_queue = prev


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_fork_guard = {"armed": 0, "registered": False, "parent": 0}


def _note_forking_pid():
    _fork_guard["parent"] = os.getpid()


def _die_with_forking_process():
    """In a child forked while a save is armed: have Linux SIGKILL it when the saving process dies."""
    if not _fork_guard["armed"]:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != _fork_guard["parent"]:  # the saving process died before prctl took effect
        os._exit(1)


@contextlib.contextmanager
def _writers_die_with_run():
    """Children forked during the block are killed by the kernel when the process that forked them dies.

    megatron-core's ``FileSystemWriterAsync.write_preloaded_data_multiproc`` forks one writer per bucket and
    waits for them in ``JoinableQueue.join()``. If the run is killed (``kill -9``, OOM killer) while it waits,
    the last writer to finish hangs for ever in ``task_done()``: ``Condition.notify_all`` waits for the dead
    waiter to wake. With ``PR_SET_PDEATHSIG`` = ``SIGKILL`` (Linux) each writer dies with the run instead; its
    half-written ``iter_*.tmp`` is removed at the next start-up or save. Elsewhere (not Linux) this is a no-op.
    """
    if not sys.platform.startswith("linux"):
        yield
        return
    if not _fork_guard["registered"]:
        os.register_at_fork(before=_note_forking_pid, after_in_child=_die_with_forking_process)
        _fork_guard["registered"] = True
    _fork_guard["armed"] += 1
    try:
        yield
    finally:
        _fork_guard["armed"] -= 1


def save_checkpoint(ckpt_dir: str, iteration: int, model, *, sharded_extra: dict | None = None,
                    common: dict | None = None, tokenizer_dir: str | None = None, keep_last: int | None = None) -> str:
    """Save ``model`` (and optional sharded optimizer state) as iteration ``iteration`` of ``ckpt_dir``.

    Collective: every rank calls it. The model's sharded keys carry no prefix and the common state holds
    ``args`` / ``iteration`` / ``checkpoint_version`` (Megatron-LM's format, see the module docstring).

    Args:
        model: the (unwrapped or wrapped) :class:`~megatron_jf.models.gpt.JFGPTModel`; it must carry
            ``model_args``.
        sharded_extra: more sharded-state entries saved next to the model (e.g. ``{"optimizer": ...}``
            built with megatron ``ShardedTensor``/``ShardedObject`` factories).
        common: JSON-serialisable training state saved in ``jf_meta.json`` (scheduler, data position, RNG seeds, ...).
        tokenizer_dir: a directory of tokenizer files copied to ``ckpt_dir/tokenizer`` once.
        keep_last: delete older iterations beyond this many (None keeps all).

    Returns:
        The final iteration directory.
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_jf.models.gpt import unwrap

    m = unwrap(model)
    final = iter_dir(ckpt_dir, iteration)
    tmp = final + ".tmp"
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    if parallel.is_rank0():
        os.makedirs(ckpt_dir, exist_ok=True)
        remove_stale_tmp(ckpt_dir)
        os.makedirs(tmp)
        if (tokenizer_dir and not os.path.isdir(os.path.join(ckpt_dir, "tokenizer"))
                and any(os.path.isfile(os.path.join(tokenizer_dir, n)) for n in TOKENIZER_FILES[:-1])):
            copy_tokenizer_files(tokenizer_dir, os.path.join(ckpt_dir, "tokenizer"))
    parallel.barrier()
    dtype = next(m.parameters()).dtype
    tok = os.path.join(os.path.abspath(ckpt_dir), "tokenizer")
    state = {
        "model": m.sharded_state_dict(prefix=MODEL_KEY_PREFIX),
        "args": megatron_lm_args(m.model_args, tp=tp, pp=pp, iteration=iteration, params_dtype=dtype,
                                 consumed_train_samples=int((common or {}).get("consumed_samples", 0) or 0),
                                 tokenizer_model=tok if os.path.isdir(tok) else None),
        "iteration": iteration,
        "checkpoint_version": CHECKPOINT_VERSION,
    }
    state.update(sharded_extra or {})
    with _sync_results_queue(), _writers_die_with_run():
        dist_checkpointing.save(state, tmp)
    parallel.barrier()
    if parallel.is_rank0():
        meta = {
            "format": FORMAT,
            "iteration": iteration,
            "model_args": m.model_args.to_dict(),
            "tp": tp,
            "pp": pp,
            "model_key_prefix": MODEL_KEY_PREFIX,
            "common": common or {},
        }
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
        old = final + ".replaced.tmp"  # re-saving an iteration: swap by renames, delete the old copy after
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        atomic_write_text(os.path.join(ckpt_dir, LATEST), str(iteration))
        if keep_last:
            its = sorted(int(d[5:]) for d in os.listdir(ckpt_dir)
                         if d.startswith("iter_") and d[5:].isdigit())
            for old in its[:-keep_last]:
                shutil.rmtree(iter_dir(ckpt_dir, old), ignore_errors=True)
    parallel.barrier()
    return final


def load_checkpoint(ckpt_dir: str, model, *, iteration: int | None = None,
                    sharded_extra: dict | None = None, strict: bool = True) -> dict:
    """Load model weights (and optional extra sharded state) into ``model`` from ``ckpt_dir``.

    Works across TP/PP layouts (the checkpoint is resharded to the current one), across layer specs
    (local or Transformer Engine), for this project's checkpoints old and new and for Megatron-LM's.

    Returns:
        ``{"meta": metadata (see read_meta), "extra": loaded extra sharded state}``.

    Raises:
        FileNotFoundError: no checkpoint there.
        CheckpointFileError: a checkpoint file is missing, truncated or foreign, or megatron-core cannot read the
            state (one line naming the file or directory and the cause).
        ValueError: the checkpoint's architecture differs from the model's (names the first field).
    """
    from megatron_jf.models.gpt import unwrap

    m = unwrap(model)
    meta = read_meta(ckpt_dir, iteration, verify=True)
    saved = ModelArgs.from_dict(meta["model_args"])
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias"):
        if getattr(saved, field) != getattr(m.model_args, field):
            raise ValueError(f"checkpoint {ckpt_dir} has {field}={getattr(saved, field)!r} but the model has "
                             f"{getattr(m.model_args, field)!r}: checkpoint from another architecture")
    prefix = meta["model_key_prefix"]
    state = {"model": m.sharded_state_dict(prefix=prefix)}
    absent = {k[len(prefix):] for k in drop_absent_extra_state(state["model"], meta["path"])}
    state.update(sharded_extra or {})
    loaded = _load_sharded(state, meta["path"])
    missing = m.load_state_dict({k[len(prefix):]: v for k, v in loaded["model"].items()},
                                strict=strict and not absent).missing_keys
    if strict and set(missing) - absent:
        raise RuntimeError(f"checkpoint {meta['path']} lacks model keys {sorted(set(missing) - absent)[:5]}")
    return {"meta": meta, "extra": {k: v for k, v in loaded.items() if k != "model"}}


def drop_absent_extra_state(sharded: dict, path: str) -> list[str]:
    """Remove from a model's sharded state dict the ``_extra_state`` objects the checkpoint at ``path`` does not hold.

    Transformer Engine modules (``TENorm``, the TE linear layers) save an ``_extra_state`` (FP8 scaling metadata) that a
    checkpoint written without TE -- on CPU, in CI, by ``tools/convert_hf.py`` on a CPU node -- lacks, and megatron's
    ``torch_dist`` load fails on any requested key the checkpoint does not have (``Missing key in checkpoint
    state_dict: decoder.final_layernorm._extra_state/shard_0_1``). Such a module starts from its default extra state,
    as a freshly built one does. The reverse (a TE checkpoint loaded without TE) needs nothing: keys the model does not
    request are not read.

    Args:
        sharded: ``{state-dict key: ShardedTensor | ShardedObject}`` (one level, as ``GPTModel.sharded_state_dict``);
            changed in place.
        path: the iteration directory.

    Returns:
        The state-dict keys removed.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    extra = [k for k, v in sharded.items() if isinstance(v, ShardedObject) and v.key.endswith("._extra_state")]
    if not extra:
        return []
    held = {getattr(v, "key", k) for k, v in load_sharded_metadata(path).items()}
    absent = [k for k in extra if sharded[k].key not in held]
    for k in absent:
        del sharded[k]
    return absent


def stored_dtype(ckpt_dir: str, iteration: int | None = None) -> torch.dtype:
    """The dtype the checkpoint's model weights are stored in (read from the distributed checkpoint's metadata,
    so it works for this project's checkpoints old and new and for Megatron-LM's).

    Raises:
        FileNotFoundError / ValueError: see :func:`read_meta`.
    """
    from megatron.core import dist_checkpointing

    meta = read_meta(ckpt_dir, iteration, verify=True)
    md = dist_checkpointing.load_tensors_metadata(meta["path"])
    prefix = meta["model_key_prefix"]
    for name in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"):
        if prefix + name in md:
            return md[prefix + name].dtype
    raise ValueError(f"{meta['path']} holds no model weights (no {prefix}embedding.word_embeddings.weight)")


def inference_spec() -> str:
    """The layer spec :func:`load_model` builds by default: ``local`` while the lean inference forward is on
    (``MEGATRON_JF_LEAN_FORWARD``, default on), else ``auto``."""
    from megatron_jf import env

    return "local" if env.lean_forward() else "auto"


def load_model(ckpt_dir: str, *, iteration: int | None = None, params_dtype: torch.dtype | None = None,
               transformer_impl: str | None = None):
    """Build the model described by a checkpoint and load its weights (for inference tools).

    Requires :func:`megatron_jf.parallel.initialize` first (any TP/PP layout). ``transformer_impl``: the layer spec;
    default ``local`` while the lean inference forward is on (``MEGATRON_JF_LEAN_FORWARD``, default on: decoding runs
    that forward -- and on CUDA its static-shape / CUDA-graph path -- over the local spec's parameters, also where
    Transformer Engine is installed; a checkpoint trained with the TE spec loads into it), else ``auto`` (megatron's
    forward, TE where present).

    Returns:
        ``(model in eval mode, ModelArgs, meta)``.
    """
    from megatron_jf.models.gpt import build_model

    meta = read_meta(ckpt_dir, iteration, verify=True)  # a damaged checkpoint stops before the model is built
    args = ModelArgs.from_dict(meta["model_args"])
    model = build_model(args, params_dtype=params_dtype, transformer_impl=transformer_impl or inference_spec())
    load_checkpoint(ckpt_dir, model, iteration=iteration, strict=False)
    return model.eval(), args, meta


def tokenizer_path(ckpt_dir: str) -> str | None:
    """``ckpt_dir/tokenizer`` when the checkpoint carries tokenizer files, else None.

    Raises:
        FileNotFoundError: ``ckpt_dir`` does not exist (so a mistyped ``--load`` is not reported as a
            missing tokenizer).
    """
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory not found: {ckpt_dir}")
    p = os.path.join(ckpt_dir, "tokenizer")
    return p if os.path.isdir(p) else None
