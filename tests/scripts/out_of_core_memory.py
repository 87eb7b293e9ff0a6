"""Peak memory of a fit with and without the out-of-core store: python out_of_core_memory.py FOLDER

Prints one line per arm and run (:data:`REPEATS`), ``ram JSON`` then ``store JSON``: the bytes of what training adds to the weights (fp32
gradients and AdamW's two moments: 12 per parameter), how much the peak RSS (VmHWM) grew from the start of training to
its end (and to the end of fit, teardown included), and the last loss. Each arm runs in a process forked from this
one after its imports (tests/scripts/forked_worlds.py): a fresh process but for the imported modules, paid once. Run
it with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_), as the test does: freed buffers go back to the system,
so that the peak measures what is live, not what the allocator kept.
"""

import functools
import json
import sys
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lightning_horizon import HorizonStrategy  # noqa: E402
from lightning_horizon.memory.probe import peak_rss, reset_peak_rss  # noqa: E402
from lightning_horizon.store import StoreConfig  # noqa: E402
from recipes.gpt import GPT, GPTConfig  # noqa: E402
from tests.scripts import forked_worlds  # noqa: E402

ARMS = ("ram", "store")
#: each arm runs this many times, alternating: a peak RSS is only ever raised by what else the machine does (another
#: test's processes, the page cache), so the test takes each arm's smallest
REPEATS = 2


class Peak(L.Callback):
    def on_train_start(self, trainer, pl_module):
        reset_peak_rss()
        self.start = peak_rss()

    def on_train_end(self, trainer, pl_module):
        self.end = peak_rss()  # before teardown gives the parameters private memory back


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=8, n_head=4, n_embd=256))

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = torch.nn.functional.cross_entropy(self.gpt(idx).flatten(0, 1), targets.flatten())
        self.last = float(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def measure(arm: str, folder: str) -> dict:
    peak = Peak()
    L.seed_everything(3, verbose=False)
    model = Model()
    n = sum(p.numel() for p in model.parameters())
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (16, 32)), torch.randint(0, 64, (16, 32)))
    store = StoreConfig(path=folder, probe_bytes=0) if arm == "store" else None
    # one intra-op thread: two on a loaded 2-core machine spin far more than they compute
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HorizonStrategy(state_store=store, threads_per_rank=1),
                        max_steps=3, callbacks=[peak], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2))
    # "after": the peak over the whole fit, teardown included (the parameters get private memory back)
    return {"added": 12 * n, "grown": peak.end - peak.start, "after": peak_rss() - peak.start, "loss": model.last}


def main(folder: str) -> None:
    for run in range(REPEATS):
        for arm in ARMS:  # one after the other
            exits = forked_worlds.run_forked([functools.partial(report, arm, str(Path(folder) / f"{arm}{run}"))])
            if exits != [0]:
                sys.exit(f"the {arm} arm failed: exit status {exits[0]}")


def report(arm: str, folder: str) -> None:
    print(arm, json.dumps(measure(arm, folder)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
