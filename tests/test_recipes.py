"""The recipes end to end (tiny sizes), the monitors' logged keys, the corpus cache and split, and the smoke runs of
bench_embedding, bench_state, bench_out_of_core and bench_sync (the other benches: tests/test_recipes_bench.py).

In-process where possible (each process start + ``import lightning`` costs seconds on 2 cores): a bench's driver runs
here and starts its arms in worker processes of their own, which it kills on its ``--timeout`` (pytest-timeout
bounds the whole); the 2-rank recipe run goes through tests/launch.py's hard timeout.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import signal
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.launch import REPO, run_script

sys.path.insert(0, str(REPO / "recipes"))

import lm_data  # noqa: E402
import pretrain_gpt  # noqa: E402
import risk_classifier  # noqa: E402

from lightning_horizon import CommMonitor, HorizonStrategy, MemoryMonitor, ThroughputMFUMonitor  # noqa: E402
from lightning_horizon.layout import cache as layout_cache  # noqa: E402
from lightning_horizon.callbacks.comm import find_comm_metrics  # noqa: E402
from lightning_horizon.parts import Part  # noqa: E402

TINY = str(REPO / "recipes" / "configs" / "tiny.yaml")


def _metrics(csv_path: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    if not csv_path.exists():  # nothing was logged at all
        return out
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if v not in ("", None):
                    out.setdefault(k, []).append(float(v))
    return out


def _report(trainer: L.Trainer):
    return next(c for c in trainer.callbacks if type(c).__name__ == "TrainingReport")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus_cache")


@pytest.fixture
def bench_here():
    """A bench driver run in this process makes SIGTERM an exception (to kill its workers' groups): undone after."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def test_tiny_pretrain_trains_logs_and_resumes(tmp_path, cache_dir):
    root = tmp_path / "run"
    args = ["fit", "--config", TINY, "--data.cache_dir", str(cache_dir), "--trainer.default_root_dir", str(root),
            "--trainer.enable_progress_bar", "false", "--trainer.strategy.threads_per_rank", "1"]
    cli = pretrain_gpt.main(args)
    trainer = cli.trainer
    assert isinstance(trainer.strategy, HorizonStrategy)
    assert type(trainer.precision_plugin).__name__ == "HorizonPrecision"
    assert any(type(c).__name__ == "GradNormBackoff" for c in trainer.callbacks)
    summary = _report(trainer).summary
    assert summary["steps"] == 60 and summary["tokens_per_sec"] > 0
    assert summary["val_step"] == 60 and 1 < summary["val_ppl"] < 40  # uniform over bytes would be 256
    assert (root / "checkpoints" / "last.ckpt").is_file()
    assert (Path(trainer.log_dir) / "loss_curve.png").stat().st_size > 1000
    m = _metrics(Path(trainer.log_dir) / "metrics.csv")
    for key in ("train_loss", "val_loss", "val_ppl", "mem/rss_mib", "mem/peak_rss_mib", "mem/available_mib",
                "train/device/items_per_sec", "train/device/mfu"):
        assert key in m, f"{key} not logged; have {sorted(m)}"
    assert m["val_ppl"][-1] < m["val_ppl"][0]  # it learns

    # resume from last.ckpt: the step count carries on and the report keeps the earlier curve; no subcommand is fit
    cli2 = pretrain_gpt.main(args[1:] + ["--ckpt_path", "last", "--trainer.max_steps", "70"])
    report2 = _report(cli2.trainer)
    assert cli2.trainer.global_step == 70
    assert cli2.datamodule._resume == {"epoch": 0, "batches": 60}  # the epoch continues at its 61st batch
    assert report2.train[0][0] == 1 and report2.train[-1][0] == 70  # history from step 1, restored


def test_tiny_pretrain_two_ranks_logs_per_rank_memory(tmp_path, cache_dir):
    root = tmp_path / "run2"
    out = run_script(REPO / "recipes" / "pretrain_gpt.py", [
        "fit", "--config", TINY, "--data.cache_dir", str(cache_dir), "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false", "--trainer.devices", "2", "--trainer.max_steps", "20",
        "--trainer.val_check_interval", "20", "--memory.log_every_n_steps", "5", "--comm.summary_every_n_steps", "10",
    ], timeout=120).stdout
    assert "=== pretrain summary ===" in out and "perplexity" in out
    assert "rank0 RSS" in out and "rank1 RSS" in out  # the memory summary covers both ranks
    m = _metrics(next(root.glob("logs/version_*/metrics.csv")))
    assert "mem/rank1/rss_mib" in m and "train/device/items_per_sec" in m
    # the comm monitor logs the collectives' accounting where the strategy keeps one, else says so once
    assert ("comm/seconds" in m) != ("exposes no communication accounting" in out)


def test_default_run_is_the_readme_job():
    # `python recipes/pretrain_gpt.py` with no arguments means `fit` with the signature defaults
    parser_defaults = pretrain_gpt.TRAINER_DEFAULTS
    assert parser_defaults["strategy"]["class_path"] == "lightning_horizon.HorizonStrategy"
    assert parser_defaults["plugins"]["init_args"]["mode"] == "auto"
    assert parser_defaults["max_steps"] % parser_defaults["val_check_interval"] == 0  # ends on a validation


def test_help_says_no_subcommand_means_fit(capsys):
    with pytest.raises(SystemExit) as info:
        pretrain_gpt.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "(required)" not in out
    assert "No subcommand means fit" in " ".join(out.split()), out


def test_the_strategy_by_name_gets_the_automatic_layout(cache_dir, monkeypatch):
    # `--trainer.strategy=horizon` (the registered name) is HorizonStrategy with its defaults: the recipe still
    # picks the layout, on the name's class path
    monkeypatch.delenv(layout_cache.CHOSEN_ENV, raising=False)
    cli = pretrain_gpt.main(["--config", TINY, "--data.cache_dir", str(cache_dir), "--trainer.strategy=horizon"],
                            run=False)
    strategy = cli.config.trainer.strategy
    assert isinstance(cli.trainer.strategy, HorizonStrategy)
    assert strategy.class_path == "lightning_horizon.HorizonStrategy" and strategy.init_args.threads_per_rank >= 1
    assert cli.datamodule.batch_size * cli.trainer.num_devices == 8


def test_gpt_rejects_bad_shapes():
    with pytest.raises(ValueError, match="n_head"):
        pretrain_gpt.GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="optimizer_impl"):
        pretrain_gpt.GPTPretrain(optimizer_impl="sgd")
    with pytest.raises(ValueError, match=r"GPTConfig\(gelu='erf'\): allowed are \('tanh', 'none'\)"):
        pretrain_gpt.GPTPretrain(gelu="erf")
    with pytest.raises(ValueError, match=r"GPTConfig\(bias='no'\): allowed are True and False"):
        pretrain_gpt.GPTPretrain(bias="no")


