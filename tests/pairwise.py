"""Test cases that cover every valid pair of values of their dimensions (and stronger groups), deterministically:
the composition matrix (test_composition.py) and the node-sharded state matrix (test_node_state.py) use them."""

from __future__ import annotations

import itertools
from typing import Callable


def _completable(partial: dict, dims: dict[str, tuple], ok: Callable[[dict], bool]) -> bool:
    """Whether some full case extends ``partial`` (depth-first; the constraints are few and local)."""
    if not ok(partial):
        return False
    rest = [d for d in dims if d not in partial]
    if not rest:
        return True
    d = rest[0]
    return any(_completable({**partial, d: v}, dims, ok) for v in dims[d])


def interactions(dims: dict[str, tuple], ok: Callable[[dict], bool], groups: tuple = ()) -> list[tuple]:
    """What a cover must contain: every valid pair of values of two dimensions, and every valid combination of
    the dimensions of each group in ``groups`` (a stronger cover where interactions are known to hide defects).
    Each is a tuple of ``(dimension, value)`` in dimension order, in a deterministic order."""
    names = list(dims)
    subsets = {tuple(sorted(s, key=names.index)) for s in itertools.combinations(names, 2)}
    subsets |= {tuple(sorted(g, key=names.index)) for g in groups}
    out = []
    for subset in sorted(subsets, key=lambda t: [names.index(d) for d in t]):
        for values in itertools.product(*(dims[d] for d in subset)):
            combo = tuple(zip(subset, values))
            if _completable(dict(combo), dims, ok):
                out.append(combo)
    return out


def all_pairs(dims: dict[str, tuple], ok: Callable[[dict], bool], groups: tuple = (),
              seeds: int = 40) -> list[dict]:
    """A deterministic greedy cover of :func:`interactions` (AETG-like): each new case starts from one of the first
    ``seeds`` uncovered interactions, fills the other dimensions in order with the value completing the most
    uncovered interactions (ties: the first value) among those that keep the case completable, and the candidate
    covering the most is kept."""
    names = list(dims)
    order = {d: i for i, d in enumerate(names)}
    todo = interactions(dims, ok, groups)
    by_item: dict[tuple, list[tuple]] = {}
    for combo in todo:
        for item in combo:
            by_item.setdefault(item, []).append(combo)

    def covers(case: dict, combo: tuple) -> bool:
        return all(case.get(d, _MISSING) == v for d, v in combo)

    cases: list[dict] = []
    left = set(todo)
    while left:
        best, best_gain = None, -1
        for seed in [c for c in todo if c in left][:seeds]:
            case = dict(seed)
            for d in names:
                if d in case:
                    continue
                scored = []
                for j, v in enumerate(dims[d]):
                    trial = {**case, d: v}
                    if not _completable(trial, dims, ok):
                        continue
                    gain = sum(1 for combo in by_item.get((d, v), ()) if combo in left and covers(trial, combo))
                    scored.append((-gain, j, v))
                case[d] = min(scored, key=lambda x: x[:2])[2]
            gain = sum(1 for combo in left if covers(case, combo))
            if gain > best_gain:
                best, best_gain = case, gain
        assert best is not None and best_gain > 0
        left = {combo for combo in left if not covers(best, combo)}
        cases.append({d: best[d] for d in sorted(best, key=order.get)})
    return cases


_MISSING = object()


def full_product(dims: dict[str, tuple], ok: Callable[[dict], bool]) -> list[dict]:
    return [c for c in (dict(zip(dims, values)) for values in itertools.product(*dims.values())) if ok(c)]


__all__ = ["all_pairs", "full_product", "interactions"]
