"""docs/DROP_IN.md's diffs turn the scripts people train with into BufferLoader ones.

The "before" scripts are below, in the shapes of pytorch/examples' imagenet main.py, of a
Lightning image classifier and of accelerate's examples/cv_example.py (all trimmed). Each test
applies the documented diff and runs the result against real daemons with a spy on the loader
that records every batch the script received (sample indices and an image checksum); a run is
killed part-way through its second epoch (the spy raises, as a crash would) and resumed from
its checkpoint, and the batches it then receives must be the uninterrupted run's. The scripts
run in this process (as `python script.py args` would, via runpy): interpreter start-up, torch
and Lightning imports are most of the cost.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torchvision.datasets import ImageFolder

from prefetchd.buffer_protocol import Manifest, Progress, daemon_pid
from prefetchd.trainer import loader_iteration
from tests.status_examples import job_result_of, state_of

DOC = Path(__file__).resolve().parents[2] / "docs" / "DROP_IN.md"

BEFORE = '''\
"""Train a classifier on class folders (the shape of pytorch/examples/imagenet/main.py, trimmed)."""
import argparse
import json
import os

import torch
import torchvision
from torch import nn
from torchvision import datasets, transforms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("data", help="dataset root with train/ and val/ class folders")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--resume", default="", help="path to the latest checkpoint")
    parser.add_argument("--checkpoint", default="checkpoint.pth.tar")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = datasets.ImageFolder(
        os.path.join(args.data, "train"),
        transforms.Compose([
            transforms.RandomResizedCrop(args.image_size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]))
    val_dataset = datasets.ImageFolder(
        os.path.join(args.data, "val"),
        transforms.Compose([
            transforms.Resize(int(args.image_size / 0.875)),
            transforms.CenterCrop(args.image_size),
            transforms.ToTensor(),
            normalize,
        ]))
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, pin_memory=True)
    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers, pin_memory=True)
    num_classes = len(train_dataset.classes)

    model = torchvision.models.get_model(args.arch, num_classes=num_classes).to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device)
        start_epoch = checkpoint["epoch"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])

    for epoch in range(start_epoch, args.epochs):
        model.train()
        total_loss, seen = 0.0, 0
        for images, target in train_loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(images)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            total_loss += loss.item() * target.size(0)
            seen += target.size(0)
        model.eval()
        correct, count = 0, 0
        with torch.no_grad():
            for images, target in val_loader:
                images = images.to(device, non_blocking=True)
                target = target.to(device, non_blocking=True)
                correct += (model(images).argmax(1) == target).sum().item()
                count += target.size(0)
        print(json.dumps({"epoch": epoch, "train_loss": total_loss / seen, "train_samples": seen,
                          "val_top1": correct / count, "val_samples": count}))
        torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, args.checkpoint)


if __name__ == "__main__":
    main()
'''

LIGHTNING_BEFORE = '''\
"""Train a classifier with Lightning on class folders (the shape of a Lightning image classifier, trimmed)."""
import argparse
import json
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


class ImageFolderData(L.LightningDataModule):
    def __init__(self, root, batch_size, image_size, workers):
        super().__init__()
        self.root, self.batch_size, self.image_size, self.workers = root, batch_size, image_size, workers

    def setup(self, stage):
        normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
        self.train_set = datasets.ImageFolder(os.path.join(self.root, "train"), transforms.Compose([
            transforms.RandomResizedCrop(self.image_size), transforms.RandomHorizontalFlip(),
            transforms.ToTensor(), normalize]))
        self.val_set = datasets.ImageFolder(os.path.join(self.root, "val"), transforms.Compose([
            transforms.Resize(int(self.image_size / 0.875)), transforms.CenterCrop(self.image_size),
            transforms.ToTensor(), normalize]))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.workers)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.workers)


class Classifier(L.LightningModule):
    def __init__(self, num_classes, lr):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(16, num_classes))

    def training_step(self, batch, batch_idx):
        images, target = batch
        loss = F.cross_entropy(self.net(images), target)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, target = batch
        self.log("val_acc", (self.net(images).argmax(1) == target).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("data", help="dataset root with train/ and val/ class folders")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--output-dir", default=".")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/last.ckpt")
    args = parser.parse_args()
    datamodule = ImageFolderData(args.data, args.batch_size, args.image_size, args.workers)
    model = Classifier(args.num_classes, args.lr)
    checkpoints = ModelCheckpoint(dirpath=args.output_dir, save_last=True)
    trainer = L.Trainer(max_epochs=args.epochs, default_root_dir=args.output_dir, callbacks=[checkpoints])
    trainer.fit(model, datamodule=datamodule,
                ckpt_path=os.path.join(args.output_dir, "last.ckpt") if args.resume else None)
    print(json.dumps({key: float(value) for key, value in trainer.callback_metrics.items()}))


if __name__ == "__main__":
    main()
'''

ACCELERATE_BEFORE = '''\
"""Train a classifier with Accelerate on class folders (the shape of accelerate's examples/cv_example.py, trimmed)."""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("data", help="dataset root with train/ and val/ class folders")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--output-dir", default=".")
    parser.add_argument("--checkpointing-steps", type=int, default=None)
    parser.add_argument("--resume-from-checkpoint", default=None, help="a step_N folder save_state wrote")
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=args.cpu)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(args.image_size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    eval_dataset = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(int(args.image_size / 0.875)), transforms.CenterCrop(args.image_size),
        transforms.ToTensor(), normalize]))
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=args.batch_size, num_workers=args.workers)
    eval_dataloader = DataLoader(eval_dataset, shuffle=False, batch_size=args.batch_size, num_workers=args.workers)

    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, args.num_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader)

    overall_step, starting_epoch, resume_step = 0, 0, 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        overall_step = int(os.path.basename(args.resume_from_checkpoint.rstrip("/")).split("_")[1])
        starting_epoch, resume_step = divmod(overall_step, len(train_dataloader))

    for epoch in range(starting_epoch, args.epochs):
        model.train()
        if epoch == starting_epoch and resume_step:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        total_loss, seen = 0.0, 0
        for images, target in active_dataloader:
            loss = F.cross_entropy(model(images), target)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            overall_step += 1
            total_loss += loss.item() * target.size(0)
            seen += target.size(0)
            if args.checkpointing_steps and overall_step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
        model.eval()
        correct, count = 0, 0
        for images, target in eval_dataloader:
            with torch.no_grad():
                predictions = model(images).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, target))
            correct += (predictions == references).sum().item()
            count += references.numel()
        accelerator.print(json.dumps({"epoch": epoch, "train_loss": total_loss / seen, "train_samples": seen,
                                      "val_top1": correct / count, "val_samples": count}))


