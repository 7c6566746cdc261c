"""MR's candidate pool (paper Sec. 3.2, "MR" decoding): recycled n-grams and context n-grams.

**Rejection recycling** (:class:`NGramPool`). Draft tokens that verification rejects are often right but
misplaced: the same n-gram turns up a few positions later. The pool keeps n-grams cut from rejected drafts, keyed
by their first token and remembering the token before them. After each verification the newest known token ``x``
(and the committed token before it) selects candidates: n-grams starting with ``x``, those whose recorded
preceding token also matches the committed text first (a two-token suffix match), newest first. The pool persists
across blocks for the whole request.

**Context n-grams** (:class:`ContextNGrams`; prompt lookup, as vLLM's n-gram proposer and lookahead decoding's
pool do). Chat and code answers repeat their prompt (a signature, a docstring, an identifier) and themselves: the
committed text (prompt + output) is indexed by token, and the tokens that followed earlier occurrences of the
newest token ``x`` become candidates, ranked by how many tokens before each occurrence match the tokens before
``x`` (up to ``max_match``), the earliest occurrence first among equal matches (as vLLM's proposer takes the
first match; on HumanEval chat prompts with SmolLM2-135M it gives more tokens per forward than the newest).

Both give ``(continuation, match)`` pairs, ``match`` the number of committed tokens the candidate's context agrees
with (the newest token included): MR ranks them together (:meth:`megatron_jf.decoding.mr.MRPolicy.candidates`).
"""

from __future__ import annotations

from collections import OrderedDict