def test_recipe_gpt_has_no_biases_unless_asked():
    """The recipe's default drops the biases (GPTConfig keeps GPT-2's); bias=True brings back every one of them."""
    tiny = dict(n_layer=2, n_head=2, n_embd=16, block_size=8)
    plain = dict(pretrain_gpt.GPTPretrain(**tiny).named_parameters())
    assert not [n for n in plain if n.endswith(".bias")]
    with_bias = dict(pretrain_gpt.GPTPretrain(**tiny, bias=True).named_parameters())
    added = {n for n in with_bias if n not in plain}
    # per block: qkv, attention proj, fc, mlp proj, two LayerNorms; and the final LayerNorm (the head has none)
    assert len(added) == 2 * 6 + 1 and all(n.endswith(".bias") for n in added)
    assert set(plain) <= set(with_bias)


@pytest.mark.parametrize("gelu", ["none", "tanh"])
def test_gpt_attention_and_gelu_are_the_textbook_forms(gelu):
    """float64: the written-out attention (mask and scale inside one baddbmm) gives the sdpa kernel's outputs and
    gradients, and the MLP is F.gelu of that form (a wrong mask, scale or GELU would be off by far more)."""
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    _same_as_sdpa("manual", block_size=12, t=10, gelu=gelu)
    a = GPT(GPTConfig(vocab_size=32, block_size=12, n_layer=2, n_head=2, n_embd=16, gelu=gelu)).double()
    h = torch.randn(4, 16, dtype=torch.float64)
    mlp = a.blocks[0].mlp
    assert torch.equal(mlp(h), mlp.proj(F.gelu(mlp.fc(h), approximate=gelu)))
    other = "tanh" if gelu == "none" else "none"
    assert (mlp(h) - mlp.proj(F.gelu(mlp.fc(h), approximate=other))).abs().max().item() > 1e-9


def _same_as_sdpa(attention, block_size, t, gelu="none", batch=3):
    """float64: the GPT with ``attention`` gives the sdpa kernel's outputs and gradients on ``batch x t`` tokens."""
    from gpt import GPT, GPTConfig

    cfgs = [GPTConfig(vocab_size=32, block_size=block_size, n_layer=2, n_head=2, n_embd=16, gelu=gelu, attention=a)
            for a in (attention, "sdpa")]
    a, b = (GPT(c).double() for c in cfgs)
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 32, (batch, t))
    ya, yb = a(x), b(x)
    ya.square().sum().backward(), yb.square().sum().backward()
    assert (ya - yb).abs().max().item() < 1e-12
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa.grad - pb.grad).abs().max().item() < 1e-12, name


