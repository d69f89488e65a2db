"""The synthetic workload: sessions that share system prompts and grow turn by turn.

A page's tokens are stood for by a 64-bit fingerprint of where they come from (system
prompt ``p`` page ``j``, or session ``s`` turn ``t`` page ``j``): two pages hold the same
tokens exactly when their fingerprints are equal. A page's key chains the key of the page
before it with its own fingerprint (:func:`chain_key`), so equal keys mean equal prefixes,
as in a radix cache.
"""

from __future__ import annotations

import hashlib
import random

import attrs

ROOT_KEY = 0
_KEY_MASK = (1 << 63) - 1  # keys fit a non-negative int64, so the device can derive data


def chain_key(prev: int, tokens: int) -> int:
    """The key of a page whose predecessor has key ``prev`` and whose tokens are ``tokens``."""
    digest = hashlib.blake2b(prev.to_bytes(8, "little") + tokens.to_bytes(8, "little"),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") & _KEY_MASK


def _fingerprint(*parts: int) -> int:
    data = b"".join(p.to_bytes(8, "little", signed=True) for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@attrs.frozen
class WorkloadConfig:
    """Shape of the workload.

    Each wave, ``concurrency`` of the ``live_sessions`` sessions (picked at random) send
    their next turn; a session ends after a random number of turns up to ``max_turns`` and a
    new one takes its place, starting from one of ``system_prompts`` shared prompts of
    ``prompt_pages`` pages. A turn appends between ``turn_pages[0]`` and ``turn_pages[1]``
    pages.
    """

    system_prompts: int = 4
    prompt_pages: int = 8
    live_sessions: int = 256
    concurrency: int = 32
    max_turns: int = 8
    turn_pages: tuple[int, int] = (1, 4)
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        from kvcore.errors import InvalidArgument

        for name in ("system_prompts", "prompt_pages", "live_sessions", "concurrency",
                     "max_turns"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(name, "a positive int", repr(getattr(self, name)))
        lo, hi = self.turn_pages
        if not 1 <= lo <= hi:
            raise InvalidArgument("turn_pages", "(lo, hi) with 1 <= lo <= hi",
                                  repr(self.turn_pages))
        if self.concurrency > self.live_sessions:
            raise InvalidArgument("concurrency", f"at most live_sessions "
                                  f"({self.live_sessions})", str(self.concurrency))

    @property
    def max_request_pages(self) -> int:
        """The most pages one request can span (prompt plus every turn)."""
        return self.prompt_pages + self.max_turns * self.turn_pages[1]


@attrs.frozen
class Request:
    """One turn of one session: the keys of every page of its prompt, in order."""

    session: int
    turn: int
    keys: tuple[int, ...]
    new_pages: int


@attrs.define
class _Session:
    id: int
    turns: int
    keys: list[int]
    turn: int = 0


class Workload:
    """Deterministic (for a seed) stream of request waves."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._prompts = []
        for p in range(config.system_prompts):
            keys, prev = [], ROOT_KEY
            for j in range(config.prompt_pages):
                prev = chain_key(prev, _fingerprint(0, p, j))
                keys.append(prev)
            self._prompts.append(keys)
        self._next_id = 0
        self._sessions = [self._new_session() for _ in range(config.live_sessions)]

    def _new_session(self) -> _Session:
        prompt = self._rng.randrange(self.config.system_prompts)
        s = _Session(self._next_id, self._rng.randint(1, self.config.max_turns),
                     list(self._prompts[prompt]))
        self._next_id += 1
        return s

    def wave(self) -> list[Request]:
        """The next ``concurrency`` requests, one per distinct session."""
        cfg = self.config
        out = []
        for slot in self._rng.sample(range(len(self._sessions)), cfg.concurrency):
            s = self._sessions[slot]
            n = self._rng.randint(*cfg.turn_pages)
            prev = s.keys[-1]
            for j in range(n):
                prev = chain_key(prev, _fingerprint(1, s.id, s.turn, j))
                s.keys.append(prev)
            out.append(Request(s.id, s.turn, tuple(s.keys), n))
            s.turn += 1
            if s.turn >= s.turns:
                self._sessions[slot] = self._new_session()
        return out
