"""This peer's checkpoints on disk (control/epoch/disk.py, train/checkpoint.py): the newest K of
each stage stay, their size is shown, and a write the disk refuses (a patched write raising
ENOSPC, as a full disk does) is a logged refusal in `status`, leaving no partial file and every
older checkpoint as it was; the next write that fits clears it."""

from __future__ import annotations

import builtins
import errno
import logging

import pytest
import torch

from dtfm import files
from dtfm.control.epoch.disk import CheckpointDisk, folder_bytes
from dtfm.peer.status import format_checkpoints
from dtfm.train import StageState, TrainConfig, checkpoint_at, get_preset, load_checkpoint, saved_checkpoints
from dtfm.train import checkpoint as ckpt

RUN = b"r" * 16
SPEC, CFG = get_preset("tiny"), TrainConfig(seed=0)


def stage(step: int) -> StageState:
    s = StageState(SPEC, CFG, (0, 2), "cpu")
    s.step = step
    with torch.no_grad():
        next(iter(s.params.values())).add_(step)  # (each step's weights differ)
    return s


@pytest.fixture
def full_disk(monkeypatch):
    """Every file replaced whole (`dtfm.files`, which the checkpoint module writes through)
    takes a few bytes, then the disk is full (ENOSPC), as os.write reports it."""
    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[:7])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def opener(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return Full(f) if "w" in mode else f

    def fill():
        monkeypatch.setattr(files, "open", opener, raising=False)

    return fill


def test_the_newest_k_of_each_stage_stay_and_their_size_is_known(tmp_path):
    disk = CheckpointDisk(tmp_path / "checkpoints", kept=2)
    for step in (1, 2, 3, 4):
        assert disk.save(RUN, stage(step)) is not None
    assert saved_checkpoints(disk.run_root(RUN)) == [(0, 2, 3), (0, 2, 4)]
    st = disk.status()
    assert st.saved == 4 and st.refused == 0 and st.refusal is None
    assert st.bytes == folder_bytes(tmp_path / "checkpoints") > 0
    assert format_checkpoints(st.to_wire()).startswith("checkpoints ")


def test_a_full_disk_is_a_logged_refusal_never_a_partial_file(tmp_path, full_disk, caplog):
    disk = CheckpointDisk(tmp_path / "checkpoints", kept=3)
    good = disk.save(RUN, stage(2))
    assert good is not None
    before = sorted(p.name for p in good.parent.iterdir())
    full_disk()
    with caplog.at_level(logging.ERROR, logger="dtfm.control.epoch.disk"):
        assert disk.save(RUN, stage(4)) is None
    # nothing of step 4, no temporary file; step 2 as it was, and it loads (its hash checks)
    assert sorted(p.name for p in good.parent.iterdir()) == before
    assert checkpoint_at(disk.run_root(RUN), (0, 2), 4) is None
    assert load_checkpoint(good).step == 2
    st = disk.status()
    assert st.refused == 1 and st.saved == 1 and "the disk is full" in st.refusal and "step 4" in st.refusal
    assert any("refusing to checkpoint" in r.getMessage() for r in caplog.records)
    shown = format_checkpoints(st.to_wire())
    assert "REFUSED" in shown and "the disk is full" in shown
    # the JSON refused after the weights were written: neither stays
    weights_written_description_refused(disk)


def weights_written_description_refused(disk: CheckpointDisk) -> None:
    """A disk that takes the weights and refuses the description: step 6 leaves nothing."""
    real = ckpt.atomic_write
    calls = []

    def once_then_full(path, data):
        calls.append(path.name)
        if path.suffix == ".json":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    ckpt_atomic = pytest.MonkeyPatch()
    ckpt_atomic.setattr(ckpt, "atomic_write", once_then_full)
    ckpt_atomic.setattr(files, "open", builtins.open, raising=False)
    try:
        assert disk.save(RUN, stage(6)) is None
    finally:
        ckpt_atomic.undo()
    assert calls == ["step-00000006.safetensors", "step-00000006.json"]
    d = disk.run_root(RUN) / "stage-000-002"
    assert not (d / "step-00000006.safetensors").exists() and checkpoint_at(disk.run_root(RUN), (0, 2), 6) is None


def test_a_write_that_fits_again_clears_the_refusal(tmp_path, full_disk, monkeypatch):
    disk = CheckpointDisk(tmp_path / "checkpoints", kept=3)
    full_disk()
    assert disk.save(RUN, stage(1)) is None and disk.status().refusal is not None
    monkeypatch.undo()
    assert disk.save(RUN, stage(2)) is not None
    st = disk.status()
    assert st.refusal is None and st.refused == 1 and st.saved == 1 and "refusal" not in st.to_wire()


def test_only_the_newest_runs_checkpoints_stay(tmp_path, caplog):
    # Runs a, b, c, d checkpoint one after another on a disk keeping 2 runs: each new run's
    # first checkpoint deletes the folders beyond the newest 2 (its own among them); an older
    # run written again (resumed) is the newest then, and the run written before it goes.
    disk = CheckpointDisk(tmp_path, kept=2, runs_kept=2)
    runs = [bytes([k]) * 16 for k in b"abcd"]
    for k, run in enumerate(runs[:3]):
        assert disk.save(run, stage(k)) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == [runs[1].hex(), runs[2].hex()]
    with caplog.at_level(logging.INFO, logger="dtfm.control.epoch.disk"):
        assert disk.save(runs[1], stage(5)) is not None  # b resumed: nothing older than the newest 2
        assert sorted(p.name for p in tmp_path.iterdir()) == [runs[1].hex(), runs[2].hex()]
        assert disk.save(runs[3], stage(0)) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == [runs[1].hex(), runs[3].hex()]
    assert [r.getMessage() for r in caplog.records] == [f"deleted the checkpoints of run {runs[2].hex()[:8]}: only "
                                                       "the newest 2 runs' stay"]
    st = disk.status()
    assert st.bytes == folder_bytes(tmp_path) and st.runs_kept == 2
    assert "of the newest 2 runs" in format_checkpoints(st.to_wire())
