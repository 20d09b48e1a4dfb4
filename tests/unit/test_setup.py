"""``make setup``'s torch (launch/install_torch.sh, issue 46): the CPU wheel from the public CPU index
on a machine with no GPU (a local wheel pip can find without an index first), the default index's
(CUDA) build where ``nvidia-smi -L`` lists a GPU. A fake ``python`` records the pip calls."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "install_torch.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _exe(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return path


def _install(tmp_path: Path, gpu: bool, local_wheel: bool) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "pip.log"
    _exe(bin_dir / "nvidia-smi", 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n' if gpu else "exit 9\n")
    no_index = "exit 0" if local_wheel else "exit 1"
    python = _exe(
        tmp_path / "python",
        f'echo "$*" >> {log}\nfor a in "$@"; do [[ "$a" == --no-index ]] && {no_index}; done\nexit 0\n',
    )
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    env.pop("TORCH_CPU_INDEX", None)
    out = subprocess.run(
        ["bash", str(SCRIPT), str(python), "2.13.0"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return log.read_text().splitlines()


@pytest.mark.parametrize(
    ("gpu", "local_wheel", "want"),
    [
        (False, False, ["-m pip install -q --no-index --no-deps torch==2.13.0",
                        f"-m pip install -q torch==2.13.0 --index-url {CPU_INDEX}"]),
        (False, True, ["-m pip install -q --no-index --no-deps torch==2.13.0"]),
        (True, False, ["-m pip install -q torch==2.13.0"]),
    ],
)  # fmt: skip
def test_cpu_wheel_without_a_gpu_cuda_with_one(tmp_path, gpu, local_wheel, want):
    assert _install(tmp_path, gpu, local_wheel) == want


def test_setup_installs_torch_before_the_package():
    recipe = re.search(r"^\$\(STAMP\):.*?\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M).group(1)
    torch_at = recipe.index("launch/install_torch.sh $(PY) $(TORCH_VERSION)")
    assert torch_at < recipe.index('pip install -q -e ".[dev]"')
    assert CPU_INDEX in (REPO / "README.md").read_text()  # the README says where the CPU wheel comes from