def test_blocked_attention_is_the_causal_attention(monkeypatch):
    """float64: the blocked attention (queries in blocks, each against the keys up to its last row) gives the sdpa
    kernel's outputs and gradients with one block, several, a ragged last one, and heads split into groups by the
    scores' size; "auto" takes it for bf16 up to 1,024 tokens only."""
    import gpt

    torch.manual_seed(0)
    assert [gpt.query_block(t) for t in (10, 256, 257, 1024)] == [128, 128, 256, 256]
    for t in (100, 128, 300, 600):  # one block; exactly one; 128 + 128 + 44; 256 + 256 + 88
        _same_as_sdpa("blocked", block_size=600, t=t, batch=2)
    monkeypatch.setattr(gpt, "SCORE_BYTES", 128 * 300 * 8 * 3)  # float64 scores of 3 heads x 128 x 300
    _same_as_sdpa("blocked", block_size=300, t=300, batch=4)  # 8 heads: per block groups of 7 + 1, 3 + 3 + 2, 8
    _same_as_sdpa("manual", block_size=300, t=300, batch=4)  # one block of 300 rows: 8 groups of one head
    attn = gpt.GPT(gpt.GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)).blocks[0].attn
    cases = ((1024, torch.bfloat16), (1025, torch.bfloat16), (512, torch.float32), (513, torch.float32),
             (16, torch.float64))
    assert [attn.kind(t, dt) for t, dt in cases] == ["blocked", "sdpa", "blocked", "sdpa", "sdpa"]


def test_model_flops_count_the_whole_attention_whichever_path_runs():
    """MFU's FLOPs are the model's (PaLM's count: the whole causal attention matrix), not the fewer the blocked path
    computes: the same for every attention setting, and equal to the closed form."""
    from gpt import GPTConfig, train_flops_per_token

    for attention in ("auto", "blocked", "manual", "sdpa"):
        cfg = GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=2, n_embd=32, attention=attention)
        assert pretrain_gpt.model_flops(cfg, 3, 128) == train_flops_per_token(cfg, 128) * 3 * 128, attention


def _attention_reference(qkv, n_head, causal, rows, p):
    """Autograd over the textbook ops, tile by tile in WrittenOutAttention's order (so that dropout draws the same
    masks): softmax(q k^T / sqrt(head_dim) + mask), dropped, times v."""
    import gpt

    b, t, width = qkv.shape
    hd = width // (3 * n_head)
    q, k, v = (z.reshape(b * n_head, t, hd) for z in qkv.view(b, t, 3, n_head, hd).permute(2, 0, 3, 1, 4))
    blocks = {}
    for s, e, g, h in gpt._tiles(b * n_head, t, rows, qkv.element_size()):
        probs = ((q[g:h, s:e] @ k[g:h, :e].mT) * hd**-0.5 + causal[s:e, :e]).softmax(-1)
        blocks.setdefault(s, []).append(F.dropout(probs, p) @ v[g:h, :e])
    y = torch.cat([torch.cat(parts) for parts in blocks.values()], 1)
    return y.view(b, n_head, t, hd).transpose(1, 2).reshape(b, t, n_head * hd)


def test_written_out_attention_backward_is_autograds(monkeypatch):
    """The written-out attention's own backward gives autograd's gradients of the textbook ops, with dropout (same
    masks), with blocks, a ragged last one and heads in groups; in bf16 it stays within bf16's rounding of float64."""
    import gpt

    torch.manual_seed(0)
    b, t, n_head, hd = 2, 300, 4, 8
    causal = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    monkeypatch.setattr(gpt, "SCORE_BYTES", 128 * 300 * 8 * 3)  # float64 scores of 3 heads x 128 x 300
    qkv = torch.randn(b, t, 3 * n_head * hd, dtype=torch.float64)
    dy = torch.randn(b, t, n_head * hd, dtype=torch.float64)
    for rows, p in ((t, 0.0), (128, 0.0), (t, 0.3), (128, 0.3)):
        grads = []
        for attention in (gpt.WrittenOutAttention.apply, _attention_reference):
            x = qkv.clone().requires_grad_()
            torch.manual_seed(1)
            y = attention(x, n_head, causal, rows, p)
            y.backward(dy)
            grads.append((y, x.grad))
        (y, g), (y_ref, g_ref) = grads
        assert (y - y_ref).abs().max().item() < 1e-12 and (g - g_ref).abs().max().item() < 1e-12, (rows, p)
        if p:  # the masks were drawn: without dropout the output differs
            assert (y - _attention_reference(qkv, n_head, causal, rows, 0.0)).abs().max().item() > 0.1
    x = qkv.bfloat16().requires_grad_()
    y = gpt.WrittenOutAttention.apply(x, n_head, causal, 128, 0.0)
    y.backward(dy.bfloat16())
    x_ref = qkv.clone().requires_grad_()
    y_ref = _attention_reference(x_ref, n_head, causal, 128, 0.0)
    y_ref.backward(dy)
    assert y.dtype == x.grad.dtype == torch.bfloat16
    assert (y.double() - y_ref).abs().max().item() < 0.02 * y_ref.abs().max().item()
    assert (x.grad.double() - x_ref.grad).abs().max().item() < 0.02 * x_ref.grad.abs().max().item()


