"""megatron-jf's vLLM plugin: Jacobi and MR decoding as vLLM speculative methods (docs/vllm_plugin.md).

Installed with the project (``pip install -e .`` into a vLLM environment; ``JF_ENV=vllm bash scripts/bootstrap.sh``
builds one), it is registered under vLLM's ``vllm.general_plugins`` entry point, so vLLM calls :func:`register`
in every process it starts (front end, engine core, workers). Then::

    from vllm import LLM
    llm = LLM(model, speculative_config={"method": "jacobi", "num_speculative_tokens": 16})
    llm = LLM(model, speculative_config={"method": "mr", "num_speculative_tokens": 32, "num_blocks": 2})

    vllm serve MODEL --speculative-config '{"method": "jacobi", "num_speculative_tokens": 16}'

Modules: :mod:`.methods` (the method names and their options), :mod:`.proposer` (the per-request policies of
:mod:`megatron_jf.decoding`), :mod:`.vllm_internals` (every vLLM internal touched, version-checked).
Importing this package imports neither vLLM nor torch.
"""


def register() -> None:
    """vLLM's general-plugin entry point: check the vLLM version and install the plugin's wraps.

    Never raises (vLLM's plugin loader does not catch, so an exception would break every vLLM use in the
    environment): on an untested vLLM version, or one whose internals changed, it logs one warning and installs
    nothing but a guard that makes ``method: jacobi | mr`` fail with one line naming the supported versions
    (:func:`megatron_jf.vllm_plugin.vllm_internals.install`).
    """
    from megatron_jf.vllm_plugin import vllm_internals

    vllm_internals.install()
