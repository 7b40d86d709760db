"""quant.checkpoint_io.atomic_output_dir: what it writes can be read by every user, at every depth."""

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from quant.checkpoint_io import atomic_output_dir

NOBODY = 65534  # uid and gid of `nobody`


def write_training_checkpoint_tree(tmp: Path) -> list[str]:
    """A tree shaped like recipes/dapo.py's checkpoints/step-N: files at the top, the adapter in adapter/,
    per-worker state one level deeper. One file is created private (0600), as torch.save may leave it.
    Returns the relative paths of the files."""
    files = [
        "controller.json",
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "workers/rank-0/trainer.pt",
    ]
    for rel in files:
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"contents of {rel}\n".encode())
    os.chmod(tmp / "workers" / "rank-0" / "trainer.pt", 0o600)
    os.chmod(tmp / "workers" / "rank-0", 0o700)
    return files


@pytest.fixture
def shared_root():
    """A directory under /tmp that any user can enter (pytest's tmp_path base is 0700 for root)."""
    root = Path(tempfile.mkdtemp(prefix="allsync-checkpoint-modes-"))
    os.chmod(root, 0o755)
    (root / "checkpoints").mkdir()
    os.chmod(root / "checkpoints", 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root)


def test_directories_0755_and_files_0644_at_every_depth(shared_root):
    out = shared_root / "checkpoints" / "step-000001"
    with atomic_output_dir(out) as tmp:
        files = write_training_checkpoint_tree(tmp)
    modes = {str(p.relative_to(out)): stat.S_IMODE(os.stat(p).st_mode) for p in out.rglob("*")}
    modes["."] = stat.S_IMODE(os.stat(out).st_mode)
    assert modes == {
        ".": 0o755,
        "adapter": 0o755,
        "workers": 0o755,
        "workers/rank-0": 0o755,
        **{f: 0o644 for f in files},
    }


def read_every_file(directory: str) -> int:
    """List every directory and read every file below `directory`; any PermissionError propagates."""
    count = 0
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if stat.S_ISDIR(os.stat(path).st_mode):
            count += read_every_file(path)
        else:
            with open(path, "rb") as f:
                f.read()
            count += 1
    return count


@pytest.mark.skipif(
    os.geteuid() != 0, reason="switching to user nobody needs root (tests run as root on the CI machine)"
)
def test_a_non_root_user_can_read_the_whole_checkpoint(shared_root):
    """Fork, become `nobody` in the child (no supplementary groups), and read the tree there: a non-root
    python cannot start on this machine (/root, where python lives, is 0700), a forked one needs nothing."""
    out = shared_root / "checkpoints" / "step-000001"
    with atomic_output_dir(out) as tmp:
        files = write_training_checkpoint_tree(tmp)
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = 0 if read_every_file(str(out)) == len(files) else 2
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # 1: PermissionError as nobody; 2: some file not reached