def test_resumed_sampler_continues_the_epoch():
    ds = list(range(100))
    full = list(lm_data.ResumableSampler(ds, 2, 1, seed=5))
    resumed = lm_data.ResumableSampler(ds, 2, 1, seed=5)
    resumed.skip_epoch, resumed.skip = 0, 12
    assert list(resumed) == full[12:]
    resumed.set_epoch(1)  # the next epoch is whole again, in its own order
    assert len(list(resumed)) == len(full) and list(resumed) != full


def test_corpus_cache_and_split_are_deterministic(tmp_path):
    corpus = tmp_path / "texts"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"f{i}.txt").write_text(f"file {i}\n" * 3000)
    cache = tmp_path / "cache"
    path, meta = lm_data.build_token_file(str(corpus), cache, 1 << 20)
    stamp = path.stat().st_mtime_ns
    again, _ = lm_data.build_token_file(str(corpus), cache, 1 << 20)
    assert again == path and path.stat().st_mtime_ns == stamp  # found, not rebuilt
    assert meta["files"] == 5 and meta["tokens"] == path.stat().st_size
    tr1, va1 = lm_data.split_windows(meta["tokens"], 64, 0.1, seed=3)
    tr2, va2 = lm_data.split_windows(meta["tokens"], 64, 0.1, seed=3)
    assert (tr1 == tr2).all() and (va1 == va2).all() and len(va1) > 0
    assert not set(tr1.tolist()) & set(va1.tolist())
    (corpus / "f0.txt").write_text("changed\n" * 3000)  # an edited corpus gets a new cache file
    assert lm_data.build_token_file(str(corpus), cache, 1 << 20)[0] != path
    with pytest.raises(ValueError, match="corpus="):
        lm_data.ByteCorpusDataModule(corpus=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="val_fraction"):
        lm_data.ByteCorpusDataModule(val_fraction=0.9)


def test_a_dotted_corpus_folder_gets_a_cache_file_per_size_and_content(tmp_path):
    """The standard library's folder is named like "python3.11": each size asked for (the tests' 1 MiB, the recipe's
    32 MiB) and each edit has a file of its own, holding what was asked for."""
    corpus = tmp_path / "python3.11"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"m{i}.py").write_text(f"x = {i}\n" * 2000)
    cache = tmp_path / "cache"
    small, small_meta = lm_data.build_token_file(str(corpus), cache, 20_000)
    large, large_meta = lm_data.build_token_file(str(corpus), cache, 1 << 20)
    assert small != large and small.name.startswith("python3.11-") and small.suffix == ".bin"
    n = 20_000 + len(lm_data._SEPARATOR)  # the cap, then the separator after the file it cut
    assert (small_meta["max_bytes"], small_meta["tokens"], small.stat().st_size) == (20_000, n, n)
    assert large_meta["max_bytes"] == 1 << 20 and large_meta["files"] == 4 == lm_data.build_token_file(
        str(corpus), cache, 1 << 20)[1]["files"]
    assert lm_data.build_token_file(str(corpus), cache, 20_000) == (small, small_meta)  # found again, each


def test_default_corpus_lists_what_rglob_lists_without_walking_skipped_folders(tmp_path, monkeypatch):
    """The standard library's listing (run in every process that finds its cached file) never lists site-packages
    or __pycache__, gives rglob's files in rglob's order, and an edited, added or removed file still rebuilds."""
    stdlib = tmp_path / "lib"
    for rel in ("a.py", "a-b/c.py", "a/b.py", "a/z.txt", "a/.hidden.py", ".dot/d.py", "x/site-packages/pkg/e.py",
                "x/__pycache__/f.py", "y/dist-packages/g.py", "site-packages/h.py", "deep/er/est/i.py"):
        (stdlib / rel).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / rel).write_text(f"# {rel}\n" * 400)
    (stdlib / "link.py").symlink_to(stdlib / "a.py")  # a file through a link: read, as rglob + is_file does
    (stdlib / "broken.py").symlink_to(stdlib / "missing.py")
    (stdlib / "linked_dir").symlink_to(stdlib / "a")  # a folder through a link: not followed, as rglob
    (stdlib / "dir.py").mkdir()
    monkeypatch.setattr(lm_data.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib)})
    rglob = sorted(p for p in stdlib.rglob("*.py")  # the definition this listing replaced
                   if p.is_file() and not lm_data._SKIP_DIRS.intersection(p.relative_to(stdlib).parts)
                   and not p.name.startswith("."))
    listed, real_scandir = [], lm_data.os.scandir

    def scandir(path="."):
        listed.append(Path(path))
        return real_scandir(path)

    monkeypatch.setattr(lm_data.os, "scandir", scandir)
    root, files = lm_data.corpus_files(None)
    monkeypatch.setattr(lm_data.os, "scandir", real_scandir)
    assert root == stdlib and files == rglob and len(files) == 6, files
    assert not [p for p in listed if lm_data._SKIP_DIRS.intersection(p.relative_to(stdlib).parts)], listed

    cache = tmp_path / "cache"
    path, meta = lm_data.build_token_file(None, cache, 1 << 20)
    assert meta["files"] == 6 and lm_data.build_token_file(None, cache, 1 << 20)[0] == path
    (stdlib / "x/site-packages/pkg/e.py").write_text("not the corpus")
    assert lm_data.build_token_file(None, cache, 1 << 20)[0] == path
    seen = {path}
    for change in (lambda: (stdlib / "deep/er/est/i.py").write_text("edited\n" * 400),
                   lambda: (stdlib / "a/new.py").write_text("added\n" * 400),
                   lambda: (stdlib / "a-b/c.py").unlink()):
        change()
        rebuilt = lm_data.build_token_file(None, cache, 1 << 20)[0]
        assert rebuilt not in seen
        seen.add(rebuilt)


