"""Compare an example's fits with their references: weights, buffers, every optimizer's state (every parameter's,
all keys), losses, validation and evaluation outputs, and the checkpoints written during and after fit (every key:
state_dict, optimizer states, loops, epoch and global_step, lr schedulers, callbacks' state).

A problem is ``(category, message)``; the categories of a failure are its signature (shrinking keeps a
simplification only while one of them still fails)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from tests.differential.plan import Plan, ckpt_path, tolerance
from tests.differential.runner import Runner
from tests.differential.space import _sharded

Problem = tuple[str, str]
#: checkpoint keys a reference need not have: the strategy's per-rank state (RNG, plans, layouts), and the
#: precision plugin's when the twin runs under another plugin
OWN_KEYS = ("HorizonStrategy", "HorizonPrecision")
#: the callbacks that stand for each other in a reference (GradNormBackoff without spikes = torch's clip)
OWN_CALLBACKS = ("GradNormBackoff", "RefClip")


class Diff:
    """Collects problems under a category prefix, and the largest relative deviation seen. ``on_update``: weights
    are compared by the relative deviation of the training update, ``|w - w_ref| / |w_ref - w0|`` over every
    parameter (where the tolerance is a codec's documented bound on it)."""

    def __init__(self, tol: float, on_update: bool = False) -> None:
        self.tol = tol
        self.on_update = on_update
        self.problems: list[Problem] = []
        self.worst = 0.0

    def add(self, category: str, message: str) -> None:
        self.problems.append((category, message))

    def value(self, cat: str, path: str, a: Any, b: Any, scale: Optional[float] = None) -> None:
        """Compare two leaves (tensors, numbers, anything else by ==); a tensor's deviation is relative to
        ``scale`` (the largest magnitude of its kind, e.g. of all the weights) or else to its own."""
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            self._tensor(cat, path, a, b, scale)
        elif isinstance(a, float) and isinstance(b, float):
            if math.isnan(a) and math.isnan(b):
                return
            dev = abs(a - b) / max(abs(b), 1e-300) if a != b else 0.0
            self.worst = max(self.worst, dev) if not math.isnan(dev) else self.worst
            if not dev <= self.tol:
                self.add(cat, f"{path}: {a!r} vs {b!r} (relative {dev:.3g}, allowed {self.tol:g})")
        elif a != b:
            self.add(cat, f"{path}: {_short(a)} vs {_short(b)}")

    def _tensor(self, cat: str, path: str, a: Any, b: Any, scale: Optional[float]) -> None:
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            self.add(cat, f"{path}: {_short(a)} vs {_short(b)}")
            return
        if a.shape != b.shape or a.dtype != b.dtype:
            self.add(cat, f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            return
        if torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a.nan_to_num(), b.nan_to_num())):
            return
        if self.tol == 0.0 or not a.is_floating_point():
            diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            self.add(cat, f"{path}: not bitwise equal (max abs diff {diff:.3g})")
            return
        diff = (a.double() - b.double()).abs().max().item()
        if scale is None:
            scale = max(b.double().abs().max().item(), a.double().abs().max().item())
        dev = diff / scale if scale > 0 else math.inf
        self.worst = max(self.worst, dev)
        if not dev <= self.tol:
            self.add(cat, f"{path}: relative deviation {dev:.3g} (max abs diff {diff:.3g} against a largest"
                          f" magnitude of {scale:.3g}, allowed {self.tol:g})")

    def tree(self, cat: str, path: str, a: Any, b: Any, limit: int = 6, scale: Optional[float] = None) -> None:
        """Compare nested dicts/lists; report missing and extra keys; at most ``limit`` problems per category."""
        if sum(1 for c, _ in self.problems if c == cat) >= limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            if set(a) != set(b):
                only_a, only_b = sorted(map(str, set(a) - set(b))), sorted(map(str, set(b) - set(a)))
                self.add(cat, f"{path}: keys only here {_short(only_a)}, only in the reference {_short(only_b)}")
            for k in a:
                if k in b:
                    self.tree(cat, f"{path}[{k!r}]", a[k], b[k], limit, scale)
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            if len(a) != len(b):
                self.add(cat, f"{path}: length {len(a)} vs {len(b)}")
            for i, (x, y) in enumerate(zip(a, b)):
                self.tree(cat, f"{path}[{i}]", x, y, limit, scale)
        else:
            self.value(cat, path, a, b, scale)

    def optimizers(self, cat: str, path: str, a: list, b: list) -> None:
        """Optimizer state_dicts: each state key's tensors relative to that key's largest magnitude over every
        parameter (a parameter whose gradient is rounding noise has state of that size: its own is no scale)."""
        if len(a) != len(b):
            self.add(cat, f"{path}: {len(a)} optimizers vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            self.tree(cat, f"{path}[{i}]['param_groups']", x["param_groups"], y["param_groups"])
            xs, ys = x["state"], y["state"]
            if set(xs) != set(ys):
                self.add(cat, f"{path}[{i}]: state for parameters {sorted(set(xs) - set(ys))} here only, for"
                              f" {sorted(set(ys) - set(xs))} in the reference only")
            scales: dict = {}
            for st in ys.values():
                for k, v in st.items():
                    scales[k] = max(scales.get(k, 0.0), largest(v))
            for idx in xs:
                if idx not in ys:
                    continue
                here, there = xs[idx], ys[idx]
                if set(here) != set(there):
                    self.add(cat, f"{path}[{i}]['state'][{idx}]: keys {sorted(here)} vs {sorted(there)}")
                for k in here:
                    if k in there:
                        self.tree(cat, f"{path}[{i}]['state'][{idx}][{k!r}]", here[k], there[k],
                                  scale=scales.get(k) or None)

    def named(self, cat: str, path: str, a: dict, b: dict, initial: Optional[dict] = None) -> None:
        """Named tensors (weights, buffers, a state_dict), relative to the largest magnitude among them; with
        ``on_update`` and the weights before fit (``initial``), the parameters among them by their update."""
        if not (self.on_update and initial is not None):
            self.tree(cat, path, a, b, scale=largest(b) or None)
            return
        params = [k for k in b if k in initial and k in a and isinstance(b[k], torch.Tensor)
                  and b[k].is_floating_point() and b[k].shape == initial[k].shape]
        self.tree(cat, path, {k: v for k, v in a.items() if k not in params},
                  {k: v for k, v in b.items() if k not in params}, scale=largest(b) or None)
        num = math.sqrt(sum(float((a[k].double() - b[k].double()).square().sum()) for k in params))
        den = math.sqrt(sum(float((b[k].double() - initial[k].double()).square().sum()) for k in params))
        dev = num / den if den > 0 else (0.0 if num == 0 else math.inf)
        self.worst = max(self.worst, dev)
        if not dev <= self.tol:
            self.add(cat, f"{path}: relative deviation of the training update {dev:.3g} (|w - w_ref| {num:.3g},"
                          f" |w_ref - w0| {den:.3g}, allowed {self.tol:g})")


def largest(x: Any) -> float:
    """The largest magnitude of the floating-point tensors in ``x`` (nested)."""
    if isinstance(x, torch.Tensor):
        return float(x.double().abs().max()) if x.is_floating_point() and x.numel() else 0.0
    if isinstance(x, dict):
        return max((largest(v) for v in x.values()), default=0.0)
    if isinstance(x, (list, tuple)):
        return max((largest(v) for v in x), default=0.0)
    return 0.0


def _short(x: Any, n: int = 160) -> str:
    s = repr(x)
    return s if len(s) <= n else s[:n] + "..."


def merged_optim(ranks: list[dict]) -> list[dict]:
    """Each optimizer's state as a whole: every parameter's from the rank that owns it (all ranks own all under
    replicated state), the param groups from rank 0."""
    out = []
    for i, sd in enumerate(ranks[0]["optim"]):
        state: dict = {}
        for r in ranks:
            owned = r["owned"][i] if r["owned"] else None
            for idx, st in r["optim"][i]["state"].items():
                if owned is None or (idx < len(owned) and owned[idx]):
                    state.setdefault(idx, st)
        out.append({"state": state, "param_groups": sd["param_groups"]})
    return out


def normalize(obj: Any, name: str) -> Any:
    """Paths that name the fit's own folder, made comparable between fits."""
    if isinstance(obj, str):
        return obj.replace(name, "<fit>")
    if isinstance(obj, dict):
        return {normalize(k, name): normalize(v, name) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(normalize(v, name) for v in obj)
    return obj


def comparable_checkpoint(ckpt: dict, name: str, other: dict) -> dict:
    ckpt = {k: v for k, v in ckpt.items() if k != "HorizonStrategy" and (k in other or k not in OWN_KEYS)}
    fit_loop = ckpt.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    if "combined_loader" in fit_loop and "combined_loader" not in other.get("loops", {}).get("fit_loop", {}).get(
            "state_dict", {}):
        # HorizonStrategy's data position (data_position.py), which Lightning's "ddp" does not keep
        ckpt = {**ckpt, "loops": {**ckpt["loops"], "fit_loop": {**ckpt["loops"]["fit_loop"], "state_dict": {
            k: v for k, v in fit_loop.items() if k != "combined_loader"}}}}
    if "callbacks" in ckpt:
        ckpt["callbacks"] = {k: v for k, v in ckpt["callbacks"].items() if not k.startswith(OWN_CALLBACKS)}
    return normalize(ckpt, name)


def compare_checkpoints(d: Diff, cat: str, a_spec: dict, b_spec: dict, runner: Runner, which: str,
                        initial: Optional[dict] = None) -> None:
    a, b = runner.checkpoint(ckpt_path(a_spec, which)), runner.checkpoint(ckpt_path(b_spec, which))
    if a is None or b is None:
        d.add(cat, f"checkpoint {which} fit: {'missing' if a is None else 'present'} here,"
                   f" {'missing' if b is None else 'present'} in the reference")
        return
    a, b = comparable_checkpoint(a, a_spec["name"], b), comparable_checkpoint(b, b_spec["name"], a)
    if set(a) != set(b):
        d.add(cat, f"checkpoint keys only here {sorted(set(a) - set(b))}, only in the reference"
                   f" {sorted(set(b) - set(a))}")
    for k in a:
        if k not in b:
            continue
        if k == "state_dict":
            d.named(cat, "checkpoint['state_dict']", a[k], b[k], initial)
        elif k == "optimizer_states":
            d.optimizers(cat, "checkpoint['optimizer_states']", a[k], b[k])
        else:
            d.tree(cat, f"checkpoint[{k!r}]", a[k], b[k])


def compare_ranks(d: Diff, prefix: str, a_ex: dict, b_ex: dict, a: list[dict], b: list[dict],
                  loss_tail: bool = False) -> None:
    """Per-rank results of two fits of the same world (``loss_tail``: ``a`` resumed mid-way, its losses are the
    tail of ``b``'s)."""
    sharded = _sharded(a_ex) or _sharded(b_ex)
    # a checkpoint holds rank 0's buffers; under manual optimization DDP does not broadcast them before each
    # forward, so the other ranks' BatchNorm statistics resume from rank 0's ("ddp" alike)
    own_buffers = sharded or (loss_tail and a_ex["optimization"] == "manual")
    for r, (x, y) in enumerate(zip(a, b)):
        d.value(f"{prefix}global_step", f"rank {r} global_step", x["global_step"], y["global_step"])
        if a_ex["model"].get("compile"):  # the compiled model ran compiled where the reference's did (not eagerly)
            d.value(f"{prefix}compiled", f"rank {r} ran dynamo's graphs", x["compiled"] > 0, y["compiled"] > 0)
        lb = y["losses"][len(y["losses"]) - len(x["losses"]):] if loss_tail else y["losses"]
        d.tree(f"{prefix}losses", f"rank {r} losses", x["losses"], lb)
        d.named(f"{prefix}weights", f"rank {r} weights", x["weights"], y["weights"], y.get("initial"))
        if r == 0 or not own_buffers:  # node_sharded: buffers are broadcast from rank 0 at setup only (node_state.md)
            d.named(f"{prefix}buffers", f"rank {r} buffers", x["buffers"], y["buffers"])
        if not sharded:
            d.optimizers(f"{prefix}optimizer", f"rank {r} optimizer", x["optim"], y["optim"])
        bn = a_ex["model"]["batchnorm"]
        if r == 0 or not (sharded and bn):  # validation reads the running statistics: rank 0's alike
            vb = y["val_losses"][len(y["val_losses"]) - len(x["val_losses"]):] if loss_tail else y["val_losses"]
            d.tree(f"{prefix}validation", f"rank {r} validation losses", x["val_losses"], vb)
            if not loss_tail:  # a resumed fit has no lifecycle of its own
                d.tree(f"{prefix}eval", f"rank {r} evaluation from the checkpoint", x["eval"], y["eval"])
    if sharded:
        d.optimizers(f"{prefix}optimizer", "optimizer (each parameter's state from its owner)", merged_optim(a),
                     merged_optim(b))


def compare_regrid(d: Diff, prefix: str, b_ex: dict, a: list[dict], b: list[dict]) -> None:
    """A fit resumed into another world size with the same global batch against the uninterrupted fit ``b``: every
    rank's weights, buffers and optimizer state against the whole of ``b``'s (rank 0's; each parameter's from its
    owner where ``b`` was node-sharded). Losses and validation are each rank's mean over its own slice of the same
    global batch, another slice at another world size: not compared."""
    y = b[0]
    optim = merged_optim(b) if _sharded(b_ex) else y["optim"]
    for r, x in enumerate(a):
        d.value(f"{prefix}global_step", f"rank {r} global_step", x["global_step"], y["global_step"])
        d.named(f"{prefix}weights", f"rank {r} weights", x["weights"], y["weights"], y.get("initial"))
        d.named(f"{prefix}buffers", f"rank {r} buffers", x["buffers"], y["buffers"])
        d.optimizers(f"{prefix}optimizer", f"rank {r} optimizer", x["optim"], optim)


def ran(d: Diff, role: str, spec: dict, runner: Runner) -> bool:
    summaries = runner.summaries(spec)
    bad = [s for s in summaries if s["status"] != "ok"]
    if not bad:
        return True
    if bad[0]["status"] == "skipped":
        return False
    s = bad[0]
    errors = s["errors"] if s["status"] == "crashed" else bad
    # a peer's "connection closed" is the echo of the rank that raised first: that one is the cause
    errors = sorted(errors, key=lambda e: "by peer" in e.get("error", "") or "lost a peer" in e.get("error", ""))
    if s.get("missing_checkpoint"):
        d.add(f"error:{role}", f"{role} fit {spec['name']}: {s['error']}")
    elif not errors:
        d.add(f"error:{role}", f"{role} fit {spec['name']}: launch ended ({s['launch']}): {s['tail'][-1200:]}")
    else:
        e = errors[0]
        hint = " (an undocumented refusal?)" if e.get("phase") in ("construction", "setup") else ""
        kind = e.get("error", "?").split(":")[0]
        d.add(f"error:{role}:{e.get('phase')}:{kind}", f"{role} fit {spec['name']}: rank {e.get('rank')} raised"
                                                         f" during {e.get('phase')}{hint}: {e.get('error', '?')[:600]}")
    return False


def first_error(spec: dict, runner: Runner) -> Optional[tuple[str, str]]:
    """(phase, exception type) of the error that ended ``spec``'s fit (the rank that raised first), or None."""
    summaries = runner.summaries(spec)
    errors = summaries[0].get("errors", []) if summaries[0]["status"] == "crashed" else summaries
    errors = [e for e in errors if e.get("status") == "error"]
    if not errors or summaries[0]["status"] == "skipped":
        return None
    e = sorted(errors, key=lambda e: "by peer" in e.get("error", "") or "lost a peer" in e.get("error", ""))[0]
    return e.get("phase", "?"), e.get("error", "?").split(":")[0]


def check(p: Plan, runner: Runner) -> tuple[list[Problem], dict[str, float]]:
    """Every problem of the example of ``p``, and the largest relative deviation measured per reference.

    Not failures (category ``unjudged:...``): an error Lightning's "ddp" raises alike (same type, same phase), and
    a "ddp" reference that raises where the example trains (nothing to compare with)."""
    if p.refused is not None:
        return check_refusal(p, runner), {}
    raised = first_error(p.main, runner)
    arbiter = p.refs.get("ddp") or p.arbiter
    if raised is not None and arbiter is not None and arbiter["name"] in runner.done \
            and first_error(arbiter, runner) == raised:
        return [("unjudged:both raise", f"the example and Lightning's \"ddp\" both raise {raised[1]} during"
                                        f" {raised[0]}")], {}
    problems, measured = _check(p, runner)
    ddp_names = {s["name"] for s in (p.refs.get("ddp"), p.resumed_ref) if s is not None and s["engine"] == "ddp"}
    return [(f"unjudged:{c}", m) if c.startswith("error:") and raised is None
            and any(n in m for n in ddp_names) else (c, m) for c, m in problems], measured


def _check(p: Plan, runner: Runner) -> tuple[list[Problem], dict[str, float]]:
    ex = p.ex
    measured: dict[str, float] = {}
    problems: list[Problem] = []
    main_ok = ran(d := Diff(0.0), "main", p.main, runner)
    problems += d.problems
    main = runner.tensors(p.main) if main_ok else None
    for role, ref in p.refs.items():
        d = Diff(tolerance(role, ex), on_update=role == "ddp" and ex["compression"] is not None)
        if ran(d, role, ref, runner) and main is not None:
            ranks = runner.tensors(ref)
            compare_ranks(d, f"{role}:", ex, ref["ex"], main, ranks)
            for which, flag in (("during", "ckpt_during"), ("after", "save_after")):
                if ex[flag]:
                    compare_checkpoints(d, f"{role}:ckpt_{which}", p.main, ref, runner, which,
                                        ranks[0].get("initial"))
        measured[role] = d.worst
        problems += d.problems
    if p.resumed is not None and p.resumed_against is not None:
        against, tol = p.resumed_against
        d = Diff(tol, on_update=against == "resumed_ref" and p.resumed_ref["engine"] == "ddp"
                 and ex["compression"] is not None)
        if ran(d, "resumed", p.resumed, runner):
            if against == "main" and main is not None and p.resumed["world"] != ex["world"]:
                compare_regrid(d, "resumed:", ex, runner.tensors(p.resumed), main)
            elif against == "main" and main is not None:
                compare_ranks(d, "resumed:", p.resumed["ex"], ex, runner.tensors(p.resumed), main, loss_tail=True)
            elif against == "resumed_ref" and p.resumed_ref is not None and ran(d, "resumed_ref", p.resumed_ref,
                                                                                 runner):
                compare_ranks(d, "resumed:", p.resumed["ex"], p.resumed_ref["ex"], runner.tensors(p.resumed),
                              runner.tensors(p.resumed_ref))
        measured["resumed"] = d.worst
        problems += d.problems
    return problems, measured


def check_refusal(p: Plan, runner: Runner) -> list[Problem]:
    """A refused example raises at the documented time on every rank, naming both sides."""
    name, phrases, at = p.refused
    summaries = runner.summaries(p.main)
    if summaries[0]["status"] == "crashed":
        errors = summaries[0]["errors"]
    else:
        errors = summaries
    problems: list[Problem] = []
    if not errors or any(s.get("status") == "ok" for s in errors):
        return [("refusal", f"{name}: expected a refusal at {at}, the fit trained")]
    for s in errors:
        missing = [ph for ph in phrases if ph not in s.get("error", "")]
        if s.get("phase") != at:
            problems.append(("refusal", f"{name}: raised during {s.get('phase')}, expected at {at}: "
                                        f"{s.get('error', '')[:400]}"))
        elif missing:
            problems.append(("refusal", f"{name}: the message does not name {missing}: {s.get('error', '')[:400]}"))
        if problems:
            break
    return problems


def signature(problems: list[Problem]) -> set[str]:
    """The categories of the problems that are failures."""
    return {c for c, _ in problems if not c.startswith("unjudged")}


__all__ = ["Diff", "Problem", "check", "merged_optim", "signature"]