class NGramPool:
    """Bounded LRU pool of n-grams keyed by first token.

    Args:
        ngram_len: tokens stored per entry (the candidate draft length; longer candidates are cut).
        max_per_key: entries kept per first token (oldest evicted).
        max_keys: distinct first tokens kept (least recently used evicted).

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(self, ngram_len: int, max_per_key: int = 8, max_keys: int = 4096):
        if ngram_len < 1 or max_per_key < 1 or max_keys < 1:
            raise ValueError("NGramPool sizes must be >= 1")
        self.ngram_len = ngram_len
        self.max_per_key = max_per_key
        self.max_keys = max_keys
        self._pool: OrderedDict[int, OrderedDict[tuple, int]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(v) for v in self._pool.values())

    def add_rejected(self, prev_token: int, tokens: list[int], stride: int = 1) -> None:
        """Add the n-grams of a rejected draft segment ``tokens`` (cut every ``stride`` positions).

        ``prev_token`` is the token that preceded ``tokens[0]`` in the draft (the suffix-match key).
        """
        n = len(tokens)
        for i in range(0, n - 1, stride):
            gram = tuple(tokens[i:i + self.ngram_len])
            if len(gram) < 2:
                break
            before = prev_token if i == 0 else tokens[i - 1]
            key = gram[0]
            entries = self._pool.get(key)
            if entries is None:
                entries = self._pool[key] = OrderedDict()
                if len(self._pool) > self.max_keys:
                    self._pool.popitem(last=False)
            else:
                self._pool.move_to_end(key)
            entries.pop(gram, None)
            entries[gram] = before
            if len(entries) > self.max_per_key:
                entries.popitem(last=False)

    def candidates(self, prev_token: int, token: int, k: int,
                   exclude: tuple | None = None) -> list[tuple[list[int], int]]:
        """Up to ``k`` ``(continuation, match)`` pairs for n-grams starting with ``token`` (the continuation without
        ``token`` itself), best first: ``match`` 2 when the entry's recorded preceding token equals ``prev_token``
        (those first), else 1; then newest first. ``exclude`` drops a continuation equal to the primary draft.
        """
        entries = self._pool.get(token)
        if not entries or k <= 0:
            return []
        grams = list(entries.items())[::-1]
        grams.sort(key=lambda kv: kv[1] != prev_token)  # stable: suffix matches first, newest first
        out, seen = [], set()
        for gram, before in grams:
            cont = gram[1:]
            if not cont or cont in seen or (exclude is not None and cont == exclude[:len(cont)]):
                continue
            seen.add(cont)
            out.append((list(cont), 2 if before == prev_token else 1))
            if len(out) == k:
                break
        return out


class ContextNGrams:
    """Prompt lookup over one request's committed tokens: an index from token to its positions, extended as the
    text grows (each committed token is indexed once).

    Args:
        min_match: fewest trailing tokens an earlier occurrence must match (>= 1).
        max_match: most trailing tokens compared when ranking (>= ``min_match``).
        max_scan: most occurrences of the newest token examined per lookup (the earliest ones; bounds the time).

    Raises:
        ValueError: ``1 <= min_match <= max_match`` or ``max_scan >= 1`` violated.
    """

    def __init__(self, min_match: int = 1, max_match: int = 4, max_scan: int = 512):
        if not 1 <= min_match <= max_match or max_scan < 1:
            raise ValueError(f"ContextNGrams needs 1 <= min_match <= max_match and max_scan >= 1, got {min_match}, "
                             f"{max_match}, {max_scan}")
        self.min_match, self.max_match, self.max_scan = min_match, max_match, max_scan
        self._pos: dict[int, list[int]] = {}
        self._indexed = 0  # context positions indexed so far (all but the newest token)
        #: the longest match of the last :meth:`candidates` call (0 where ``context[-1]`` has no earlier occurrence
        #: matching ``min_match`` tokens), counted before duplicates and ``exclude`` are dropped
        self.longest = 0

    def _index(self, context: list[int]) -> None:
        end = len(context) - 1  # the newest token has no continuation yet
        if end < self._indexed:  # the text was cut (never by the engines here): start over
            self._pos.clear()
            self._indexed = 0
        pos = self._pos
        for i in range(self._indexed, end):
            t = context[i]
            lst = pos.get(t)
            if lst is None:
                pos[t] = [i]
            else:
                lst.append(i)
        self._indexed = max(end, 0)

    def candidates(self, context: list[int], k: int, max_len: int,
                   exclude: tuple | None = None) -> list[tuple[list[int], int]]:
        """Up to ``k`` ``(continuation, match)`` pairs for ``context[-1]``: the ``max_len`` tokens after an earlier
        occurrence of it (not including it; where they run past the context, the copy goes on overlapping itself, so
        a pattern repeating with period ``p`` is continued with that period), ``match`` the number of tokens ending at
        that occurrence that equal the tokens ending at ``context[-1]`` (at most ``max_match``, at least
        ``min_match``). Best first: longer matches, then earlier occurrences. Duplicate continuations and one equal to
        ``exclude`` (the draft) are dropped. Sets :attr:`longest`.
        """
        self.longest = 0
        if k <= 0 or max_len <= 0 or not context:
            return []
        self._index(context)
        occ = self._pos.get(context[-1])
        if not occ:
            return []
        n, top = len(context), self.max_match
        scored = []
        for i in occ[: self.max_scan]:
            m = 1
            while m < top and i - m >= 0 and context[i - m] == context[n - 1 - m]:
                m += 1
            if m >= self.min_match:
                scored.append((m, i))
        scored.sort(key=lambda x: -x[0])  # stable: earliest first among equal matches
        self.longest = scored[0][0] if scored else 0
        out, seen = [], set()
        for m, i in scored:
            seq = context[i + 1: i + 1 + max_len]
            while len(seq) < max_len:  # the continuation runs into the newest tokens: copy on, overlapping (a
                j = i + 1 + len(seq)  # repeating pattern continues with its period, LZ77-style)
                seq.append(context[j] if j < n else seq[j - n])
            cont = tuple(seq)
            if cont in seen or (exclude is not None and cont == exclude[:len(cont)]):
                continue
            seen.add(cont)
            out.append((list(cont), m))
            if len(out) == k:
                break
        return out