def test_risk_classifier_reaches_auroc_target(tmp_path):
    cli = risk_classifier.main([
        "fit", "--data.n_rows", "30000", "--trainer.default_root_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.strategy.threads_per_rank", "1",
    ])
    m, dm = cli.trainer.callback_metrics, cli.trainer.datamodule
    assert dm.oracle_auroc > 0.88  # the generator's signal is there to be found
    assert float(m["val_auroc"]) >= 0.85, f"AUROC {float(m['val_auroc']):.3f} (oracle {dm.oracle_auroc:.3f})"
    assert 0.5 < float(m["val_acc"]) <= 1


class _Tokens(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.flops_per_batch = 1_000_000

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _FakeSync(Part):
    """Stands in for the collectives' GradientSync (a strategy part): what CommMonitor reads."""

    def comm_metrics(self):
        return {"comm/intra_bytes": 1024.0, "comm/inter_bytes": 0.0, "comm/seconds": 0.001, "comm/calls": 2.0}


def _fit_monitors(tmp_path, strategy, callbacks):
    data = TensorDataset(torch.randint(0, 32, (64, 8)), torch.randint(0, 32, (64, 8)))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=8, callbacks=callbacks,
                        logger=L.pytorch.loggers.CSVLogger(tmp_path), log_every_n_steps=1,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(_Tokens(), DataLoader(data, batch_size=4))
    return trainer, _metrics(Path(trainer.log_dir) / "metrics.csv")


def test_monitors_log_their_keys_and_summaries(tmp_path, caplog):
    throughput = ThroughputMFUMonitor(window_size=2, summary_every_n_steps=4, peak_matmul_sizes=(256,))
    memory = MemoryMonitor(log_every_n_steps=2, summary_every_n_steps=4)
    comm = CommMonitor(summary_every_n_steps=4)
    strategy = HorizonStrategy(threads_per_rank=1)
    strategy.parts.add("collectives", _FakeSync())
    with caplog.at_level(logging.INFO):
        trainer, m = _fit_monitors(tmp_path, strategy, [throughput, memory, comm])
    for key in ("train/device/items_per_sec", "train/device/flops_per_sec", "train/device/mfu", "mem/rss_mib",
                "mem/peak_rss_mib", "mem/available_mib", "comm/intra_bytes", "comm/seconds", "comm/time_share"):
        assert key in m, f"{key} not logged; have {sorted(m)}"
    assert throughput.peaks["fp32"] > 1e8 and 0 < throughput.last["mfu"]
    assert memory.last[0]["peak_rss_mib"] >= memory.last[0]["rss_mib"] * 0.5 > 0
    text = caplog.text
    assert re.search(r"step 4: [\d,]+ tok/s", text) and "step 4: memory: rank0 RSS" in text
    assert "step 4: comm: 0.00 MiB intra-node" in text
    # the module's flops_per_batch (1e6 per batch), over the batches per second the window measured
    assert throughput.flops_from == "module"
    assert throughput.last["flops_per_sec"] == pytest.approx(1e6 * m["train/device/batches_per_sec"][-1], rel=1e-6)
    assert re.search(r"fit: 6 steps after 2 warm-up batches in .* GFLOP/s per rank \(the module's flops_per_batch\)",
                     text)


def test_comm_monitor_is_silent_on_one_process(tmp_path, caplog):
    """One process sends nothing: no figures and no line about them, whatever the strategy."""
    assert find_comm_metrics(object()) is None
    for strategy in ("auto", HorizonStrategy(threads_per_rank=1)):
        comm = CommMonitor()
        with caplog.at_level(logging.INFO):
            _, m = _fit_monitors(tmp_path, strategy, [comm])
        assert not [k for k in m if k.startswith("comm/")]
        assert "CommMonitor" not in caplog.text


def test_monitor_arguments_are_checked():
    with pytest.raises(ValueError, match="window_size"):
        ThroughputMFUMonitor(window_size=1)
    with pytest.raises(ValueError, match="log_every_n_steps"):
        MemoryMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match="summary_every_n_steps"):
        CommMonitor(summary_every_n_steps=-1)
    with pytest.raises(ValueError, match=r"flops_per_batch=-1\): allowed is a finite number >= 0"):
        ThroughputMFUMonitor(flops_per_batch=-1)
    # None (the default) follows the Trainer's log_every_n_steps
    assert MemoryMonitor().log_every_n_steps is None and CommMonitor(log_every_n_steps=None).summary_every_n_steps is None


