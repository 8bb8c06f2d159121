"""docs/DROP_IN.md's diff turns a standard ImageFolder + DataLoader script into a BufferLoader one.

The "before" script is below (the shape of pytorch/examples' imagenet main.py, trimmed). The test
runs it, applies the documented diff, and runs the result against real daemons for one epoch with
a spy on the loader that records every sample index the script received. Both scripts run in this
process (as `python script.py args` would, via runpy): interpreter start-up is most of the cost."""

from __future__ import annotations

import json
import math
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
from torchvision.datasets import ImageFolder

from prefetchd.trainer import loader as loader_module

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

    for epoch in range(args.epochs):
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


if __name__ == "__main__":
    main()
'''

SMALL = ["--batch-size", "8", "--image-size", "32", "--workers", "1", "--seed", "3", "--epochs", "1"]


def documented_diff() -> str:
    blocks = re.findall(r"```diff\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, f"{DOC} should hold exactly one diff block"
    return str(blocks[0])


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


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")  # the original, on a CPU
def test_documented_diff_turns_a_dataloader_script_into_a_bufferloader_one(
    shapes_data: Path, shm_dir: Path, start_daemon: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    after = apply_diff(BEFORE, documented_diff())
    assert "DataLoader" not in after and "ImageFolder" not in after and "BufferLoader(" in after
    changed = sum(1 for line in after.splitlines() if "BufferLoader" in line or "_buffer" in line)
    assert changed <= 6, "the drop-in is a few lines"
    before_path, after_path = tmp_path / "before.py", tmp_path / "after.py"
    before_path.write_text(BEFORE)
    after_path.write_text(after)
    n_train = len(ImageFolder(str(shapes_data / "train")).samples)
    n_val = len(ImageFolder(str(shapes_data / "val")).samples)
    common = ["--arch", "mobilenet_v3_small", "--epochs", "1", "--lr", "0.05"]

    train_buffer, val_buffer = shm_dir / "train", shm_dir / "val"
    start_daemon(train_buffer, "--data", shapes_data / "train", *SMALL)
    start_daemon(val_buffer, "--data", shapes_data / "val", "--split", "val", *SMALL)

    # The original script, as it is (in this process, while the daemons start): it works on this
    # data with a DataLoader.
    result = run_script(before_path, [str(shapes_data), *common, "--batch-size", "8", "--image-size", "32",
                                      "--workers", "0"], capsys)
    assert result["train_samples"] == n_train and result["val_samples"] == n_val

    # The script after the diff, fed by the daemons, with a spy on the sample indices it is handed.
    seen: list[tuple[str, list[int]]] = []
    real_next = loader_module._EpochIterator.__next__

    def spying_next(self: Any) -> Any:
        batch = real_next(self)
        seen.append((str(self._loader.buffer), batch.indices.tolist()))
        return batch

    monkeypatch.setattr(loader_module._EpochIterator, "__next__", spying_next)
    result = run_script(after_path, ["--train-buffer", str(train_buffer), "--val-buffer", str(val_buffer), *common],
                        capsys)
    assert math.isfinite(result["train_loss"]) and 0 <= result["val_top1"] <= 1
    assert result["train_samples"] == n_train and result["val_samples"] == n_val
    train_indices = [i for buffer, batch in seen if buffer == str(train_buffer) for i in batch]
    val_indices = [i for buffer, batch in seen if buffer == str(val_buffer) for i in batch]
    assert sorted(train_indices) == list(range(n_train)), "every training sample exactly once"
    assert train_indices != sorted(train_indices), "shuffled, as shuffle=True was"
    assert val_indices == list(range(n_val)), "every validation sample once, in order"
