"""BufferDataModule in real Lightning Trainers (CPU) over fake jobs: what goes into the checkpoint and
what comes back. The real daemons, the documented diff and spawning are in tests/integration/test_dropin.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from prefetchd.trainer import SetupError, StateMismatch

if TYPE_CHECKING:  # conftest is pytest's to import; only its types are needed here
    from conftest import MakeJob

pytest.importorskip("lightning")
import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from prefetchd.lightning import BufferDataModule  # noqa: E402


class Killed(Exception):
    pass


class Recorder(L.LightningModule):
    """Records every training batch it is given, as (epoch, step); raises Killed at ``kill_at``."""

    def __init__(self, kill_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 3)
        self.kill_at = kill_at
        self.trained: list[tuple[int, int, list[int]]] = []
        self.devices: set[torch.device] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if (batch.epoch, batch.step) == self.kill_at:
            raise Killed
        images, labels = batch  # a DataLoader script's unpacking
        self.trained.append((batch.epoch, batch.step, batch.indices.tolist()))
        self.devices.add(images.device)
        loss: torch.Tensor = torch.nn.functional.cross_entropy(self.net(images.float().mean((2, 3))), labels)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(module: Recorder, dm: BufferDataModule, out: Path, ckpt_path: str | None = None, **kwargs: Any) -> None:
    trainer = L.Trainer(
        default_root_dir=out, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=out, save_last=True, every_n_train_steps=2)], **{"max_epochs": 2, **kwargs},
    )
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)


def test_a_mid_epoch_checkpoint_resumes_at_the_batch_after_the_last_one_trained(
    make_job: MakeJob, tmp_path: Path
) -> None:
    job = make_job(write=2, samples=10, batch_size=4)  # 3 steps an epoch
    full = Recorder()
    fit(full, BufferDataModule(job.buffer, normalize=False, timeout=5), tmp_path / "full")
    assert [t[:2] for t in full.trained] == [(e, s) for e in range(2) for s in range(3)]
    assert full.devices == {torch.device("cpu")}

    # Checkpoints after global steps 2 and 4; killed when handed (1, 2), after step 4 = (1, 0) and
    # with (1, 1) already fetched by Lightning's read-ahead: the checkpoint must say (1, 1), not (1, 2).
    killed = Recorder(kill_at=(1, 2))
    with pytest.raises(Killed):
        fit(killed, BufferDataModule(job.buffer, normalize=False, timeout=5), tmp_path / "killed")
    state = torch.load(tmp_path / "killed" / "last.ckpt", weights_only=False)["BufferDataModule"]
    assert [(r["epoch"], r["step"]) for r in state["ranks"]] == [(1, 1)]

    resumed = Recorder()
    fit(resumed, BufferDataModule(job.buffer, normalize=False, timeout=5), tmp_path / "resumed",
        ckpt_path=str(tmp_path / "killed" / "last.ckpt"))
    assert resumed.trained == full.trained[4:]


def test_an_epoch_cut_short_by_lightning_is_not_continued(make_job: MakeJob, tmp_path: Path) -> None:
    job = make_job(write=2, samples=10, batch_size=4)
    module = Recorder()
    fit(module, BufferDataModule(job.buffer, normalize=False, timeout=5), tmp_path, limit_train_batches=1)
    assert [t[:2] for t in module.trained] == [(0, 0), (1, 0)]


def test_a_resume_after_an_epoch_cut_short_starts_the_next_epoch(make_job: MakeJob, tmp_path: Path) -> None:
    """limit_train_batches, and an epoch-end checkpoint: it held the position after the last batch handed
    over, mid-epoch, and the resume trained the rest of that epoch as Lightning's next one (review)."""
    job = make_job(write=3, samples=12, batch_size=4, epochs=3)  # 3 steps an epoch
    whole = Recorder()
    fit(whole, BufferDataModule(job.buffer, normalize=False, timeout=5), tmp_path / "whole", limit_train_batches=2,
        max_epochs=3)
    assert [t[:2] for t in whole.trained] == [(e, s) for e in range(3) for s in range(2)]
    first = Recorder()
    fit(first, BufferDataModule(job.buffer, normalize=False, timeout=5), tmp_path / "first", limit_train_batches=2,
        max_epochs=1)
    resumed = Recorder()
    fit(resumed, BufferDataModule(job.buffer, normalize=False, timeout=5), tmp_path / "resumed",
        ckpt_path=str(tmp_path / "first" / "last.ckpt"), limit_train_batches=2, max_epochs=3)
    assert first.trained + resumed.trained == whole.trained