if __name__ == "__main__":
    main()
'''

# batch 8 of 72 training samples: 9 steps per epoch. The daemons' --epochs is one more than the
# runs train, so no daemon finishes its job while a test still needs it.
DAEMON = ["--batch-size", "8", "--image-size", "32", "--workers", "1", "--epochs", "3"]
KILL_AT = (1, 4)  # (epoch, step): the killed runs die when the loader hands over this batch


class Killed(Exception):
    """What the spy raises in place of a SIGKILL."""


def documented_diffs() -> dict[str, str]:
    """The diff blocks of docs/DROP_IN.md, by the name in the comment above each."""
    blocks = re.findall(r"<!-- applied by test_dropin\.py to (\w+) -->\n```diff\n(.*?)```", DOC.read_text(), flags=re.S)
    names = [name for name, _ in blocks]
    assert sorted(names) == ["ACCELERATE_BEFORE", "BEFORE", "LIGHTNING_BEFORE"], f"{DOC}: diff blocks {names}"
    return {name: str(diff) for name, diff in blocks}


def service_commands(data: Path, train_buffer: Path, val_buffer: Path) -> tuple[list[list[str]], list[str]]:
    """The `prefetchd submit` command lines of DROP_IN's section 6 (its block "run by test_dropin.py") for this
    test's data, buffers and sizes, and the arguments of its `python main.py` line."""
    block = re.search(r"<!-- run by test_dropin\.py -->\n```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    assert block, f"{DOC}: no bash block run by test_dropin.py"
    text = block[1].replace("\\\n", " ")
    for documented, here in (("/dev/shm/imagenet-train", train_buffer), ("/dev/shm/imagenet-val", val_buffer),
                             ("/data/imagenet", data), ("--batch-size 256", "--batch-size 8"),
                             ("--image-size 224", "--image-size 32"), ("--epochs 90", "--epochs 2"),
                             ("--arch resnet50", "--arch mobilenet_v3_small")):
        assert documented in text, f"{DOC}: {documented!r} is not in its service block:\n{text}"
        text = text.replace(documented, str(here))
    lines = [shlex.split(line) for line in text.splitlines() if line.strip()]
    submits = [line for line in lines if line[:2] == ["prefetchd", "submit"]]
    script = [line for line in lines if line[:2] == ["python", "main.py"]]
    assert len(submits) == 2 and len(script) == 1 and len(lines) == 3, lines
    return submits, script[0][2:]


def apply_diff(text: str, diff: str) -> str:
    """Apply unified-diff hunks by their content (hunk headers are labels, not line numbers)."""
    hunks = [h for h in re.split(r"^@@.*\n", diff, flags=re.M) if h.strip()]
    for hunk in hunks:
        old, new = [], []
        for line in hunk.splitlines():
            tag, body = line[:1], line[1:]
            if tag in (" ", "-"):
                old.append(body)
            if tag in (" ", "+"):
                new.append(body)
            if tag not in (" ", "-", "+"):
                raise AssertionError(f"not a diff line: {line!r}")
        before, after = "\n".join(old) + "\n", "\n".join(new) + "\n"
        assert text.count(before) == 1, f"hunk does not apply exactly once:\n{before}"
        text = text.replace(before, after)
    return text


def last_json_line(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, stdout
    return dict(json.loads(lines[-1]))


def run_script(path: Path, args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Run a training script in this process as ``python path args`` would; its last JSON line."""
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [str(path), *args])
        runpy.run_path(str(path), run_name="__main__")
    return last_json_line(capsys.readouterr().out)


def write_after(name: str, before: str, tmp_path: Path) -> Path:
    after = apply_diff(before, documented_diffs()[name])
    assert "DataLoader(" not in after and "ImageFolder(" not in after
    path = tmp_path / f"{name.lower()}_after.py"
    path.write_text(after)
    return path


Received = tuple[int, int, tuple[int, ...], str]  # epoch, step, sample indices, sha1 of the images


class Spy:
    """Records every batch the loaders hand over, per buffer; raises Killed at ``kill_at`` when armed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.received: dict[str, list[Received]] = {}
        self.kill: tuple[str, tuple[int, int]] | None = None
        real_next = loader_iteration._EpochIterator.__next__
        spy = self

        def spying_next(it: Any) -> Any:
            batch = real_next(it)
            buffer = str(it._loader.buffer)
            if spy.kill == (buffer, (batch.epoch, batch.step)):
                spy.kill = None
                raise Killed(f"killed at epoch {batch.epoch} step {batch.step}")
            digest = hashlib.sha1(batch.images.cpu().contiguous().numpy().tobytes()).hexdigest()
            spy.received.setdefault(buffer, []).append(
                (batch.epoch, batch.step, tuple(batch.indices.tolist()), digest))
            return batch

        monkeypatch.setattr(loader_iteration._EpochIterator, "__next__", spying_next)


def received_since(spy: Spy, buffer: Path, start: int) -> list[Received]:
    return spy.received.get(str(buffer), [])[start:]


def count(spy: Spy, buffer: Path) -> int:
    return len(spy.received.get(str(buffer), []))


def epoch_steps(batches: list[Received]) -> list[tuple[int, int]]:
    return [(epoch, step) for epoch, step, _, _ in batches]


def check_resume_is_exact(uninterrupted: list[Received], resumed: list[Received], resume_at: tuple[int, int],
                          steps_per_epoch: int) -> None:
    """The resumed run received exactly the uninterrupted run's batches from ``resume_at`` on."""
    first = resume_at[0] * steps_per_epoch + resume_at[1]
    assert epoch_steps(uninterrupted) == [(e, s) for e in range(2) for s in range(steps_per_epoch)]
    assert epoch_steps(resumed) == epoch_steps(uninterrupted[first:])
    assert resumed == uninterrupted[first:], "same sample indices and bit-identical images"


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")  # the original, on a CPU
def test_stock_script_diff_trains_and_resumes_by_epoch(
    shapes_data: Path, shm_dir: Path, start_daemon: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    diff = documented_diffs()["BEFORE"]
    after = apply_diff(BEFORE, diff)
    changed = sum(1 for line in diff.splitlines() if line.startswith("+"))
    assert changed <= 9, "the drop-in is a few lines"
    before_path, after_path = tmp_path / "before.py", tmp_path / "after.py"
    before_path.write_text(BEFORE)
    after_path.write_text(after)
    n_train = len(ImageFolder(str(shapes_data / "train")).samples)
    n_val = len(ImageFolder(str(shapes_data / "val")).samples)
    common = ["--arch", "mobilenet_v3_small", "--epochs", "2", "--lr", "0.05"]

    train_buffer, val_buffer = shm_dir / "train", shm_dir / "val"
    start_daemon(train_buffer, "--data", shapes_data / "train", "--seed", "3", *DAEMON)
    start_daemon(val_buffer, "--data", shapes_data / "val", "--split", "val", "--seed", "3", *DAEMON)

    # The original script, as it is (in this process, while the daemons start): it works on this
    # data with a DataLoader.
    result = run_script(before_path, [str(shapes_data), *common, "--epochs", "1", "--batch-size", "8",
                                      "--image-size", "32", "--workers", "0",
                                      "--checkpoint", str(tmp_path / "before.pth")], capsys)
    assert result["train_samples"] == n_train and result["val_samples"] == n_val

    # The script after the diff, fed by the daemons: two epochs uninterrupted.
    spy = Spy(monkeypatch)
    args = ["--train-buffer", str(train_buffer), "--val-buffer", str(val_buffer), *common]
    result = run_script(after_path, [*args, "--checkpoint", str(tmp_path / "full.pth")], capsys)
    assert math.isfinite(result["train_loss"]) and 0 <= result["val_top1"] <= 1
    assert result["train_samples"] == n_train and result["val_samples"] == n_val
    uninterrupted = received_since(spy, train_buffer, 0)
    for epoch in range(2):
        indices = [i for e, _, batch, _ in uninterrupted if e == epoch for i in batch]
        assert sorted(indices) == list(range(n_train)), "every training sample exactly once an epoch"
        assert indices != sorted(indices), "shuffled, as shuffle=True was"
    val_indices = [i for _, _, batch, _ in received_since(spy, val_buffer, 0)[: -(-n_val // 8)] for i in batch]
    assert val_indices == list(range(n_val)), "every validation sample once, in order"

    # Killed in its second epoch, then resumed with --resume from the checkpoint of the first.
    checkpoint = str(tmp_path / "killed.pth")
    spy.kill = (str(train_buffer), KILL_AT)
    with pytest.raises(Killed):
        run_script(after_path, [*args, "--checkpoint", checkpoint], capsys)
    start = count(spy, train_buffer)
    result = run_script(after_path, [*args, "--checkpoint", checkpoint, "--resume", checkpoint], capsys)
    assert result["epoch"] == 1 and result["train_samples"] == n_train
    # The val daemon was told each epoch too: it saw the resumed run validate epoch 1, its last of 2.
    assert Progress.read(val_buffer) == Progress(2, 0), Progress.read(val_buffer)
    steps = -(-n_train // 8)
    check_resume_is_exact(uninterrupted, received_since(spy, train_buffer, start), (1, 0), steps)


def test_lightning_diff_resumes_from_its_checkpoint_exactly(
    shapes_data: Path, shm_dir: Path, start_daemon: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("lightning")
    after = write_after("LIGHTNING_BEFORE", LIGHTNING_BEFORE, tmp_path)
    train_buffer, val_buffer = shm_dir / "train", shm_dir / "val"
    args = [str(shapes_data), "--train-buffer", str(train_buffer), "--val-buffer", str(val_buffer),
            "--epochs", "2", "--batch-size", "8", "--image-size", "32", "--workers", "1", "--num-classes", "3",
            "--lr", "0.05"]
    spy = Spy(monkeypatch)

    # Uninterrupted, with no daemon running: the DataModule starts both and stops them at the end.
    result = run_script(after, [*args, "--output-dir", str(tmp_path / "full")], capsys)
    assert math.isfinite(result["train_loss_epoch"]) and 0 <= result["val_acc"] <= 1
    uninterrupted = received_since(spy, train_buffer, 0)
    assert all(daemon_pid(b) is None for b in (train_buffer, val_buffer)), "the daemons it started are stopped"
    n_val_steps = -(-len(ImageFolder(str(shapes_data / "val")).samples) // 8)
    val = epoch_steps(received_since(spy, val_buffer, 0))
    sanity = [(0, s) for s in range(min(2, n_val_steps))]
    assert val == sanity + [(e, s) for e in range(2) for s in range(n_val_steps)], \
        "the sanity check's batches, then all of the epoch's validation batches after each epoch"

    # Killed in the second epoch (daemons started beside it, as by systemd), resumed with ckpt_path=.
    for buffer, split in ((train_buffer, "train"), (val_buffer, "val")):
        daemon = start_daemon(buffer, "--data", shapes_data / split, "--split", split, "--seed", "0", *DAEMON)
        daemon.wait_until(lambda: daemon_pid(buffer) is not None, 60, "the daemon to own its buffer")
    killed = [*args, "--output-dir", str(tmp_path / "killed")]
    spy.kill = (str(train_buffer), KILL_AT)
    with pytest.raises(Killed):
        run_script(after, killed, capsys)
    start = count(spy, train_buffer)
    run_script(after, [*killed, "--resume"], capsys)
    steps = -(-len(ImageFolder(str(shapes_data / "train")).samples) // 8)
    check_resume_is_exact(uninterrupted, received_since(spy, train_buffer, start), (1, 0), steps)


def test_accelerate_diff_resumes_mid_epoch_exactly(
    shapes_data: Path, shm_dir: Path, start_daemon: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("accelerate")
    after = write_after("ACCELERATE_BEFORE", ACCELERATE_BEFORE, tmp_path)
    train_buffer, val_buffer = shm_dir / "train", shm_dir / "val"
    daemons = [start_daemon(train_buffer, "--data", shapes_data / "train", "--seed", "5", *DAEMON),
               start_daemon(val_buffer, "--data", shapes_data / "val", "--split", "val", "--seed", "5", *DAEMON)]
    args = ["--train-buffer", str(train_buffer), "--val-buffer", str(val_buffer),
            "--num-classes", "3", "--cpu", "--checkpointing-steps", "4"]
    spy = Spy(monkeypatch)
    result = run_script(after, [*args, "--epochs", "2", "--output-dir", str(tmp_path / "full")], capsys)
    n_train = len(ImageFolder(str(shapes_data / "train")).samples)
    assert result["train_samples"] == n_train and math.isfinite(result["train_loss"])
    uninterrupted = received_since(spy, train_buffer, 0)

    # Killed at step 4 of epoch 1 (global step 13); step_12 was saved after epoch 1's step 2.  The
    # resumed run trains on to the daemons' last epoch, 2, as the first run's --epochs 3 would have.
    out = tmp_path / "killed"
    spy.kill = (str(train_buffer), KILL_AT)
    with pytest.raises(Killed):
        run_script(after, [*args, "--epochs", "2", "--output-dir", str(out)], capsys)
    start = count(spy, train_buffer)
    result = run_script(after, [*args, "--epochs", "3", "--output-dir", str(out),
                                "--resume-from-checkpoint", str(out / "step_12")], capsys)
    assert result["epoch"] == 2
    steps = -(-n_train // 8)
    resumed = received_since(spy, train_buffer, start)
    check_resume_is_exact(uninterrupted, resumed[: 2 * steps - 12], (1, 3), steps)
    assert epoch_steps(resumed[2 * steps - 12:]) == [(2, s) for s in range(steps)]
    # eval_dataloader.set_epoch(epoch) told the val daemon each epoch: the resumed run validated its epochs
    # 1 and 2 (not the daemon's 0 and 1 again), so both daemons reached their --epochs 3 and ended.
    assert Progress.read(val_buffer) == Progress(3, 0), Progress.read(val_buffer)
    for daemon in daemons:
        assert daemon.wait_exit(60) == 0, daemon.log


def test_stock_script_on_a_service_with_the_documented_submits_resumes_exactly(
    shapes_data: Path, shm_dir: Path, start_daemon: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Section 6: daemons as a service runs them (--group-access, no data) are given their jobs by the documented
    `prefetchd submit` lines; the script of section 2 trains on them, is killed in its second epoch, and another
    user's job replaces the training one meanwhile (--replace).  Submitted again, the validation job answers
    "already producing this job" (status's `later` line) and the training one is started again, and the run resumed
    with --resume gets the batches the killed run had of that epoch."""
    train_buffer, val_buffer = shm_dir / "imagenet-train", shm_dir / "imagenet-val"
    daemons = [start_daemon(buffer, "--group-access", "--workers", "1", "--high-water", "3")
               for buffer in (train_buffer, val_buffer)]
    for daemon, buffer in zip(daemons, (train_buffer, val_buffer)):
        daemon.wait_until(lambda b=buffer: state_of(b) == "waiting-for-job", 30, "the daemon to wait for a job")
    submits, script_args = service_commands(shapes_data, train_buffer, val_buffer)

    def submit(line: list[str]) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "prefetchd", *line[1:]], capture_output=True, text=True,
                              timeout=120)
        assert "Traceback" not in done.stderr, done.stderr
        return done

    def status(buffer: Path) -> str:
        out = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--buffer", str(buffer)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    for line in submits:
        answer = submit(line)
        assert answer.returncode == 0 and " accepted: producing " in answer.stdout, answer.stdout + answer.stderr
    after = write_after("BEFORE", BEFORE, tmp_path)
    checkpoint = str(tmp_path / "checkpoint.pth.tar")
    args = [*script_args, "--train-buffer", str(train_buffer), "--val-buffer", str(val_buffer), "--lr", "0.05",
            "--checkpoint", checkpoint]
    spy = Spy(monkeypatch)
    spy.kill = (str(train_buffer), KILL_AT)
    with pytest.raises(Killed):
        run_script(after, args, capsys)
    killed = received_since(spy, train_buffer, 0)
    steps = -(-len(ImageFolder(str(shapes_data / "train")).samples) // 8)
    assert epoch_steps(killed) == [(e, s) for e in range(2) for s in range(steps)][: steps + KILL_AT[1]]

    other = submit([*submits[0], "--seed", "9", "--replace"])  # another user's job, meanwhile
    assert other.returncode == 0, other.stdout + other.stderr
    daemons[0].wait_until(lambda: Manifest.read(train_buffer).seed == 9, 30, "the other job's manifest")

    again = [submit(line) for line in submits]  # the same two lines, then --resume
    assert again[0].returncode == 0, again[0].stdout + again[0].stderr
    assert f"accepted: producing {shapes_data / 'train'} for " in again[0].stdout, again[0].stdout
    assert f", replacing the running job on {shapes_data / 'train'} (seed: 9 -> 0)" in again[0].stdout, again[0].stdout
    assert again[1].returncode == 0 and "accepted: already producing this job" in again[1].stdout, again[1].stdout
    later_id = again[1].stdout.split()[1]
    shown = status(val_buffer)
    assert re.search(r"^  job       \w+ submitted by .* at 20[-0-9: ]+: producing ", shown, re.M), shown
    assert f"  later     {later_id} submitted by " in shown and "accepted: already producing this job" in shown, shown
    assert f"  job       {again[0].stdout.split()[1]} submitted by " in status(train_buffer)

    start = count(spy, train_buffer)
    result = run_script(after, [*args, "--resume", checkpoint], capsys)
    assert result["epoch"] == 1 and result["train_samples"] == len(ImageFolder(str(shapes_data / "train")).samples)
    assert result["val_samples"] == len(ImageFolder(str(shapes_data / "val")).samples)
    assert Manifest.read(val_buffer).split == "val", "the validation job is the val split, in order"
    resumed = received_since(spy, train_buffer, start)
    assert epoch_steps(resumed) == [(1, s) for s in range(steps)]
    assert resumed[: KILL_AT[1]] == killed[steps:], "the killed run's batches of epoch 1: indices and images"

    # Both jobs' epochs are read: each daemon waits for the next, and says so of the job it finished, also
    # the val daemon, whose last answer was the `later` one.
    for daemon, buffer in zip(daemons, (train_buffer, val_buffer)):
        daemon.wait_until(lambda b=buffer: state_of(b) == "waiting-for-job", 60, "the job to be read to its end")
        done = job_result_of(buffer)
        assert done is not None and done.reason.startswith("finished producing "), done
        assert "  last job  " in status(buffer) and "already producing" not in status(buffer)