def test_hf_gpt2_trains_under_horizon_exactly_as_under_lightning(cache_dir):
    """Hugging Face's GPT-2 (a model written outside the project; the bench's --model hf-gpt2) at tiny.yaml's shapes:
    horizon's defaults (strategy, precision "auto", GradNormBackoff clipping to 1.0) give plain Lightning's 32-true
    with gradient_clip_val=1.0 its losses bit for bit ("auto" computes this 64-wide model in fp32 on every CPU it
    was measured on; the clip is torch's clip_grad_norm_'s)."""
    pytest.importorskip("transformers")
    import yaml

    import bench_vs_lightning
    import hf_gpt2
    from lightning_horizon import GradNormBackoff, HorizonPrecision

    assert bench_vs_lightning.model_class("hf-gpt2") is hf_gpt2.GPT2Pretrain
    with pytest.raises(ValueError, match=r"GPT2Pretrain\(bias=False\): transformers' GPT-2 always has biases"):
        hf_gpt2.GPT2Pretrain(bias=False)
    cfg = yaml.safe_load(Path(TINY).read_text())

    class Losses(L.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].item())

    runs = {}
    for arm in ("lightning", "horizon"):
        L.seed_everything(0, verbose=False)
        model, seen = hf_gpt2.GPT2Pretrain(**cfg["model"]), Losses()
        ours = dict(strategy=HorizonStrategy(), plugins=[HorizonPrecision("auto")],
                    callbacks=[GradNormBackoff(max_norm=1.0), seen])
        theirs = dict(precision="32-true", gradient_clip_val=1.0, callbacks=[seen])
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            **(ours if arm == "horizon" else theirs))
        trainer.fit(model, lm_data.ByteCorpusDataModule(**cfg["data"], cache_dir=str(cache_dir)))
        runs[arm] = seen.losses
    assert len(runs["horizon"]) == 4 and runs["horizon"] == runs["lightning"], runs
    assert runs["horizon"][-1] < runs["horizon"][0]


# ---------------------------------------------------------------------- every recipe script runs, tiny settings
# (bench_vs_lightning, bench_node, bench_collectives, bench_precision, bench_sharding: tests/test_recipes_bench.py;
# pretrain_gpt and risk_classifier: their tests above)


