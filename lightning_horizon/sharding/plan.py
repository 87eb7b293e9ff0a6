"""The planner: which module calls to recompute so that the step's estimated peak fits the budget.

The profiled step is a sequence of *units* (module calls on the current frontier of the call tree) and *glue*
(what training_step and the parents' own code save between calls). A cut before a unit is priced by the bytes
that cross it: a recomputed unit keeps only its inputs (``in_bytes``) until backward, a stored one keeps all it
saved (``saved_bytes``). Memory over the step, with ``prefix(k)`` the bytes held by everything before ``k``:

- during unit ``k``'s backward (or its recompute): ``prefix(k) + saved(k) + transient(k) + grads(>= k)``,
  where transient is the gradient working set (its input and output gradients and three times its largest
  saved tensor) and grads the parameter gradients backward has allocated by then (all of them, from the
  forward on, where the previous step's gradients live until backward: Lightning zeroes them after
  training_step);
- after backward, before the optimizer step: all parameter gradients.

A dynamic program over the units, keeping a Pareto front of (prefix bytes, recompute cost), finds the choice
that keeps every one of these under the budget at the least recompute cost (forward FLOPs plus a charge per
byte re-materialized, so that memory-bound recomputes are not free). A unit whose backward alone exceeds the
budget is replaced by its children (the planner *descends*), as is a container that must not be recomputed;
when recomputed units can be split into cheaper children, the finer frontier is kept if it costs less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from lightning_horizon.checks import is_int, require
from lightning_horizon.memory.probe import fmt_bytes
from lightning_horizon.sharding.profile import Call, Profile
from lightning_horizon.sharding.shard_plan import InfeasibleBudgetError, Shard, ShardPlan

#: Recompute cost charged per byte re-materialized, in FLOP-equivalents: roughly a CPU core's FLOP/byte balance
#: (tens of GFLOP/s against ~10 GB/s), so an elementwise recompute that moves many bytes is not counted as free.
BYTE_COST = 4.0
_STATES = 4096  # resolution of the DP's memory axis: prefixes within budget/4096 of each other are merged


@dataclass
class _Item:
    call: Optional[Call]  # None: glue
    stored: int
    kept: int
    transient: int
    grads: int
    cost: float

    @property
    def choosable(self) -> bool:
        return self.call is not None and not self.call.reason and self.kept < self.stored


def _label(call: Call, calls_per_name: dict[str, int]) -> str:
    name = call.name or "<root>"
    return f"{name}#{call.occurrence}" if calls_per_name[call.name] > 1 else name


def _items(profile: Profile, frontier: set[int], scale: float) -> list[_Item]:
    items: list[_Item] = []

    def glue(n: int) -> None:
        n = int(n * scale)
        if items and items[-1].call is None:
            items[-1].stored += n
            items[-1].transient = max(items[-1].transient, n)
        elif n:
            items.append(_Item(None, n, n, n, 0, 0.0))

    def walk(timeline: list[tuple[str, int]]) -> None:
        for kind, v in timeline:
            if kind == "saved":
                glue(v)
                continue
            c = profile.calls[v]
            if v not in frontier:
                walk(c.timeline)
                continue
            stored, kept = int(c.saved_bytes * scale), int(c.in_bytes * scale)
            # Backward's working set: the gradients entering and leaving, and around the largest saved tensor
            # its gradient, the gradient being produced and the op's workspace (measured ~3x on attention).
            transient = int((c.in_bytes + c.out_bytes + 3 * c.max_saved) * scale)
            items.append(_Item(c, stored, kept, transient, c.grad_bytes, c.flops + BYTE_COST * c.saved_bytes))

    walk(profile.top)
    return items


@dataclass(frozen=True)
class _Grads:
    pending: int  #: bytes of gradients backward allocates
    in_forward: bool  #: the previous step's gradients are alive during the forward (Lightning's order)

    def needs(self, items: list[_Item]) -> list[int]:
        """For each item: what its backward holds on top of the prefix (saved, transient, gradients by then)."""
        needs, before = [], 0
        for it in items:
            grads = self.pending if self.in_forward else max(0, self.pending - before)
            needs.append(it.stored + it.transient + grads)
            before += it.grads
        return needs

    def at_forward_end(self) -> int:
        return self.pending if self.in_forward else 0


def _floor(items: list[_Item], g: _Grads) -> tuple[int, list[int]]:
    """The least peak any choice reaches on these items, and each item's backward with the least prefix."""
    prefix, worst, at = 0, g.pending, []
    for it, need in zip(items, g.needs(items)):
        at.append(prefix + need)
        worst = max(worst, prefix + need)
        prefix += it.kept if it.choosable else it.stored
    return max(worst, prefix + g.at_forward_end()), at


