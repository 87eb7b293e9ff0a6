"""Run fit specs (tests/differential/plan.py) in few launches: one per world size, many fits each, the world sizes
in decreasing order (a fit resumed on one rank reads what a 2-rank fit wrote), then the fits resumed into a larger
world than the one that wrote their checkpoint. A fit that ended its launch (an
unexpected error on a rank whose peers may be mid-collective) is recorded; the fits after it are launched again."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable, Optional

import torch

from tests.launch import REPO, run_scripts

SCRIPT = REPO / "tests" / "scripts" / "differential_fit.py"


class Runner:
    def __init__(self, work: Path, chunk: int = 80) -> None:
        self.work = Path(work)
        self.chunk = chunk
        self.crashed: dict[str, dict] = {}  # name -> what ended its launch
        self.done: set[str] = set()
        self.timings: list[tuple[int, int, float]] = []  # (world, fits, seconds) per launch

    def summaries(self, spec: dict) -> list[dict]:
        """Per-rank JSON summaries of ``spec``'s fit, or ``[{"status": "crashed", ...}]``."""
        if spec["name"] in self.crashed:
            return [self.crashed[spec["name"]]]
        if spec["name"] not in self.done:
            return [{"status": "skipped"}]  # not run: the fit it compares with failed first
        return [json.loads((self.work / f"{spec['name']}.rank{r}.json").read_text()) for r in range(spec["world"])]

    def tensors(self, spec: dict) -> list[dict]:
        return [torch.load(self.work / f"{spec['name']}.rank{r}.pt", weights_only=False) for r in range(spec["world"])]

    def checkpoint(self, path: str) -> Optional[dict]:
        f = self.work / path
        return torch.load(f, weights_only=False, map_location="cpu") if f.exists() else None

    def _complete(self, spec: dict) -> bool:
        return all((self.work / f"{spec['name']}.rank{r}.json").exists() for r in range(spec["world"]))

    def run(self, specs: Iterable[dict]) -> None:
        specs = [s for s in specs if s["name"] not in self.done]
        # a fit resumed into a larger world than the one that wrote its checkpoint runs after all others
        later = [s for s in specs if s["resume_from"] and _world_of(s["resume_from"]) < s["world"]]
        for phase in ([s for s in specs if s not in later], later):
            by_world: dict[int, dict[str, dict]] = {}
            for s in phase:
                by_world.setdefault(s["world"], {}).setdefault(s["name"], s)
            for world in sorted(by_world, reverse=True):
                # a resumed fit after the fit that writes its checkpoint
                pending = sorted(by_world[world].values(), key=lambda s: s["resume_from"] is not None)
                for i in range(0, len(pending), self.chunk):
                    self._launch_until_done(world, pending[i:i + self.chunk])

    def _launch_until_done(self, world: int, pending: list[dict]) -> None:
        retried: set[str] = set()
        while pending:
            cfg = self.work / f"launch{len(self.timings)}-w{world}.json"
            cfg.write_text(json.dumps({"runs": pending}))
            t0 = time.monotonic()
            try:  # the timeout only ends a hang: a fit takes seconds
                (proc,) = run_scripts([(SCRIPT, [cfg, self.work], {"OMP_NUM_THREADS": "1"})],
                                      timeout=120 + 10 * world * len(pending), check=False)
                tail, rc = proc.stdout[-6000:], proc.returncode
            except AssertionError as err:
                tail, rc = str(err)[-6000:], "timeout"
            self.timings.append((world, len(pending), time.monotonic() - t0))
            rest: list[dict] = []
            for i, s in enumerate(pending):
                if self._complete(s):
                    self.done.add(s["name"])
                    continue
                if rc not in (0, "timeout") and s["name"] not in retried and not self._any_rank_wrote(s):
                    retried.add(s["name"])  # died without a word (a signal, a child that failed to start): again
                    rest = pending[i:]
                    break
                errors = [json.loads(f.read_text()) for f in sorted(self.work.glob(f"{s['name']}.rank*.json"))]
                self.crashed[s["name"]] = {"status": "crashed", "launch": rc, "errors": errors, "tail": tail}
                self.done.add(s["name"])
                rest = pending[i + 1:]
                break
            pending = rest

    def _any_rank_wrote(self, spec: dict) -> bool:
        return any(self.work.glob(f"{spec['name']}.rank*.json"))


__all__ = ["Runner", "SCRIPT"]


def _world_of(checkpoint: str) -> int:
    """The world size of the fit that writes ``checkpoint`` (a path under the fit's folder, named by plan.spec)."""
    return int(checkpoint.split("/")[0].split("-")[1][1:])
