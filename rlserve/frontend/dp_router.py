"""Which data-parallel replica a new request goes to.

Two rules, from what a rollout workload needs:

- **Load**: each replica's outstanding work is the tokens it still owes, counted from what
  the front end sent and what came back: every unfinished request's prompt tokens plus
  n x max_tokens, less the tokens it has produced. A request goes to the replica that owes
  least (ties: the one that was given fewest requests), so a replica busy with long
  prompts or long generations gets less.
- **Prefix affinity**: a request whose prompt shares at least half of its full KV blocks
  with a prompt sent recently (the same prompt sent again for a GRPO group, the next turn
  of a conversation) goes where that prompt went, so it hits that replica's prefix cache,
  unless that replica owes `max_imbalance_tokens` more than the least loaded one. The
  routing key is the chain of block hashes of the prompt (one per `block_size` tokens,
  each over all tokens before it, as the KV cache hashes them, salted by cache_salt).
  A prompt's `n` samples are one request to the engine, so always on one replica.
"""

from __future__ import annotations

from collections import OrderedDict


class Router:
    def __init__(self, num_replicas: int, block_size: int, *, max_entries: int = 200_000,
                 match_fraction: float = 0.5, max_imbalance_tokens: int = 16384):
        self.block_size = block_size
        self.load = [0] * num_replicas  # tokens owed
        self.assigned = [0] * num_replicas  # requests routed, ever
        self.match_fraction = match_fraction
        self.max_imbalance_tokens = max_imbalance_tokens
        self._max_entries = max_entries
        self._where: OrderedDict[int, int] = OrderedDict()  # block-chain hash -> replica

    def block_hashes(self, prompt: list[int], salt: str | None = None) -> list[int]:
        bs, out, h = self.block_size, [], hash(salt)
        for start in range(0, len(prompt) - bs + 1, bs):
            h = hash((h, tuple(prompt[start:start + bs])))
            out.append(h)
        return out

    def choose(self, hashes: list[int], candidates: list[int]) -> int:
        """The replica for a prompt with these block hashes, among `candidates` (not empty)."""
        least = min(candidates, key=lambda i: (self.load[i], self.assigned[i], i))
        if hashes:
            matched, where = 0, None
            for h in hashes:  # the longest prefix seen before
                r = self._where.get(h)
                if r is None:
                    break
                matched, where = matched + 1, r
            if (where is not None and where in candidates and matched >= self.match_fraction * len(hashes)
                    and self.load[where] - self.load[least] <= self.max_imbalance_tokens):
                return where
        return least

    def sent(self, replica: int, hashes: list[int], cost: int) -> None:
        self.load[replica] += cost
        self.assigned[replica] += 1
        where = self._where
        for h in hashes:
            where[h] = replica
            where.move_to_end(h)
        while len(where) > self._max_entries:
            where.popitem(last=False)

    def done(self, replica: int, tokens: int) -> None:
        self.load[replica] -= tokens

    def forget(self, replica: int) -> None:
        """The replica is gone: its prefix cache with it."""
        self.load[replica] = 0
        for h in [h for h, r in self._where.items() if r == replica]:
            del self._where[h]