def _solve(items: list[_Item], allowance: int, g: _Grads) -> Optional[tuple[float, int, set[int]]]:
    """The cheapest choice keeping every constraint under ``allowance``: (cost, peak, recomputed item indices)."""
    if g.pending > allowance:
        return None
    quantum = max(1, allowance // _STATES)
    # front: prefix bucket -> (cost, exact prefix, peak so far, back-pointer chain of recomputed items)
    front: dict[int, tuple[float, int, int, Optional[tuple]]] = {0: (0.0, 0, g.pending, None)}
    for k, (it, need) in enumerate(zip(items, g.needs(items))):
        nxt: dict[int, tuple[float, int, int, Optional[tuple]]] = {}

        def offer(prefix: int, cost: float, peak: int, back: Optional[tuple]) -> None:
            b = -(-prefix // quantum)
            old = nxt.get(b)
            if old is None or (cost, prefix) < (old[0], old[1]):
                nxt[b] = (cost, prefix, peak, back)

        for cost, prefix, peak, back in front.values():
            if prefix + need > allowance:
                continue  # this state's backward of item k does not fit; prefixes only grow from here
            peak = max(peak, prefix + need)
            offer(prefix + it.stored, cost, peak, back)
            if it.choosable:
                offer(prefix + it.kept, cost + it.cost, peak, (k, back))
        # Pareto front: a state is kept only if no state with a smaller prefix is as cheap.
        front, best = {}, math.inf
        for b in sorted(nxt):
            if nxt[b][0] < best:
                front[b], best = nxt[b], nxt[b][0]
        if not front:
            return None
    done = [s for s in front.values() if s[1] + g.at_forward_end() <= allowance]
    if not done:
        return None
    cost, prefix, peak, back = min(done, key=lambda s: (s[0], s[1]))
    chosen: set[int] = set()
    while back is not None:
        chosen.add(back[0])
        back = back[1]
    return cost, max(peak, prefix + g.at_forward_end()), chosen


def _top(profile: Profile) -> set[int]:
    return {v for kind, v in profile.top if kind == "call"}


def _global_floor(profile: Profile, scale: float, g: _Grads) -> tuple[int, set[int]]:
    """The least peak over the frontiers met descending everywhere at once, level by level, and its frontier."""
    frontier, best = _top(profile), (math.inf, set())
    while True:
        items = _items(profile, frontier, scale)
        f = _floor(items, g)[0]
        if f < best[0]:
            best = (f, set(frontier))
        parents = {it.call.index for it in items if it.call is not None and it.call.children}
        if not parents:
            return best
        frontier = (frontier - parents) | {ch for i in parents for ch in profile.calls[i].children}


def make_plan(
    profile: Profile,
    budget: int,
    fixed: int,
    headroom: float = 0.95,
    scale: float = 1.0,
    best_effort: bool = False,
    grads_in_forward: bool = False,
) -> ShardPlan:
    """Plan for ``budget`` bytes of RSS, ``fixed`` of which are resident before the step.

    ``grads_in_forward``: the previous step's gradients are still allocated during the forward (Lightning's
    automatic optimization zeroes them between training_step and backward).

    Raises :class:`InfeasibleBudgetError` (stating the smallest feasible budget) when no plan fits, unless
    ``best_effort``, which returns the plan with the smallest estimated peak instead (used when re-planning
    during training, where stopping the run would lose more than a tight step).
    """
    require(is_int(budget, 1), "make_plan", "budget", budget, "a positive int (bytes)")
    target = int(budget * headroom)
    allowance = target - fixed
    grads = _Grads(profile.pending_grad_bytes, grads_in_forward)
    frontier = _top(profile)
    floor, floor_frontier = _global_floor(profile, scale, grads)
    whole = _assemble(profile, _items(profile, frontier, scale), set(), budget, budget, fixed, scale, fixed + floor,
                      grads)
    if whole.estimated_peak <= budget:
        # The whole step fits: recompute would buy memory nobody asked for. The headroom is the margin for what
        # a recompute plan estimates it saves; a plan that recomputes nothing aims at the budget itself.
        return whole
    while True:
        items = _items(profile, frontier, scale)
        f, at = _floor(items, grads)
        if f <= allowance:
            break
        # Descend into units whose backward alone cannot fit, and into containers that may not be recomputed
        # (their children may be).
        deeper = {
            it.call.index for it, a in zip(items, at)
            if it.call is not None and it.call.children and (a > allowance or it.call.reason)
        }
        if not deeper:
            if floor <= allowance:  # the guided descent is stuck, but a finer frontier fits
                frontier = floor_frontier
                break
            # the least of: the floor under headroom, and the whole step within the budget itself
            smallest = min(math.ceil((fixed + floor) / headroom), whole.estimated_peak)
            if best_effort:
                frontier = floor_frontier
                break
            raise _infeasible(budget, fixed, floor, smallest, headroom, whole.estimated_peak)
        frontier = (frontier - deeper) | {ch for i in deeper for ch in profile.calls[i].children}
    items = _items(profile, frontier, scale)
    solved = _solve(items, allowance, grads)
    if solved is None:  # best effort: every choosable unit recomputed
        chosen = {k for k, it in enumerate(items) if it.choosable}
        solved = (sum(items[k].cost for k in chosen), _floor(items, grads)[0], chosen)
    else:
        items, solved = _refine(profile, frontier, items, solved, allowance, grads, scale)
    return _assemble(profile, items, solved[2], budget, target, fixed, scale, fixed + floor, grads)


def _refine(
    profile: Profile,
    frontier: set[int],
    items: list[_Item],
    solved: tuple,
    allowance: int,
    grads: "_Grads",
    scale: float,
) -> tuple[list[_Item], tuple]:
    """A recomputed unit with children may have a cheaper recompute among them (the attention's scores rather
    than the whole block): try finer frontiers (all such units at once, else one at a time, costliest first) and
    keep one while it costs less. Returns the items and solution kept."""
    for _ in range(16):
        split = sorted((k for k in solved[2] if items[k].call.children), key=lambda k: -items[k].cost)
        better = None
        for group in ([split] if len(split) > 1 else []) + [[k] for k in split[:32]]:
            parents = {items[k].call.index for k in group}
            finer = (frontier - parents) | {ch for i in parents for ch in profile.calls[i].children}
            finer_items = _items(profile, finer, scale)
            trial = _solve(finer_items, allowance, grads)
            if trial is not None and trial[0] < 0.98 * solved[0]:
                better = (finer, finer_items, trial)
                break
        if better is None:
            break
        frontier, items, solved = better
    return items, solved


def _infeasible(
    budget: int, fixed: int, floor: int, smallest: int, headroom: float, whole: int
) -> "InfeasibleBudgetError":
    return InfeasibleBudgetError(
        f"budget={budget} bytes ({fmt_bytes(budget)}) is below the smallest feasible plan: the least"
        f" estimated peak is {fmt_bytes(fixed + floor)} ({fmt_bytes(fixed)} resident + {fmt_bytes(floor)}"
        f" activations and gradients with every recomputable call recomputed), which needs a budget of at"
        f" least {smallest} bytes ({fmt_bytes(smallest)}) at headroom={headroom} (a plan that recomputes"
        f" nothing aims at the budget itself: the whole step is estimated at {fmt_bytes(whole)})",
        smallest,
    )


def _assemble(profile: Profile, items: list[_Item], chosen: set[int], budget: int, target: int, fixed: int,
              scale: float, floor: int, g: _Grads) -> ShardPlan:
    per_name: dict[str, int] = {}
    for c in profile.calls:
        per_name[c.name] = per_name.get(c.name, 0) + 1
    shards: list[Shard] = []
    prefix, peak = 0, 0
    for k, (it, need) in enumerate(zip(items, g.needs(items))):
        here = fixed + prefix + need
        peak = max(peak, here)
        prefix += it.kept if k in chosen else it.stored
        if it.call is None:  # glue joins the shard it follows (or opens a stored one)
            if not shards:
                shards.append(Shard([], "store", 0, here))
            shards[-1].peak = max(shards[-1].peak, here)
            continue
        mode = "recompute" if k in chosen else "store"
        if not shards or shards[-1].mode != mode:
            shards.append(Shard([], mode, 0, here))
        s = shards[-1]
        s.modules.append(_label(it.call, per_name))
        s.params += it.call.param_bytes
        s.peak = max(s.peak, here)
    peak = max(peak, fixed + prefix + g.at_forward_end(), fixed + g.pending)
    recompute = [items[k].call.key for k in sorted(chosen)]
    flops = sum(items[k].call.flops for k in chosen)
    return ShardPlan(
        recompute=recompute, shards=shards, budget=budget, target=target, fixed=fixed, estimated_peak=peak,
        recompute_flops=flops, forward_flops=profile.forward_flops, scale=scale, profile_mode=profile.mode,
        floor=floor, counted=sorted(n for n, count in per_name.items() if count > 1),
    )


def evaluate(profile: Profile, recompute: list[tuple[str, int]], budget: int, fixed: int, headroom: float = 0.95,
             scale: float = 1.0, grads_in_forward: bool = False) -> Optional[ShardPlan]:
    """Re-price a given recompute set (e.g. one restored from a checkpoint); None if its calls are not all in
    the profile or one of them may not be recomputed."""
    by_key = profile.by_key()
    if any(k not in by_key or by_key[k].reason for k in recompute):
        return None
    wanted = {by_key[k].index for k in recompute}
    # The frontier holding exactly these calls: expand every ancestor of a wanted call, from the top down.
    ancestors = set()
    for i in wanted:
        p = profile.calls[i].parent
        while p >= 0:
            ancestors.add(p)
            p = profile.calls[p].parent
    frontier = _top(profile)
    while frontier & ancestors:
        frontier = (frontier - ancestors) | {ch for i in frontier & ancestors for ch in profile.calls[i].children}
    items = _items(profile, frontier, scale)
    chosen = {k for k, it in enumerate(items) if it.call is not None and it.call.index in wanted}
    grads = _Grads(profile.pending_grad_bytes, grads_in_forward)
    floor = _global_floor(profile, scale, grads)[0]
    return _assemble(profile, items, chosen, budget, int(budget * headroom), fixed, scale, fixed + floor, grads)


__all__ = ["BYTE_COST", "InfeasibleBudgetError", "Shard", "ShardPlan", "evaluate", "make_plan"]