def test_a_second_fit_of_the_same_trainer_goes_on_with_the_next_epoch(make_job: MakeJob, tmp_path: Path) -> None:
    """fit, then fit again with max_epochs raised: the module opened a new loader at (0, 0) and Lightning's
    epoch 2 trained epoch 0's batches again (review)."""
    job = make_job(write=3, samples=8, batch_size=4, epochs=3)
    module = Recorder()
    trainer = L.Trainer(max_epochs=2, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    dm = BufferDataModule(job.buffer, normalize=False, timeout=5)
    trainer.fit(module, datamodule=dm)
    trainer.fit_loop.max_epochs = 3
    trainer.fit(module, datamodule=dm)
    assert [t[:2] for t in module.trained] == [(e, s) for e in range(3) for s in range(2)]


class Validated(Recorder):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.trained.append((batch.epoch, batch.step, []))


def test_validate_after_fit_validates(make_job: MakeJob, tmp_path: Path) -> None:
    """After fit(max_epochs=2) Lightning's current_epoch is 2, the val job's end (its --epochs 2): a
    trainer.validate() then ran over that empty epoch, silently (review). It validates the last epoch."""
    train, val = make_job(tmp_path / "train", write=2, samples=8, batch_size=4), make_job(
        tmp_path / "val", write=2, samples=8, batch_size=4, split="val")
    module = Validated()
    trainer = L.Trainer(max_epochs=2, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    dm = BufferDataModule(train.buffer, val_buffer=val.buffer, normalize=False, timeout=5)
    trainer.fit(module, datamodule=dm)
    module.trained.clear()
    trainer.validate(module, datamodule=dm, verbose=False)
    assert module.trained == [(1, 0, []), (1, 1, [])]


def test_a_checkpoint_of_another_job_or_world_is_refused(make_job: MakeJob) -> None:
    job = make_job(write=1)
    dm = BufferDataModule(job.buffer, timeout=5)
    with pytest.raises(StateMismatch, match="format 'other'"):
        dm.load_state_dict({"format": "other", "version": 1})
    with pytest.raises(StateMismatch, match="2 ranks but this run has 1"):
        dm.load_state_dict({"format": "prefetchd.rank_states", "version": 1, "ranks": [{}, {}]})
    dm.load_state_dict({})  # a checkpoint taken before the training loader existed: nothing to restore


def test_val_data_needs_somewhere_to_go(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a val_buffer"):
        BufferDataModule(tmp_path / "train", data=tmp_path, val_data=tmp_path)


def test_daemon_options_without_data_are_refused_not_ignored(tmp_path: Path) -> None:
    """BufferDataModule(buffer, batch_size=99, image_size=64, seed=3) on a daemon of batch 16 at 32 px gave
    batches of 16 at 32 px without a word: those options start daemons (data=), and none is started without it."""
    with pytest.raises(ValueError, match=r"^seed=3, batch_size=99, image_size=64: options of the daemons this module "
                                         r"starts, given data=; without it the daemon serving .* decides them"):
        BufferDataModule(tmp_path / "train", seed=3, batch_size=99, image_size=64)
    for option in ("epochs", "workers", "high_water"):
        with pytest.raises(ValueError, match=rf"^{option}=2: options of the daemons this module starts"):
            BufferDataModule(tmp_path / "train", **{option: 2})
    BufferDataModule(tmp_path / "train", data=tmp_path, seed=3, batch_size=99)  # the daemon it starts takes them


def test_a_val_buffer_of_a_train_split_is_refused(make_job: MakeJob, tmp_path: Path) -> None:
    """Validating on random crops and flips of the training data measures nothing."""
    train, val = make_job(tmp_path / "train", write=1), make_job(tmp_path / "val", write=1)  # both split "train"
    for job in (train, val):
        job.claim()
    dm = BufferDataModule(train.buffer, val_buffer=val.buffer, timeout=5)
    dm.prepare_data()
    with pytest.raises(SetupError, match=rf"val_buffer {val.buffer}: its daemon produces the train split"):
        dm.val_dataloader()
    ok = make_job(tmp_path / "val-ok", write=1, split="val")
    ok.claim()
    good = BufferDataModule(train.buffer, val_buffer=ok.buffer, timeout=5)
    good.prepare_data()
    assert len(good.val_dataloader()) == ok.manifest.steps_per_epoch
    good.teardown("fit")


def test_a_val_buffer_whose_samples_are_training_samples_is_refused_whichever_opens_first(
        make_job: MakeJob, tmp_path: Path) -> None:
    """A training daemon without --val-fraction on the dataset a --val-fraction 0.2 val daemon holds out from: the
    validation set is training data.  Lightning's sanity check opens validation first, so it is checked there too."""
    train = make_job(tmp_path / "train", write=1, fingerprint="one")
    val = make_job(tmp_path / "val", write=1, split="val", fingerprint="one")
    dataclasses.replace(val.manifest, val_fraction=0.2).write(val.buffer)
    for job in (train, val):
        job.claim()
    for first, second in (("train_dataloader", "val_dataloader"), ("val_dataloader", "train_dataloader")):
        dm = BufferDataModule(train.buffer, val_buffer=val.buffer, timeout=5)
        dm.prepare_data()
        getattr(dm, first)()
        with pytest.raises(SetupError, match="'s validation samples are training samples too: .* the training one "
                                             r"with no --val-fraction \(every sample\) and the validation one with "
                                             "--val-fraction 0.2"):
            getattr(dm, second)()
        dm.teardown("fit")


def test_data_given_to_a_buffer_a_daemon_already_serves_must_match_its_job(make_job: MakeJob, tmp_path: Path) -> None:
    """data= with a daemon already running there: its job is used, so it must be the one asked for (as
    prefetchd-train --spawn-daemon checks), not silently another dataset or batch size."""
    job = make_job(write=1, batch_size=4)  # dataset_root /data/fake
    job.claim()  # a live "daemon" owns the buffer: nothing is spawned
    dm = BufferDataModule(job.buffer, data="/data/other", batch_size=8, epochs=1, timeout=5)
    dm.prepare_data()
    with pytest.raises(SetupError, match=r"produces dataset /data/fake, not /data/other; batch size 4, not 8\. "
                                          r".*to let BufferDataModule\(data=\.\.\.\) start the job asked for, or drop "
                                          r"the differing arguments$"):
        dm.train_dataloader()
    same = BufferDataModule(job.buffer, data="/data/fake", batch_size=4, epochs=1, timeout=5)
    same.prepare_data()
    assert len(same.train_dataloader()) == job.manifest.steps_per_epoch
    same.teardown("fit")


def test_daemons_the_module_started_are_stopped_when_fit_raises(shapes_data: Path, shm_dir: Path) -> None:
    """Lightning calls no teardown then: the daemons outlived the process, reparented to init."""
    import subprocess
    import sys
    import time

    import psutil

    script = (
        "import sys\n"
        "from prefetchd.buffer_protocol import daemon_pid\n"
        "from prefetchd.lightning import BufferDataModule\n"
        "dm = BufferDataModule(sys.argv[1], data=sys.argv[2], batch_size=4, image_size=16, workers=1, timeout=60)\n"
        "dm.prepare_data()\n"
        "print(daemon_pid(sys.argv[1]), flush=True)\n"
        "raise RuntimeError('fit failed')\n"
    )
    buffer = shm_dir / "bf"
    proc = subprocess.run([sys.executable, "-c", script, str(buffer), str(shapes_data / "train")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "fit failed" in proc.stderr, proc.stderr
    pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            psutil.Process(pid).kill()
            raise AssertionError(f"the daemon (pid {pid}) the module started outlived the failed fit")
        time.sleep(0.05)



def test_the_val_progress_names_this_run_from_its_first_training_step(make_job: MakeJob, tmp_path: Path) -> None:
    """check_val_every_n_epoch=2 and no sanity check: Lightning opened the val loader only at its first
    validation, an epoch into training, and until then the val buffer's progress file was an earlier run's (its
    pid GONE in `prefetchd status`), or absent.  It names this run's first pass (epoch 1) from the first step."""
    import os

    from prefetchd.buffer_protocol import Progress

    train, val = make_job(tmp_path / "train", write=2, samples=8, batch_size=4), make_job(
        tmp_path / "val", write=2, samples=8, batch_size=4, split="val")
    seen: list[Progress | None] = []

    class Looks(Validated):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if not seen:
                seen.append(Progress.read(val.buffer))
            return super().training_step(batch, batch_idx)

    module = Looks()
    trainer = L.Trainer(max_epochs=2, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, check_val_every_n_epoch=2)
    trainer.fit(module, datamodule=BufferDataModule(train.buffer, val_buffer=val.buffer, normalize=False, timeout=5))
    assert seen[0] is not None and (seen[0].epoch, seen[0].step, seen[0].pid) == (1, 0, os.getpid()), seen
    assert [t for t in module.trained if not t[2]] == [(1, 0, []), (1, 1, [])]  # validated epoch 1, whole


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("resume", [None, "epoch end", "mid-epoch"])
def test_the_val_progress_names_the_first_pass_after_a_resume(
    make_job: MakeJob, tmp_path: Path, resume: str | None, every: int
) -> None:
    """check_val_every_n_epoch=every.  Right after a resume from an epoch-end checkpoint Lightning's current_epoch
    can still name the epoch the checkpoint closed: train_dataloader named that one in the val progress, an epoch
    before the first pass (with every=2 Lightning then also loaded the val loader, and its iterability check named
    that epoch again), and the val daemon prefetched an epoch never validated until a pass named its own (review).
    A fresh start and a mid-epoch resume named the first pass already, and still do."""
    from prefetchd.buffer_protocol import Progress

    train, val = make_job(tmp_path / "train", write=4, samples=8, batch_size=4, epochs=4), make_job(
        tmp_path / "val", write=4, samples=8, batch_size=4, epochs=4, split="val")  # 2 steps an epoch
    named: list[tuple[int, int]] = []  # the val progress as train_dataloader left it, then at the first step

    def looked() -> None:
        progress = Progress.read(val.buffer)
        assert progress is not None
        named.append((progress.epoch, progress.step))

    class Looks(Validated):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if len(named) == 1:
                looked()
            return super().training_step(batch, batch_idx)

    def trainer(out: Path, **kwargs: Any) -> L.Trainer:
        return L.Trainer(default_root_dir=out, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, check_val_every_n_epoch=every, **kwargs)

    ckpt_path = None
    if resume is not None:
        first = tmp_path / "first"
        saves = ModelCheckpoint(dirpath=first, save_last=True, every_n_train_steps=1 if resume == "mid-epoch" else None)
        stop = {"max_epochs": 2} if resume == "epoch end" else {"max_steps": 5}  # after (2, 0), before (2, 1)
        trainer(first, callbacks=[saves], **stop).fit(
            Validated(), datamodule=BufferDataModule(train.buffer, val_buffer=val.buffer, normalize=False, timeout=5))
        ckpt_path = str(first / "last.ckpt")
        state = torch.load(ckpt_path, weights_only=False)["BufferDataModule"]
        assert [(r["epoch"], r["step"]) for r in state["ranks"]] == [(2, 0) if resume == "epoch end" else (2, 1)]
    dm = BufferDataModule(train.buffer, val_buffer=val.buffer, normalize=False, timeout=5)
    opened = dm.train_dataloader

    def train_dataloader() -> Any:  # on the instance: a subclass's checkpoint key would not be BufferDataModule's
        loader = opened()
        looked()
        return loader

    dm.train_dataloader = train_dataloader  # type: ignore[method-assign]
    module = Looks()
    trainer(tmp_path / "resumed", max_epochs=4).fit(module, datamodule=dm, ckpt_path=ckpt_path)
    validated = [t[0] for t in module.trained if not t[2]]
    start = 0 if resume is None else 2  # the first epoch trained
    assert validated[0] == (start if every == 1 else start + 1)  # every=2 validates epochs 1 and 3
    assert named == [(validated[0], 0)] * 2


@pytest.mark.parametrize("stop, refused", [
    ({"max_epochs": 3}, "Trainer(max_epochs=3) trains 3 epochs"),
    ({"max_epochs": -1}, "Trainer(max_epochs=-1) trains without end"),
    ({"max_epochs": -1, "max_steps": 3}, None),  # it may end in time: left to set_epoch past the end
])
def test_a_trainer_for_more_epochs_than_the_job_is_refused_before_it_trains(
        make_job: MakeJob, tmp_path: Path, stop: dict[str, int], refused: str | None) -> None:
    """Trainer(max_epochs=4) over a daemon of --epochs 2 trained 2 epochs, then an empty one, then failed deep in
    Lightning at the fourth with advice for a hand-written loop (a user's walk)."""
    job = make_job(write=2, samples=8, batch_size=4)  # --epochs 2
    module = Recorder()
    if refused is None:
        fit(module, BufferDataModule(job.buffer, normalize=False, timeout=5), tmp_path, **stop)
        assert len(module.trained) == 3
        return
    with pytest.raises(SetupError, match=rf"{re.escape(refused)}, but the daemon of .* produces only 2 epochs "
                                         r"\(its --epochs\): pass Trainer\(max_epochs=2\)"):
        fit(module, BufferDataModule(job.buffer, normalize=False, timeout=5), tmp_path, **stop)
    assert module.trained == []


def test_a_val_job_shorter_than_the_training_is_refused_before_it_trains(make_job: MakeJob, tmp_path: Path) -> None:
    train = make_job(tmp_path / "train", write=2, samples=8, batch_size=4, epochs=3)
    val = make_job(tmp_path / "val", write=2, samples=8, batch_size=4, split="val")  # --epochs 2
    module = Validated()
    with pytest.raises(SetupError, match=r"Trainer\(max_epochs=3\) trains 3 epochs, but the daemon of .*val.* "
                                         r"produces only 2 validation epochs"):
        fit(module, BufferDataModule(train.buffer, val_buffer=val.buffer, normalize=False, timeout=5), tmp_path,
            max_epochs=3, num_sanity_val_steps=0)
    assert module.trained == []
