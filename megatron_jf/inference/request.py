"""One generation request's settings as plain data: :class:`SamplingParams` and :class:`Request`, and the one check
of a prompt against the context window (:func:`check`).

Standard library only (no torch): the server's protocol parses into a :class:`Request`, the scheduler queues it,
the tensor-parallel broadcast pickles it, and :meth:`BatchSession.add <megatron_jf.inference.session.BatchSession.add>`
keeps it on the row that decodes it -- the same object all the way.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_jf.decoding.config import DecodeConfig

__all__ = ["ContextError", "DecodeConfig", "Request", "SamplingParams", "check"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` means greedy.

    Attributes:
        temperature: softmax temperature (>= 0).
        top_k: keep the k most likely tokens (0 = all).
        top_p: nucleus mass in (0, 1] (1 = all).
        seed: seed of the per-request random generator (same seed, same output).

    Raises:
        ValueError: on construction, for a negative temperature or top_k, or top_p outside (0, 1].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0`` (argmax decoding)."""
        return self.temperature == 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Request:
    """Everything one prompt is decoded with (the prompt itself travels next to it).

    Attributes:
        decode: decoder and its parameters.
        sampling: greedy (default) or sampling parameters; ``sampling.seed`` also seeds the draft initialisation.
        max_new_tokens: exact cap on emitted tokens (>= 1).
        stop_strings: strings that end the request (the output ends right before the first occurrence of any;
            needs a detokenizer where it is decoded). Any iterable of non-empty strings; kept as a tuple.
        eos_ids: token ids that end the request (kept as its last token); any iterable of ints, kept as a
            frozenset. None: the caller's default (:meth:`LLM.generate <megatron_jf.inference.llm.LLM.generate>`:
            the checkpoint's stop ids; the engine: none).
        seed: seed of this row's sampling generator (None: ``sampling.seed``).
        record_trajectory: keep every block's intermediate drafts (``jacobi`` decoder only).
        name: how errors name the prompt (e.g. ``"prompt 3"``).

    Raises:
        ValueError: on construction, naming the field: a wrong type, ``max_new_tokens < 1``, an empty stop string,
            a negative EOS id.
    """

    decode: DecodeConfig = DecodeConfig()
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 128
    stop_strings: tuple[str, ...] = ()
    eos_ids: frozenset[int] | None = None
    seed: int | None = None
    record_trajectory: bool = False
    name: str = "prompt"

    def __post_init__(self):
        if not isinstance(self.decode, DecodeConfig):
            raise ValueError(f"decode must be a DecodeConfig, got {type(self.decode).__name__}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if not _is_int(self.max_new_tokens):
            raise ValueError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        stops = (self.stop_strings,) if isinstance(self.stop_strings, str) else self.stop_strings
        try:
            stops = tuple(stops)
        except TypeError:
            raise ValueError(f"stop_strings must be a sequence of strings, got {self.stop_strings!r}") from None
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop_strings must be non-empty strings, got {stops!r}")
        object.__setattr__(self, "stop_strings", stops)
        if self.eos_ids is not None:
            try:
                eos = frozenset(self.eos_ids)
            except TypeError:
                raise ValueError(f"eos_ids must be a set of token ids or None, got {self.eos_ids!r}") from None
            if not all(_is_int(t) and t >= 0 for t in eos):
                raise ValueError(f"eos_ids must be token ids (integers >= 0), got {sorted(eos, key=repr)!r}")
            object.__setattr__(self, "eos_ids", eos)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.record_trajectory, bool):
            raise ValueError(f"record_trajectory must be a bool, got {self.record_trajectory!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {self.name!r}")

    @property
    def row_seed(self) -> int:
        """The seed of this row's sampling generator: :attr:`seed`, else ``sampling.seed``."""
        return self.sampling.seed if self.seed is None else self.seed


class ContextError(ValueError):
    """A prompt that does not fit the context window with its request's ``max_new_tokens``.

    Attributes:
        field: ``"prompt"`` (empty, or it leaves no token to generate) or ``"max_new_tokens"`` (prompt + cap too
            long).
        prompt_len, max_new_tokens, max_context: the numbers compared (tokens).
    """

    def __init__(self, message: str, field: str, prompt_len: int, max_new_tokens: int, max_context: int):
        super().__init__(message)
        self.field = field
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.max_context = max_context


def check(request: Request, prompt_len: int, max_context: int) -> None:
    """The prompt fits: ``prompt_len >= 1`` and ``prompt_len + request.max_new_tokens <= max_context`` (tokens).

    Raises:
        ContextError: naming ``request.name`` and the field at fault.
    """
    n, m = prompt_len, request.max_new_tokens
    if n == 0:
        raise ContextError(f"{request.name} is empty", "prompt", n, m, max_context)
    if n + m > max_context:
        raise ContextError(f"{request.name} has {n} tokens; with max_new_tokens={m} it exceeds the context window "
                           f"of {max_context} tokens", "prompt" if n >= max_context else "max_new_tokens", n, m,
                           max_context)
