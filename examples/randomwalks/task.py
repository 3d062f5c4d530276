"""The randomwalks task: find short paths to a goal node in a small random graph.

A fixed directed random graph has ``n_nodes`` nodes named by letters (``'a'``,
``'b'``, ...). Every ordered pair of distinct nodes is an edge independently with
probability ``p``. Node ``'a'`` is the absorbing goal. A *walk* is a string of
node names such as ``"dkfa"``: the prompt is the start node (``"d"``) and the
model's output is the rest (``"kfa"``).

The optimality of a walk of ``L`` nodes (start included) from a start whose
shortest path to the goal has ``S`` nodes is ``(max_length - L) / (max_length - S)``
(``max_length`` = 10): 1.0 for a shortest path, smaller for detours, 0.0 for a
walk that reaches the goal at exactly ``max_length`` nodes. A walk is *invalid*,
and scores 0.0, when it is empty, contains a character that is not a node name,
uses an edge that does not exist, does not reach the goal within ``max_length``
nodes (unfinished), or has anything after the goal (the goal is absorbing, so
the walk ends at its first ``'a'``; trailing characters are an error, not
silently ignored).

Graphs are redrawn deterministically (``seed``, ``seed + 1``, ...) until every
non-goal node has an out-edge and reaches the goal through a path of fewer than
``max_length`` nodes, so every start has a reachable optimum and the optimality
denominator is positive.

This module is pure Python (no torch); it is the reward side of the example.
"""

from __future__ import annotations

import random
import string
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Set

DEFAULT_SEED = 1246  # first draw is accepted; a uniform random walker scores ~0.32 (trlx: ~0.35)
DEFAULT_N_NODES = 21
DEFAULT_P = 0.1
MAX_LENGTH = 10  # most nodes a walk may have, start node included
GOAL = "a"

__all__ = [
    "DEFAULT_SEED",
    "DEFAULT_N_NODES",
    "DEFAULT_P",
    "MAX_LENGTH",
    "GOAL",
    "Graph",
    "make_graph",
    "build_graph",
    "default_graph",
    "random_walks",
    "walk_status",
    "is_valid_walk",
    "optimality",
    "reward_fn",
    "metric_fn",
    "train_prompts",
    "eval_prompts",
    "expected_random_walk_optimality",
]


@dataclass
class Graph:
    """A directed graph with a goal node.

    ``adjacency[u]`` is the set of nodes ``v`` with an edge ``u -> v``; the goal
    keeps no out-edges (it is absorbing). ``shortest[u]`` is the number of nodes
    on a shortest path from ``u`` to the goal, both ends included (1 for the goal
    itself); nodes that cannot reach the goal are absent from ``shortest``.
    ``seed`` is the seed that actually produced the graph (after rejections).
    """

    nodes: List[str]
    adjacency: Dict[str, Set[str]]
    goal: str = GOAL
    shortest: Dict[str, int] = field(default_factory=dict)
    seed: Optional[int] = None
    max_length: int = MAX_LENGTH

    def __post_init__(self) -> None:
        if self.goal not in self.nodes:
            raise ValueError(f"goal {self.goal!r} is not a node")
        self.adjacency = {u: set(self.adjacency.get(u, ())) for u in self.nodes}
        self.adjacency[self.goal] = set()  # absorbing
        for u, vs in self.adjacency.items():
            bad = vs - set(self.nodes)
            if bad or u in vs:
                raise ValueError(f"bad out-edges of {u!r}: {sorted(vs)}")
        if not self.shortest:
            self.shortest = _shortest_to_goal(self.nodes, self.adjacency, self.goal)

    @property
    def starts(self) -> List[str]:
        """Non-goal nodes, in node order (the possible prompts)."""
        return [u for u in self.nodes if u != self.goal]

    def has_edge(self, u: str, v: str) -> bool:
        return v in self.adjacency.get(u, ())

    def n_edges(self) -> int:
        return sum(len(vs) for vs in self.adjacency.values())


def _shortest_to_goal(nodes: Sequence[str], adjacency: Dict[str, Set[str]], goal: str) -> Dict[str, int]:
    """BFS on reversed edges: number of nodes on a shortest path to ``goal``."""
    incoming: Dict[str, List[str]] = {u: [] for u in nodes}
    for u, vs in adjacency.items():
        for v in vs:
            incoming[v].append(u)
    dist = {goal: 1}
    queue = deque([goal])
    while queue:
        v = queue.popleft()
        for u in incoming[v]:
            if u not in dist:
                dist[u] = dist[v] + 1
                queue.append(u)
    return dist


def _node_names(n_nodes: int) -> List[str]:
    if not 2 <= n_nodes <= 26:
        raise ValueError("n_nodes must be between 2 and 26 (nodes are named by letters)")
    return list(string.ascii_lowercase[:n_nodes])


def make_graph(seed: int, n_nodes: int = DEFAULT_N_NODES, p: float = DEFAULT_P) -> Graph:
    """Draw one graph from ``seed`` (no rejection)."""
    nodes = _node_names(n_nodes)
    rng = random.Random(seed)
    adjacency: Dict[str, Set[str]] = {u: set() for u in nodes}
    for u in nodes:  # fixed order: row by row, each ordered pair once
        for v in nodes:
            if u != v and rng.random() < p:
                adjacency[u].add(v)
    return Graph(nodes=nodes, adjacency=adjacency, goal=GOAL, seed=seed)