def test_bench_embedding_smoke(tmp_path, capsys):
    """2 runs of 2 ranks (a 10k-row table, 3 steps): the dense table under "ddp" and the sharded one; the table's
    bytes per rank are what the arms hold (dense: weight, gradient, two AdamW moments; sharded: half the rows and
    one Adagrad sum per row); then span="auto" on 2 emulated nodes of 1 rank: its row says what it chose, and holds
    that."""
    import bench_embedding

    bench_embedding.main(["--smoke", "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    # on failure, the end of the output: a run that failed printed its log there
    assert "torchrec: skipped: " in out and "2 ranks, sharded / dense: samples/s" in out, out[-4000:]
    mib = {r["arm"]: r["table_mib"] for r in json.loads((tmp_path / "out.json").read_text())}
    assert mib["dense"] == pytest.approx(10_000 * 16 * 4 * 4 / 2**20, rel=1e-6)
    assert mib["sharded"] == pytest.approx(5_000 * (16 + 1) * 4 / 2**20, rel=1e-6)
    # 2 emulated nodes of 1 rank on loopback: a copy of the table on each (every row on each rank), or half each
    bench_embedding.main(["--smoke", "--nodes", "2", "--no-netns", "--arms", "sharded-auto", "--json",
                          str(tmp_path / "nodes.json")])
    out = capsys.readouterr().out
    row, = json.loads((tmp_path / "nodes.json").read_text())
    chosen = "node" if row["copies"] == 2 else "world"
    assert "2 emulated nodes on loopback" in out and f"| sharded-auto ({chosen}) | 2 |" in out
    assert row["table_mib"] == pytest.approx((10_000 if chosen == "node" else 5_000) * 17 * 4 / 2**20, rel=1e-6)


def test_risk_classifier_shards_its_table_over_two_ranks(tmp_path):
    """The recipe at 2 ranks: the table's rows spread over them, AUROC as at one."""
    out = run_script(REPO / "recipes" / "risk_classifier.py", [
        "fit", "--data.n_rows", "30000", "--trainer.devices", "2", "--trainer.default_root_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ], timeout=300).stdout
    auroc = float(out.split("val AUROC ")[1].split()[0])
    assert auroc >= 0.85, out[-3000:]


def test_grad_norm_backoff_demo_smoke(tmp_path, monkeypatch, capsys):
    import grad_norm_backoff_demo

    png = tmp_path / "backoff.png"
    monkeypatch.setattr(sys, "argv", ["grad_norm_backoff_demo.py", "--steps", "12", "--spike-at", "4", "5",
                                      "--nan-at", "8", "--recover-after", "2", "--out", str(png)])
    grad_norm_backoff_demo.main()
    assert "spikes=2 skipped_steps=1 " in capsys.readouterr().out
    assert png.stat().st_size > 1000


def test_bench_state_smoke(cache_dir, capsys, bench_here):
    """3 runs of 2 ranks (tiny GPT at n_embd 64, 2 steps), each in its own process group: replicated, node_sharded
    (shared weights) and FSDP2 (Lightning's ModelParallelStrategy + fully_shard) compared (the table has them and
    their ratios), and a one-candidate --fit-memory search for both states whose candidate (n_embd 64, 2 steps) is
    the table's run, reused. The remaining arm, node_sharded-copies, is HorizonStrategy keywords the table treats as
    any other arm: checked to build here; its fits are tests/test_node_state.py's (node_weights="copies")."""
    import bench_state

    assert set(bench_state.STATES) < set(bench_state.ARMS)
    for arm in bench_state.ARMS.values():
        assert isinstance(HorizonStrategy(**arm), HorizonStrategy)
    result = bench_state.main(["--smoke", "--arms", "replicated,node_sharded,fsdp2", "--fit-memory", "64GiB",
                               "--cache-dir", str(cache_dir), "--timeout", "120"])
    out = capsys.readouterr().out
    assert "| 2 x 1 | replicated |" in out and "| 2 x 1 | node_sharded |" in out, out[-3000:]
    # FSDP2 under Lightning's ModelParallelStrategy, in the same table: its shards are half the replicated state,
    # it trains the same model to the same loss, and our sharded state is compared with it
    assert "| 2 x 1 | fsdp2 |" in out and re.search(r"2 ranks, node_sharded / fsdp2: training state per node"
                                                     r" [\d.]+x, peak memory per node [\d.]+x, tokens/s", out)
    assert re.search(r"\| 2 \| node_sharded / replicated \| [\d.]+x \|", out), out[-3000:]
    assert "peak memory per node: " in out and "CPU: " in out
    assert "largest replicated: n_embd 64" in out and "largest node_sharded: n_embd 64" in out, out[-3000:]
    assert "ratio node_sharded / replicated (parameters that fit): 1.00x" in out
    assert out.count("(the table's run) -> fits") == 3, out[-3000:]  # the search's candidate ran once, in the table
    assert "largest fsdp2: n_embd 64" in out and "ratio node_sharded / fsdp2 (parameters that fit): 1.00x" in out
    rows = {r["state"]: r for r in result["rows"]}
    assert set(rows) == {"replicated", "node_sharded", "fsdp2"} and all(r["ok"] and r["tps"] > 0 for r in rows.values())
    assert rows["node_sharded"]["state_bytes"] < rows["replicated"]["state_bytes"]  # sharded over the node's ranks
    assert rows["fsdp2"]["state_bytes"] < 0.6 * rows["replicated"]["state_bytes"]  # every part in 2 shards
    assert rows["fsdp2"]["loss"] == pytest.approx(rows["replicated"]["loss"], rel=1e-4)
    assert rows["fsdp2"]["sent"] > 0 and "fsdp2: bytes per step computed" in out
    assert {s: f["n_embd"] for s, f in result["fit"].items()} == {"replicated": 64, "node_sharded": 64, "fsdp2": 64}


def test_bench_state_emulated_nodes_and_no_deepspeed(cache_dir, capsys, monkeypatch, bench_here):
    """--nodes 2 at 2 ranks: our arms on 2 emulated nodes of 1 rank (HorizonStrategy(ranks_per_node=1)), every byte
    they send inter-node, FSDP2 one flat world; and a DeepSpeed arm where deepspeed cannot be imported (blocked in
    this process, where the driver's availability check runs) skipped with why and how to install, the rest run."""
    import bench_state

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    result = bench_state.main(["--smoke", "--nodes", "2", "--arms", "replicated,node_sharded,fsdp2,deepspeed-zero2",
                               "--cache-dir", str(cache_dir), "--timeout", "120"])
    out = capsys.readouterr().out
    assert re.search(r"deepspeed-zero2 skipped: deepspeed is not importable \(.+\); install it with DS_BUILD_OPS=0"
                     r" pip install 'lightning-horizon\[deepspeed\]'", out), out[-3000:]
    assert set(result["skipped"]) == {"deepspeed-zero2"} and "emulated nodes: every rank count split into 2" in out
    for arm in ("replicated", "node_sharded"):
        assert f"| 2 x 1 on 2 nodes | {arm} |" in out, out[-3000:]
    assert "| 2 x 1 flat | fsdp2 |" in out and "(flat world)" in out
    rows = {r["state"]: r for r in result["rows"]}
    assert set(rows) == {"replicated", "node_sharded", "fsdp2"}
    for arm in ("replicated", "node_sharded"):  # one rank per node: all of it crosses nodes
        assert rows[arm]["inter"] > 0 and rows[arm]["intra"] == 0, rows[arm]
    assert rows["fsdp2"]["flat"] > 0 and rows["fsdp2"]["loss"] == pytest.approx(rows["replicated"]["loss"], rel=1e-4)


def test_bench_state_deepspeed_arms(cache_dir, capsys, bench_here):
    """Where deepspeed is installed (not in CI: an optional extra), ZeRO-2 and ZeRO-3 at 2 ranks train the same model
    to the same loss as replicated, with less training state, and count the bytes of their collectives."""
    pytest.importorskip("deepspeed")
    import bench_state

    result = bench_state.main(["--smoke", "--arms", "replicated,deepspeed-zero2,deepspeed-zero3",
                               "--cache-dir", str(cache_dir), "--timeout", "180"])
    out = capsys.readouterr().out
    rows = {r["state"]: r for r in result["rows"]}
    assert set(rows) == {"replicated", "deepspeed-zero2", "deepspeed-zero3"} and not result["skipped"], out[-3000:]
    for arm in ("deepspeed-zero2", "deepspeed-zero3"):
        assert f"| 2 x 1 | {arm} |" in out and f"{arm}: bytes per step from the sizes of the collectives" in out
        assert rows[arm]["loss"] == pytest.approx(rows["replicated"]["loss"], rel=1e-4)
        assert 0 < rows[arm]["state_bytes"] < rows["replicated"]["state_bytes"] and rows[arm]["flat"] > 0

def test_bench_out_of_core_smoke(tmp_path, cache_dir, capsys, bench_here):
    """A tiny GPT, 3 steps at one batch, each arm in its own process (the driver here): in RAM, and out of core
    (prefetch "read", a 4 MiB disk probe, a 1 GiB budget, under a cgroup limit when root). The table prints both, the
    final losses are the same bits, and the store arm went to the disk."""
    import json

    import bench_out_of_core

    bench_out_of_core.main(["--smoke", "--cache-dir", str(cache_dir), "--timeout", "90",
                            "--json", str(tmp_path / "o.json")])
    out = capsys.readouterr().out
    assert "| 2 x 32 | ram |" in out and "| 2 x 32 | store-read |" in out, out[-3000:]
    assert re.search(r"store-read: final loss identical to ram: \S+ vs \S+ -> met", out), out[-3000:]
    assert "store-read: peak RSS <= 1.1x budget: " in out  # reported; not required at this size
    rows = {r["arm"]: r for r in json.loads((tmp_path / "o.json").read_text())["rows"]}
    assert rows["ram"]["ok"] and rows["store-read"]["ok"]
    assert rows["store-read"]["loss"] == rows["ram"]["loss"]
    assert rows["store-read"]["written"] > 0 and all(v > 0 for v in rows["store-read"]["disk"])  # read, write, shared
    assert "store-read: reads during a write-back >= 0.7x measured while writing: " in out  # reported, not required
    assert rows["ram"]["tps"] > 0 and rows["store-read"]["tps"] > 0


def test_bench_sync_smoke(cache_dir, capsys, bench_here):
    """bench_sync.py on loopback (3 emulated nodes of 1 rank in one launch): the synchronous arm and the overlapped
    DiLoCo arm train the tiny GPT to a finite loss and the table compares them; every arm's keywords build a
    HorizonStrategy."""
    import bench_sync

    for arm in bench_sync.ARMS.values():
        assert isinstance(HorizonStrategy(sync_every=2, **arm) if arm else HorizonStrategy(), HorizonStrategy)
    result = bench_sync.main(["--smoke", "--nodes", "3", "--cache-dir", str(cache_dir), "--timeout", "180"])
    out = capsys.readouterr().out
    assert set(result) == {"sync", "overlap_nesterov-H2"}, out
    assert all(r["tps"] > 0 and math.isfinite(r["loss"]) for r in result.values()), result
    assert "| overlap_nesterov-H2 |" in out and "loopback" in out and "3 nodes x 1 rank(s)" in out
    with pytest.raises(SystemExit):
        bench_sync.main(["--smoke", "--nodes", "1"])
    assert "--nodes 1: allowed is an int >= 2" in capsys.readouterr().err


def test_mfu_line_names_one_peak():
    """A bf16 run's line gives the MFU against the bf16 peak only: a share above 100% of the fp32 peak would read as
    an error (it stays a logged figure, device/mfu_vs_fp32_peak)."""
    monitor = ThroughputMFUMonitor()
    monitor.compute_dtype, monitor.peaks, monitor.available_flops = "bf16", {"fp32": 207e9, "bf16": 443e9}, 443e9
    monitor.last = {"tokens_per_sec": 4000.0, "flops_per_sec": 266e9, "mfu": 0.60, "mfu_vs_fp32_peak": 1.29}
    line = monitor.summary()
    assert "MFU 60% of bf16 peak 443 GFLOP/s" in line and "fp32" not in line and "129" not in line, line
