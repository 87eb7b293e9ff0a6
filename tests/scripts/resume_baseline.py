"""The figures of docs/reliability.md ("The data position"): python tests/scripts/resume_baseline.py OUT_DIR

Runs tests/test_resume.py's mid-epoch interruptions (2 ranks; one float64 resume on 1 rank) twice, once with
HorizonStrategy's data position switched off (Lightning's own loader handling: ``process_dataloader`` and
``on_train_start`` as DDPStrategy's) and once as shipped, and prints, per case, the largest absolute difference of
rank 0's final weights from the uninterrupted run's, and whether Lightning warned that the loader is not resumable.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests import test_resume as T  # noqa: E402
from tests.scripts import forked_worlds  # noqa: E402


def _switch_off() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_horizon import HorizonStrategy

    HorizonStrategy.process_dataloader = DDPStrategy.process_dataloader
    HorizonStrategy.on_train_start = DDPStrategy.on_train_start


def _runs(work: Path) -> list[dict]:
    two = []
    for kind in T.RUN:
        options = T.KINDS[kind]
        two += [T._run(work, f"{kind}_whole", 2, 1, T.BATCH, **options),
                T._run(work, f"{kind}_stop", 2, 1, T.BATCH, stop_at=T.STOP, **options),
                T._run(work, f"{kind}_resumed", 2, 1, T.BATCH, resume_from=f"{kind}_stop", **options)]
    two += [T._run(work, "ref2_whole", 2, 1, T.BATCH, **T.F64), T._run(work, "ref2_stop", 2, 1, T.BATCH,
                                                                        stop_at=T.STOP, **T.F64)]
    return two


def _measure(work: Path, off: bool) -> tuple[dict[str, float], str]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if off:
        _switch_off()  # before the forks: every rank inherits it
    (work / "two.json").write_text(json.dumps(_runs(work)))
    (work / "one.json").write_text(json.dumps([T._run(work, "w2_to_w1", 1, 1, 2 * T.BATCH, resume_from="ref2_stop",
                                                      **T.F64)]))
    from tests.scripts.resume_fit import fit_all
    for tag, devices in (("two", 2), ("one", 1)):
        log = work / f"{tag}.log"
        exits = forked_worlds.world(devices, lambda tag=tag: fit_all(str(work / f"{tag}.json"), str(work)), log)
        assert exits == [0] * devices, (exits, log.read_text()[-3000:])

    def diff(a: str, b: str) -> float:
        x, y = (torch.load(work / f"{n}.rank0.pt", weights_only=True) for n in (a, b))
        return max(float((x[k] - y[k]).abs().max()) for k in x)

    figures = {kind: diff(f"{kind}_whole", f"{kind}_resumed") for kind in T.RUN}
    figures["float64, 2 ranks -> 1"] = diff("ref2_whole", "w2_to_w1")
    return figures, (work / "two.log").read_text()


def main(out: str) -> None:
    import os

    results = {}
    for off in (True, False):  # each in a child: switching off patches the class
        pid = os.fork()
        if pid == 0:
            figures, log = _measure(Path(out) / ("off" if off else "on"), off)
            (Path(out) / f"{'off' if off else 'on'}.json").write_text(json.dumps(
                {"figures": figures, "warned": "dataloader is not resumable" in log}))
            os._exit(0)
        os.waitpid(pid, 0)
        results[off] = json.loads((Path(out) / f"{'off' if off else 'on'}.json").read_text())
    print(f"{'case':32} {'Lightning':>12} {'HorizonStrategy':>16}")
    for case in results[True]["figures"]:
        print(f"{case:32} {results[True]['figures'][case]:12.2g} {results[False]['figures'][case]:16.2g}")
    print(f"Lightning warned 'not resumable': {results[True]['warned']}; with the data position: "
          f"{results[False]['warned']}")


if __name__ == "__main__":
    main(sys.argv[1])
