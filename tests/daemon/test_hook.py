"""prefetchd.daemon.hook: the user's transform hook, found and checked when the job is configured,
run after the built-in augmentation on the sample's stream, and a failure of it reported as a
HookError that names it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prefetchd.daemon.errors import ConfigError
from prefetchd.daemon.hook import HookError, load_hook, validate_hook, validate_hook_within
from prefetchd.daemon.plan import AugmentOptions
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.transforms import augment
from tests.daemon.pictures import save_jpeg, smooth_array

# torchvision 0.29 announces that its decoders move to TorchCodec; they still work.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")


HOOK_MODULE = """
import numpy as np
import torch

calls = []

def invert(image, rng):
    calls.append((tuple(image.shape), image.dtype, type(rng).__name__))
    return 255 - image

def noisy(image, rng):
    return (image.int() + int(rng.integers(0, 50))).clamp(0, 255).to(torch.uint8)

def wrong_shape(image, rng):
    return image[:, :-1]

def wrong_dtype(image, rng):
    return image.float()

def not_a_tensor(image, rng):
    return image.numpy()

def broken(image, rng):
    raise KeyError("oops")

def exits(image, rng):
    import sys
    sys.exit(3)

class Holder:
    @staticmethod
    def flip(image, rng):
        return image.flip(-1)

NOT_CALLABLE = 3
"""


@pytest.fixture
def hook_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"prefetchd_test_hooks_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(HOOK_MODULE)
    (tmp_path / f"{name}_fails.py").write_text("raise ImportError('needs a GPU library')\n")
    (tmp_path / f"{name}_raises.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / f"{name}_exits.py").write_text("import sys\nsys.exit(5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    load_hook.cache_clear()
    return name


def test_validate_hook_finds_the_callable(hook_module: str) -> None:
    assert validate_hook(f"{hook_module}:invert").__name__ == "invert"
    assert validate_hook(f"{hook_module}:Holder.flip").__name__ == "flip"


@pytest.mark.parametrize(("suffix", "words"), [
    (":nowhere", ["no attribute", "nowhere"]),
    (":NOT_CALLABLE", ["an object of type int", "not a callable"]),
    (":Holder.nothing", ["no attribute"]),
])
def test_validate_hook_errors_say_what_is_wrong(hook_module: str, suffix: str, words: list[str]) -> None:
    name = hook_module + suffix
    with pytest.raises(ConfigError) as exc:
        validate_hook(name)
    assert repr(name) in str(exc.value)
    for word in words:
        assert word in str(exc.value)


def test_validate_hook_reports_import_failures(hook_module: str) -> None:
    for name, words in [("no_such_module_prefetchd:fn", ["cannot import", "ModuleNotFoundError", "PYTHONPATH"]),
                        (f"{hook_module}_fails:fn", ["cannot import", "needs a GPU library"]),
                        # Not "cannot import ... install it": it was found, and failed (a walk); sys.exit() in it
                        # ended start and config with its code and not a word.
                        (f"{hook_module}_raises:fn", ["importing", "raised RuntimeError: boom at import; fix the module"]),
                        (f"{hook_module}_exits:fn", ["importing", "raised SystemExit: 5; fix the module"])]:
        with pytest.raises(ConfigError) as exc:
            validate_hook(name)
        for word in words:
            assert word in str(exc.value)


def test_hook_runs_after_the_built_in_augmentation(tmp_path: Path, hook_module: str) -> None:
    import importlib

    module = importlib.import_module(hook_module)
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(120, 90))
    plain = augment(jpeg, 32, True, sample_rng(0, 0, 0))
    out = augment(jpeg, 32, True, sample_rng(0, 0, 0), AugmentOptions(transform=f"{hook_module}:invert"))
    assert np.array_equal(out, 255 - plain)
    assert module.calls == [((3, 32, 32), torch.uint8, "Generator")]
    val = augment(jpeg, 32, False, sample_rng(0, 0, 0), AugmentOptions(transform=f"{hook_module}:Holder.flip"))
    assert np.array_equal(val, augment(jpeg, 32, False, None)[:, ::-1])


def test_hook_draws_from_the_samples_stream(tmp_path: Path, hook_module: str) -> None:
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(120, 90))
    options = AugmentOptions(transform=f"{hook_module}:noisy", color_jitter=0.2)
    a = [augment(jpeg, 32, True, sample_rng(1, e, 0), options).tobytes() for e in range(4)]
    assert a == [augment(jpeg, 32, True, sample_rng(1, e, 0), options).tobytes() for e in range(4)]
    assert len(set(a)) == 4


BROKEN_LINE = HOOK_MODULE.splitlines().index('    raise KeyError("oops")') + 1  # in the module's file

@pytest.mark.parametrize(("hook", "words"), [
    ("wrong_shape", ["(3, 31, 32)", "(3, 32, 32)"]),
    ("wrong_dtype", ["torch.float32", "uint8"]),
    ("not_a_tensor", ["returned an object of type ndarray", "uint8 tensor"]),
    # Where in the hook, not only what (a walk): the line that raised.
    ("broken", ["KeyError", "oops", f".py:{BROKEN_LINE}, in broken)"]),
    # They ended the worker: its file was "crashed its worker 2 times", the job stopped as bad data (a walk of hooks).
    ("exits", ["failed on", "SystemExit: 3"]),
    ("nowhere", ["no attribute"]),
])
def test_hook_failures_are_hook_errors(tmp_path: Path, hook_module: str, hook: str, words: list[str]) -> None:
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(60, 50))
    with pytest.raises(HookError) as exc:
        augment(jpeg, 32, True, sample_rng(0, 0, 0), AugmentOptions(transform=f"{hook_module}:{hook}"))
    assert f"{hook_module}:{hook}" in str(exc.value)
    for word in words:
        assert word in str(exc.value)


def test_a_hook_module_that_sets_a_signal_handler_when_imported_is_accepted(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's bounded check imports the hook on a thread, where signal.signal raises ValueError; the
    workers import it in their main threads, where it works, so the daemon must accept it too."""
    name = f"prefetchd_test_signal_hook_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        "import signal\nsignal.signal(signal.SIGUSR2, signal.getsignal(signal.SIGUSR2))\n"
        "def same(image, rng):\n    return image\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ticks: list[str] = []
    hook = validate_hook_within(f"{name}:same", 60.0, ticks.append)
    assert hook.__name__ == "same"
    # A module that fails otherwise is still refused, with its error.
    (tmp_path / f"{name}_bad.py").write_text("raise ValueError('not this one')\n")
    with pytest.raises(ConfigError, match="not this one"):
        validate_hook_within(f"{name}_bad:same", 60.0, ticks.append)
