"""The shared prompt order: an endless stream of row indices, the same on every rank."""

from __future__ import annotations

import numpy as np

from .records import DataError


class PromptSampler:
    """An endless stream of prompt indices, identical on every rank (shared seed).

    Each pass over the data is a permutation drawn from ``(seed, epoch)``, so the state is two integers
    and a resumed run continues the exact same stream.
    """

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        from ..seeding import stream_seed

        return np.random.default_rng([stream_seed(self.seed, "prompt_order"), epoch]).permutation(self.n)

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            take = min(k - len(out), self.n - self.pos)
            out.extend(int(i) for i in self._perm[self.pos : self.pos + take])
            self.pos += take
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n"] != self.n:
            raise DataError(f"checkpoint was made with {state['n']} prompts, the data now has {self.n}")
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._perm = self._permutation(self.epoch)