def _acceptable(graph: Graph) -> bool:
    for u in graph.starts:
        if not graph.adjacency[u]:
            return False
        s = graph.shortest.get(u)
        if s is None or s >= graph.max_length:
            return False
    return True


def build_graph(
    seed: int = DEFAULT_SEED,
    n_nodes: int = DEFAULT_N_NODES,
    p: float = DEFAULT_P,
    max_tries: int = 10_000,
) -> Graph:
    """The task graph: the first acceptable draw among seeds ``seed, seed+1, ...``.

    Acceptable: every non-goal node has an out-edge and reaches the goal in
    fewer than ``MAX_LENGTH`` nodes. ``graph.seed`` is the seed that was used.
    """
    for k in range(max_tries):
        graph = make_graph(seed + k, n_nodes, p)
        if _acceptable(graph):
            return graph
    raise RuntimeError(f"no acceptable graph in seeds {seed}..{seed + max_tries - 1}")


@lru_cache(maxsize=None)
def default_graph() -> Graph:
    """The graph used by :func:`reward_fn` and :func:`metric_fn` (built once)."""
    return build_graph(DEFAULT_SEED, DEFAULT_N_NODES, DEFAULT_P)


def _as_rng(rng: Any) -> random.Random:
    if isinstance(rng, random.Random):
        return rng
    return random.Random(rng)  # an int seed or None


def random_walks(graph: Graph, n: int, rng: Any = None) -> List[str]:
    """``n`` random walks: the pretraining corpus.

    Each walk starts at a uniformly random non-goal node and follows uniformly
    random out-edges until it reaches the goal or has ``max_length`` nodes;
    unfinished walks are kept, as a random walker produces them. ``rng`` is a
    ``random.Random`` or an int seed.
    """
    rng = _as_rng(rng)
    starts = graph.starts
    out = {u: sorted(vs) for u, vs in graph.adjacency.items()}
    walks = []
    for _ in range(n):
        node = rng.choice(starts)
        walk = [node]
        while node != graph.goal and len(walk) < graph.max_length:
            node = rng.choice(out[node])
            walk.append(node)
        walks.append("".join(walk))
    return walks


def walk_status(graph: Graph, walk: str) -> str:
    """``"ok"`` or why ``walk`` is invalid: ``"empty"``, ``"bad_char"``,
    ``"bad_edge"``, ``"after_goal"``, ``"too_long"`` or ``"unfinished"``."""
    if not walk:
        return "empty"
    node_set = graph.adjacency
    for ch in walk:
        if ch not in node_set:
            return "bad_char"
    for u, v in zip(walk, walk[1:]):
        if u == graph.goal:
            return "after_goal"
        if v not in graph.adjacency[u]:
            return "bad_edge"
    if len(walk) > graph.max_length:
        return "too_long"
    if walk[-1] != graph.goal:
        return "unfinished"
    return "ok"


def is_valid_walk(graph: Graph, walk: str) -> bool:
    return walk_status(graph, walk) == "ok"


def optimality(graph: Graph, prompt: str, output: str) -> float:
    """Optimality in [0, 1] of the walk ``prompt + output`` (0.0 when invalid)."""
    walk = prompt + output
    if walk_status(graph, walk) != "ok":
        return 0.0
    shortest = graph.shortest[walk[0]]
    m = graph.max_length
    if shortest >= m:  # cannot happen for graphs from build_graph
        return 0.0
    return (m - len(walk)) / (m - shortest)


def reward_fn(samples: Sequence[str], prompts: Sequence[str], outputs: Sequence[str], **kwargs: Any) -> List[float]:
    """Reward of each sample: its optimality on the default graph.

    ``samples[i] == prompts[i] + outputs[i]``; extra keyword arguments (token
    ids, tokenizer, metadata columns) are ignored.
    """
    graph = default_graph()
    return [optimality(graph, p, o) for p, o in zip(prompts, outputs)]


def metric_fn(samples: Sequence[str], prompts: Sequence[str], outputs: Sequence[str], **kwargs: Any) -> Dict[str, List[float]]:
    """Evaluation metrics per sample: ``{"optimality": [...]}``."""
    return {"optimality": reward_fn(samples, prompts, outputs, **kwargs)}


def train_prompts(graph: Graph, n: int, seed: int = 0) -> List[str]:
    """``n`` training prompts: uniformly random non-goal start nodes (deterministic in ``seed``)."""
    rng = random.Random(seed)
    return [rng.choice(graph.starts) for _ in range(n)]


def eval_prompts(graph: Graph, n_per_node: int = 10) -> List[str]:
    """Every non-goal node repeated ``n_per_node`` times, grouped by node
    (20 nodes x 10 = 200 prompts by default)."""
    return [u for u in graph.starts for _ in range(n_per_node)]


def expected_random_walk_optimality(graph: Graph) -> float:
    """Exact mean optimality of a uniform random walker (the pretraining
    distribution), averaged uniformly over non-goal starts."""
    m = graph.max_length
    out = {u: sorted(vs) for u, vs in graph.adjacency.items()}
    total = 0.0
    for start in graph.starts:
        # prob[u] = probability of being at u after len(walk) nodes, not yet at goal
        prob = {start: 1.0}
        score = 0.0
        for length in range(2, m + 1):
            nxt: Dict[str, float] = {}
            for u, pu in prob.items():
                share = pu / len(out[u])
                for v in out[u]:
                    if v == graph.goal:
                        score += share * (m - length) / (m - graph.shortest[start])
                    else:
                        nxt[v] = nxt.get(v, 0.0) + share
            prob = nxt
        total += score
    return total / len(graph.starts)
